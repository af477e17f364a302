"""Two configurations' training steps side by side: what tiny_conv_context.py and
iou_score_step.py share.

Each side is a Trainer built from the shipped config, the script's overrides and the side's
own settings, and runs the Trainer's own step, `trainer.step` (forward, loss, backward,
clipping, AdamW, scheduler), on the same K batches taken once from side A's training
DataLoader and held in memory. Blocks of N steps alternate ABBA for R rounds; the figure is
median A / median B against the script's target.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import harness

from pipeline.models import parameter_count


@dataclass(frozen=True)
class Comparison:
    """A script's two sides: for each, its label and its settings (key=value); the target
    and the words of its ratio."""

    name: str
    doc: str
    sides: dict[str, tuple[str, list[str]]]
    target: float
    ratio_words: str
    settings_help: str


def parse_args(comparison: Comparison, argv: list[str]):
    parser = harness.parser(comparison.name, comparison.doc)
    harness.add_torch_options(parser)
    harness.add_alternation_options(parser, warmup=10, block=10, rounds=20)
    harness.add_batches_and_data_options(parser, comparison.settings_help)
    args = parser.parse_args(argv)
    harness.check_positive(parser, args, "batches", "block", "rounds")
    return args


def main(comparison: Comparison, argv: list[str]) -> int:
    args = parse_args(comparison, argv)
    started = time.perf_counter()
    device = harness.setup_torch(args)
    trainers = {
        side: harness.stepping_trainer(harness.trainer_config(args, device, *settings))
        for side, (_, settings) in comparison.sides.items()
    }
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
    blocks, conditions = harness.measure_trainer_steps(
        comparison.name, first, sides, args, len(batches)
    )

    result = {
        side: {
            **harness.side_summary(label, harness.counted(blocks, side)),
            "parameters": parameter_count(trainers[side].model),
        }
        for side, (label, _) in comparison.sides.items()
    }
    ratio, per_round = harness.print_sides(
        result,
        blocks,
        f"parameters: A {result['A']['parameters']:,}, B {result['B']['parameters']:,}; ",
    )
    for side, count in skipped.items():
        if count:
            print(f"WARNING: side {side} skipped {count} steps with a non-finite loss (faster).")
    passed, line = harness.verdict("ratio A/B of median step times", ratio, comparison.target)
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
            "ratio", comparison.ratio_words, ratio, "ratio", target=("<=", comparison.target)
        ),
        *harness.side_figures(result),
    ]
    harness.write_record(
        args, harness.record(comparison.name, figures, settings=settings, flags=flags)
    )
    raw = {
        "benchmark": comparison.name,
        "target": {"ratio_max": comparison.target, "ratio": "median A / median B"},
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
