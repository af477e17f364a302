"""Input pipeline: training steps fed by the real DataLoader against the same steps fed from memory.

Side A draws each batch from the Trainer's own training DataLoader (epoch after epoch,
as `fit()` does) and runs the Trainer's step on it; the time of a step includes
fetching its batch. Side B runs the same step on batches materialised in memory
beforehand (taken from the same loader). Both sides use one model, the Trainer's own:
training on either side changes the weights, which does not change what a step costs.
Blocks of N steps alternate ABBA for R rounds.

Two rows: the default configuration (data.cache=true: every image is decoded once at
start, a one-time cost reported apart; DataLoader workers from default_num_workers(True))
and the uncached path (data.cache=false: every image decoded from PNG on each access,
workers from default_num_workers(False)), so the table shows what the cache buys.
Target, for the default (cached) row only: median A / median B <= 1.10.
"""

from __future__ import annotations

import copy
import gc
import itertools
import statistics
import time
from typing import Any

import harness
import torch

from pipeline import device as dev
from pipeline.engine.trainer import Trainer

NAME = "input_pipeline"
TARGET = 1.10
ROWS = {"cached": "cached (default)", "uncached": "uncached (PNG each access)"}


def parse_args(argv: list[str]):
    parser = harness.parser(NAME, __doc__)
    harness.add_torch_options(parser)
    harness.add_alternation_options(parser, warmup=5, block=16, rounds=12)
    parser.add_argument(
        "--batches",
        type=int,
        default=0,
        help="batches materialised in memory for side B (0: one epoch's worth)",
    )
    parser.add_argument(
        "--skip",
        type=int,
        default=-1,
        help="first steps of each block timed but not counted (-1: the loader's prefetch depth, "
        "workers x prefetch_factor, which the workers fill while the other side runs; at most "
        "half a block)",
    )
    parser.add_argument(
        "--no-uncached", action="store_true", help="measure the default (cached) row only"
    )
    parser.add_argument(
        "--data-root", default=str(harness.DEFAULT_DATA_ROOT), help="the generated data set"
    )
    parser.add_argument(
        "settings",
        nargs="*",
        metavar="key=value",
        help="config overrides on top of the defaults (data.cache is set per row)",
    )
    args = parser.parse_args(argv)
    harness.check_positive(parser, args, "block", "rounds")
    if args.batches < 0 or args.skip >= args.block:
        parser.error("--batches must be at least 0 and --skip smaller than --block")
    return args


class LoaderFeed:
    """Batches from the real DataLoader, a new epoch (and permutation) whenever one ends."""

    def __init__(self, loader: torch.utils.data.DataLoader) -> None:
        self.loader, self.epoch, self.iterator = loader, 0, iter(())

    def next(self) -> Any:
        batch = next(self.iterator, None)
        if batch is None:
            self.epoch += 1
            self.loader.sampler.set_epoch(self.epoch)
            self.iterator = iter(self.loader)
            batch = next(self.iterator)
        return batch


def build(args, device: torch.device, cache: bool) -> tuple[Trainer, float]:
    """A Trainer, and how long building it took (with the cache, that is the decoding)."""
    config = harness.trainer_config(args, device, f"data.cache={str(cache).lower()}")
    start = time.perf_counter()
    trainer = harness.stepping_trainer(config)
    return trainer, time.perf_counter() - start


def measure(row: str, trainer: Trainer, args, device: torch.device) -> dict[str, Any]:
    loader = trainer.train_loader
    trainer.model.train()
    feed = LoaderFeed(loader)
    batches = [feed.next() for _ in range(args.batches or trainer.steps_per_epoch)]
    workers = loader.num_workers
    prefetched = workers * (loader.prefetch_factor or 0)
    skip = args.skip if args.skip >= 0 else min(prefetched, args.block // 2)
    position = itertools.count()
    steps = itertools.count()

    def run(images: torch.Tensor, targets: list[dict[str, Any]]) -> None:
        next(steps)
        trainer.tally.add(trainer.step(images, targets))

    sides = {
        "A": lambda: run(*feed.next()),
        "B": lambda: run(*batches[next(position) % len(batches)]),
    }
    print(
        f"{ROWS[row]}: {workers} DataLoader workers, {len(batches)} batches in memory for B, "
        f"first {skip} steps of each block not counted",
        flush=True,
    )
    # the conditions end before the workers shut down: their CPU is ours
    blocks, conditions = harness.measure(
        sides, device, warmup=args.warmup, rounds=args.rounds, block=args.block, skip=skip
    )
    harness.warn_if_loaded(conditions, f"the {row} row")
    a = harness.side_summary("DataLoader + step", harness.counted(blocks, "A"))
    b = harness.side_summary("in memory + step", harness.counted(blocks, "B"))
    return {
        "label": ROWS[row],
        "cache": row == "cached",
        "num_workers": workers,
        "skip": skip,
        "batches_in_memory": len(batches),
        "epochs_drawn": feed.epoch,
        "ratio": a["summary"]["median_ms"] / b["summary"]["median_ms"],
        "per_round_ratios": harness.round_ratios(blocks, "A", "B"),
        "sides": {"A": a, "B": b},
        # read once, after timing: steps whose loss was not finite were skipped (faster)
        "nonfinite_skipped_steps": next(steps) - int(trainer.tally.finite_steps.item()),
        "conditions": conditions,
        "blocks": blocks,
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    device = harness.setup_torch(args)
    trainer, startup_cached = build(args, device, cache=True)
    initial = copy.deepcopy(trainer.model.state_dict())
    images = len(trainer.train_loader.dataset) + len(trainer.val_loader.dataset)
    print(
        f"{NAME}: {trainer.config['model']['name']} on {dev.describe_device(device)} in "
        f"{trainer.precision}, batch {trainer.train_cfg['batch_size']}, "
        f"{torch.get_num_threads()} torch threads; warm-up {args.warmup}, "
        f"{args.rounds} rounds x {args.block} steps per side (ABBA); one model per row, "
        "shared by both sides",
        flush=True,
    )
    settings = {
        "model": trainer.config["model"]["name"],
        "precision": trainer.precision,
        "batch_size": trainer.train_cfg["batch_size"],
        "warmup": args.warmup,
        "block": args.block,
        "rounds": args.rounds,
        "overrides": args.settings,
        "model_use": "one model per row, shared by sides A and B (the Trainer's own)",
    }
    rows = {"cached": measure("cached", trainer, args, device)}
    startup = {"cached_s": startup_cached, "images_decoded": images}
    del trainer
    gc.collect()

    if not args.no_uncached:
        trainer, startup["uncached_s"] = build(args, device, cache=False)
        trainer.model.load_state_dict(initial)  # the same starting weights as the cached row
        rows["uncached"] = measure("uncached", trainer, args, device)
        del trainer
        gc.collect()  # shuts the persistent workers down

    headers = ("row", "workers", "A: loader ms", "IQR", "B: memory ms", "IQR", "A/B", "rounds A/B")
    table = []
    for row in rows.values():
        a, b = row["sides"]["A"]["summary"], row["sides"]["B"]["summary"]
        per_round = row["per_round_ratios"]
        table.append(
            [
                row["label"],
                row["num_workers"],
                harness.ms(a["median_ms"]),
                harness.ms(a["iqr_ms"]),
                harness.ms(b["median_ms"]),
                harness.ms(b["iqr_ms"]),
                row["ratio"],
                f"{min(per_round):.3f}-{max(per_round):.3f}",
            ]
        )
    print(harness.table(headers, table))
    line = f"start-up, once: {startup_cached:.2f} s with the cache (decodes {images} images)"
    if "uncached_s" in startup:
        line += f", {startup['uncached_s']:.2f} s without"
    print(line)
    for row in rows.values():
        if row["nonfinite_skipped_steps"]:
            print(
                f"WARNING: {row['label']}: {row['nonfinite_skipped_steps']} steps skipped "
                "with a non-finite loss."
            )
    if "uncached" in rows:
        print(
            f"what the cache buys: A/B {rows['uncached']['ratio']:.3f} uncached -> "
            f"{rows['cached']['ratio']:.3f} cached (the uncached row has no target)"
        )
    passed, line = harness.verdict(
        "ratio A/B, default (cached) configuration", rows["cached"]["ratio"], TARGET
    )
    print(line)
    print(f"took {time.perf_counter() - started:.0f} s")
    flags = []
    for key, row in rows.items():
        flags += harness.condition_flags(row["conditions"], f"the {key} row")
        flags += harness.noisy_flags(row["sides"], f"{key} row, ")
        if row["nonfinite_skipped_steps"]:
            flags.append(
                f"{key} row: {row['nonfinite_skipped_steps']} steps skipped, loss not finite"
            )
    figures = [
        harness.figure(
            "cached.ratio",
            "cached (default): median step fed by the DataLoader / fed from memory",
            rows["cached"]["ratio"],
            "ratio",
            target=("<=", TARGET),
        ),
        *harness.side_figures(rows["cached"]["sides"], "cached."),
        harness.figure(
            "cached.startup_s", "cached: decoding every image once, at start", startup_cached, "s"
        ),
    ]
    if "uncached" in rows:
        figures.append(
            harness.figure(
                "uncached.ratio",
                "uncached (PNG each access): the same ratio, no target",
                rows["uncached"]["ratio"],
                "ratio",
            )
        )
    harness.write_record(args, harness.record(NAME, figures, settings=settings, flags=flags))
    record = {
        "benchmark": NAME,
        "target": {
            "ratio_max": TARGET,
            "ratio": "median A / median B",
            "applies_to": "cached (default configuration)",
        },
        "ratio": rows["cached"]["ratio"],
        "median_per_round_ratio": statistics.median(rows["cached"]["per_round_ratios"]),
        "startup": startup,
        "rows": rows,
        "settings": settings,
        "environment": harness.environment(device),
    }
    return harness.finish(args.out, record, passed, args.check)


if __name__ == "__main__":
    harness.run(main)
