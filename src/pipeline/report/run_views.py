"""View models of the sections drawn from the training runs: training, evaluation and the
inference profile, for the templates sections/training, evaluation and profile.html.j2.
A view of None means there is nothing to show yet: the template says which step to run."""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path
from typing import Any

from pipeline.report import charts, decisions
from pipeline.report.load import (
    RunResults,
    predicted_images,
    read_operators,
    read_predictions,
)

MAX_GRID_IMAGES = 8
TOP_OPERATORS = 10


def training_view(runs: list[RunResults], colors: dict[str, str]) -> dict[str, Any] | None:
    trained = [run for run in runs if run.summary or run.metrics]
    if not trained:
        return None
    return {
        "chart": charts.training_chart(trained, colors),
        "runs": [training_run(run) for run in trained],
        "comparison": run_comparison(trained, colors) if len(trained) > 1 else None,
    }


def training_run(run: RunResults) -> dict[str, Any]:
    summary = run.summary or {}
    best, epoch = decisions.best_f1(run)
    return {
        "name": run.name,
        "has_summary": bool(run.summary),
        "metrics_note": run.metrics_note,
        "device": summary.get("device_description", "n/a"),
        "amp": bool(summary.get("amp")),
        "precision": summary.get("precision", "n/a"),
        "epochs": summary.get("epochs", "n/a"),
        "wall_time_s": summary.get("wall_time_s"),
        "images_per_s": summary.get("images_per_s"),
        "peak_memory": summary.get("peak_memory"),
        "backend": summary.get("backend"),
        "host_rss_mb": summary.get("host_peak_rss_mb"),
        "best_f1": best,
        "best_epoch": epoch,
        "ema": bool(summary.get("ema")),  # the validated weights were the weights' average
    }


def run_comparison(runs: list[RunResults], colors: dict[str, str]) -> dict[str, Any]:
    """Runs side by side: what differs between them (swept values), and accuracy against time."""
    keys = sorted({key for run in runs for key in decisions.swept_values(run.name)})
    rows = []
    for run in runs:
        swept, summary = decisions.swept_values(run.name), run.summary or {}
        rows.append(
            {
                "name": run.name,
                "swept": [swept.get(key, "—") for key in keys],
                "setting": f"{summary.get('backend', 'n/a')} {summary.get('precision', '')}".strip(),
                "wall_time_s": summary.get("wall_time_s"),
                **decisions.run_scores(run),
            }
        )
    return {"swept_keys": keys, "runs": rows, "chart": charts.accuracy_time_chart(runs, colors)}


def evaluation_view(runs: list[RunResults], config: dict[str, Any] | None) -> dict[str, Any] | None:
    evaluated = [run for run in runs if run.evaluation]
    if not evaluated:
        return None
    return {
        "runs": [evaluation_run(run) for run in evaluated],
        "per_class": per_class_view(evaluated),
        "sizes": size_view(evaluated),
        "grid": prediction_grid(runs, config),
    }


def evaluation_run(run: RunResults) -> dict[str, Any]:
    """One row of the evaluation table: F1 at the configured threshold first, and the split
    every figure comes from (the held-out test split where the data has one)."""
    evaluation = run.evaluation or {}
    metrics = evaluation["metrics"]
    micro = metrics.get("micro") if isinstance(metrics.get("micro"), dict) else metrics
    best = metrics.get("best") if isinstance(metrics.get("best"), dict) else {}
    point = (
        evaluation.get("operating_point")
        if isinstance(evaluation.get("operating_point"), dict)
        else {}
    )
    return {
        "name": run.name,
        "split": evaluation.get("split", "n/a"),
        "held_out": evaluation.get("metrics_split") == "test",
        "checkpoint_epoch": evaluation.get("checkpoint_epoch", "n/a"),
        "score_threshold": metrics.get("score_threshold"),
        "precision": micro.get("precision"),
        "precision_interval": metrics.get("precision_interval"),
        "recall": micro.get("recall"),
        "recall_interval": metrics.get("recall_interval"),
        "f1": micro.get("f1"),
        "f1_interval": metrics.get("f1_interval"),
        "picked": {
            "threshold": point.get("threshold"),
            "on": point.get("picked_on"),
            "f1": point.get("f1"),
            "f1_interval": point.get("f1_interval"),
        }
        if point
        else None,
        "best_f1": metrics.get("best_f1"),
        "best_f1_threshold": best.get("threshold", metrics.get("best_f1_threshold")),
        "ap50": metrics.get("ap50"),
        "ap50_interval": metrics.get("ap50_interval"),
        "ap": metrics.get("ap"),
        "ap_interval": metrics.get("ap_interval"),
        "ap75": metrics.get("ap75"),
        "ap75_interval": metrics.get("ap75_interval"),
        "num_images": metrics.get("num_images", "n/a"),
        "num_ground_truth": metrics.get("num_ground_truth", "n/a"),
        "num_detections": metrics.get("num_detections", "n/a"),
    }


def per_class_view(runs: list[RunResults]) -> dict[str, Any]:
    """AP@.5 (with its interval where the file has one) and AP of each class (rows) in each run
    (columns); None where a run lacks the class."""
    per_run = {run.name: class_rows(run) for run in runs}
    return {
        "runs": list(per_run),
        "classes": [
            {
                "name": name,
                "num_gt": first.get("num_gt"),
                "scores": [
                    None
                    if row is None
                    else {
                        "ap50": row.get("ap50"),
                        "ap50_interval": row.get("ap50_interval"),
                        "ap": row.get("ap"),
                        "ap_interval": row.get("ap_interval"),
                    }
                    for row in cells
                ],
            }
            for name, first, cells in _lined_up(per_run)
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


def class_rows(run: RunResults) -> dict[str, dict[str, Any]]:
    rows = (run.evaluation or {})["metrics"].get("per_class") or []
    return {str(row.get("name")): row for row in rows if isinstance(row, dict)}


def prediction_grid(runs: list[RunResults], config: dict[str, Any] | None) -> dict[str, Any] | None:
    """Evaluated images of the first run with predictions, and the files that could not be read."""
    run = next((run for run in runs if run.predictions_path), None)
    if run is None:
        return None
    predictions = read_predictions(run.predictions_path)
    threshold = decisions.score_threshold(run, config)
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
        ],
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
