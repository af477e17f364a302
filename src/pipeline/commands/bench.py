"""`python -m pipeline bench`: time one backend x precision x mode for one or more models."""

from __future__ import annotations

from pipeline import atomic
from pipeline.cli import command_parser
from pipeline.config import load_schema
from pipeline.errors import ConfigError

DEFAULTS = load_schema()["properties"]["bench"]["properties"]


def main(argv: list[str]) -> int:
    parser = command_parser("bench", __doc__)
    default = {key: spec.get("default") for key, spec in DEFAULTS.items()}
    parser.add_argument(
        "--device",
        default="auto",
        help="auto, cpu, cuda, cuda:N or mps; an absent backend is an error",
    )
    parser.add_argument("--precision", required=True, choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--mode", default="train", choices=["train", "infer"])
    parser.add_argument(
        "--model", default="tiny_conv", help="model name, or several separated by commas"
    )
    parser.add_argument("--batch-size", type=int, default=default["batch_size"])
    parser.add_argument("--image-size", type=int, default=default["image_size"])
    parser.add_argument("--warmup", type=int, default=default["warmup_steps"], help="untimed steps")
    parser.add_argument("--steps", type=int, default=default["steps"], help="most timed steps")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=default["time_budget_s"],
        metavar="SECONDS",
        help="stop after this long (at least one step is timed)",
    )
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model first")
    parser.add_argument("--out", required=True, metavar="FILE.json")
    args = parser.parse_args(argv)
    for name in ("batch_size", "image_size", "steps"):
        if getattr(args, name) < 1:
            raise ConfigError(
                f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}."
            )
    if args.time_budget <= 0 or args.warmup < 0:
        raise ConfigError("--time-budget must be positive and --warmup at least 0.")

    from pipeline import bench
    from pipeline import device as dev
    from pipeline.models import MODELS, check_input_size

    models = [name.strip() for name in args.model.split(",") if name.strip()]
    unknown = [name for name in models if name not in MODELS]
    if unknown or not models:
        raise ConfigError(
            f"Unknown model(s) {unknown or [args.model]}: choose from {', '.join(MODELS)}."
        )
    for name in models:
        check_input_size(name, args.image_size)
    device = dev.resolve_device(args.device)
    settings = {
        "batch_size": args.batch_size,
        "image_size": args.image_size,
        "warmup_steps": args.warmup,
        "steps": args.steps,
        "time_budget_s": args.time_budget,
        "channels_last": args.channels_last,
        "compile": args.compile,
    }
    records = [bench.run(device, args.precision, args.mode, name, settings) for name in models]
    atomic.write_json(args.out, {"format": bench.FORMAT, "records": records})
    return 0
