"""`python -m pipeline prepare-data`: generate the built-in synthetic detection set (COCO format)."""

from __future__ import annotations

from pathlib import Path

from pipeline import atomic
from pipeline.cli import add_config_options, command_parser, config_from_args
from pipeline.data.synthetic import SyntheticSpec, generate
from pipeline.errors import ConfigError


def main(argv: list[str]) -> int:
    parser = command_parser("prepare-data", __doc__)
    parser.add_argument(
        "--out", metavar="DIR", help="output folder (default: the config's data.root)"
    )
    parser.add_argument(
        "--splits",
        nargs="+",
        choices=("train", "val", "test"),
        metavar="SPLIT",
        help="only these splits (train, val, test; default: all the config has)",
    )
    add_config_options(parser, "data.synthetic.num_train=64")
    args = parser.parse_args(argv)
    config = config_from_args(args)
    if config["data"]["format"] != "synthetic":
        raise ConfigError(
            f"data.format is {config['data']['format']!r}: prepare-data only generates the built-in synthetic set. "
            "Your own COCO or VOC data needs no preparation."
        )
    out = Path(args.out or config["data"]["root"]).expanduser()
    atomic.refuse_unwritable_output("--out", out, folder=True)
    generate(SyntheticSpec.from_config(config["data"]["synthetic"]), out, splits=args.splits)
    return 0
