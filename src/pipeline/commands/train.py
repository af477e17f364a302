"""`python -m pipeline train`: train a detector with the resolved device and AMP policy."""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.cli import command_parser
from pipeline.config import default_config_path, load_config, parse_bool
from pipeline.errors import ConfigError

log = logging.getLogger("pipeline")


def main(argv: list[str]) -> int:
    parser = command_parser("train", __doc__)
    parser.add_argument(
        "--config", metavar="FILE.yaml", help="config file (default: config/config.yaml if present)"
    )
    parser.add_argument(
        "--device", help="auto, cpu, cuda, cuda:N or mps (overrides the config's device)"
    )
    parser.add_argument("--amp", help="auto, true or false (overrides the config's amp)")
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument(
        "--resume",
        action="store_true",
        help="continue from <out>/last.pth (it must exist and match)",
    )
    resume.add_argument(
        "--resume-if-possible",
        action="store_true",
        help="continue an unfinished run in <out> trained with the same settings; otherwise start afresh",
    )
    parser.add_argument(
        "--out", metavar="DIR", help="run folder (default: results/train/<device>-<precision>)"
    )
    parser.add_argument(
        "settings", nargs="*", metavar="key=value", help="config overrides, e.g. train.epochs=5"
    )
    args = parser.parse_args(argv)

    settings = list(args.settings)
    if args.device:
        settings.append(f"device={args.device}")
    if args.amp:
        amp = parse_bool(args.amp)
        if amp not in (True, False, "auto"):
            raise ConfigError(f"--amp {args.amp!r} is not understood: use auto, true or false.")
        settings.append(f"amp={str(amp).lower()}")
    config = load_config(default_config_path(args.config), settings)

    from pipeline import device as dev
    from pipeline.engine.trainer import Trainer
    from pipeline.runs import Run

    out = args.out
    if not out:
        device = dev.resolve_device(config["device"])
        precision = dev.training_precision(config["amp"], config["amp_dtype"], device)
        out = Path("results/train") / Run(str(device), precision).name
    trainer = Trainer(config, out)
    if args.resume or args.resume_if_possible:
        trainer.resume(required=args.resume)
    summary = trainer.fit()
    final = summary["final_val"] or {}
    log.info(
        "done in %.0f s: best %s %.4f at epoch %s; final F1 %.3f, AP@.5 %.3f -> %s",
        summary["wall_time_s"],
        summary["monitor"],
        summary["best_metric"] if summary["best_metric"] is not None else float("nan"),
        summary["best_epoch"],
        final.get("f1", float("nan")),
        final.get("ap50", float("nan")),
        trainer.run_dir,
    )
    return 0
