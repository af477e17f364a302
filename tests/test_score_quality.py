"""benchmarks/score_quality.py: F1 at fixed thresholds and the score-IoU rank correlation read
from a real-set record's kept test predictions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmark_modules import load

from pipeline.errors import DataError

score_quality = load("score_quality")


def a_record(tmp_path: Path, detections: list[tuple[list[float], float]]) -> Path:
    """One image, two objects of class 0, the detections given (all of class 0)."""
    work = tmp_path / "work"
    work.mkdir()
    truth = {"boxes": [[0, 0, 10, 10], [20, 20, 40, 40]], "labels": [0, 0], "ignore_boxes": []}
    found = {
        "boxes": [box for box, _ in detections],
        "scores": [score for _, score in detections],
        "labels": [0] * len(detections),
    }
    image = {"image_id": 0, "ground_truth": truth, "detections": found}
    (work / "predictions.json").write_text(json.dumps({"images": [image]}))
    figures = {"ap50": 0.9, "ap": 0.5, "at_operating_point": {"f1": 0.8, "threshold": 0.35}}
    record = {"work": str(work), "settings": {"seed": 3}, "figures": figures}
    path = tmp_path / "record.json"
    path.write_text(json.dumps(record))
    return path


def test_f1_at_fixed_thresholds_counts_matches_at_iou_half_from_the_kept_predictions(
    tmp_path: Path,
) -> None:
    path = a_record(
        tmp_path,
        [
            ([0, 0, 10, 10], 0.9),  # exact: a true positive at every threshold
            ([20, 20, 38, 38], 0.45),  # IoU 0.81: true positive from 0.4 down
            ([50, 50, 60, 60], 0.35),  # on nothing: a false positive at 0.3
        ],
    )
    row = score_quality.run_figures(path)
    assert row["f1_at_0.5"] == pytest.approx(2 * 1 / (2 * 1 + 0 + 1))
    assert row["f1_at_0.4"] == pytest.approx(1.0)
    assert row["f1_at_0.3"] == pytest.approx(2 * 2 / (2 * 2 + 1 + 0))
    assert (row["seed"], row["ap"], row["threshold"]) == (3, 0.5, 0.35)
    assert row["tp_rank_correlation"] is None  # two true positives are too few to rank


def test_the_rank_correlation_follows_the_order_not_the_values() -> None:
    assert score_quality.spearman([0.1, 0.5, 0.9], [0.2, 0.6, 0.7]) == pytest.approx(1.0)
    assert score_quality.spearman([0.1, 0.5, 0.9], [0.7, 0.6, 0.2]) == pytest.approx(-1.0)
    assert score_quality.spearman([0.1, 0.5, 0.9, 0.95], [0.2, 0.9, 0.3, 0.95]) == pytest.approx(
        0.8
    )


def test_a_record_whose_run_folder_is_gone_is_named(tmp_path: Path) -> None:
    path = a_record(tmp_path, [])
    (Path(json.loads(path.read_text())["work"]) / "predictions.json").unlink()
    with pytest.raises(DataError, match=r"predictions\.json are gone"):
        score_quality.run_figures(path)
