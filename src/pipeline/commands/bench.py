"""`python -m pipeline bench`: time the step training takes on one backend, in one precision x
mode (--out FILE.json) or in several in one command, the precisions of a model and mode timed
in interleaved rounds (--out-dir DIR: one DIR/BACKEND-PRECISION-MODE.json each); on a CPU each
model instance index in a child forked from the bench process.

What is timed comes from the training config (config/config.yaml, any --configfile over it,
key=value settings on top); the options below override single `bench.*` keys.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline import atomic
from pipeline.cli import add_config_options, command_parser, config_from_args
from pipeline.config import load_schema
from pipeline.errors import ConfigError

# option -> bench key it overrides (None: not given)
OPTIONS = {
    "model": "models",
    "batch_size": "batch_size",
    "image_size": "image_size",
    "warmup": "warmup_steps",
    "steps": "steps",
    "instances": "instances",
    "time_budget": "time_budget_s",
    "channels_last": "channels_last",
    "compile": "compile",
}


def main(argv: list[str]) -> int:
    parser = command_parser("bench", __doc__)
    parser.add_argument(
        "--device",
        default="auto",
        help="auto, cpu, cuda, cuda:N or mps; an absent backend is an error",
    )
    parser.add_argument(
        "--precision",
        required=True,
        type=_names(PRECISIONS),
        help="fp32, fp16 or bf16, or several separated by commas (fp32 is timed first)",
    )
    parser.add_argument(
        "--mode",
        default=["train"],
        type=_names(MODES),
        help="train or infer, or both separated by commas (default: train)",
    )
    parser.add_argument(
        "--model", help="model name, or several separated by commas (default: training's model)"
    )
    parser.add_argument("--batch-size", type=int, help="default: train.batch_size")
    parser.add_argument("--image-size", type=int, help="default: data.image_size")
    parser.add_argument("--warmup", type=int, help="fewest untimed warm-up steps")
    parser.add_argument("--steps", type=int, help="most timed steps")
    parser.add_argument(
        "--instances",
        type=int,
        help="freshly built models timed per precision, the interval over them (bench.instances)",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        metavar="SECONDS",
        help="stop timing after this long (at least one step is timed)",
    )
    parser.add_argument(
        "--channels-last",
        action=argparse.BooleanOptionalAction,
        help="default: train.channels_last",
    )
    parser.add_argument(
        "--compile", action="store_true", default=None, help="torch.compile the model first"
    )
    out = parser.add_mutually_exclusive_group(required=True)
    out.add_argument("--out", metavar="FILE.json", help="the file of one precision and mode")
    out.add_argument(
        "--out-dir",
        metavar="DIR",
        help="one DIR/BACKEND-PRECISION-MODE.json per precision and mode",
    )
    add_config_options(parser, "model.width=16")
    args = parser.parse_args(argv)
    # before any timing: found when the records are written, that would be minutes later
    atomic.refuse_unwritable_output("--out-dir", args.out_dir, folder=True)
    atomic.refuse_unwritable_output(
        "--out",
        args.out,
        advice=f"Or give --out-dir {args.out} for one BACKEND-PRECISION-MODE.json per precision "
        "and mode there.",
    )
    precisions, modes = args.precision, args.mode
    if args.out and len(precisions) * len(modes) > 1:
        raise ConfigError(
            f"--out writes one precision and mode, and --precision {','.join(precisions)} "
            f"--mode {','.join(modes)} asks for {len(precisions) * len(modes)}: give "
            "--out-dir DIR instead."
        )
    for name in ("batch_size", "image_size", "steps", "instances"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}.")
    if (args.time_budget is not None and args.time_budget <= 0) or (
        args.warmup is not None and args.warmup < 0
    ):
        raise ConfigError("--time-budget must be positive and --warmup at least 0.")
    overrides = []
    for option, key in OPTIONS.items():
        value = getattr(args, option)
        if value is None:
            continue
        if option == "model":
            value = [name.strip() for name in value.split(",") if name.strip()]
            known = load_schema()["properties"]["model"]["properties"]["name"]["enum"]
            unknown = [name for name in value if name not in known]
            if unknown or not value:
                raise ConfigError(
                    f"Unknown model(s) {unknown or [args.model]}: choose from {', '.join(known)}."
                )
        overrides.append(f"bench.{key}={json.dumps(value)}")
    config = config_from_args(args, *overrides)

    from pipeline import bench, bench_record
    from pipeline import device as dev
    from pipeline.data import class_count
    from pipeline.models import check_input_size

    plan = bench_record.settings_from_config(config, class_count(config))
    for name in plan["models"]:
        check_input_size({**plan["model_options"], "name": name}, plan["image_size"])
    device = dev.resolve_device(args.device)
    files: dict[tuple[str, str], list[dict]] = {}
    for record in bench.run_backend(device, precisions, modes, plan["models"], plan):
        files.setdefault((record["precision"], record["mode"]), []).append(record)
    for (precision, mode), records in files.items():
        path = args.out or Path(args.out_dir) / f"{device.type}-{precision}-{mode}.json"
        atomic.write_json(path, {"format": bench_record.FORMAT, "records": records})
    return 0


PRECISIONS = ("fp32", "fp16", "bf16")
MODES = ("train", "infer")


def _names(known: tuple[str, ...]):
    """An option's type: one of `known`, or several separated by commas (repeats dropped)."""

    def names(value: str) -> list[str]:
        listed = list(dict.fromkeys(name.strip() for name in value.split(",") if name.strip()))
        unknown = [name for name in listed if name not in known]
        if unknown or not listed:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {', '.join(map(repr, unknown)) or repr(value)} (choose from "
                f"{', '.join(known)}, or several separated by commas)"
            )
        return listed

    return names
