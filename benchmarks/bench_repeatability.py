"""Bench repeatability: two consecutive CPU fp32 train benchmarks must agree on the median.

Runs `python -m pipeline bench --device cpu --precision fp32 --mode train --model tiny_conv
--out <tmp>` twice in a row, as subprocesses: what the workflow's bench rule runs, with
batch size, image size, warm-up, steps and time budget left at the bench command's
defaults (the config schema's). Reads both records and compares their medians.
Target: larger median / smaller median <= 1.10, for every pair (--repeats pairs).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness

from pipeline import timing
from pipeline.errors import PipelineError

NAME = "bench_repeatability"
TARGET = 1.10


def parse_args(argv: list[str]):
    parser = harness.parser(NAME, __doc__)
    parser.add_argument("--repeats", type=int, default=1, help="pairs of consecutive runs")
    parser.add_argument("--model", default="tiny_conv", help="model the bench command times")
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


def bench_once(command: list[str], out: Path) -> dict[str, Any]:
    start = time.perf_counter()
    done = subprocess.run(
        [*command, str(out)], cwd=harness.REPO, capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise PipelineError(
            f"'{' '.join(command)} {out}' exited with status {done.returncode}:\n"
            f"{done.stderr.strip()[-2000:]}"
        )
    record = json.loads(out.read_text(encoding="utf-8"))["records"][0]
    if record["status"] != "ok":
        raise PipelineError(f"The benchmark was skipped: {record['reason']}")
    return {"wall_s": wall, "log": done.stderr.splitlines()[-20:], "record": record}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    command = [
        sys.executable,
        "-m",
        "pipeline",
        "bench",
        "--device",
        "cpu",
        "--precision",
        "fp32",
        "--mode",
        "train",
        "--model",
        args.model,
        *args.bench_args,
        "--out",
    ]
    print(
        f"{NAME}: {args.repeats} pair(s) of consecutive runs of\n  "
        f"{' '.join(['python', *command[1:]])} <tmp>",
        flush=True,
    )
    pairs = []
    conditions = timing.RunConditions()
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.repeats):
            runs = [bench_once(command, Path(tmp) / f"{pair}-{run}.json") for run in (1, 2)]
            medians = [run["record"]["timing"]["median_ms"] for run in runs]
            pairs.append({"runs": runs, "ratio": max(medians) / min(medians)})
    conditions = conditions.finish()  # the bench subprocesses are ours, not other work
    harness.warn_if_loaded(conditions, "the runs")
    for index, pair in enumerate(pairs, start=1):
        for run, result in enumerate(pair["runs"], start=1):
            harness.warn_if_loaded(result["record"]["conditions"], f"run {run} of pair {index}")

    rows = []
    for index, pair in enumerate(pairs, start=1):
        for run, result in enumerate(pair["runs"], start=1):
            summary = result["record"]["timing"]
            rows.append(
                [
                    f"pair {index} run {run}",
                    harness.ms(summary["median_ms"]),
                    harness.ms(summary["iqr_ms"]),
                    f"{summary['iqr_ratio']:.1%}",
                    summary["count"],
                    "yes" if summary["budget_limited"] else "no",
                    f"{result['wall_s']:.1f}",
                ]
            )
        rows.append([f"pair {index}: larger/smaller", f"{pair['ratio']:.3f}", "", "", "", "", ""])
    print(
        harness.table(
            ("run", "median ms", "IQR ms", "IQR/median", "n", "budget-limited", "wall s"), rows
        )
    )
    worst = max(pair["ratio"] for pair in pairs)
    label = "larger/smaller median" + (", worst pair" if len(pairs) > 1 else "")
    passed, line = harness.verdict(label, worst, TARGET)
    print(line)
    print(f"took {time.perf_counter() - started:.0f} s")
    record = {
        "benchmark": NAME,
        "target": {
            "ratio_max": TARGET,
            "ratio": "larger median / smaller median of two consecutive runs, worst pair",
        },
        "ratio": worst,
        "command": [*command, "<tmp>"],
        "pairs": pairs,
        "environment": harness.environment(None),
        "conditions": conditions,
    }
    return harness.finish(args.out, record, passed, args.check)


if __name__ == "__main__":
    harness.run(main)
