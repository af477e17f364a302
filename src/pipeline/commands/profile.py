"""`python -m pipeline profile`: inference latency per batch size and a torch.profiler trace."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path

from pipeline import atomic
from pipeline.cli import add_precision_option, command_parser
from pipeline.config import load_schema
from pipeline.errors import ConfigError

log = logging.getLogger("pipeline")
DEFAULTS = {
    key: spec["default"]
    for key, spec in load_schema()["properties"]["profile"]["properties"].items()
}


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise ConfigError(
            f"--batch-sizes {text!r} must be positive integers separated by commas, e.g. 1,8,32."
        ) from error
    if not sizes or min(sizes) < 1:
        raise ConfigError(
            f"--batch-sizes {text!r} must be positive integers separated by commas, e.g. 1,8,32."
        )
    return sizes


def main(argv: list[str]) -> int:
    parser = command_parser("profile", __doc__)
    parser.add_argument("--checkpoint", required=True, metavar="PATH")
    parser.add_argument(
        "--device", help="device to profile on (default: the checkpoint's config device)"
    )
    add_precision_option(
        parser, "default: the checkpoint's (a measured run's: the choice it trained in)"
    )
    parser.add_argument(
        "--batch-sizes", default=",".join(map(str, DEFAULTS["batch_sizes"])), metavar="1,8,32"
    )
    parser.add_argument("--warmup", type=int, default=DEFAULTS["warmup"])
    parser.add_argument("--repeats", type=int, default=DEFAULTS["repeats"])
    parser.add_argument(
        "--time-budget", type=float, default=DEFAULTS["time_budget_s"], metavar="SECONDS"
    )
    parser.add_argument("--trace-steps", type=int, default=DEFAULTS["trace_steps"])
    parser.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="writes profile.json, operators.json, trace.json",
    )
    args = parser.parse_args(argv)
    atomic.refuse_unwritable_output("--out", args.out, folder=True)
    settings = {
        "batch_sizes": _batch_sizes(args.batch_sizes),
        "warmup": args.warmup,
        "repeats": args.repeats,
        "time_budget_s": args.time_budget,
        "trace_steps": args.trace_steps,
    }
    # `not > 0`: a budget of NaN is no budget, and passes `<= 0`
    if args.repeats < 1 or args.trace_steps < 1 or args.warmup < 0 or not args.time_budget > 0:
        raise ConfigError(
            "--repeats and --trace-steps must be at least 1, --warmup at least 0, --time-budget positive."
        )

    from pipeline import device as dev
    from pipeline import profiling
    from pipeline.engine import checkpoint
    from pipeline.models import memory_format

    state = checkpoint.load(args.checkpoint)
    config = checkpoint.config_of(state, args.checkpoint)
    # the forward pass as predict runs it: with the flip test where the run evaluates with it
    settings["flip_test"] = config["eval"]["flip_test"]
    device = dev.resolve_device(args.device or config["device"])
    # a run of precision=measured keeps the precision its benchmarks chose (the checkpoint's)
    requested = args.precision or config["precision"]
    precision = dev.run_precision(requested, device, state.get("precision"), "profile")
    dev.require_precision(device, precision, "profiling")
    layout = memory_format(config["train"]["channels_last"])
    model = checkpoint.restore_model(state, device, layout, args.checkpoint)
    out = Path(args.out)
    atomic.make_folder(out, "--out")
    log.info(
        "profiling %s on %s (%s%s), batch sizes %s",
        args.checkpoint,
        dev.describe_device(device),
        precision,
        ", each image and its mirror (eval.flip_test)" if settings["flip_test"] else "",
        settings["batch_sizes"],
    )
    result = profiling.run(
        model, device, precision, config["data"]["image_size"], settings, out, layout
    )
    atomic.write_json(
        out / "profile.json",
        {
            "format": profiling.FORMAT,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "checkpoint": str(args.checkpoint),
            "model": config["model"]["name"],
            "device": str(device),
            "backend": device.type,
            "device_description": dev.describe_device(device),
            "precision": precision,
            "image_size": config["data"]["image_size"],
            "settings": settings,
            **result,
        },
    )
    return 0
