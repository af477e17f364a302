"""What the IoU branch (`model.iou_score: true`) costs a training step.

Side A is a Trainer built with `model.iou_score=true` (the IoU branch's 1x1 conv on the box
head's hidden features, and its BCE term in the loss), side B the same config with the key off
(the default). Both run the Trainer's own step, `trainer.step` (forward, loss, backward,
clipping, AdamW, scheduler), on the same K batches taken once from the training DataLoader and
held in memory. Blocks of N steps alternate ABBA for R rounds. Target: median A / median B <=
1.05 (in a fixed time budget, a slower step is fewer epochs).
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

NAME = "iou_score_step"
TARGET = 1.05
SIDES = {"A": "iou_score on", "B": "iou_score off (default)"}


def parse_args(argv: list[str]):
    parser = harness.parser(NAME, __doc__)
    harness.add_torch_options(parser)
    harness.add_alternation_options(parser, warmup=10, block=10, rounds=20)
    harness.add_batches_and_data_options(
        parser,
        "config overrides for both sides, e.g. train.batch_size=4 (the presets' batch)",
    )
    args = parser.parse_args(argv)
    harness.check_positive(parser, args, "batches", "block", "rounds")
    return args


def build(args, device: torch.device, iou_score: bool) -> Trainer:
    config = load_config(
        None,
        [
            f"device={device}",
            f"seed={args.seed}",
            f"data.root={args.data_root}",
            *args.settings,
            f"model.iou_score={str(iou_score).lower()}",
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
    trainers = {"A": build(args, device, True), "B": build(args, device, False)}
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
        f"{NAME}: {first.config['model']['name']} on {dev.describe_device(device)} in "
        f"{first.precision}, batch {first.train_cfg['batch_size']} at "
        f"{first.config['data']['image_size']} px, {torch.get_num_threads()} torch threads; "
        f"K={len(batches)} batches in memory, warm-up {args.warmup}, {args.rounds} rounds x "
        f"{args.block} steps per side (ABBA)",
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
        "model": first.config["model"]["name"],
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
            "median step with the IoU branch / median step without it",
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
