"""tiny_conv's training step with stride-32 context against the stride-16 tiny_conv it replaced.

Side A is the default tiny_conv (`model.max_stride: 32`: a stride-32 stage whose features
the top-down neck brings back to the stride-4 head); side B is the same config with
`model.max_stride=16`, which builds the earlier architecture (the same modules and parameter
names; both sides have the per-class box channels, so the ratio is what the context costs).
Each side is a Trainer built from the default config plus the overrides given, and runs the
Trainer's own step, `trainer.step` (forward, loss, backward, clipping,
AdamW, scheduler), on the same K batches taken once from the training DataLoader and held in memory.
Blocks of N steps alternate ABBA for R rounds. Target: median A / median B <= 1.3.
"""

from __future__ import annotations

import itertools
import tempfile
import time

import harness
import torch

from pipeline import device as dev
from pipeline import timing
from pipeline.config import load_config
from pipeline.engine.trainer import Trainer
from pipeline.models import parameter_count

NAME = "tiny_conv_context"
TARGET = 1.3
SIDES = {"A": "max_stride 32 (default)", "B": "max_stride 16 (before)"}


def parse_args(argv: list[str]):
    parser = harness.parser(NAME, __doc__)
    harness.add_torch_options(parser)
    harness.add_alternation_options(parser, warmup=10, block=10, rounds=20)
    harness.add_batches_and_data_options(
        parser, "config overrides for both sides, e.g. data.image_size=256 (the data set's size)"
    )
    args = parser.parse_args(argv)
    harness.check_positive(parser, args, "batches", "block", "rounds")
    return args


def build(args, device: torch.device, max_stride: int) -> Trainer:
    config = load_config(
        None,
        [
            f"device={device}",
            f"seed={args.seed}",
            f"data.root={args.data_root}",
            *args.settings,
            "model.name=tiny_conv",
            f"model.max_stride={max_stride}",
        ],
    )
    with tempfile.TemporaryDirectory() as run_dir:  # fit() is never called: nothing is written
        trainer = Trainer(config, run_dir)
    trainer.model.train()
    return trainer


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    device = harness.setup_torch(args)
    trainers = {"A": build(args, device, 32), "B": build(args, device, 16)}
    loader = trainers["A"].train_loader
    loader.sampler.set_epoch(1)
    batches = list(itertools.islice(itertools.cycle(loader), args.batches))
    positions = {side: itertools.count() for side in trainers}
    skipped = dict.fromkeys(trainers, 0)

    def stepper(side: str):
        def step() -> None:
            images, targets = batches[next(positions[side]) % len(batches)]
            if not bool(trainers[side].step(images, targets).finite):  # one sync, both sides
                skipped[side] += 1

        return step

    sides = {side: stepper(side) for side in trainers}
    first = trainers["A"]
    print(
        f"{NAME}: tiny_conv on {dev.describe_device(device)} in {first.precision}, batch "
        f"{first.train_cfg['batch_size']} at {first.config['data']['image_size']} px, "
        f"{torch.get_num_threads()} torch threads; K={len(batches)} batches in memory, warm-up "
        f"{args.warmup}, {args.rounds} rounds x {args.block} steps per side (ABBA)",
        flush=True,
    )
    harness.warm_up(sides, device, args.warmup)
    conditions = timing.RunConditions()
    blocks = harness.alternate(sides, device, rounds=args.rounds, block=args.block)
    conditions = conditions.finish()
    harness.warn_if_loaded(conditions, "the measurement")

    result = {
        side: {
            **harness.side_summary(label, harness.counted(blocks, side)),
            "parameters": parameter_count(trainers[side].model),
        }
        for side, label in SIDES.items()
    }
    ratio, per_round = harness.print_sides(
        result,
        blocks,
        f"parameters: A {result['A']['parameters']:,}, B {result['B']['parameters']:,}; ",
    )
    for side, count in skipped.items():
        if count:
            print(f"WARNING: side {side} skipped {count} steps with a non-finite loss (faster).")
    passed, line = harness.verdict("ratio A/B of median step times", ratio, TARGET)
    print(line)
    print(f"took {time.perf_counter() - started:.0f} s")
    settings = {
        "precision": first.precision,
        "batch_size": first.train_cfg["batch_size"],
        "image_size": first.config["data"]["image_size"],
        "channels_last": first.train_cfg["channels_last"],
        "batches": len(batches),
        "warmup": args.warmup,
        "block": args.block,
        "rounds": args.rounds,
        "overrides": args.settings,
        "parameters": {side: result[side]["parameters"] for side in result},
    }
    flags = [*harness.condition_flags(conditions, "the measurement"), *harness.noisy_flags(result)]
    flags += [
        f"side {side} skipped {count} steps with a non-finite loss (faster)"
        for side, count in skipped.items()
        if count
    ]
    figures = [
        harness.figure(
            "ratio",
            "median step with stride-32 context / median step of the stride-16 tiny_conv",
            ratio,
            "ratio",
            target=("<=", TARGET),
        ),
        *harness.side_figures(result),
    ]
    harness.write_record(args, harness.record(NAME, figures, settings=settings, flags=flags))
    raw = {
        "benchmark": NAME,
        "target": {"ratio_max": TARGET, "ratio": "median A / median B"},
        "ratio": ratio,
        "per_round_ratios": per_round,
        "sides": result,
        "nonfinite_skipped_steps": skipped,
        "settings": settings,
        "environment": harness.environment(device),
        "conditions": conditions,
        "blocks": blocks,
    }
    return harness.finish(args.out, raw, passed, args.check)


if __name__ == "__main__":
    harness.run(main)
