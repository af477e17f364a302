"""The detector's accuracy targets within CPU time budgets, measured on this machine.

Each training runs as a user runs it: `python -m pipeline prepare-data`, `train` and `evaluate`
in subprocesses, with the presets of config/presets, into a work folder (the data sets are
generated there too, so nothing under resources/ changes). Every figure comes from the
evaluate stage's JSON: the held-out test split, and validation where a target names it.

  default             the default synthetic set in a 2-minute budget: F1 >= 0.93, AP@.5 >= 0.95
  multiscale          config/presets/multiscale.yaml (its 5 minutes): AP@.5 >= 0.90 in every
                      size bucket, on validation and on test
  microscopy-kind     photographs.yaml + five-minutes-cpu.yaml + microscopy-kind.yaml (384 px):
                      AP@.5 >= 0.88, every class >= 0.80, F1 >= 0.85
  large-objects-kind  photographs.yaml + five-minutes-cpu.yaml + large-objects-kind.yaml
                      (256 px): AP@.5 >= 0.95

`--precision-choice FILE` trains every run with `precision: measured` from that choice (the
`results/choice/<backend>.json` of a pipeline run, or `python -m pipeline choose-precision`'s):
the targets at the precision the benchmarks chose, as `--config precision=measured` trains. Overrides
given as key=value apply to every training after its own settings.

The two kinds are synthetic stand-ins for real data sets, not those sets: a PASS there says
nothing about the real ones. What a budget reaches follows how many epochs fit into it, so a
slower CPU fits fewer and may miss what a faster one meets; the table says how many fit.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import harness
import torch

from pipeline import atomic, timing
from pipeline.report.run_views import FEW_IN_BUCKET

NAME = "detector_targets"
PRESETS = harness.REPO / "config" / "presets"


@dataclass(frozen=True)
class Figure:
    """One measured figure against its lower bound."""

    label: str
    value: float | None
    target: float
    spread: str  # its interval, or how many objects it rests on
    interval: tuple[float, float] | None = None

    @property
    def passed(self) -> bool:
        return self.value is not None and self.value >= self.target


def interval_of(metrics: dict[str, Any], key: str) -> tuple[float, float] | None:
    found = metrics.get(f"{key}_interval")
    return (found["low"], found["high"]) if found else None


def interval(metrics: dict[str, Any], key: str) -> str:
    found = interval_of(metrics, key)
    return f"95% {found[0]:.3f}-{found[1]:.3f}" if found else "no interval"


def ap50_figure(label: str, found: dict[str, Any], target: float, spread: str) -> Figure:
    """A class's or a bucket's AP@.5 with its interval."""
    return Figure(label, found["ap50"], target, spread, interval_of(found, "ap50"))


def ap50_spread(found: dict[str, Any]) -> str:
    """A class's or a bucket's AP@.5 interval and the objects it rests on."""
    return f"{interval(found, 'ap50')}; {found['num_gt']} objects"


def overall(metrics: dict[str, Any], f1: float | None, ap50: float) -> list[Figure]:
    figures = [ap50_figure("test AP@.5", metrics, ap50, interval(metrics, "ap50"))]
    if f1 is not None:
        figures.insert(
            0,
            Figure(
                "test F1", metrics["f1"], f1, interval(metrics, "f1"), interval_of(metrics, "f1")
            ),
        )
    return figures


def default_figures(evaluation: dict[str, Any]) -> list[Figure]:
    return overall(evaluation["metrics"], f1=0.93, ap50=0.95)


def multiscale_figures(evaluation: dict[str, Any]) -> list[Figure]:
    figures = []
    for split, metrics in (
        ("validation", evaluation["val_metrics"]),
        ("test", evaluation["metrics"]),
    ):
        for bucket, found in metrics["size_buckets"].items():
            # as the report does: a class with a handful of objects can decide a bucket's mean
            few = [
                f"{c['name']}: {c['num_gt']} at {c['ap50']:.3f}"
                for c in found["per_class"]
                if 0 < c["num_gt"] < FEW_IN_BUCKET
            ]
            spread = "; ".join([ap50_spread(found), *few])
            figures.append(ap50_figure(f"{split} AP@.5 {bucket}", found, 0.90, spread))
    return figures


def microscopy_figures(evaluation: dict[str, Any]) -> list[Figure]:
    metrics = evaluation["metrics"]
    figures = overall(metrics, f1=0.85, ap50=0.88)
    for found in metrics["per_class"]:
        figures.append(ap50_figure(f"test AP@.5 {found['name']}", found, 0.80, ap50_spread(found)))
    return figures


def large_objects_figures(evaluation: dict[str, Any]) -> list[Figure]:
    return overall(evaluation["metrics"], f1=None, ap50=0.95)


@dataclass(frozen=True)
class Training:
    name: str
    configs: tuple[str, ...]  # config/presets files, layered in this order
    settings: tuple[str, ...]  # key=value on top
    figures: Callable[[dict[str, Any]], list[Figure]]


PHOTOS_IN_FIVE_MINUTES = ("photographs.yaml", "five-minutes-cpu.yaml")
TRAININGS = (
    Training("default", (), ("train.time_budget_s=120",), default_figures),
    Training("multiscale", ("multiscale.yaml",), (), multiscale_figures),
    Training(
        "microscopy-kind",
        (*PHOTOS_IN_FIVE_MINUTES, "microscopy-kind.yaml"),
        (),
        microscopy_figures,
    ),
    Training(
        "large-objects-kind",
        (*PHOTOS_IN_FIVE_MINUTES, "large-objects-kind.yaml"),
        (),
        large_objects_figures,
    ),
)


def parse_args(argv: list[str]):
    parser = harness.parser(NAME, __doc__)
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[training.name for training in TRAININGS],
        metavar="NAME",
        help="only these trainings (default: all four, each within its budget, plus data generation)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the config's seed")
    parser.add_argument(
        "--work",
        type=Path,
        help="folder for the data sets, runs and logs (default: a temporary one, removed after)",
    )
    parser.add_argument(
        "--precision-choice",
        type=Path,
        metavar="FILE.json",
        help="train with precision=measured from this choice (e.g. results/choice/cpu.json)",
    )
    parser.add_argument(
        "settings",
        nargs="*",
        metavar="key=value",
        help="config overrides for every training, after its own",
    )
    return parser.parse_args(argv)


def pipeline(args: list[str], log: Path) -> None:
    """`python -m pipeline ARGS` from the repository root, its output appended to `log`."""
    harness.run_logged([sys.executable, "-m", "pipeline", *args], log)


def measure(
    training: Training, seed: int, work: Path, overrides: list[str], choice: Path | None
) -> dict[str, Any]:
    # no --configfile without presets: the option takes one file at least
    files = [str(PRESETS / name) for name in training.configs]
    configs = ["--configfile", *files] if files else []
    data, run, log = (
        work / "data" / training.name,
        work / training.name,
        work / f"{training.name}.log",
    )
    settings = [f"data.root={data}", f"seed={seed}", *training.settings, *overrides]
    pipeline(["prepare-data", *configs, *settings], log)
    conditions = timing.RunConditions()
    chosen = (
        ["--precision", "measured", "--precision-choice", str(choice.resolve())] if choice else []
    )
    pipeline(["train", *configs, "--out", str(run), *chosen, *settings], log)
    measured = conditions.finish()
    harness.warn_if_loaded(measured, f"training {training.name}")
    evaluation_path = work / f"{training.name}.json"
    pipeline(
        ["evaluate", "--checkpoint", str(run / "best.pth"), "--out", str(evaluation_path)], log
    )
    summary = json.loads((run / "train_summary.json").read_text(encoding="utf-8"))
    evaluation = json.loads(evaluation_path.read_text(encoding="utf-8"))
    figures = training.figures(evaluation)
    return {
        "name": training.name,
        "configs": list(training.configs),
        "settings": settings,
        "precision": summary["precision"],
        "epochs": summary["epochs"],
        "steps": summary["steps"],
        "time_budget_s": summary["time_budget_s"],
        "wall_time_s": summary["wall_time_s"],
        "median_step_time_s": summary["median_step_time_s"],
        "figures": [asdict(figure) | {"passed": figure.passed} for figure in figures],
        "passed": all(figure.passed for figure in figures),
        "evaluation": evaluation["metrics"] | {"per_image": None},
        "conditions": measured,
    }


def record_figures(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One training's figures for the record: what fit into its budget, then each target."""
    name = result["name"]
    figures = [
        harness.figure(f"{name}.epochs", f"{name}: epochs that fit", result["epochs"], "epochs"),
        harness.figure(f"{name}.wall_s", f"{name}: training wall time", result["wall_time_s"], "s"),
        harness.figure(
            f"{name}.median_step_ms",
            f"{name}: median training step",
            1000 * result["median_step_time_s"],
            "ms",
        ),
    ]
    for found in result["figures"]:
        label = found["label"]
        figures.append(
            harness.figure(
                f"{name}.{label.replace('@', '').replace(' ', '_').lower()}",
                f"{name}: {label}",
                found["value"],
                "F1" if label.endswith("F1") else "AP",
                target=(">=", found["target"]),
                interval=found["interval"],
            )
        )
    return figures


def print_result(result: dict[str, Any]) -> None:
    print(
        f"\n{result['name']} ({result['precision']}): {result['steps']} steps over "
        f"{result['epochs']} epochs in "
        f"{result['wall_time_s']:.0f} s, median step {1000 * result['median_step_time_s']:.0f} ms",
        flush=True,
    )
    rows = [
        [
            figure["label"],
            "n/a" if figure["value"] is None else f"{figure['value']:.3f}",
            f">= {figure['target']:.2f}",
            figure["spread"],
            "PASS" if figure["passed"] else "FAIL",
        ]
        for figure in result["figures"]
    ]
    print(harness.table(("figure", "value", "target", "spread", ""), rows), flush=True)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    chosen = [t for t in TRAININGS if args.only is None or t.name in args.only]
    with tempfile.TemporaryDirectory(prefix=f"{NAME}-") as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        results = []
        for training in chosen:
            results.append(measure(training, args.seed, work, args.settings, args.precision_choice))
            print_result(results[-1])
    passed = all(result["passed"] for result in results)
    print(
        "\nall targets "
        + (
            "PASS"
            if passed
            else "FAIL: " + ", ".join(r["name"] for r in results if not r["passed"])
        )
    )
    harness.write_record(
        args,
        harness.record(
            NAME,
            [figure for result in results for figure in record_figures(result)],
            settings={
                "seed": args.seed,
                "trainings": [result["name"] for result in results],
                "precision_choice": None
                if args.precision_choice is None
                else str(args.precision_choice),
                "overrides": args.settings,
                "precisions": {result["name"]: result["precision"] for result in results},
            },
            flags=[
                flag
                for result in results
                for flag in harness.condition_flags(
                    result["conditions"], f"training {result['name']}"
                )
            ],
        ),
    )
    atomic.write_json(
        args.out,
        {
            "name": NAME,
            "environment": harness.environment(torch.device("cpu")),
            "seed": args.seed,
            "results": results,
            "passed": passed,
        },
    )
    print(f"wrote {args.out}")
    return 1 if args.check and not passed else 0


if __name__ == "__main__":
    harness.run(main)
