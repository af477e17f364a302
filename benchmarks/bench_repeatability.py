"""Bench repeatability: do two consecutive benchmark runs tell the same story?

Each run is what the workflow's bench rule runs on a CPU, as a subprocess with the bench
command's defaults (the training configuration, steady-state warm-up) and the shipped
config's `bench.precisions` and `bench.modes`: `python -m pipeline bench --device cpu
--precision fp32,fp16,bf16 --mode train,infer --out-dir DIR` as shipped, timing the
precisions of each mode in interleaved rounds, each model instance in a child forked from the
bench process (what else a process times moves its step times, so the run times what the rule
times). The training records of fp32 and the candidate
(default bf16) are read. Two runs in a row, side by side in one script, and for each:

- every record's drift check (median of the second half of its timed steps over the
  first half's): target within 5% wherever a record has the 4 or more steps it needs;
- the candidate's speed-up over fp32 with its interval, as the report and
  `precision: measured` state it (paired by rounds, over the bench's model instances,
  `stats.speedup_between`): target, the two runs' intervals overlap;
- the fp32 medians of the two runs: target larger / smaller <= 1.10.

Each run's line also gives its model instances' median steps, to set the spread between
instances beside the spread between runs.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import numpy as np

from pipeline import stats, timing
from pipeline.config import load_config
from pipeline.errors import PipelineError

NAME = "bench_repeatability"
MEDIAN_TARGET = 1.10


def parse_args(argv: list[str]):
    parser = harness.parser(NAME, __doc__)
    parser.add_argument("--repeats", type=int, default=1, help="pairs of consecutive runs")
    parser.add_argument(
        "--candidate", default="bf16", choices=("bf16", "fp16"), help="precision against fp32"
    )
    parser.add_argument(
        "bench_args",
        nargs="*",
        metavar="-- BENCH_OPTION",
        help="extra options for 'pipeline bench' after --, e.g. -- --time-budget 1 "
        "(the default run passes none, as the workflow does)",
    )
    args = parser.parse_args(argv)
    harness.check_positive(parser, args, "repeats")
    return args


def bench_once(candidate: str, extra: list[str], out_dir: Path) -> dict[str, Any]:
    """One bench process timing what the bench rule times (the candidate included); the
    training records of fp32 and `candidate`."""
    shipped = load_config(None)["bench"]
    precisions = list(dict.fromkeys(["fp32", *shipped["precisions"], candidate]))
    modes = list(dict.fromkeys(["train", *shipped["modes"]]))
    command = [
        *(sys.executable, "-m", "pipeline", "bench", "--device", "cpu"),
        *("--precision", ",".join(precisions), "--mode", ",".join(modes), *extra),
        *("--out-dir", str(out_dir)),
    ]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=harness.REPO, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise PipelineError(
            f"'{' '.join(command)}' exited with status {done.returncode}:\n"
            f"{done.stderr.strip()[-2000:]}"
        )
    found = {}
    for precision in ("fp32", candidate):
        path = out_dir / f"cpu-{precision}-train.json"
        record = json.loads(path.read_text(encoding="utf-8"))["records"][0]
        if record["status"] != "ok":
            raise PipelineError(f"The {precision} benchmark was skipped: {record['reason']}")
        found[precision] = {"wall_s": wall, "command": command, "record": record}
    return found


def instance_medians(summary: dict[str, Any]) -> str:
    """A record's median step per model instance, in instance order."""
    samples = np.asarray(summary["samples_ms"])
    instances = np.asarray(summary.get("instances") or [0] * samples.size)
    return " ".join(f"{np.median(samples[instances == k]):.1f}" for k in np.unique(instances))


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    print(
        f"{NAME}: {args.repeats} pair(s) of consecutive runs of python -m pipeline bench --device "
        f"cpu with the shipped bench.precisions and bench.modes (fp32 and {args.candidate} "
        f"read), each with {' '.join(args.bench_args) or 'the defaults'}",
        flush=True,
    )
    runs = []
    conditions = timing.RunConditions()
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(2 * args.repeats):
            pair = bench_once(args.candidate, args.bench_args, Path(tmp) / str(index))
            speed = stats.speedup_between(
                pair["fp32"]["record"]["timing"], pair[args.candidate]["record"]["timing"]
            )
            runs.append({"records": pair, "speedup": {**speed.as_dict(), "text": speed.text}})
    conditions = conditions.finish()  # the bench subprocesses are ours, not other work
    harness.warn_if_loaded(conditions, "the runs")

    rows, drifts = [], []
    for number, run in enumerate(runs, start=1):
        for precision, result in run["records"].items():
            summary = result["record"]["timing"]
            harness.warn_if_loaded(result["record"]["conditions"], f"run {number} {precision}")
            drift = summary["drift_ratio"]
            if drift is not None:
                drifts.append(abs(drift - 1))
            rows.append(
                [
                    f"run {number} {precision}",
                    harness.ms(summary["median_ms"]),
                    f"{summary['iqr_ratio']:.1%}",
                    summary["count"],
                    f"{summary['warmup_steps']}{'' if summary['warmup_settled'] else ' (cap)'}",
                    "n/a (< 4 steps)" if drift is None else f"{drift:.3f}",
                    f"{result['wall_s']:.1f}",
                ]
            )
    print(
        harness.table(
            ("run", "median ms", "IQR/median", "n", "warm-up", "drift 2nd/1st half", "wall s"),
            rows,
        )
    )
    for number, run in enumerate(runs, start=1):
        speed = run["speedup"]
        rounds, instances = speed["paired_rounds"], speed.get("paired_instances") or 1
        paired = f"paired over {rounds} interleaved rounds" if rounds else "unpaired"
        paired += f" of {instances} model instance pairs" if rounds and instances > 1 else ""
        instances = "; ".join(
            f"{precision} {instance_medians(result['record']['timing'])}"
            for precision, result in run["records"].items()
        )
        print(f"run {number} {args.candidate} vs fp32: {speed['text']}, {paired}")
        print(f"  median ms per model instance: {instances}")
    worst_drift = max(drifts, default=0.0)
    drift_ok, line = harness.verdict("worst |drift - 1| of the records", worst_drift, 0.05)
    print(line)
    overlaps = []
    for first, second in zip(runs[::2], runs[1::2], strict=True):
        a, b = first["speedup"], second["speedup"]
        overlaps.append(a["low"] <= b["high"] and b["low"] <= a["high"])
        print(
            f"{args.candidate}/fp32 intervals {a['low']:.2f}-{a['high']:.2f}x and "
            f"{b['low']:.2f}-{b['high']:.2f}x: {'overlap   PASS' if overlaps[-1] else 'apart   FAIL'}"
        )
    medians = [run["records"]["fp32"]["record"]["timing"]["median_ms"] for run in runs]
    worst_median = max(
        max(a, b) / min(a, b) for a, b in zip(medians[::2], medians[1::2], strict=True)
    )
    median_ok, line = harness.verdict("fp32 larger/smaller median", worst_median, MEDIAN_TARGET)
    print(line)
    print(f"took {time.perf_counter() - started:.0f} s")
    figures = [
        harness.figure(
            "fp32_median_ratio",
            "fp32 median step of two consecutive runs, larger / smaller (the worst pair)",
            worst_median,
            "ratio",
            target=("<=", MEDIAN_TARGET),
        ),
        harness.figure(
            "worst_drift",
            "worst |drift - 1| of the records (second half's median / first half's)",
            worst_drift,
            "fraction",
            target=("<=", 0.05),
        ),
    ]
    for number, overlap in enumerate(overlaps, start=1):
        figures.append(
            harness.figure(
                f"pair{number}.intervals_overlap",
                f"pair {number}: the two runs' {args.candidate}/fp32 speed-up intervals overlap",
                overlap,
                "boolean",
                target=("==", True),
            )
        )
    for number, run in enumerate(runs, start=1):
        speed = run["speedup"]
        figures.append(
            harness.figure(
                f"run{number}.speedup",
                f"run {number}: {args.candidate} training step speed-up over fp32 "
                f"({speed['verdict']})",
                speed["ratio"],
                "speed-up",
                interval=(speed["low"], speed["high"]),
            )
        )
    flags = harness.condition_flags(conditions, "the runs")
    for number, run in enumerate(runs, start=1):
        for precision, result in run["records"].items():
            flags += harness.condition_flags(
                result["record"]["conditions"], f"run {number} {precision}"
            )
            if result["record"]["timing"]["noisy"]:
                flags.append(
                    f"run {number} {precision} noisy: IQR {result['record']['timing']['iqr_ratio']:.0%} of its median"
                )
    settings = {
        "repeats": args.repeats,
        "candidate": args.candidate,
        "bench_args": args.bench_args,
        # the bench command as the workflow runs it, without this run's temporary --out
        "bench_command": shlex.join(["python", *runs[0]["records"]["fp32"]["command"][1:-2]]),
        "paired_rounds": [run["speedup"]["paired_rounds"] for run in runs],
        "paired_instances": [run["speedup"].get("paired_instances") for run in runs],
    }
    harness.write_record(args, harness.record(NAME, figures, settings=settings, flags=flags))
    record = {
        "benchmark": NAME,
        "target": {
            "drift_max": 0.05,
            "intervals": "the speed-up intervals of two consecutive runs overlap",
            "ratio_max": MEDIAN_TARGET,
            "ratio": "larger fp32 median / smaller, of two consecutive runs",
        },
        "ratio": worst_median,
        "worst_drift": worst_drift,
        "intervals_overlap": overlaps,
        "runs": runs,
        "environment": harness.environment(None),
        "conditions": conditions,
    }
    return harness.finish(args.out, record, drift_ok and all(overlaps) and median_ok, args.check)


if __name__ == "__main__":
    harness.run(main)
