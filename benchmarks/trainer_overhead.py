"""Trainer overhead: the Trainer's steady-state training step against a bare PyTorch loop.

Side A is what the Trainer does for a step between log steps, `Trainer.train_step`: `TrainStep`
(autocast context, GradScaler, the non-finite guard on the device, clipping, scheduler), the
weight average's update with train.ema=true (which B does not do: the ratio then includes its
cost), memory sampling and the device-side tally of losses; side B is the same algorithm written out by hand:
forward, DetectionLoss, zero_grad, backward, clip_grad_norm_, optimizer.step(),
scheduler.step(). Both start from the same weights (B trains a deep copy taken before
any step), with their own AdamW and LambdaLR built by the Trainer's own functions, on
the same K batches taken once from the Trainer's train loader and held in memory.
Blocks of N steps alternate ABBA for R rounds. Target: median A / median B <= 1.05.
"""

from __future__ import annotations

import copy
import itertools
import time
from typing import Any

import harness
import torch

from pipeline import device as dev
from pipeline.engine.step import build_optimizer, build_scheduler
from pipeline.engine.trainer import Trainer
from pipeline.models.loss import DetectionLoss

NAME = "trainer_overhead"
TARGET = 1.05
Batch = tuple[torch.Tensor, list[dict[str, Any]]]


def parse_args(argv: list[str]):
    parser = harness.parser(NAME, __doc__)
    harness.add_torch_options(parser)
    harness.add_alternation_options(parser, warmup=10, block=10, rounds=40)
    harness.add_batches_and_data_options(
        parser,
        "config overrides on top of the defaults, e.g. train.batch_size=32 model.name=resnet18",
    )
    args = parser.parse_args(argv)
    harness.check_positive(parser, args, "batches", "block", "rounds")
    return args


class BareLoop:
    """The Trainer's algorithm without its bookkeeping, on its own copy of the model."""

    def __init__(self, trainer: Trainer) -> None:
        train = trainer.train_cfg
        self.device, self.memory_format = trainer.device, trainer.memory_format
        self.model = copy.deepcopy(trainer.model)  # before any step: the same initial weights
        self.model.train()
        self.loss_fn = DetectionLoss.for_model(self.model, train["box_weight"])
        self.optimizer = build_optimizer(self.model.parameters(), train)
        self.scheduler = build_scheduler(self.optimizer, train, trainer.steps_per_epoch)
        self.max_norm = train["grad_clip"]
        # Off the CPU the default config trains with AMP: the bare loop must do the same work.
        self.precision = trainer.precision
        self.scaler = (
            torch.amp.GradScaler(self.device.type) if trainer.precision == "fp16" else None
        )

    def step(self, images: torch.Tensor, targets: list[dict[str, Any]]) -> None:
        images = images.to(self.device, non_blocking=True).contiguous(
            memory_format=self.memory_format
        )
        with dev.autocast(self.device, self.precision):
            outputs = self.model(images)
        loss = self.loss_fn(outputs, targets)["total"]
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is None:
            loss.backward()
            if self.max_norm:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            if self.max_norm:
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.scheduler.step()


def take_batches(trainer: Trainer, count: int) -> list[Batch]:
    """The first `count` batches the Trainer's loader gives, epoch after epoch if needed."""
    batches: list[Batch] = []
    epoch = 0
    while len(batches) < count:
        epoch += 1
        trainer.train_loader.sampler.set_epoch(epoch)
        batches.extend(itertools.islice(trainer.train_loader, count - len(batches)))
    return batches


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    device = harness.setup_torch(args)
    config = harness.trainer_config(args, device)
    trainer = harness.stepping_trainer(config)
    bare = BareLoop(trainer)
    batches = take_batches(trainer, args.batches)

    positions = {"A": itertools.count(), "B": itertools.count()}

    def trainer_step() -> None:
        trainer.train_step(*batches[next(positions["A"]) % len(batches)])

    def bare_step() -> None:
        bare.step(*batches[next(positions["B"]) % len(batches)])

    sides = {"A": trainer_step, "B": bare_step}
    blocks, conditions = harness.measure_trainer_steps(NAME, trainer, sides, args, len(batches))

    result = {
        "A": harness.side_summary("Trainer step", harness.counted(blocks, "A")),
        "B": harness.side_summary("bare PyTorch loop", harness.counted(blocks, "B")),
    }
    ratio, per_round = harness.print_sides(result, blocks)
    # read once, after timing: steps of A whose loss was not finite (skipped: a faster A)
    skipped = next(positions["A"]) - int(trainer.tally.finite_steps.item())
    if skipped:
        print(f"WARNING: the Trainer skipped {skipped} steps with a non-finite loss (faster A).")
    passed, line = harness.verdict("ratio A/B of median step times", ratio, TARGET)
    print(line)
    print(f"took {time.perf_counter() - started:.0f} s")
    settings = {
        "model": config["model"]["name"],
        "precision": trainer.precision,
        "batch_size": trainer.train_cfg["batch_size"],
        "channels_last": trainer.train_cfg["channels_last"],
        "grad_clip": trainer.train_cfg["grad_clip"],
        "batches": len(batches),
        "warmup": args.warmup,
        "block": args.block,
        "rounds": args.rounds,
        "overrides": args.settings,
    }
    flags = [*harness.condition_flags(conditions, "the measurement"), *harness.noisy_flags(result)]
    if skipped:
        flags.append(f"the Trainer skipped {skipped} steps with a non-finite loss (a faster A)")
    figures = [
        harness.figure(
            "ratio",
            "median Trainer step / median bare-loop step",
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
