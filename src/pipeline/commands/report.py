"""`python -m pipeline report`: one self-contained HTML page comparing every benchmark, run,
evaluation and profile under the results folder, with the answer at the top."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pipeline.cli import command_parser
from pipeline.errors import ConfigError

log = logging.getLogger("pipeline")


def _json_object(text: str, option: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"{option} is not valid JSON ({error.msg} at column {error.colno})."
        ) from error
    if not isinstance(value, dict):
        raise ConfigError(f"{option} must be a JSON object, not a {type(value).__name__}.")
    return value


def _config_from_file(path: str) -> dict[str, Any]:
    """A YAML or JSON config file, resolved as the workflow resolves it (defaults filled in)."""
    from pipeline.config import read_yaml, validate

    return validate(read_yaml(path), path)


def main(argv: list[str]) -> int:
    parser = command_parser("report", __doc__)
    parser.add_argument(
        "--results",
        default="results",
        metavar="DIR",
        help="results folder to read (default: results)",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--config-json", metavar="JSON", help="the workflow's resolved config as a JSON string"
    )
    source.add_argument(
        "--config", metavar="FILE", help="a YAML or JSON config file instead of --config-json"
    )
    parser.add_argument(
        "--invocation-json",
        metavar="JSON",
        help='how the workflow was called, {"configfiles": [...], "config": {...}}, so the '
        "report's commands repeat it",
    )
    parser.add_argument(
        "--out", metavar="FILE", help="HTML file to write (default: <results>/report.html)"
    )
    args = parser.parse_args(argv)
    config = None
    if args.config_json is not None:
        config = _json_object(args.config_json, "--config-json")
    elif args.config is not None:
        config = _config_from_file(args.config)
    invocation = None
    if args.invocation_json is not None:
        invocation = _json_object(args.invocation_json, "--invocation-json")

    # pandas, matplotlib and jinja2: imported only once the arguments are good
    from pipeline.report.render import build

    out = Path(args.out) if args.out else Path(args.results) / "report.html"
    build(args.results, out, config, invocation)
    log.info("report written: %s", out)
    return 0
