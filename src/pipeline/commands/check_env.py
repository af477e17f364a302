"""`python -m pipeline check-env`: print the environment table and write it as JSON."""

from __future__ import annotations

from pipeline import atomic, environment
from pipeline.cli import command_parser


def main(argv: list[str]) -> int:
    parser = command_parser("check-env", __doc__)
    parser.add_argument("--out", metavar="FILE.json", help="also write the report as JSON")
    parser.add_argument(
        "--device",
        metavar="SPEC",
        help="also resolve this device spec; exit 2 with the reason if it is not available",
    )
    args = parser.parse_args(argv)
    atomic.refuse_unwritable_output("--out", args.out)
    info = environment.collect(args.device)
    print(environment.format_table(info))
    if args.out:
        atomic.write_json(args.out, info)
        print(f"\nwritten: {args.out}")
    return 0
