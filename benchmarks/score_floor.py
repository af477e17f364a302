"""The score floor (eval.min_score) on trained runs: the figures with and without it, and what
it leaves to count.

Each --checkpoint (a run's best.pth) is evaluated as `python -m pipeline evaluate` evaluates
it, with the run's own config (its data, protocol and operating point), in this process: once
with eval.min_score=0 (every decoded detection kept, as before the floor existed) and once
with --floor (default: the shipped eval.min_score). Compared: AP@.5, AP@[.5:.95], AP@.75, F1
at the checkpoint's operating point, the best-F1 threshold picked on validation and the F1
it gives on the split the figures come from, and the detections counted. Target: no AP or F1
figure of any checkpoint moves by more than --tolerance. The seconds each evaluation took are
kept too (the first evaluation of all is run once untimed: it pays the imports).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import harness

from pipeline import timing
from pipeline.config import load_config

NAME = "score_floor"
COMPARED = ("ap50", "ap", "ap75", "f1", "val_f1_at_val_threshold", "f1_at_val_threshold")
LABELS = {
    "ap50": "AP@.5",
    "ap": "AP@[.5:.95]",
    "ap75": "AP@.75",
    "f1": "F1 at the checkpoint's operating point",
    "val_f1_at_val_threshold": "best F1 on validation",
    "f1_at_val_threshold": "F1 at validation's best-F1 threshold",
}


def parse_args(argv: list[str]):
    parser = harness.parser(NAME, __doc__)
    parser.add_argument(
        "--checkpoint",
        action="append",
        required=True,
        metavar="PATH[,DATA_ROOT]",
        help="a run's best.pth (repeat for several), named by its folder (the one above run/); "
        "DATA_ROOT: evaluate on this data root (--data) instead of the one its config names",
    )
    parser.add_argument(
        "--floor",
        type=float,
        default=load_config(None)["eval"]["min_score"],
        help="eval.min_score compared with 0",
    )
    parser.add_argument(
        "--tolerance", type=float, default=0.001, help="largest change of a figure that passes"
    )
    parser.add_argument("--cpu-threads", default="auto", help="as python -m pipeline takes it")
    args = parser.parse_args(argv)
    if not 0 < args.floor < 1:
        parser.error(f"--floor must be above 0 and below 1, got {args.floor}")
    return args


def run_name(given: str) -> str:
    path = Path(given.partition(",")[0]).resolve()
    return path.parent.parent.name if path.parent.name == "run" else path.parent.name


def evaluate(given: str, floor: float, threads: str, scratch: Path) -> dict[str, Any]:
    """One `python -m pipeline evaluate` of the checkpoint (PATH[,DATA_ROOT]) at
    eval.min_score=floor."""
    checkpoint, _, data = given.partition(",")
    out = scratch / "eval.json"
    argv = [
        "--cpu-threads", threads, "evaluate", "--checkpoint", checkpoint, "--out", str(out),
        *(["--data", data] if data else []), "--predictions", str(scratch / "predictions.json"),
        f"eval.min_score={floor}",
    ]  # fmt: skip
    result, seconds = harness.evaluate_in_process(argv, out)
    metrics, point = result["metrics"], result["operating_point"]
    val = result["val_metrics"] or metrics
    return {
        "split": result["metrics_split"],
        "images": metrics["num_images"],
        "detections": metrics["num_detections"],
        "val_detections": val["num_detections"],
        "ap50": metrics["ap50"],
        "ap": metrics["ap"],
        "ap75": metrics["ap75"],
        "f1": metrics["f1"],
        "score_threshold": metrics["score_threshold"],
        "val_threshold": point["threshold"],
        "val_f1_at_val_threshold": val["best_f1"],
        "f1_at_val_threshold": point["f1"],
        "seconds": seconds,
    }


def _shown(value: float) -> str:
    return f"{value:.5f}" if isinstance(value, float) else str(value)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    conditions = timing.RunConditions()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        evaluate(args.checkpoint[0], 0.0, args.cpu_threads, Path(scratch))  # pays the imports
        for checkpoint in args.checkpoint:
            rows.append(
                {
                    "run": run_name(checkpoint),
                    "checkpoint": checkpoint,
                    "kept_all": evaluate(checkpoint, 0.0, args.cpu_threads, Path(scratch)),
                    "floor": evaluate(checkpoint, args.floor, args.cpu_threads, Path(scratch)),
                }
            )
    conditions = conditions.finish()
    largest = max(abs(row["floor"][key] - row["kept_all"][key]) for row in rows for key in COMPARED)

    headers = ("run", "split", "figure", "min_score 0", f"min_score {args.floor}", "change")
    table = []
    for row in rows:
        before, after = row["kept_all"], row["floor"]
        for key in (*COMPARED, "val_threshold", "detections", "val_detections", "seconds"):
            change = after[key] - before[key]
            table.append(
                [row["run"], before["split"], key, *map(_shown, (before[key], after[key], change))]
            )
    print(harness.table(headers, table))
    passed = largest <= args.tolerance
    print(
        f"largest change of an AP or F1 figure: {largest:.6f}   target <= {args.tolerance}   "
        f"{'PASS' if passed else 'FAIL'}"
    )
    harness.warn_if_loaded(conditions, "this run")

    figures = [
        harness.figure(
            "largest_change",
            "largest change of an AP or F1 figure, any run",
            largest,
            "fraction",
            target=("<=", args.tolerance),
        )
    ]
    for row in rows:
        for side, words in (("kept_all", "min_score 0"), ("floor", f"min_score {args.floor}")):
            found = row[side]
            figures += [
                harness.figure(
                    f"{row['run']}.{side}.{key}",
                    f"{row['run']} ({found['split']}), {words}: {LABELS[key]}",
                    found[key],
                    "F1" if "f1" in key else "AP",
                )
                for key in COMPARED
            ]
            figures += [
                harness.figure(
                    f"{row['run']}.{side}.detections",
                    f"{row['run']} ({found['split']}), {words}: detections counted",
                    found["detections"],
                    "count",
                ),
                harness.figure(
                    f"{row['run']}.{side}.val_threshold",
                    f"{row['run']}, {words}: best-F1 threshold picked on validation",
                    found["val_threshold"],
                    "fraction",
                ),
                harness.figure(
                    f"{row['run']}.{side}.seconds",
                    f"{row['run']}, {words}: the evaluate command",
                    found["seconds"],
                    "s",
                ),
            ]
    settings = {
        "checkpoints": args.checkpoint,
        "floor": args.floor,
        "tolerance": args.tolerance,
        "cpu_threads": args.cpu_threads,
    }
    flags = harness.condition_flags(conditions, "the evaluations")
    harness.write_record(args, harness.record(NAME, figures, settings=settings, flags=flags))
    record = {"benchmark": NAME, "runs": rows, "settings": settings, "conditions": conditions}
    return harness.finish(args.out, record, passed, args.check)


if __name__ == "__main__":
    harness.run(main)
