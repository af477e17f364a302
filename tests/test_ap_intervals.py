"""AP's intervals over images: resamples as an array dimension must keep the coverage of the
bootstrap they replace (one resample at a time, per class, IoU threshold and size range)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.evaluation.coco import coco_ap

REFERENCE = Path(__file__).parent / "data" / "ap_intervals_reference.json"
CLASSES = ["a", "b", "c", "d"]


def interval_scene(images: int = 150, seed: int = 11) -> tuple[list[dict], list[dict]]:
    """Objects of four classes from 5 to 100 px (every size bucket), found with jitter, wrong
    classes, misses and clutter, some images with a crowd region: what the reference holds the
    intervals of."""
    rng = np.random.default_rng(seed)
    gts, dets = [], []
    for image_id in range(1, images + 1):
        count = int(rng.integers(0, 6))
        sides = np.exp(rng.uniform(np.log(5), np.log(100), size=(count, 1))) * [1, 1]
        sides *= rng.uniform(0.7, 1.3, size=(count, 2))
        corners = rng.uniform(0, 128 - sides)
        boxes = np.concatenate([corners, corners + sides], axis=1)
        labels = rng.integers(0, len(CLASSES), size=count)
        truth: dict[str, Any] = {"image_id": image_id, "boxes": boxes, "labels": labels}
        if rng.random() < 0.2:
            corner = rng.uniform(0, 80, size=2)
            truth["ignore_boxes"] = np.concatenate([corner, corner + 40])[None]
            truth["ignore_labels"] = rng.integers(0, len(CLASSES), size=1)
        gts.append(truth)
        found = rng.random(count) < 0.85
        noisy = boxes[found] + rng.normal(0, 0.08, size=(int(found.sum()), 4)) * np.repeat(
            sides[found], 2, axis=1
        )
        noisy_labels = np.where(
            rng.random(int(found.sum())) < 0.1, (labels[found] + 1) % len(CLASSES), labels[found]
        )
        clutter = int(rng.integers(0, 4))
        corners = rng.uniform(0, 100, size=(clutter, 2))
        clutter_boxes = np.concatenate([corners, corners + rng.uniform(5, 28, (clutter, 2))], 1)
        scores = np.concatenate(
            [rng.uniform(0.3, 1.0, int(found.sum())), rng.uniform(0.0, 0.7, clutter)]
        )
        dets.append(
            {
                "image_id": image_id,
                "boxes": np.concatenate([noisy, clutter_boxes]),
                "scores": scores,
                "labels": np.concatenate([noisy_labels, rng.integers(0, len(CLASSES), clutter)]),
            }
        )
    return gts, dets


def intervals_of(result: dict[str, Any]) -> dict[str, dict[str, float] | None]:
    """Every interval of a coco_ap result, by a flat name."""
    found = {name: result[f"{name}_interval"] for name in ("ap", "ap50", "ap75")}
    for row in result["per_class"]:
        for name in ("ap", "ap50"):
            found[f"class {row['name']} {name}"] = row[f"{name}_interval"]
    for bucket, row in result["size_buckets"].items():
        for name in ("ap", "ap50", "recall"):
            found[f"{bucket} {name}"] = row[f"{name}_interval"]
    return {
        key: None if value is None else {"low": value["low"], "high": value["high"]}
        for key, value in found.items()
    }


def test_every_ap_interval_matches_the_per_resample_bootstrap_within_a_point() -> None:
    """tests/data/ap_intervals_reference.json holds the intervals the per-resample bootstrap
    gave on this scene (commit named in the file): the array form must give the same
    coverage: every interval within a point of it, on the same figures."""
    reference = json.loads(REFERENCE.read_text())
    gts, dets = interval_scene()
    result = coco_ap(gts, dets, len(CLASSES), (128, 128), CLASSES, 0.5, ap_intervals=True)
    assert {name: result[name] for name in ("ap", "ap50", "ap75")} == pytest.approx(
        reference["figures"], abs=1e-12
    )
    found = intervals_of(result)
    assert found.keys() == reference["intervals"].keys()
    assert sum(value is not None for value in found.values()) >= 18  # every bucket, class, IoU
    for name, expected in reference["intervals"].items():
        if expected is None:
            assert found[name] is None, name
        else:
            assert found[name]["low"] == pytest.approx(expected["low"], abs=0.01), name
            assert found[name]["high"] == pytest.approx(expected["high"], abs=0.01), name
