"""`python -m pipeline check-env`: print the environment table and write it as JSON."""

from __future__ import annotations

from pipeline import atomic, environment
from pipeline.cli import command_parser
from pipeline.errors import PipelineError


def main(argv: list[str]) -> int:
    parser = command_parser("check-env", __doc__)
    parser.add_argument("--output", "-o", metavar="FILE.json", help="also write the report as JSON")
    parser.add_argument(
        "--device",
        metavar="SPEC",
        help="also resolve this device spec; exit 2 with the reason if it is not available",
    )
    args = parser.parse_args(argv)
    info = environment.collect(args.device)
    print(environment.format_table(info))
    if args.output:
        try:
            atomic.write_json(args.output, info)
        except OSError as error:
            raise PipelineError(
                f"Cannot write the environment report to {args.output}: {error}."
            ) from error
        print(f"\nwritten: {args.output}")
    return 0
