"""Each trained run summed up for summary.json: how it trained, how long it took, and its
scores and evaluation as the report's run tables and `compare` show them (summary/build.py puts
them in the summary)."""

from __future__ import annotations

import statistics
from typing import Any

from pipeline.report.formatting import number
from pipeline.summary import accuracy
from pipeline.summary.load import RunResults


def run_entry(run: RunResults) -> dict[str, Any]:
    """One trained run: how it trained, how long it took, and its scores."""
    summary = run.summary or {}
    best, epoch = accuracy.best_f1(run)
    epoch_times = [
        t for t in (number(v) for v in summary.get("epoch_times_s") or []) if t is not None
    ]
    median_step = number(summary.get("median_step_time_s"))
    return {
        "name": run.name,
        "sweep": accuracy.swept_values(run.name),
        "has_train_summary": run.summary is not None,
        "metrics_note": run.metrics_note,
        "backend": summary.get("backend"),
        "device": summary.get("device_description"),
        "precision": summary.get("precision"),
        "amp": summary.get("amp"),
        "model": summary.get("model"),
        "ema": bool(summary.get("ema")),
        "epochs": summary.get("epochs"),
        "steps": summary.get("steps"),
        "batch_size": summary.get("batch_size"),
        "wall_time_s": number(summary.get("wall_time_s")),
        "epoch_time_s": statistics.median(epoch_times) if epoch_times else None,
        "median_step_ms": None if median_step is None else 1000 * median_step,
        "images_per_s": number(summary.get("images_per_s")),
        "peak_memory": summary.get("peak_memory"),
        "host_peak_rss_mb": number(summary.get("host_peak_rss_mb")),
        # optimistic: the highest of several validations, on the images best.pth is picked by
        "best_validation_f1": {"value": best, "epoch": epoch} if best is not None else None,
        "scores": scores(run),
        "evaluation": evaluation(run),
    }


def scores(run: RunResults) -> dict[str, Any]:
    """The run's leading figures: the held-out F1 at the threshold picked on validation where
    the evaluation has one, else F1 at the score threshold; AP@.5; the split they come from."""
    found = accuracy.run_scores(run)
    point = operating_point(run)
    held_out = point is not None and point["applied_to"] == "test"
    return {
        "split": found["split"],
        "f1": point["f1"] if held_out else found["f1"],
        "f1_interval": point["f1_interval"] if held_out else found["f1_interval"],
        "f1_threshold": "validation" if held_out else "score threshold",
        "ap50": found["ap50"],
        "ap50_interval": found["ap50_interval"],
    }


def operating_point(run: RunResults) -> dict[str, Any] | None:
    """The best-F1 threshold picked on validation and F1 at it, as the evaluation recorded it."""
    point = (run.evaluation or {}).get("operating_point")
    if not isinstance(point, dict) or number(point.get("f1")) is None:
        return None
    interval = point.get("f1_interval")
    return {
        "threshold": number(point.get("threshold")),
        "picked_on": point.get("picked_on"),
        "applied_to": point.get("applied_to"),
        "f1": number(point.get("f1")),
        "f1_interval": interval if isinstance(interval, dict) else None,
    }


def evaluation(run: RunResults) -> dict[str, Any] | None:
    """The evaluation's figures as the report's table shows them; None where none ran."""
    if not run.evaluation:
        return None
    document = run.evaluation
    metrics = document["metrics"]
    micro = metrics.get("micro") if isinstance(metrics.get("micro"), dict) else metrics
    best = metrics.get("best") if isinstance(metrics.get("best"), dict) else {}

    def interval(key: str) -> dict[str, Any] | None:
        return metrics.get(key) if isinstance(metrics.get(key), dict) else None

    return {
        "split": document.get("split"),
        "held_out": document.get("metrics_split") == "test",
        "checkpoint_epoch": document.get("checkpoint_epoch"),
        "operating_point": operating_point(run),
        "score_threshold": number(metrics.get("score_threshold")),
        "f1": number(micro.get("f1")),
        "f1_interval": interval("f1_interval"),
        "precision": number(micro.get("precision")),
        "precision_interval": interval("precision_interval"),
        "recall": number(micro.get("recall")),
        "recall_interval": interval("recall_interval"),
        # optimistic: the threshold is picked on the very images it scores
        "best_f1": number(metrics.get("best_f1")),
        "best_f1_threshold": number(best.get("threshold", metrics.get("best_f1_threshold"))),
        "ap50": number(metrics.get("ap50")),
        "ap50_interval": interval("ap50_interval"),
        "ap": number(metrics.get("ap")),
        "ap_interval": interval("ap_interval"),
        "ap75": number(metrics.get("ap75")),
        "ap75_interval": interval("ap75_interval"),
        # which rules each figure follows (None: a file from before protocols were named)
        "protocol": metrics.get("protocol"),
        "figure_protocols": metrics.get("figure_protocols"),
        # the settings that shaped every figure (None: a file from before the key): decoded
        # from each image and its mirror; detections below the score floor dropped as decoded;
        # where the score threshold came from
        "flip_test": metrics.get("flip_test"),
        "min_score": number(metrics.get("min_score")),
        "score_threshold_source": document.get("score_threshold_source"),
        "num_images": metrics.get("num_images"),
        "num_ground_truth": metrics.get("num_ground_truth"),
        "num_detections": metrics.get("num_detections"),
        "per_class": [
            {
                "name": str(row.get("name")),
                "num_gt": row.get("num_gt"),
                "ap50": number(row.get("ap50")),
                "ap50_interval": row.get("ap50_interval"),
                "ap": number(row.get("ap")),
                "ap_interval": row.get("ap_interval"),
                "f1": number(row.get("f1")),
            }
            for row in metrics.get("per_class") or []
            if isinstance(row, dict)
        ],
    }
