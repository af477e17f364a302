"""The flip test (eval.flip_test) paired on the same weights: trained checkpoints evaluated on
their set's test split with and without it, side by side.

Each checkpoint given (a `real_sets.py measure` run's best.pth, kept with --work) is evaluated
as `python -m pipeline evaluate` does, once with `eval.flip_test=false` and once with `true`,
each time with the operating point picked again on validation as evaluated (the one saved in
the checkpoint was picked without the flip test). Training is the same for both sides, so the
difference is the flip test's alone, free of seed-to-seed training noise. Compared: AP@.5,
AP@[.5:.95], AP@.75 and F1 at validation's best-F1 threshold; and the cost, the forward time of
both splits (timing.model_s, flip test / without) and the evaluate command's wall time. The
two sides alternate which goes first from one checkpoint to the next, after one unrecorded
evaluation that warms the process up. Prints every run, the
means and the mean differences; records them (no target: a comparison).

    python benchmarks/flip_test.py --set eggs --cpu-threads 1 \\
        /tmp/fliptest/eggs-seed*/run/best.pth --record benchmarks/records/flip_test/NAME.json
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path
from typing import Any

import harness
import numpy as np

from pipeline.engine import checkpoint
from pipeline.errors import DataError

NAME = "flip_test"
SIDES = ("plain", "flip")
COLUMNS = (
    ("ap50", "AP@.5", "AP"),
    ("ap", "AP@[.5:.95]", "AP"),
    ("ap75", "AP@.75", "AP"),
    ("f1_op", "F1 at validation's best-F1 threshold", "F1"),
    ("threshold", "validation's best-F1 threshold", "fraction"),
)
COMPARED = ("ap50", "ap", "ap75", "f1_op")


def parse_args(argv: list[str]):
    parser = harness.parser(NAME, __doc__)
    parser.add_argument("--set", required=True, help="the set's name, for the record")
    parser.add_argument("checkpoints", nargs="+", type=Path, help="trained runs' best.pth")
    parser.add_argument("--data", help="data root (default: each checkpoint's own)")
    parser.add_argument("--cpu-threads", type=int, default=1)
    return parser.parse_args(argv)


def evaluate(
    best: Path, flip: bool, data: str | None, threads: int, folder: Path
) -> dict[str, Any]:
    """The test figures of `best` with or without the flip test, the operating point picked
    on validation as evaluated, and the seconds the model and the command took."""
    state = checkpoint.load(best)
    state.pop("operating_point", None)  # picked again, with this side's decoding
    copy = checkpoint.save(folder / "best.pth", state)
    out = folder / "eval.json"
    argv = ["--cpu-threads", str(threads), "evaluate", "--checkpoint", str(copy)]
    argv += [*(("--data", data) if data else ()), "--out", str(out)]
    argv += ["eval.score_threshold=null", f"eval.flip_test={str(flip).lower()}"]
    with contextlib.redirect_stdout(io.StringIO()):
        result, wall_s = harness.evaluate_in_process(argv, out)
    metrics, val = result["metrics"], result["val_metrics"]
    if result["metrics_split"] != "test" or val is None:
        raise DataError(f"{best}: its data set has no test split to compare on")
    if metrics["flip_test"] is not flip:
        raise DataError(f"{best}: evaluated with flip_test {metrics['flip_test']}, not {flip}")
    return {
        "ap50": metrics["ap50"],
        "ap": metrics["ap"],
        "ap75": metrics["ap75"],
        "f1_op": result["operating_point"]["f1"],
        "threshold": result["operating_point"]["threshold"],
        "model_s": metrics["timing"]["model_s"] + val["timing"]["model_s"],
        "wall_s": wall_s,
        "test_images": metrics["num_images"],
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    runs = []
    checkpoints = sorted(args.checkpoints)
    seeds = {}
    for best in checkpoints:
        if not best.is_file():
            raise DataError(f"{best} is not a file: pass trained runs' best.pth")
        seeds[best] = checkpoint.config_of(checkpoint.load(best), best)["seed"]
    with tempfile.TemporaryDirectory() as folder:
        # unrecorded: the first evaluation in a process also pays for imports and page cache
        evaluate(checkpoints[0], False, args.data, args.cpu_threads, Path(folder))
        for index, best in enumerate(checkpoints):
            seed = seeds[best]
            order = SIDES if index % 2 == 0 else SIDES[::-1]
            sides = {
                side: evaluate(best, side == "flip", args.data, args.cpu_threads, Path(folder))
                for side in order
            }
            run = {"checkpoint": str(best), "seed": seed, "first": order[0], **sides}
            run["model_time_ratio"] = sides["flip"]["model_s"] / sides["plain"]["model_s"]
            run["wall_time_ratio"] = sides["flip"]["wall_s"] / sides["plain"]["wall_s"]
            runs.append(run)
            print(
                f"seed {seed}: "
                + "; ".join(
                    f"{key} {sides['plain'][key]:.3f} -> {sides['flip'][key]:.3f}"
                    for key in COMPARED
                ),
                flush=True,
            )
    keys = [key for key, _, _ in COLUMNS]
    means = {
        side: {key: float(np.mean([run[side][key] for run in runs])) for key in keys}
        for side in SIDES
    }
    change = {key: means["flip"][key] - means["plain"][key] for key in COMPARED}
    rose = {key: sum(run["flip"][key] > run["plain"][key] for run in runs) for key in COMPARED}
    model_ratio = float(np.median([run["model_time_ratio"] for run in runs]))
    wall_ratio = float(np.median([run["wall_time_ratio"] for run in runs]))
    rows = [
        [f"seed {run['seed']} {side}", *(run[side][k] for k in keys)]
        for run in runs
        for side in SIDES
    ]
    rows += [[f"{side} mean", *means[side].values()] for side in SIDES]
    print(f"{NAME}: {args.set}, test split, {len(runs)} checkpoints")
    print(harness.table(["run", *keys], rows))
    print(harness.table(["figure", "flip - plain (mean)", "runs it rose"],
                        [[key, change[key], f"{rose[key]} of {len(runs)}"] for key in COMPARED]))  # fmt: skip
    print(f"eval time, flip test / without (median over runs): model {model_ratio:.2f}, "
          f"command {wall_ratio:.2f}")  # fmt: skip
    figures = [
        harness.figure(f"{side}.{key}", f"{side}: {title}, mean over runs", means[side][key], unit)
        for side in SIDES
        for key, title, unit in COLUMNS
    ]
    figures += [
        harness.figure(f"change.{key}", f"flip - plain: {title}, mean over runs", change[key], unit)
        for key, title, unit in COLUMNS
        if key in COMPARED
    ]
    figures += [
        harness.figure(
            f"rose.{key}", f"runs where the flip test raised {title}", rose[key], "count"
        )
        for key, title, _ in COLUMNS
        if key in COMPARED
    ]
    figures.append(harness.figure("runs", "checkpoints compared", len(runs), "count"))
    figures += [
        harness.figure(
            "model_time_ratio",
            "forward time of val and test, flip test / without, median over runs",
            model_ratio,
            "ratio",
        ),
        harness.figure(
            "wall_time_ratio",
            "evaluate's wall time, flip test / without, median over runs",
            wall_ratio,
            "ratio",
        ),
    ]
    settings = {
        "set": args.set,
        "checkpoints": [run["checkpoint"] for run in runs],
        "data": args.data,
        "cpu_threads": args.cpu_threads,
        "runs": runs,
    }
    harness.write_record(args, harness.record(NAME, figures, settings=settings))
    return harness.finish(
        args.out, {"benchmark": NAME, "settings": settings, "runs": runs}, True, False
    )


if __name__ == "__main__":
    harness.run(main)
