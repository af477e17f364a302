"""`python -m pipeline summarize`: sum up a results folder in one small file, summary.json.

The machine (as check-env described it), the commit, what the figures may be compared by,
the answer with its interval, every benchmark's median, IQR and flags, and each trained run's
time and evaluation: what the report shows and `python -m pipeline compare` sets side by side
with other machines' summaries (schemas/summary.schema.yaml).
"""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline import atomic
from pipeline.cli import add_resolved_config_options, command_parser, resolved_config

log = logging.getLogger("pipeline")


def main(argv: list[str]) -> int:
    parser = command_parser("summarize", __doc__)
    parser.add_argument(
        "--results", default="results", metavar="DIR", help="results folder (default: results)"
    )
    add_resolved_config_options(parser)
    parser.add_argument(
        "--out", metavar="FILE", help="summary to write (default: <results>/summary.json)"
    )
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else Path(args.results) / "summary.json"
    atomic.refuse_unwritable_output("--out", out)
    config = resolved_config(args)

    from pipeline.summary.build import summarize, write

    if config is None:
        log.warning(
            "no config given (--config-json or --config): the summary records no settings to "
            "compare accuracy by, so compare will not set its accuracy beside another's"
        )
    write(summarize(args.results, config), out)
    log.info("summary written: %s", out)
    return 0
