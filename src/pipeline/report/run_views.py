"""View models of the sections drawn from the training runs: training, evaluation and the
inference profile, for the templates sections/training, evaluation and profile.html.j2. The
run tables show the summary's runs; charts, images and the profile come from the results
folder itself. A view of None means there is nothing to show yet: the template says which
step to run."""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path
from typing import Any

from pipeline.report import charts
from pipeline.summary.load import (
    RunResults,
    predicted_images,
    read_operators,
    read_predictions,
)

MAX_GRID_IMAGES = 8
TOP_OPERATORS = 10
# Where neither the evaluation nor the config says which detections to draw.
DEFAULT_SCORE_THRESHOLD = 0.3


def training_view(
    runs: list[RunResults], summary_runs: list[dict[str, Any]], colors: dict[str, str]
) -> dict[str, Any] | None:
    """The summary's trained runs (with a train summary or metrics rows), and the chart of
    their metrics rows."""
    trained = [run for run in runs if run.summary or run.metrics]
    if not trained:
        return None
    names = {run.name for run in trained}
    rows = [run for run in summary_runs if run["name"] in names]
    return {
        "chart": charts.training_chart(trained, colors),
        "runs": rows,
        "comparison": run_comparison(rows, colors) if len(rows) > 1 else None,
    }


def run_comparison(runs: list[dict[str, Any]], colors: dict[str, str]) -> dict[str, Any]:
    """Runs side by side: what differs between them (swept values), and accuracy against time."""
    keys = sorted({key for run in runs for key in run["sweep"]})
    rows = [{**run, "swept": [run["sweep"].get(key, "—") for key in keys]} for run in runs]
    return {"swept_keys": keys, "runs": rows, "chart": charts.accuracy_time_chart(runs, colors)}


def evaluation_view(
    runs: list[RunResults], summary_runs: list[dict[str, Any]], config: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The summary's evaluated runs and their classes; sizes and images from the files."""
    evaluated = [run for run in summary_runs if run["evaluation"]]
    if not evaluated:
        return None
    files = [run for run in runs if run.evaluation]
    return {
        "runs": evaluated,
        "per_class": per_class_view(evaluated),
        "sizes": size_view(files),
        "grid": prediction_grid(runs, summary_runs, config),
    }


def per_class_view(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """AP@.5 and AP (with their intervals) of each class (rows) in each of the summary's
    evaluated runs (columns); None where a run lacks the class. `without_objects` names the
    classes with no objects in the split, which COCO's class means leave out."""
    per_run = {
        run["name"]: {row["name"]: row for row in run["evaluation"]["per_class"]} for run in runs
    }
    classes = [
        {"name": name, "num_gt": first["num_gt"], "scores": cells}
        for name, first, cells in _lined_up(per_run)
    ]
    # a class without objects in the split (one box in all, in training) has no AP, not a zero
    return {
        "runs": list(per_run),
        "classes": classes,
        "without_objects": [
            row["name"]
            for row in classes
            if any(cell is not None and cell["num_gt"] == 0 for cell in row["scores"])
        ],
    }


# A class with fewer objects than this in a size bucket is named under the bucket's AP: each of
# its objects moves the class's AP by a tenth or more, and the bucket's AP, COCO's mean over
# classes, by that over the number of classes, however many objects the others have.
FEW_IN_BUCKET = 10


def size_view(runs: list[RunResults]) -> dict[str, Any]:
    """AP@.5, AP and recall per object-size bucket (rows) in each run (columns), from the
    evaluator's `size_buckets`; None where a run's file has no such bucket (an older file).
    Each cell's `few` lists the classes with fewer than FEW_IN_BUCKET objects in the bucket,
    with their count and AP@.5."""
    per_run = {
        run.name: (run.evaluation or {})["metrics"].get("size_buckets") or {} for run in runs
    }
    return {
        "runs": list(per_run),
        "few_in_bucket": FEW_IN_BUCKET,
        "buckets": [
            {
                "name": name,
                "range_px": first.get("range_px"),
                "cells": [None if cell is None else {**cell, "few": _few(cell)} for cell in cells],
            }
            for name, first, cells in _lined_up(per_run)
        ],
    }


def _few(bucket: dict[str, Any]) -> list[dict[str, Any]]:
    """The bucket's classes with 1 to FEW_IN_BUCKET - 1 objects (none in files without per_class)."""
    return [row for row in bucket.get("per_class") or [] if 0 < row["num_gt"] < FEW_IN_BUCKET]


def _lined_up(
    per_run: dict[str, dict[str, dict[str, Any]]],
) -> list[tuple[str, dict[str, Any], list[dict[str, Any] | None]]]:
    """Rows named in any run, in first-seen order: (name, the first run's row of that name,
    every run's row or None), for a table of rows by runs."""
    names = dict.fromkeys(name for rows in per_run.values() for name in rows)
    return [
        (
            name,
            next(rows[name] for rows in per_run.values() if name in rows),
            [rows.get(name) for rows in per_run.values()],
        )
        for name in names
    ]


def prediction_grid(
    runs: list[RunResults], summary_runs: list[dict[str, Any]], config: dict[str, Any] | None
) -> dict[str, Any] | None:
    """Evaluated images of the first run with predictions, and the files that could not be read."""
    run = next((run for run in runs if run.predictions_path), None)
    if run is None:
        return None
    predictions = read_predictions(run.predictions_path)
    summary_run = next((found for found in summary_runs if found["name"] == run.name), None)
    threshold = score_threshold(summary_run, config)
    shown, missing = predicted_images(predictions, run.predictions_path, MAX_GRID_IMAGES)
    image = (
        charts.predictions_chart(run.name, shown, predictions["class_names"], threshold)
        if shown
        else None
    )
    return {
        "run": run.name,
        "predictions_file": run.predictions_path.name,
        "image": image,
        "threshold": threshold,
        "max_detections": charts.MAX_DRAWN_DETECTIONS,
        "missing": missing,
    }


def score_threshold(run: dict[str, Any] | None, config: dict[str, Any] | None) -> float:
    """The score above which detections are drawn: the evaluation's, else the config's."""
    evaluation = (run or {}).get("evaluation") or {}
    if evaluation.get("score_threshold") is not None:
        return evaluation["score_threshold"]
    from_config = ((config or {}).get("eval") or {}).get("score_threshold")
    return from_config if isinstance(from_config, float | int) else DEFAULT_SCORE_THRESHOLD


def profile_view(
    runs: list[RunResults], colors: dict[str, str], out: Path
) -> dict[str, Any] | None:
    profiled = [run for run in runs if run.profile]
    if not profiled:
        return None
    return {
        "chart": charts.latency_chart(profiled, colors),
        "latency": [
            latency_row(run, row)
            for run in profiled
            for row in run.profile["latency"]
            if isinstance(row, dict)
        ],
        "operators": [operators_view(run, out) for run in profiled],
    }


def latency_row(run: RunResults, row: dict[str, Any]) -> dict[str, Any]:
    profile = run.profile or {}
    wall = row.get("wall") or {}
    settings = profile.get("settings") or {}
    return {
        "run": run.name,
        "device": profile.get("device_description", "n/a"),
        "precision": profile.get("precision", "n/a"),
        "backend": profile.get("backend"),
        "batch_size": row.get("batch_size", "n/a"),
        "p50_ms": wall.get("p50_ms"),
        "p90_ms": wall.get("p90_ms"),
        "p99_ms": wall.get("p99_ms"),
        "images_per_s": row.get("throughput_images_per_s"),
        "memory": row.get("memory"),
        "flags": [
            label
            for label, key in (("noisy", "noisy"), ("budget-limited", "budget_limited"))
            if wall.get(key)
        ]
        # two forward passes per image, as the run evaluates and predicts
        + (["flip test: each image and its mirror"] if settings.get("flip_test") else []),
    }


def operators_view(run: RunResults, out: Path) -> dict[str, Any]:
    """The top operators of one run and a link to its trace, relative to the report, so the
    results folder can move with the report in it."""
    profiler = read_operators(run)
    view: dict[str, Any] = {"name": run.name, "profiler": None}
    if not profiler:
        return view
    operators = [op for op in profiler.get("top_operators") or [] if isinstance(op, dict)]
    view["profiler"] = {
        "batch_size": profiler.get("batch_size"),
        "steps": profiler.get("steps"),
        "sorted_by": profiler.get("sorted_by"),
        "activities": profiler.get("activities") or [],
        "note": profiler.get("note"),
        "top": [
            {
                "name": op.get("name"),
                "calls": op.get("calls", "n/a"),
                "self_cpu_ms": op.get("self_cpu_ms"),
                "self_device_ms": op.get("self_device_ms"),
                "share": op.get("share"),
            }
            for op in operators[:TOP_OPERATORS]
        ],
    }
    trace = (run.profile_dir or Path()) / Path(str(profiler.get("trace") or "trace.json")).name
    view["trace_name"] = trace.name
    view["trace_path"] = view["trace_href"] = None
    if trace.exists():
        relative = Path(os.path.relpath(trace.resolve(), out.resolve().parent)).as_posix()
        view.update(trace_path=relative, trace_href=urllib.parse.quote(relative))
    return view
