"""`python -m pipeline compare SUMMARY.json...`: machines side by side, from the summary.json
files of their pipeline runs (one per machine, cluster partition or GPU model).

Each machine's answer with its interval, the speed-up of every backend and precision, each
machine's speed against the reference machine's (the first by name) with its interval, time per
epoch and to the end of training, and accuracy: set side by side only where the summaries timed
(speed) or ran (accuracy) the same configuration; elsewhere the page says what differs.
`--out` writes a self-contained HTML page, `--markdown` the same tables as Markdown (to a file,
or to standard output), sorted so that the same summaries always give the same text.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from pipeline import atomic
from pipeline.cli import command_parser, refuse_writing_over
from pipeline.errors import ConfigError

log = logging.getLogger("pipeline")


def main(argv: list[str]) -> int:
    parser = command_parser("compare", __doc__)
    parser.add_argument("summaries", nargs="+", metavar="SUMMARY.json", help="summaries to compare")
    parser.add_argument("--out", metavar="FILE.html", help="write the comparison as an HTML page")
    parser.add_argument(
        "--markdown",
        nargs="?",
        const="-",
        metavar="FILE",
        help="write the comparison as Markdown tables to FILE (no FILE: standard output)",
    )
    args = parser.parse_args(argv)
    if args.out is None and args.markdown is None:
        raise ConfigError(
            "compare writes nothing without --out FILE.html or --markdown [FILE]: give one or both."
        )
    markdown_file = None if args.markdown == "-" else args.markdown
    refuse_writing_over(
        [("a SUMMARY.json argument", summary) for summary in args.summaries],
        [("--out", args.out), ("--markdown", markdown_file)],
    )
    atomic.refuse_unwritable_output("--out", args.out)
    atomic.refuse_unwritable_output("--markdown", markdown_file)

    from pipeline.compare import compare, markdown_text, read_machines

    sections = compare(read_machines(args.summaries))  # every summary checked before any write
    if args.out is not None:
        from pipeline.report.compare_page import render

        atomic.write_text(Path(args.out), render(sections))
        log.info("comparison written: %s", args.out)
    if args.markdown == "-":
        sys.stdout.write(markdown_text(sections))
    elif args.markdown is not None:
        atomic.write_text(Path(args.markdown), markdown_text(sections))
        log.info("comparison written: %s", args.markdown)
    return 0
