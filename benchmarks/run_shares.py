"""Run shares: where a training run of the README's "Your own data" path spends its wall time.

Trains one run in this process as `python -m pipeline train` would (config/config.yaml, then
config/presets/photographs.yaml and five-minutes-cpu.yaml, then a user file with the set's
format, paths and data.image_size, as benchmarks/real_sets.py builds it; key=value settings
last), for fixed epochs (--epochs) or within a time budget (--budget, as the preset's run),
and times, as parts of Trainer.fit()'s wall time: the training steps (TrainStep: forward, loss,
backward, optimizer), waiting for the next batch (the loader: with the cache, the augmentation
of each sample in this process), the weight average's update, validations, checkpoint writes
(last.pth every epoch, best.pth when validation improves), and the rest (logging, metrics rows,
the budget's planning, the loop). The first epoch's excess over the median epoch (oneDNN
creating its kernels) is reported beside them.

Optionally (--workers-rounds R) it then sets whole epochs fed by the loader as configured
against epochs fed by one DataLoader worker process, ABBA for R rounds on the same model:
whether moving the augmentation out of the training process pays on this machine's cores.

No target: the figures say what is worth removing (a share of a few percent is not).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import harness
import torch
import yaml
from real_sets import BASE_CONFIG, PREPARED, PRESETS, SETS, user_data

from pipeline import device as dev
from pipeline import timing
from pipeline.cli import configure_logging
from pipeline.config import load_config
from pipeline.data.dataset import make_loader
from pipeline.engine import checkpoint
from pipeline.engine.trainer import Trainer

NAME = "run_shares"
SHAPES = "shapes"  # the generated set, as config/config.yaml has it (data.root a setting)
PARTS = {
    "steps": "training steps (TrainStep)",
    "batches": "waiting for batches (loader, augmentation)",
    "weight_average": "weight average updates",
    "validation": "validations",
    "checkpoints": "checkpoint writes",
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = harness.parser(NAME, __doc__)
    parser.add_argument(
        "name",
        choices=[*sorted(SETS), SHAPES],
        help="a set benchmarks/real_sets.py prepares, or the generated shapes",
    )
    parser.add_argument("--data", type=Path, help="the prepared set (default: resources/real/NAME)")
    parser.add_argument("--epochs", type=int, default=6, help="fixed epochs (without --budget)")
    parser.add_argument(
        "--budget", type=float, help="train.time_budget_s: train as the preset does instead"
    )
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--image-size", type=int, help="default: the set's own")
    parser.add_argument(
        "--cpu-threads", default="auto", help="torch CPU threads (auto, as the README)"
    )
    parser.add_argument(
        "--workers-rounds",
        type=int,
        default=0,
        help="R: rounds of one epoch fed as configured against one fed by 1 worker (0: none)",
    )
    parser.add_argument("settings", nargs="*", metavar="key=value", help="settings, layered last")
    args = parser.parse_intermixed_args(argv)  # the settings may follow options
    if args.epochs < 1 or args.workers_rounds < 0 or (args.budget is not None and args.budget <= 0):
        parser.error("--epochs must be at least 1, --workers-rounds at least 0, --budget above 0")
    return args


class Clock:
    """Seconds spent in each part, added up by the wrappers `timed` makes."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)

    def timed(self, part: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start

        return run

    def timed_batches(self, loader: torch.utils.data.DataLoader) -> Any:
        clock = self

        class Timed:
            """The loader, its batches' waits timed; what the Trainer reads of it passed on."""

            sampler = loader.sampler

            def __len__(self) -> int:
                return len(loader)

            def __iter__(self) -> Iterator[Any]:
                batches = iter(loader)
                while True:
                    start = time.perf_counter()
                    batch = next(batches, None)
                    clock.seconds["batches"] += time.perf_counter() - start
                    if batch is None:
                        return
                    yield batch

        return Timed()


def instrument(trainer: Trainer, clock: Clock) -> None:
    """Wrap the parts of `trainer` that `Clock` times (the instance's, nothing else's)."""
    trainer.step = clock.timed("steps", trainer.step)
    trainer._validate = clock.timed("validation", trainer._validate)
    trainer.train_loader = clock.timed_batches(trainer.train_loader)
    if trainer.weight_average is not None:
        average = trainer.weight_average
        average.update = clock.timed("weight_average", average.update)


def config_for(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The README path's config: the presets, the set's user file (none for `shapes`, the
    generated set: data.root among the settings), the run's length, then the settings."""
    files = [BASE_CONFIG, *PRESETS]
    if args.name != SHAPES:
        real = SETS[args.name]
        user_file = work / f"{real.name}.yaml"
        data = user_data(real, args.data or PREPARED / real.name, args.image_size)
        user_file.write_text(yaml.safe_dump(data), encoding="utf-8")
        files.append(user_file)
    length = (
        [f"train.time_budget_s={args.budget:g}"]
        if args.budget is not None
        else [f"train.epochs={args.epochs}", "train.time_budget_s=null"]
    )
    size = [f"data.image_size={args.image_size}"] if args.image_size and args.name == SHAPES else []
    return load_config(
        files, ["device=cpu", *length, f"precision={args.precision}", *size, *args.settings]
    )


def workers_rounds(trainer: Trainer, rounds: int) -> dict[str, Any]:
    """Whole epochs fed by the loader as configured (A) and by one worker process (B), ABBA."""
    dataset = trainer.train_loader.dataset
    loaders = {
        side: make_loader(
            dataset,
            trainer.train_cfg["batch_size"],
            shuffle=True,
            seed=trainer.config["seed"],
            num_workers=workers,
            pin_memory=False,
            drop_last=True,
        )
        for side, workers in (("A", trainer.train_loader.num_workers), ("B", 1))
    }
    epochs = itertools.count(1_000)  # other permutations than the run's, the same for A and B
    trainer.model.train()

    def epoch(side: str) -> float:
        loader = loaders[side]
        loader.sampler.set_epoch(next(epochs))
        start = time.perf_counter()
        for images, targets in loader:
            trainer.train_step(images, targets)
        dev.synchronize(trainer.device)
        return time.perf_counter() - start

    for side in ("A", "B"):  # warm: the worker started, the kernels made
        epoch(side)
    conditions = timing.RunConditions()
    seconds: dict[str, list[float]] = {"A": [], "B": []}
    for index in range(rounds):
        for side in timing.balanced_order(["A", "B"], index):
            seconds[side].append(epoch(side))
    ratios = [b / a for a, b in zip(seconds["A"], seconds["B"], strict=True)]
    return {
        "epoch_s": seconds,
        "ratio": statistics.median(seconds["B"]) / statistics.median(seconds["A"]),
        "per_round_ratios": ratios,
        "conditions": conditions.finish(),
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    configure_logging(None)
    dev.set_cpu_threads(args.cpu_threads)
    clock = Clock()
    save = checkpoint.save
    checkpoint.save = clock.timed("checkpoints", save)  # what the trainer module calls
    try:
        with tempfile.TemporaryDirectory() as work:
            config = config_for(args, Path(work))
            trainer = Trainer(config, Path(work) / "run")
            loader = trainer.train_loader
            instrument(trainer, clock)
            conditions = timing.RunConditions()
            start = time.perf_counter()
            summary = trainer.fit()
            wall = time.perf_counter() - start
            loaded = conditions.finish()
    finally:
        checkpoint.save = save
    epochs = summary["epoch_times_s"]
    parts = dict(clock.seconds)
    parts["rest"] = wall - sum(parts.values())
    first_excess = epochs[0] - statistics.median(epochs[1:]) if len(epochs) > 1 else None
    names = {**PARTS, "rest": "the rest: logging, rows, planning, the loop"}
    rows = [[names[key], f"{s:.2f}", f"{s / wall:.1%}"] for key, s in parts.items()]
    print(
        f"{NAME}: {args.name} at {config['data']['image_size']} px, {summary['precision']}, "
        f"batch {summary['batch_size']}, {torch.get_num_threads()} torch threads: "
        f"{summary['epochs']} epochs, {summary['steps']} steps in {wall:.1f} s"
    )
    print(harness.table(("part of fit()", "seconds", "share"), rows))
    if first_excess is not None:
        print(
            f"the first epoch's excess over the median epoch: {first_excess:.2f} s "
            f"({first_excess / wall:.1%})"
        )
    harness.warn_if_loaded(loaded, "the run")
    figures = [harness.figure("wall_s", "Trainer.fit() wall time", wall, "s")]
    figures += [
        harness.figure(
            f"share.{key}", f"share of the wall time: {names[key]}", s / wall, "fraction"
        )
        for key, s in parts.items()
    ]
    if first_excess is not None:
        excess = "the first epoch minus the median epoch"
        figures.append(harness.figure("first_epoch_excess_s", excess, first_excess, "s"))
    flags = harness.condition_flags(loaded, "the run")
    workers = None
    if args.workers_rounds:
        trainer.train_loader = loader
        workers = workers_rounds(trainer, args.workers_rounds)
        print(
            f"epochs fed by 1 worker process / fed as configured ({loader.num_workers} workers): "
            f"{workers['ratio']:.3f} (per round {min(workers['per_round_ratios']):.3f}-"
            f"{max(workers['per_round_ratios']):.3f}, {args.workers_rounds} rounds ABBA)"
        )
        harness.warn_if_loaded(workers["conditions"], "the workers rounds")
        flags += harness.condition_flags(workers["conditions"], "the workers rounds")
        label = "median epoch fed by 1 worker process / median epoch fed as configured"
        figures.append(harness.figure("workers.ratio", label, workers["ratio"], "ratio"))
    settings = {
        "set": args.name,
        "image_size": config["data"]["image_size"],
        "precision": summary["precision"],
        "batch_size": summary["batch_size"],
        "epochs": summary["epochs"],
        "steps": summary["steps"],
        "time_budget_s": args.budget,
        "cpu_threads": torch.get_num_threads(),
        "overrides": args.settings,
    }
    if workers is not None:
        settings["workers_rounds"] = args.workers_rounds
    document = harness.record(NAME, figures, settings=settings, flags=flags)
    if args.record is None:  # one record per set, size, precision and length, not one a day
        length = f"budget{args.budget:g}s" if args.budget is not None else f"{args.epochs}epochs"
        default = harness.default_record_path(document)
        args.record = default.with_stem(
            f"{default.stem}-{args.name}-{settings['image_size']}px-{args.precision}-{length}"
        )
    harness.write_record(args, document)
    raw = {
        "benchmark": NAME,
        "parts_s": parts,
        "wall_s": wall,
        "summary": summary,
        "settings": settings,
        "conditions": loaded,
        "workers": workers,
    }
    return harness.finish(args.out, raw, True, False)


if __name__ == "__main__":
    harness.run(main)
