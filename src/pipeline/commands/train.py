"""`python -m pipeline train`: train a detector with the resolved device and AMP policy."""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.cli import command_parser
from pipeline.config import load_config, parse_bool
from pipeline.errors import ConfigError

log = logging.getLogger("pipeline")
DEFAULT_CONFIG = Path("config/config.yaml")


def main(argv: list[str]) -> int:
    parser = command_parser("train", __doc__)
    parser.add_argument(
        "--config", metavar="FILE.yaml", help="config file (default: config/config.yaml if present)"
    )
    parser.add_argument(
        "--device", help="auto, cpu, cuda, cuda:N or mps (overrides the config's device)"
    )
    parser.add_argument("--amp", help="auto, true or false (overrides the config's amp)")
    parser.add_argument(
        "--resume",
        nargs="?",
        const="required",
        choices=["required", "auto"],
        help="continue from <out>/last.pth; '--resume=auto' resumes only if it exists and has the same settings",
    )
    parser.add_argument(
        "--out", metavar="DIR", help="run folder (default: results/train/<device>-<precision>)"
    )
    parser.add_argument(
        "settings", nargs="*", metavar="key=value", help="config overrides, e.g. train.epochs=5"
    )
    args = parser.parse_args(argv)

    path = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
    settings = list(args.settings)
    if args.device:
        settings.append(f"device={args.device}")
    if args.amp:
        amp = parse_bool(args.amp)
        if amp not in (True, False, "auto"):
            raise ConfigError(f"--amp {args.amp!r} is not understood: use auto, true or false.")
        settings.append(f"amp={str(amp).lower()}")
    config = load_config(path, settings)

    from pipeline import device as dev
    from pipeline.engine.trainer import Trainer

    out = args.out
    if not out:
        device = dev.resolve_device(config["device"])
        out = (
            Path("results/train")
            / f"{device.type}-{dev.training_precision(config['amp'], config['amp_dtype'], device)}"
        )
    trainer = Trainer(config, out)
    if args.resume:
        trainer.resume(required=args.resume == "required")
    summary = trainer.fit()
    best = summary["final_val"] or {}
    log.info(
        "done in %.0f s: best %s %.4f at epoch %s; final F1 %.3f, AP@.5 %.3f -> %s",
        summary["wall_time_s"],
        summary["monitor"],
        summary["best_metric"] or float("nan"),
        summary["best_epoch"],
        best.get("f1", float("nan")),
        best.get("ap50", float("nan")),
        trainer.run_dir,
    )
    return 0
