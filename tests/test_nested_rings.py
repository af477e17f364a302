"""benchmarks/nested_rings.py: the dotted-ring diagnostic of the multi-scale preset."""

from __future__ import annotations

import pytest
from benchmark_modules import load

nested_rings = load("nested_rings")

CLASSES = ["circle", "ring"]


def image(gt_boxes, gt_labels, boxes, scores, labels) -> dict:
    return {
        "image_id": 0,
        "file": "a.png",
        "width": 256,
        "height": 256,
        "ground_truth": {
            "boxes": gt_boxes,
            "labels": gt_labels,
            "ignore_boxes": [],
            "ignore_labels": [],
        },
        "detections": {"boxes": boxes, "scores": scores, "labels": labels},
    }


def test_a_dotted_ring_given_its_holes_box_is_missed_and_its_hole_box_counted_inside_it() -> None:
    ring, dot, hole = [50, 50, 150, 150], [96, 96, 104, 104], [75, 75, 125, 125]
    dotted = image([ring, dot], [1, 0], [hole, dot], [0.8, 0.9], [1, 0])
    plain = image([ring], [1], [[52, 50, 150, 148]], [0.9], [1])
    result = nested_rings.measure({"class_names": CLASSES, "images": [dotted, plain]})
    assert (result["dotted_rings"], result["dotted_found"]) == (1, 0.0)
    assert result["dotted_mean_iou"] == pytest.approx(0.25)
    assert (result["plain_rings"], result["plain_found"]) == (1, 1.0)
    assert (result["medium_ring_false_positives"], result["of_them_inside_a_ring"]) == (1, 1)


def test_a_low_scored_or_matching_ring_detection_is_no_false_positive() -> None:
    ring = [0, 0, 60, 60]  # a medium ring (cut at the corner), found
    found = image([ring], [1], [ring, [100, 100, 140, 140]], [0.5, 0.2], [1, 1])
    result = nested_rings.measure({"class_names": CLASSES, "images": [found]})
    assert result["medium_ring_false_positives"] == 0
    assert result["dotted_rings"] == result["plain_rings"] == 0


def test_a_medium_ring_is_ranked_against_the_false_medium_rings_of_every_image() -> None:
    ring = [0, 0, 60, 60]  # cut at the corner: medium
    found = image([ring], [1], [[2, 0, 60, 58], [0, 0, 20, 20]], [0.3, 0.9], [1, 1])
    missed = image([[196, 196, 256, 256]], [1], [], [], [])
    elsewhere = image([], [], [[100, 100, 140, 140], [10, 10, 50, 50]], [0.5, 0.1], [1, 1])
    result = nested_rings.measure({"class_names": CLASSES, "images": [found, missed, elsewhere]})
    assert result["medium_ring_scores"] == [pytest.approx(0.3), 0.0]
    assert result["medium_ring_outranked_by"] == [2, 3]  # by 0.9 (the corner box), 0.5; and 0.1
