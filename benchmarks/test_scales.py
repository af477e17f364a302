"""Test-time scales (eval.test_scales) paired on the same weights: trained checkpoints evaluated
on their set's test split with the data's own input size alone and with the scales given, side
by side, the flip test on (or off) on both sides alike.

Each checkpoint given (a `real_sets.py measure` run's best.pth, kept with --work) is evaluated
as `python -m pipeline evaluate` does, once with `eval.test_scales=[1.0]` ("base") and once with
`--scales` ("scaled"), each time with the operating point picked again on validation as
evaluated (the one saved in the checkpoint was picked at the base scale). Training is the same
for both sides, so the difference is the scales' alone, free of seed-to-seed training noise.
Compared: AP@.5, AP@[.5:.95], AP@.75 and F1 at validation's best-F1 threshold; and the cost,
the forward time of both splits (timing.model_s, scaled / base) and the evaluate command's wall
time. With --native, a third side ("native") evaluates the same weights with data.image_size
at the largest scale (the images read from their files at that size, the scale's rounding) and
no other scale: whether the model itself reads objects at that size as well as at its own, apart
from how the views are resampled and averaged. The sides take turns at going first from one
checkpoint to the next, after one unrecorded evaluation that warms the process up. Prints every run, the means and the mean
differences; records them (no target: a comparison).

    python benchmarks/test_scales.py --set eggs --cpu-threads 1 --scales 1,1.5 \\
        /tmp/fliptest/eggs-seed*/run/best.pth --record benchmarks/records/test_scales/NAME.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
from pathlib import Path
from typing import Any

import harness
import numpy as np

from pipeline.engine import checkpoint
from pipeline.errors import DataError
from pipeline.models import input_multiple
from pipeline.models.test_time import scaled_side

NAME = "test_scales"
SIDES = ("base", "scaled", "native")
COLUMNS = (
    ("ap50", "AP@.5", "AP"),
    ("ap", "AP@[.5:.95]", "AP"),
    ("ap75", "AP@.75", "AP"),
    ("f1_op", "F1 at validation's best-F1 threshold", "F1"),
    ("threshold", "validation's best-F1 threshold", "fraction"),
)
COMPARED = ("ap50", "ap", "ap75", "f1_op")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = harness.parser(NAME, __doc__)
    parser.add_argument("--set", required=True, help="the set's name, for the record")
    parser.add_argument("checkpoints", nargs="+", type=Path, help="trained runs' best.pth")
    parser.add_argument(
        "--scales",
        type=lambda text: [float(part) for part in text.split(",")],
        default=[1.0, 1.5],
        help="the scaled side's scales, comma-separated (1,1.5)",
    )
    parser.add_argument(
        "--flip-test",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="eval.flip_test on both sides",
    )
    parser.add_argument(
        "--native", action="store_true", help="a third side: data.image_size at the largest scale"
    )
    parser.add_argument("--data", help="data root (default: each checkpoint's own)")
    parser.add_argument("--cpu-threads", type=int, default=1)
    return parser.parse_args(argv)


def evaluate(
    best: Path,
    scales: list[float],
    image_size: int | None,
    flip_test: bool,
    data: str | None,
    threads: int,
    folder: Path,
) -> dict[str, Any]:
    """The test figures of `best` at `scales` (and `image_size`, None: its own), the operating
    point picked on validation as evaluated, and the seconds the model and the command took."""
    state = checkpoint.load(best)
    state.pop("operating_point", None)  # picked again, with this side's decoding
    copy = checkpoint.save(folder / "best.pth", state)
    out = folder / "eval.json"
    argv = ["--cpu-threads", str(threads), "evaluate", "--checkpoint", str(copy)]
    argv += [*(("--data", data) if data else ()), "--out", str(out)]
    argv += ["eval.score_threshold=null", f"eval.flip_test={str(flip_test).lower()}"]
    argv += [f"eval.test_scales=[{', '.join(map(str, scales))}]"]
    argv += [f"data.image_size={image_size}"] if image_size else []
    with contextlib.redirect_stdout(io.StringIO()):
        result, wall_s = harness.evaluate_in_process(argv, out)
    metrics, val = result["metrics"], result["val_metrics"]
    if result["metrics_split"] != "test" or val is None:
        raise DataError(f"{best}: its data set has no test split to compare on")
    if metrics["test_scales"] != scales or metrics["flip_test"] is not flip_test:
        raise DataError(
            f"{best}: evaluated at scales {metrics['test_scales']} (flip test "
            f"{metrics['flip_test']}), not {scales} ({flip_test})"
        )
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


def native_size(best: Path, scale: float) -> int:
    """The input size of `best`'s data at `scale`, rounded as eval.test_scales rounds it."""
    config = checkpoint.load(best)["config"]
    multiple = input_multiple(config["model"])
    return scaled_side(config["data"]["image_size"], scale, multiple)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    scales = {"base": [1.0], "scaled": list(args.scales), "native": [1.0]}
    sides_run = SIDES if args.native else SIDES[:2]
    runs = []
    checkpoints = sorted(args.checkpoints)
    for best in checkpoints:
        if not best.is_file():
            raise DataError(f"{best} is not a file: pass trained runs' best.pth")
    with tempfile.TemporaryDirectory() as folder:

        def side(best: Path, name: str) -> dict[str, Any]:
            return evaluate(
                best,
                scales[name],
                native_size(best, max(args.scales)) if name == "native" else None,
                args.flip_test,
                args.data,
                args.cpu_threads,
                Path(folder),
            )

        # unrecorded: the first evaluation in a process also pays for imports and page cache
        side(checkpoints[0], "base")
        for index, best in enumerate(checkpoints):
            seed = checkpoint.load(best)["config"]["seed"]
            shift = index % len(sides_run)
            order = sides_run[shift:] + sides_run[:shift]
            sides = {name: side(best, name) for name in order}
            run = {"checkpoint": str(best), "seed": seed, "first": order[0], **sides}
            run["model_time_ratio"] = sides["scaled"]["model_s"] / sides["base"]["model_s"]
            run["wall_time_ratio"] = sides["scaled"]["wall_s"] / sides["base"]["wall_s"]
            runs.append(run)
            print(
                f"seed {seed}: "
                + "; ".join(
                    f"{key} {sides['base'][key]:.3f} -> "
                    + " / ".join(f"{sides[name][key]:.3f}" for name in sides_run[1:])
                    for key in COMPARED
                ),
                flush=True,
            )
    keys = [key for key, _, _ in COLUMNS]
    means = {
        name: {key: float(np.mean([run[name][key] for run in runs])) for key in keys}
        for name in sides_run
    }
    others = sides_run[1:]
    change = {
        name: {key: means[name][key] - means["base"][key] for key in COMPARED} for name in others
    }
    rose = {
        name: {key: sum(run[name][key] > run["base"][key] for run in runs) for key in COMPARED}
        for name in others
    }
    model_ratio = float(np.median([run["model_time_ratio"] for run in runs]))
    wall_ratio = float(np.median([run["wall_time_ratio"] for run in runs]))
    rows = [
        [f"seed {run['seed']} {name}", *(run[name][k] for k in keys)]
        for run in runs
        for name in sides_run
    ]
    rows += [[f"{name} mean", *means[name].values()] for name in sides_run]
    flip = "with" if args.flip_test else "without"
    print(f"{NAME}: {args.set}, test split, {len(runs)} checkpoints, scales {args.scales} "
          f"against [1.0], {flip} the flip test")  # fmt: skip
    print(harness.table(["run", *keys], rows))
    print(harness.table(["figure", *(f"{name} - base (mean)" for name in others), "runs it rose"],
                        [[key, *(change[name][key] for name in others),
                          ", ".join(f"{rose[name][key]} of {len(runs)}" for name in others)]
                         for key in COMPARED]))  # fmt: skip
    print(f"eval time, scaled / base (median over runs): model {model_ratio:.2f}, "
          f"command {wall_ratio:.2f}")  # fmt: skip
    figures = [
        harness.figure(f"{name}.{key}", f"{name}: {title}, mean over runs", means[name][key], unit)
        for name in sides_run
        for key, title, unit in COLUMNS
    ]
    prefixes = {"scaled": "", "native": "native."}  # change.ap: the scales' own
    figures += [
        harness.figure(
            f"{prefixes[name]}change.{key}",
            f"{name} - base: {title}, mean over runs",
            change[name][key],
            unit,
        )
        for name in others
        for key, title, unit in COLUMNS
        if key in COMPARED
    ]
    figures += [
        harness.figure(
            f"{prefixes[name]}rose.{key}",
            f"runs where {name} raised {title}",
            rose[name][key],
            "count",
        )
        for name in others
        for key, title, _ in COLUMNS
        if key in COMPARED
    ]
    figures.append(harness.figure("runs", "checkpoints compared", len(runs), "count"))
    figures += [
        harness.figure(
            "model_time_ratio",
            "forward time of val and test, scaled / base, median over runs",
            model_ratio,
            "ratio",
        ),
        harness.figure(
            "wall_time_ratio",
            "evaluate's wall time, scaled / base, median over runs",
            wall_ratio,
            "ratio",
        ),
    ]
    settings = {
        "set": args.set,
        "scales": list(args.scales),
        "flip_test": args.flip_test,
        "native": args.native,
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
