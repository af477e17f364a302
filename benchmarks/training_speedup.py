"""Training speed-up: does the bench's answer hold for training as the Trainer runs it?

The bench times the model's training step on one rendered batch held in memory, and the
report's answer is its speed-up of a precision over fp32. Training does more per step: it
draws each batch from its loader (augmentation, collation), updates the weight average and
tallies the losses. Three measurements of fp32 against --candidate (default bf16), one run:

1. bench: `bench.run_backend` times both precisions' training step interleaved, as the bench
   rule does (first, before this process computes anything, so that on a CPU its model
   instances are timed in forked children); the speed-up paired by rounds, with its interval
   (`stats.speedup_between`).
2. Trainer, in this process: two Trainers of the same config and data, one per precision,
   blocks of --block steps of `Trainer.train_step`, each fed by its own train loader, in
   ABBA rounds; the speed-up paired by rounds the same way.
   Target: the Trainer's speed-up at least TRANSFER_TARGET x the bench's.
3. processes: `python -m pipeline train` of each precision for --epochs epochs, --processes
   times each, alternating; each run's median step time (train_summary.json). Processes
   are not paired by anything: the spread of their ratios shows what comparing two separate
   training runs can and cannot tell.
"""

from __future__ import annotations

import itertools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import torch

from pipeline import bench, bench_record, stats, timing
from pipeline import device as dev
from pipeline.data import class_count
from pipeline.engine.trainer import Trainer

NAME = "training_speedup"
TRANSFER_TARGET = 0.9  # Trainer speed-up / bench speed-up


def parse_args(argv: list[str]):
    parser = harness.parser(NAME, __doc__)
    harness.add_torch_options(parser)
    harness.add_alternation_options(parser, warmup=8, block=4, rounds=20)
    parser.add_argument(
        "--candidate", default="bf16", choices=("bf16", "fp16"), help="precision against fp32"
    )
    parser.add_argument(
        "--processes", type=int, default=3, help="training processes per precision (0: none)"
    )
    parser.add_argument("--epochs", type=int, default=2, help="epochs of each training process")
    parser.add_argument(
        "--data-root", default=str(harness.DEFAULT_DATA_ROOT), help="the generated data set"
    )
    parser.add_argument(
        "settings", nargs="*", metavar="key=value", help="config overrides for every side"
    )
    args = parser.parse_args(argv)
    harness.check_positive(parser, args, "block", "rounds", "epochs")
    if args.processes < 0:
        parser.error(f"--processes must be at least 0, got {args.processes}")
    return args


def bench_speedup(config: dict[str, Any], device: torch.device, candidate: str, classes: int):
    """The bench's paired speed-up of `candidate` over fp32 for the config's model."""
    settings = bench_record.settings_from_config(config, classes)
    model = config["model"]["name"]
    # run before any torch compute here: on a CPU its model instances are timed in forked
    # children, as the bench rule times them
    records = bench.run_backend(device, ["fp32", candidate], ["train"], [model], settings)
    timed = {r["precision"]: r for r in records}
    for record in timed.values():
        if record["status"] != "ok":
            raise RuntimeError(f"bench {record['precision']}: {record.get('reason')}")
    return stats.speedup_between(timed["fp32"]["timing"], timed[candidate]["timing"]), timed


def looping_steps(trainer: Trainer):
    """One Trainer step per call, each on the next batch of its own loader, epoch after epoch."""

    def batches():
        for epoch in itertools.count(1):
            trainer.train_loader.sampler.set_epoch(epoch)
            yield from trainer.train_loader

    stream = batches()
    trainer.model.train()
    return lambda: trainer.train_step(*next(stream))


def trainer_speedup(config: dict[str, Any], device: torch.device, candidate: str, args):
    """Two Trainers' steps in ABBA rounds; the candidate's paired speed-up over fp32."""
    trainers = {
        precision: harness.stepping_trainer({**config, "precision": precision})
        for precision in ("fp32", candidate)
    }
    sides = {precision: looping_steps(t) for precision, t in trainers.items()}
    blocks, conditions = harness.measure(
        sides, device, warmup=args.warmup, rounds=args.rounds, block=args.block
    )

    def side(name: str) -> tuple[list[float], list[int]]:
        mine = [b for b in blocks if b["side"] == name]
        return [s for b in mine for s in b["samples_s"]], [
            b["round"] for b in mine for _ in b["samples_s"]
        ]

    (fp32_s, fp32_rounds), (cand_s, cand_rounds) = side("fp32"), side(candidate)
    speedup = stats.speedup(fp32_s, cand_s, rounds=(fp32_rounds, cand_rounds))
    sides_summary = {
        "fp32": harness.side_summary("Trainer fp32", fp32_s),
        candidate: harness.side_summary(f"Trainer {candidate}", cand_s),
    }
    return speedup, sides_summary, conditions, blocks


def training_process(
    precision: str, args, device: torch.device, work: Path, index: int
) -> dict[str, Any]:
    """One `python -m pipeline train` run; its median step and training time."""
    out = work / f"{precision}-{index}"
    command = [
        sys.executable,
        "-m",
        "pipeline",
        "--cpu-threads",
        str(args.cpu_threads),
        "train",
        "--device",
        str(device),
        "--precision",
        precision,
        "--out",
        str(out),
        f"seed={args.seed}",
        f"data.root={args.data_root}",
        f"train.epochs={args.epochs}",
        f"train.val_interval={args.epochs + 1}",
        *args.settings,
    ]
    harness.run_logged(command, work / "train.log")
    summary = json.loads((out / "train_summary.json").read_text(encoding="utf-8"))
    return {
        "precision": precision,
        "median_step_ms": summary["median_step_time_s"] * 1000,
        "train_time_s": summary["train_time_s"],
    }


def process_ratios(args, device: torch.device, candidate: str) -> list[dict[str, Any]]:
    """fp32 and candidate training processes alternating (ABBA by pair); the ratio per pair."""
    pairs = []
    with tempfile.TemporaryDirectory() as work:
        for index in range(args.processes):
            order = timing.balanced_order(["fp32", candidate], index)
            runs = {p: training_process(p, args, device, Path(work), index) for p in order}
            ratio = runs["fp32"]["median_step_ms"] / runs[candidate]["median_step_ms"]
            pairs.append({"runs": runs, "ratio": ratio})
            print(
                f"  processes, pair {index + 1}: fp32 {runs['fp32']['median_step_ms']:.1f} ms, "
                f"{candidate} {runs[candidate]['median_step_ms']:.1f} ms: {ratio:.2f}x",
                flush=True,
            )
    return pairs


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    device = harness.setup_torch(args)
    candidate = args.candidate
    config = harness.trainer_config(args, device)
    print(
        f"{NAME}: {config['model']['name']} on {dev.describe_device(device)}, fp32 against "
        f"{candidate}, batch {config['train']['batch_size']}, {torch.get_num_threads()} torch threads",
        flush=True,
    )
    benched, bench_records = bench_speedup(config, device, candidate, class_count(config))
    print(f"  bench (as the bench rule times it): {benched.text}", flush=True)
    trained, sides, conditions, blocks = trainer_speedup(config, device, candidate, args)
    print(
        f"  Trainer, {args.rounds} rounds x {args.block} steps (ABBA): {trained.text}", flush=True
    )
    harness.warn_if_loaded(conditions, "the Trainer's measurement")
    pairs = process_ratios(args, device, candidate) if args.processes else []

    transfer = trained.ratio / benched.ratio
    passed = transfer >= TRANSFER_TARGET
    print(
        f"Trainer speed-up / bench speed-up: {transfer:.3f}   target >= {TRANSFER_TARGET}   "
        f"{'PASS' if passed else 'FAIL'}"
    )
    print(f"took {time.perf_counter() - started:.0f} s")

    figures = [
        harness.figure(
            "bench.speedup",
            f"bench: {candidate} speed-up over fp32 (paired over {benched.paired_rounds} rounds"
            f"{benched.over_instances})",
            benched.ratio,
            "speed-up",
            interval=(benched.low, benched.high),
        ),
        harness.figure(
            "trainer.speedup",
            f"Trainer steps: {candidate} speed-up over fp32 (paired over {trained.paired_rounds} rounds)",
            trained.ratio,
            "speed-up",
            interval=(trained.low, trained.high),
        ),
        harness.figure(
            "transfer",
            "Trainer speed-up / bench speed-up",
            transfer,
            "ratio",
            target=(">=", TRANSFER_TARGET),
        ),
        *harness.side_figures(sides, prefix="trainer."),
        *[
            harness.figure(
                f"bench.{precision}.median_ms",
                f"bench: median step time, {precision}",
                record["timing"]["median_ms"],
                "ms",
            )
            for precision, record in bench_records.items()
        ],
    ]
    if pairs:
        ratios = [pair["ratio"] for pair in pairs]
        figures.append(
            harness.figure(
                "processes.speedup",
                f"separate training processes: median of {len(ratios)} pairs' ratios "
                "(the interval: their smallest and largest)",
                float(sorted(ratios)[len(ratios) // 2]),
                "speed-up",
                interval=(min(ratios), max(ratios)),
            )
        )
    settings = {
        "model": config["model"]["name"],
        "candidate": candidate,
        "batch_size": config["train"]["batch_size"],
        "warmup": args.warmup,
        "block": args.block,
        "rounds": args.rounds,
        "processes": args.processes,
        "epochs": args.epochs,
        "overrides": args.settings,
    }
    flags = [
        *harness.condition_flags(conditions, "the Trainer's measurement"),
        *harness.noisy_flags(sides),
    ]
    harness.write_record(args, harness.record(NAME, figures, settings=settings, flags=flags))
    raw = {
        "benchmark": NAME,
        "bench": benched.as_dict(),
        "trainer": trained.as_dict(),
        "transfer": transfer,
        "sides": sides,
        "process_pairs": pairs,
        "settings": settings,
        "environment": harness.environment(device),
        "conditions": conditions,
        "blocks": blocks,
    }
    return harness.finish(args.out, raw, passed, args.check)


if __name__ == "__main__":
    harness.run(main)
