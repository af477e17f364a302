"""Step-time modes: does one benchmark, repeated on fresh model instances, time the same step?

A paired interval over rounds of one model instance per precision (the bench with
`bench.instances: 1`) cannot see this. The script asks: --processes processes, one after
another, each building --models fresh instances in turn of the default config's model and
timing each one's training step in --precision as the bench rule does (`bench.run_backend`,
one precision and one instance per call, its warm-up and budget), but within the process
(`fork=False`), where the bench rule times each CPU instance in a forked child of its own.
Per instance: the median step and its IQR. Figures: the spread of the instances'
medians (largest / smallest) over all instances and, the worst, within one process; and the
median of the instances' IQR over their median, the noise one instance's interval is built
from. No target: a diagnostic. Where the spread of medians is far beyond the IQRs, a single
instance's interval understates how much the step time (and so a speed-up) can move.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from typing import Any

import harness

from pipeline import bench, timing
from pipeline.bench_record import settings_from_config
from pipeline.config import load_config
from pipeline.data import class_count

NAME = "step_modes"


def parse_args(argv: list[str]):
    parser = harness.parser(NAME, __doc__)
    harness.add_torch_options(parser)
    parser.add_argument("--precision", default="bf16", choices=("fp32", "fp16", "bf16"))
    parser.add_argument("--processes", type=int, default=4, help="processes, one after another")
    parser.add_argument("--models", type=int, default=3, help="fresh model instances per process")
    parser.add_argument(
        "--child", action="store_true", help="(internal) time --models instances, print JSON"
    )
    parser.add_argument(
        "settings",
        nargs="*",
        metavar="key=value",
        help="config overrides, e.g. model.name=resnet18",
    )
    args = parser.parse_args(argv)
    harness.check_positive(parser, args, "processes", "models")
    return args


def time_instances(args) -> list[dict[str, Any]]:
    """In this process: --models fresh instances timed one after another, as the bench does."""
    device = harness.setup_torch(args)
    config = load_config(None, [f"device={device}", f"seed={args.seed}", *args.settings])
    settings = settings_from_config(config, class_count(config))  # as the bench command
    settings["instances"] = 1  # one model per bench call: the instances are this loop's
    model = config["model"]["name"]
    instances = []
    for _ in range(args.models):
        # fork=False: this loop asks what fresh instances do within one process
        (record,) = bench.run_backend(
            device, [args.precision], ["train"], [model], settings, fork=False
        )
        if record["status"] != "ok":
            raise RuntimeError(f"bench {args.precision}: {record.get('reason')}")
        timing = record["timing"]
        instances.append({"median_ms": timing["median_ms"], "iqr_ms": timing["iqr_ms"]})
    return instances


def child_command(args) -> list[str]:
    return [
        sys.executable,
        __file__,
        "--child",
        "--no-record",
        "--device",
        args.device,
        "--cpu-threads",
        str(args.cpu_threads),
        "--seed",
        str(args.seed),
        "--precision",
        args.precision,
        "--models",
        str(args.models),
        *args.settings,
    ]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(time_instances(args)))
        return 0
    started = time.perf_counter()
    print(
        f"{NAME}: {args.processes} processes x {args.models} fresh instances, {args.precision} "
        f"training step, {args.cpu_threads} CPU threads",
        flush=True,
    )
    device = harness.setup_torch(args)
    conditions = timing.RunConditions()
    processes = []
    for index in range(args.processes):
        done = subprocess.run(
            child_command(args), cwd=harness.REPO, capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"process {index + 1} failed:\n{done.stderr[-2000:]}")
        instances = json.loads(done.stdout.strip().splitlines()[-1])
        processes.append(instances)
        medians = ", ".join(f"{i['median_ms']:.1f}" for i in instances)
        print(f"  process {index + 1}: medians {medians} ms", flush=True)
    conditions = conditions.finish()
    harness.warn_if_loaded(conditions, "the measurement")

    medians = [i["median_ms"] for instances in processes for i in instances]
    within = max(
        max(i["median_ms"] for i in instances) / min(i["median_ms"] for i in instances)
        for instances in processes
    )
    noise = statistics.median(i["iqr_ms"] / i["median_ms"] for p in processes for i in p)
    spread = max(medians) / min(medians)
    print(
        f"largest / smallest instance median: {spread:.3f} (worst within one process "
        f"{within:.3f}); an instance's IQR / median, median over instances: {noise:.3f}"
    )
    print(f"took {time.perf_counter() - started:.0f} s")
    figures = [
        harness.figure(
            "spread", "largest / smallest instance median, all instances", spread, "ratio"
        ),
        harness.figure(
            "spread_within_process",
            "largest / smallest instance median within one process, the worst process",
            within,
            "ratio",
        ),
        harness.figure(
            "instance_iqr", "an instance's IQR / its median, median over instances", noise, "ratio"
        ),
        harness.figure(
            "median_ms", "median of the instances' medians", statistics.median(medians), "ms"
        ),
    ]
    settings = {
        "precision": args.precision,
        "processes": args.processes,
        "models": args.models,
        "overrides": args.settings,
        "torch_threads_requested": str(args.cpu_threads),
    }
    flags = harness.condition_flags(conditions, "the measurement")
    harness.write_record(args, harness.record(NAME, figures, settings=settings, flags=flags))
    raw = {
        "benchmark": NAME,
        "processes": processes,
        "settings": settings,
        "environment": harness.environment(device),
        "conditions": conditions,
    }
    return harness.finish(args.out, raw, True, args.check)


if __name__ == "__main__":
    harness.run(main)
