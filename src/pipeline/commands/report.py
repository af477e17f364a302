"""`python -m pipeline report`: one self-contained HTML page comparing every benchmark, run,
evaluation and profile under the results folder, with the answer at the top.

The answer, the decisions and the run tables come from the summary (<results>/summary.json,
which `python -m pipeline summarize` writes); where there is none, the folder is summarised
here first, by the same code, and nothing else is written.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline import atomic
from pipeline.cli import (
    add_resolved_config_options,
    command_parser,
    json_object,
    refuse_writing_over,
    resolved_config,
)

log = logging.getLogger("pipeline")


def main(argv: list[str]) -> int:
    parser = command_parser("report", __doc__)
    parser.add_argument(
        "--results",
        default="results",
        metavar="DIR",
        help="results folder to read (default: results)",
    )
    parser.add_argument(
        "--summary",
        metavar="FILE",
        help="the results folder's summary (default: <results>/summary.json where it exists)",
    )
    add_resolved_config_options(parser)
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
    refuse_writing_over([("--summary", args.summary)], [("--out", args.out)])
    out = Path(args.out) if args.out else Path(args.results) / "report.html"
    atomic.refuse_unwritable_output("--out", out)
    config = resolved_config(args)
    invocation = None
    if args.invocation_json is not None:
        invocation = json_object(args.invocation_json, "--invocation-json")

    # pandas, matplotlib and jinja2: imported only once the arguments are good
    from pipeline.report.render import build

    build(args.results, out, config, invocation, args.summary)
    log.info("report written: %s", out)
    return 0
