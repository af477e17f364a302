"""A detector's output made up from the ground truth, for timing and scoring evaluation
without a model: what evaluation_speed times and ap_interval_coverage scores.

COCO scale: 80 classes; images of 1 to 15 objects (COCO's mean is about 7) from 4 to 400 px
in a 640-px input; 100 detections per image, each a ground-truth box of its image moved by
noise (most far off: false positives; some of another class), scored higher the nearer they
are.
"""

from __future__ import annotations

from typing import Any

import numpy as np

COCO_CLASSES = 80
COCO_INPUT = 640
DETECTIONS = 100


def noisy_detections(
    boxes: np.ndarray, labels: np.ndarray, classes: int, size: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """DETECTIONS boxes made from an image's objects: each a copy of one of them moved by
    noise of a random scale (up to its own size: mostly false positives), of another class one
    time in five, scored higher the smaller the noise. Without objects: boxes anywhere."""
    if len(boxes) == 0:
        corners = rng.uniform(0, size * 0.8, (DETECTIONS, 2))
        found = np.concatenate([corners, corners + rng.uniform(4, size * 0.2, (DETECTIONS, 2))], 1)
        return {
            "boxes": found.astype(np.float32),
            "scores": rng.uniform(0, 0.5, DETECTIONS).astype(np.float32),
            "labels": rng.integers(0, classes, DETECTIONS),
        }
    pick = rng.integers(0, len(boxes), DETECTIONS)
    sides = np.repeat(boxes[pick, 2:] - boxes[pick, :2], 2, axis=0).reshape(-1, 4)
    noise = rng.exponential(0.25, (DETECTIONS, 1))
    moved = boxes[pick] + rng.normal(0, 1, (DETECTIONS, 4)) * noise * sides
    moved[:, 2:] = np.maximum(moved[:, 2:], moved[:, :2] + 1)
    other = rng.random(DETECTIONS) < 0.2
    found_labels = np.where(other, rng.integers(0, classes, DETECTIONS), labels[pick])
    scores = np.clip(1 - noise[:, 0] + rng.normal(0, 0.1, DETECTIONS), 0.01, 1)
    return {
        "boxes": np.clip(moved, 0, size).astype(np.float32),
        "scores": scores.astype(np.float32),
        "labels": found_labels,
    }


def coco_scale(images: int, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`images` images of ground truth and the detections made from it (seeded)."""
    rng = np.random.default_rng(seed)
    gts, dets = [], []
    for image_id in range(1, images + 1):
        count = int(rng.integers(1, 16))
        sides = np.exp(rng.uniform(np.log(4), np.log(400), (count, 1))) * rng.uniform(
            0.6, 1.4, (count, 2)
        )
        sides = np.minimum(sides, COCO_INPUT - 1)
        corners = rng.uniform(0, COCO_INPUT - sides)
        boxes = np.concatenate([corners, corners + sides], axis=1)
        labels = rng.integers(0, COCO_CLASSES, count)
        gts.append({"image_id": image_id, "boxes": boxes.astype(np.float32), "labels": labels})
        found = noisy_detections(boxes, labels, COCO_CLASSES, COCO_INPUT, rng)
        dets.append({"image_id": image_id, **found})
    return gts, dets
