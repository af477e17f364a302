"""`python -m pipeline train`: train a detector with the resolved device and precision.

With `--precision measured` (the shipped default) the precision is the one the benchmarks found
fastest with acceptable numerics on the run's backend (read from --bench DIR, or a
--precision-choice file), or fp32 where none is; train_summary.json records that choice and why.
Where results/bench holds no training benchmark of the backend and model (a first `train` outside
the workflow), the run trains in what precision=auto gives, with a warning saying how to measure;
a --bench DIR without them is refused.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline import atomic
from pipeline.cli import add_config_options, add_precision_option, command_parser, config_from_args
from pipeline.errors import ConfigError

log = logging.getLogger("pipeline")


def main(argv: list[str]) -> int:
    parser = command_parser("train", __doc__)
    parser.add_argument(
        "--device", help="auto, cpu, cuda, cuda:N or mps (overrides the config's device)"
    )
    add_precision_option(parser, "overrides the config's precision")
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument(
        "--bench",
        metavar="DIR",
        help="with precision=measured: the benchmark records to choose from (default: results/bench)",
    )
    choice.add_argument(
        "--precision-choice",
        metavar="FILE.json",
        help="with precision=measured: a choice written by 'python -m pipeline choose-precision'",
    )
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
    add_config_options(parser, "train.epochs=5")
    args = parser.parse_args(argv)

    settings = []
    if args.device:
        settings.append(f"device={args.device}")
    if args.precision:
        settings.append(f"precision={args.precision}")
    config = config_from_args(args, *settings)

    from pipeline import device as dev
    from pipeline import measured
    from pipeline.engine.trainer import Trainer
    from pipeline.runs import Run

    device = dev.resolve_device(config["device"])
    precision_choice = None
    if config["precision"] == "measured":
        model = config["model"]["name"]
        if args.precision_choice:
            precision_choice = measured.choice_for_model(args.precision_choice, model)
        else:
            bench_dir = args.bench or measured.DEFAULT_BENCH_DIR
            records = measured.train_records(bench_dir, device.type)
            if args.bench or measured.has_records(records, device.type, model):
                precision_choice = measured.choose_precision(
                    records, device.type, model, dev.measured_refusals(device)
                )
            else:  # nothing measured here yet (the shipped default, outside the workflow)
                auto = dev.training_precision("auto", device)
                precision_choice = measured.unmeasured_choice(device.type, model, auto)
                log.warning("%s", precision_choice.reason)
        log.info(
            "precision=measured on %s: %s (%s)",
            device,
            precision_choice.precision,
            precision_choice.reason,
        )
    elif args.bench or args.precision_choice:
        raise ConfigError("--bench and --precision-choice are only read with precision=measured.")
    out = args.out
    if not out:
        measured_precision = precision_choice.precision if precision_choice else None
        precision = dev.run_precision(config["precision"], device, measured_precision)
        out = Path("results/train") / Run(str(device), precision).name
    # here, once the default's name is known from the device and precision: before the data
    atomic.refuse_unwritable_output("--out", out, folder=True)
    trainer = Trainer(config, out, precision_choice=precision_choice)
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
