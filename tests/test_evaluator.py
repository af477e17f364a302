"""Detection metrics: greedy matching, P/R/F1, COCO AP through pycocotools, and the Evaluator loop."""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from pipeline.errors import ConfigError, DataError
from pipeline.evaluation import intervals, paired_ap, weighted_ap
from pipeline.evaluation import loop as evaluator_module
from pipeline.evaluation.coco import SIZE_BUCKETS, coco_ap
from pipeline.evaluation.image_level import image_level_f1
from pipeline.evaluation.loop import TIMING_KEYS, Evaluator
from pipeline.evaluation.matching import (
    ignored_detections,
    matched_objects,
    pool,
    precision_recall_f1,
)

RECALL_THRESHOLDS = np.linspace(0.0, 1.0, 101)  # COCO's 101 recall points


def gt(image_id: int, boxes: list[list[float]], labels: list[int]) -> dict[str, Any]:
    return {
        "image_id": image_id,
        "boxes": np.asarray(boxes, dtype=np.float32).reshape(-1, 4),
        "labels": np.asarray(labels, dtype=np.int64),
    }


def det(
    image_id: int, boxes: list[list[float]], scores: list[float], labels: list[int]
) -> dict[str, Any]:
    return {
        "image_id": image_id,
        "boxes": np.asarray(boxes, dtype=np.float32).reshape(-1, 4),
        "scores": np.asarray(scores, dtype=np.float32),
        "labels": np.asarray(labels, dtype=np.int64),
    }


def perfect(gts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        det(g["image_id"], g["boxes"].tolist(), [1.0] * len(g["labels"]), g["labels"].tolist())
        for g in gts
    ]


@pytest.fixture
def scene() -> list[dict[str, Any]]:
    """Four images, three classes with ground truth, a fourth class without any."""
    return [
        gt(1, [[0, 0, 10, 10], [20, 20, 40, 40], [50, 5, 60, 30]], [0, 1, 0]),
        gt(2, [[5, 5, 25, 25]], [2]),
        gt(3, [], []),
        gt(4, [[0, 0, 64, 64], [10, 10, 20, 20]], [1, 2]),
    ]


# The hand-built case. Image 1: A, B of class 0 and C of class 1. Image 2: D of class 1, never
# detected. Image 3: no objects, one confident false positive. At score >= 0.5 (d4 dropped):
#   d0 0.9 class 0 = A exactly                 -> TP (A)
#   d1 0.8 class 0 shifted A, IoU 0.82         -> FP, A is taken: duplicate
#   d2 0.7 class 1 on B                        -> FP, B is class 0: wrong class
#   d3 0.6 class 1 over 40% of C, IoU 0.4      -> FP, low IoU
#   d4 0.2 class 0 on B, IoU 0.9               -> TP (B), but below 0.5
#   e0 0.95 class 0 on the empty image 3       -> FP
HAND_GTS = [
    gt(1, [[0, 0, 10, 10], [20, 20, 30, 30], [0, 20, 10, 30]], [0, 0, 1]),
    gt(2, [[50, 50, 70, 70]], [1]),
    gt(3, [], []),
]
HAND_DETS = [
    det(
        1,
        [[0, 0, 10, 10], [1, 0, 11, 10], [20, 20, 30, 30], [0, 20, 4, 30], [20, 20, 30, 29]],
        [0.9, 0.8, 0.7, 0.6, 0.2],
        [0, 0, 1, 1, 0],
    ),
    det(3, [[0, 0, 5, 5]], [0.95], [0]),
]


def test_matching_marks_duplicate_wrong_class_and_low_iou_detections_as_false_positives() -> None:
    d = HAND_DETS[0]
    g = HAND_GTS[0]
    flags = matched_objects(d["boxes"], d["scores"], d["labels"], g["boxes"], g["labels"]) >= 0
    assert flags.tolist() == [True, False, False, False, True]


def test_matching_is_greedy_by_score_and_reports_flags_in_the_input_order() -> None:
    gt_boxes = np.array([[0, 0, 10, 10]], dtype=np.float32)
    # Listed low score first: the 0.9 detection (IoU 0.6) claims the object before the
    # 0.5 detection with the perfect box, which becomes the false positive.
    boxes = np.array([[0, 0, 10, 10], [0, 0, 10, 6]], dtype=np.float32)
    found = matched_objects(boxes, np.array([0.5, 0.9]), np.array([0, 0]), gt_boxes, np.array([0]))
    assert found.tolist() == [-1, 0]


def test_matching_takes_the_unmatched_ground_truth_with_the_highest_iou() -> None:
    gt_boxes = np.array([[0, 0, 10, 10], [5, 0, 15, 10]], dtype=np.float32)
    # The first detection overlaps both (IoU 0.54 and 0.67): it must take the second, which
    # leaves the first object for the second detection. First-found matching would give 1 TP.
    boxes = np.array([[3, 0, 13, 10], [0, 0, 10, 10]], dtype=np.float32)
    flags = (
        matched_objects(boxes, np.array([0.9, 0.8]), np.array([0, 0]), gt_boxes, np.array([0, 0]))
        >= 0
    )
    assert flags.tolist() == [True, True]


def test_a_detection_as_close_to_two_objects_takes_the_first_listed() -> None:
    objects = np.array([[0, 0, 10, 10], [2, 0, 12, 10]], dtype=np.float64)  # IoU 0.818 each
    found = matched_objects([[1, 0, 11, 10]], [0.9], [0], objects, [0, 0])
    assert found.tolist() == [0]
    assert matched_objects([[1, 0, 11, 10]], [0.9], [0], objects[::-1], [0, 0]).tolist() == [0]


def test_matching_with_no_ground_truth_or_no_detections_matches_nothing() -> None:
    empty_boxes = np.zeros((0, 4), dtype=np.float32)
    assert matched_objects(
        [[0, 0, 1, 1]], [0.9], [0], empty_boxes, np.zeros(0, dtype=np.int64)
    ).tolist() == [-1]
    assert matched_objects(empty_boxes, [], [], [[0, 0, 1, 1]], [0]).tolist() == []


def test_hand_built_precision_recall_f1_micro_macro_and_per_class() -> None:
    result = precision_recall_f1(HAND_GTS, HAND_DETS, num_classes=3, score_threshold=0.5)
    micro = result["micro"]
    assert (micro["tp"], micro["fp"], micro["fn"]) == (1, 4, 3)
    assert micro["precision"] == pytest.approx(1 / 5)
    assert micro["recall"] == pytest.approx(1 / 4)
    assert micro["f1"] == pytest.approx(2 / 9)
    class0, class1, class2 = result["per_class"]
    assert (class0["num_gt"], class0["tp"], class0["fp"], class0["fn"]) == (2, 1, 2, 1)
    assert class0["precision"] == pytest.approx(1 / 3)
    assert class0["recall"] == pytest.approx(1 / 2)
    assert class0["f1"] == pytest.approx(2 / 5)
    assert (class1["num_gt"], class1["tp"], class1["fp"], class1["fn"]) == (2, 0, 2, 2)
    assert class1["f1"] == 0.0
    assert (class2["num_gt"], class2["tp"], class2["fp"]) == (0, 0, 0)
    assert (class2["precision"], class2["recall"], class2["f1"]) == (None, None, None)
    # Class 2 has neither ground truth nor detections: left out of the macro mean.
    macro = result["macro"]
    assert macro["num_classes"] == 2
    assert macro["precision"] == pytest.approx(1 / 6)
    assert macro["recall"] == pytest.approx(1 / 4)
    assert macro["f1"] == pytest.approx(1 / 5)
    assert result["num_ground_truth"] == 4
    assert result["num_detections"] == 6


def test_per_image_counts_add_up_to_the_micro_counts_and_bound_the_f1_interval() -> None:
    result = precision_recall_f1(HAND_GTS, HAND_DETS, num_classes=3, score_threshold=0.5)
    # image 1: one hit, a duplicate, a wrong class and a loose box; 2: a miss; 3: a stray box
    assert result["per_image"] == {
        "image_ids": [1, 2, 3],
        "tp": [1, 0, 0],
        "fp": [3, 0, 1],
        "fn": [2, 1, 0],
    }
    interval = result["f1_interval"]
    assert interval["images"] == 3 and interval["confidence"] == 0.95
    assert 0.0 <= interval["low"] < 2 / 9 < interval["high"] <= 1.0
    # an ignored detection counts in no image
    crowd = precision_recall_f1([CROWD_GT], [CROWD_DET], num_classes=2, score_threshold=0.5)
    assert crowd["per_image"] == {"image_ids": [1], "tp": [1], "fp": [2], "fn": [0]}


def test_best_f1_on_the_hand_built_case_lowers_the_threshold_to_catch_the_last_true_positive() -> (
    None
):
    # Sweep (0.95 FP, 0.9 TP, 0.8 FP, 0.7 FP, 0.6 FP, 0.2 TP; 4 objects): F1 0, 1/3, 2/7, 1/4, 2/9, 2/5.
    best = precision_recall_f1(HAND_GTS, HAND_DETS, num_classes=3, score_threshold=0.5)["best"]
    assert best["threshold"] == pytest.approx(0.2, abs=1e-6)
    assert best["f1"] == pytest.approx(2 / 5)
    assert best["precision"] == pytest.approx(2 / 6)
    assert best["recall"] == pytest.approx(2 / 4)


def test_best_f1_threshold_picks_the_middle_score_that_maximises_micro_f1() -> None:
    # Three objects; detections by score: TP, TP, FP, FP, FP, TP -> F1 0.5, 0.8, 0.67, 0.57, 0.5, 0.67.
    objects = [[0, 0, 10, 10], [20, 0, 30, 10], [40, 0, 50, 10]]
    gts = [gt(1, objects, [0, 0, 0])]
    boxes = [
        objects[0],
        objects[1],
        [60, 0, 70, 10],
        [80, 0, 90, 10],
        [100, 0, 110, 10],
        objects[2],
    ]
    dets = [det(1, boxes, [0.9, 0.8, 0.7, 0.6, 0.5, 0.4], [0] * 6)]
    best = precision_recall_f1(gts, dets, num_classes=1, score_threshold=0.3)["best"]
    assert best["threshold"] == pytest.approx(0.8, abs=1e-6)
    assert best["f1"] == pytest.approx(0.8)
    assert best["precision"] == pytest.approx(1.0)
    assert best["recall"] == pytest.approx(2 / 3)


def test_best_f1_never_splits_tied_scores_and_prefers_the_higher_threshold_on_equal_f1() -> None:
    # 0.9 TP, then three detections tied at 0.7 (one TP). Keeping only the first 0.7 one would
    # give F1 1.0, but a threshold cannot split a tie: F1 is 2/3 at 0.9 and 2/3 at 0.7.
    objects = [[0, 0, 10, 10], [20, 0, 30, 10]]
    boxes = [objects[0], objects[1], [60, 0, 70, 10], [80, 0, 90, 10]]
    dets = [det(1, boxes, [0.9, 0.7, 0.7, 0.7], [0] * 4)]
    best = precision_recall_f1([gt(1, objects, [0, 0])], dets, 1, score_threshold=0.5)["best"]
    assert best["f1"] == pytest.approx(2 / 3)
    assert best["threshold"] == pytest.approx(0.9, abs=1e-6)


def test_records_of_flat_lists_and_single_values_score_as_their_arrays_do() -> None:
    """Records need not hold arrays of a record's own shapes: a flat list of corners, a single
    label or score (each reshaped where the records are laid end to end) score the same."""
    flat_gts = [
        {
            "image_id": g["image_id"],
            "boxes": g["boxes"].reshape(-1).tolist(),
            "labels": g["labels"].tolist(),
        }
        for g in HAND_GTS
    ]
    flat_gts[1]["labels"] = int(HAND_GTS[1]["labels"][0])  # one object: its label alone
    flat_dets = [{**d, "boxes": d["boxes"].reshape(-1).tolist()} for d in HAND_DETS]
    flat_dets[1]["scores"] = float(HAND_DETS[1]["scores"][0])
    flat_dets[1]["labels"] = int(HAND_DETS[1]["labels"][0])
    names = ["a", "b", "c"]
    assert coco_ap(flat_gts, flat_dets, 3, names) == coco_ap(HAND_GTS, HAND_DETS, 3, names)
    flat = precision_recall_f1(flat_gts, flat_dets, 3, 0.5)
    assert flat == precision_recall_f1(HAND_GTS, HAND_DETS, 3, 0.5) and flat["micro"]["tp"] == 1


def test_best_f1_is_the_same_whatever_order_tied_scores_come_in() -> None:
    """A tie is one threshold, read at its end: the order of its detections (which the sort
    behind the sweep leaves as it finds it) changes no figure."""
    rng = np.random.default_rng(3)
    objects = [[x, 0, x + 10, 10] for x in range(0, 400, 20)]
    on, off = (
        [[x, 0, x + 10, 10] for x in range(0, 200, 20)],
        [[x, 50, x + 10, 60] for x in range(0, 400, 20)],
    )
    boxes = np.asarray(on + off, dtype=np.float64)
    scores = rng.choice([0.2, 0.4, 0.6, 0.8], len(boxes)).astype(np.float32)  # many ties
    found = []
    for _ in range(5):
        order = rng.permutation(len(boxes))
        dets = [det(1, boxes[order].tolist(), scores[order].tolist(), [0] * len(boxes))]
        found.append(precision_recall_f1([gt(1, objects, [0] * 20)], dets, 1, 0.5)["best"])
    assert all(best == found[0] for best in found) and 0 < found[0]["f1"] < 1


def test_the_figures_at_a_chosen_threshold_equal_to_the_fixed_one_reuse_its_resamples(
    monkeypatch,
) -> None:
    import pipeline.evaluation.matching as matching

    resampled = []
    original = matching.micro_intervals
    monkeypatch.setattr(
        matching, "micro_intervals", lambda *a, **k: resampled.append(1) or original(*a, **k)
    )
    counts = precision_recall_f1(HAND_GTS, HAND_DETS, 3, score_threshold=0.5, chosen_threshold=0.5)
    assert len(resampled) == 1
    chosen = counts["chosen_threshold"]
    assert chosen["f1_interval"] == counts["f1_interval"] and chosen["f1"] == counts["micro"]["f1"]
    elsewhere = precision_recall_f1(HAND_GTS, HAND_DETS, 3, 0.5, chosen_threshold=0.92)
    assert len(resampled) == 3 and elsewhere["chosen_threshold"]["tp"] < counts["micro"]["tp"]


def test_ground_truth_given_as_predictions_scores_ap_1_and_f1_1(
    scene: list[dict[str, Any]],
) -> None:
    names = ["a", "b", "c", "d"]
    ap = coco_ap(scene, perfect(scene), 4, names)
    # pycocotools divides by tp + fp + eps, so a perfect precision is 1 - 2e-16.
    assert ap["ap"] == pytest.approx(1.0, abs=1e-9)
    assert ap["ap50"] == pytest.approx(1.0, abs=1e-9)
    assert ap["ap75"] == pytest.approx(1.0, abs=1e-9)
    assert [row["ap"] for row in ap["per_class"][:3]] == pytest.approx([1.0] * 3, abs=1e-9)
    counts = precision_recall_f1(scene, perfect(scene), 4, score_threshold=0.3)
    assert counts["micro"]["f1"] == 1.0
    assert counts["macro"]["f1"] == 1.0
    assert counts["best"]["f1"] == 1.0


def test_no_predictions_gives_zero_everywhere_without_crashing(scene: list[dict[str, Any]]) -> None:
    empty = [det(g["image_id"], [], [], []) for g in scene]
    for dets in ([], empty):
        counts = precision_recall_f1(scene, dets, 4, score_threshold=0.3)
        assert counts["micro"] == {
            "precision": 0.0,
            "recall": 0.0,
            "f1": 0.0,
            "tp": 0,
            "fp": 0,
            "fn": 6,
        }
        assert counts["macro"]["f1"] == 0.0
        assert counts["best"] == {"threshold": 0.3, "precision": 0.0, "recall": 0.0, "f1": 0.0}
        ap = coco_ap(scene, dets, 4, ["a", "b", "c", "d"])
        assert (ap["ap"], ap["ap50"], ap["ap75"]) == (0.0, 0.0, 0.0)
        assert [row["ap"] for row in ap["per_class"]] == [0.0, 0.0, 0.0, None]


def test_no_ground_truth_at_all_gives_zero_and_per_class_ap_none() -> None:
    gts = [gt(1, [], []), gt(2, [], [])]
    dets = [det(1, [[0, 0, 10, 10]], [0.9], [0])]
    counts = precision_recall_f1(gts, dets, 2, score_threshold=0.3)
    assert counts["micro"]["f1"] == counts["micro"]["precision"] == counts["micro"]["recall"] == 0.0
    assert counts["micro"]["fp"] == 1
    assert counts["num_ground_truth"] == 0
    ap = coco_ap(gts, dets, 2, ["a", "b"])
    assert ap["ap"] == 0.0
    assert [row["ap"] for row in ap["per_class"]] == [None, None]


def test_per_class_ap_is_none_for_a_class_without_ground_truth(scene: list[dict[str, Any]]) -> None:
    dets = [*perfect(scene[:3]), det(4, [[0, 0, 64, 64], [30, 30, 40, 40]], [0.8, 0.7], [1, 3])]
    ap = coco_ap(scene, dets, 4, ["a", "b", "c", "d"])
    rows = ap["per_class"]
    assert rows[3]["ap"] is None and rows[3]["ap50"] is None
    assert rows[3]["name"] == "d" and rows[3]["num_gt"] == 0
    # A class with ground truth it never detects scores 0, not None: class 2 misses image 4.
    assert rows[2]["ap50"] == pytest.approx(np.mean(RECALL_THRESHOLDS <= 0.5), abs=1e-9)


def test_per_class_recall_is_none_without_objects_and_precision_and_f1_without_detections_too(
    scene: list[dict[str, Any]],
) -> None:
    """A class absent from the split has no recall to measure: None, never a 0.0 that reads
    as a model finding none of it. Class 3 has no objects but one false detection (precision
    and F1 0, measured), class 4 neither objects nor detections, class 2 objects it misses in
    image 4 (recall measured, below 1); the macro mean keeps its figures."""
    dets = [*perfect(scene[:3]), det(4, [[0, 0, 64, 64], [30, 30, 40, 40]], [0.8, 0.7], [1, 3])]
    counts = precision_recall_f1(scene, dets, 5, score_threshold=0.5)
    rows = counts["per_class"]
    assert (rows[3]["num_gt"], rows[3]["tp"], rows[3]["fp"], rows[3]["fn"]) == (0, 0, 1, 0)
    assert (rows[3]["precision"], rows[3]["recall"], rows[3]["f1"]) == (0.0, None, 0.0)
    assert (rows[4]["num_gt"], rows[4]["tp"], rows[4]["fp"], rows[4]["fn"]) == (0, 0, 0, 0)
    assert (rows[4]["precision"], rows[4]["recall"], rows[4]["f1"]) == (None, None, None)
    assert rows[2]["recall"] == 0.5 and rows[2]["precision"] == 1.0
    # classes 0 to 3 count in the macro mean, class 3's recall as 0 (sklearn's rule)
    assert counts["macro"]["num_classes"] == 4
    assert counts["macro"]["recall"] == pytest.approx((1 + 1 + 0.5 + 0) / 4)
    assert counts["macro"]["f1"] == pytest.approx((1 + 1 + 2 / 3 + 0) / 4)


def _iou(a: list[float], b: list[float]) -> float:
    width = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    height = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = width * height
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def reference_ap50(
    gts: list[dict[str, Any]], dets: list[dict[str, Any]], num_classes: int
) -> list[float | None]:
    """COCO-style AP@.5 per class, written out plainly: 101-point interpolated precision."""
    found = {d["image_id"]: d for d in dets}
    result: list[float | None] = []
    for c in range(num_classes):
        ranked: list[tuple[float, bool]] = []
        positives = 0
        for g in gts:
            truth = [
                box.tolist()
                for box, label in zip(g["boxes"], g["labels"], strict=True)
                if label == c
            ]
            positives += len(truth)
            d = found.get(g["image_id"])
            if d is None:
                continue
            mine = sorted(
                (
                    (float(score), box.tolist())
                    for box, score, label in zip(d["boxes"], d["scores"], d["labels"], strict=True)
                    if label == c
                ),
                key=lambda item: -item[0],
            )
            taken = [False] * len(truth)
            for score, box in mine:
                best, best_iou = None, 0.5
                for index, other in enumerate(truth):
                    overlap = _iou(box, other)
                    if not taken[index] and overlap >= best_iou:
                        best, best_iou = index, overlap
                if best is not None:
                    taken[best] = True
                ranked.append((score, best is not None))
        if positives == 0:
            result.append(None)
            continue
        ranked.sort(key=lambda item: -item[0])
        hits = np.cumsum([hit for _, hit in ranked])
        recall = hits / positives
        precision = hits / np.arange(1, len(ranked) + 1)
        points = [
            max((p for p, r in zip(precision, recall, strict=True) if r >= level), default=0.0)
            for level in RECALL_THRESHOLDS
        ]
        result.append(float(np.mean(points)))
    return result


def noisy_scene(images: int, seed: int = 7) -> tuple[list, list]:
    """Images of 1 to 4 objects of 3 classes, found with jitter (some under IoU 0.5), a few
    wrong classes and clutter."""
    rng = np.random.default_rng(seed)
    num_classes, gts, dets = 3, [], []
    for image_id in range(1, images + 1):
        count = int(rng.integers(1, 5))
        corners = rng.uniform(0, 80, size=(count, 2))
        sizes = rng.uniform(8, 40, size=(count, 2))
        boxes = np.concatenate([corners, corners + sizes], axis=1)
        labels = rng.integers(0, num_classes, size=count)
        gts.append(gt(image_id, boxes.tolist(), labels.tolist()))
        # Jittered copies (some fall under IoU 0.5), a few with the wrong class, plus clutter.
        noisy = boxes + rng.normal(0, 3.5, size=boxes.shape)
        noisy_labels = np.where(rng.random(count) < 0.2, (labels + 1) % num_classes, labels)
        clutter = np.concatenate(
            [rng.uniform(0, 80, (2, 2)), rng.uniform(0, 80, (2, 2)) + 90], axis=1
        )
        all_boxes = np.concatenate([noisy, clutter])
        all_labels = np.concatenate([noisy_labels, rng.integers(0, num_classes, 2)])
        dets.append(
            det(image_id, all_boxes.tolist(), rng.random(count + 2).tolist(), all_labels.tolist())
        )
    return gts, dets


def test_ap50_agrees_with_a_plain_101_point_interpolated_computation() -> None:
    num_classes = 3
    gts, dets = noisy_scene(5)
    expected = reference_ap50(gts, dets, num_classes)
    ap = coco_ap(gts, dets, num_classes, ["x", "y", "z"])
    assert [row["ap50"] for row in ap["per_class"]] == pytest.approx(expected, abs=1e-6)
    present = [value for value in expected if value is not None]
    assert ap["ap50"] == pytest.approx(np.mean(present), abs=1e-6)
    assert 0.0 < ap["ap50"] < 1.0  # a fixture where the interpolation actually matters


def test_ap_reweighed_with_every_image_once_is_pycocotools_own(monkeypatch) -> None:
    """The intervals' resamples reuse pycocotools' matches with image weights: all ones must
    give back pycocotools' AP@.5, AP@[.5:.95] and AP@.75 exactly, classes without objects left
    out as it does."""
    from pipeline.evaluation import coco

    gts, dets = noisy_scene(12, seed=3)
    ones = lambda images, resamples=3: iter([np.ones((3, images), dtype=np.int64)])  # noqa: E731
    monkeypatch.setattr(intervals, "bootstrap_weights", ones)
    monkeypatch.setattr(coco, "bootstrap_weights", ones)
    ap = coco_ap(gts, dets, 4, ["x", "y", "z", "none"], ap_intervals=True)
    assert 0.0 < ap["ap75"] < ap["ap"] < ap["ap50"] < 1.0  # every IoU threshold matters
    for name in ("ap", "ap50", "ap75"):
        assert ap[f"{name}_interval"]["low"] == pytest.approx(ap[name], abs=1e-12), name
        assert ap[f"{name}_interval"]["high"] == pytest.approx(ap[name], abs=1e-12), name
    rows = [*ap["per_class"], *(row for row in ap["size_buckets"].values())]
    assert sum(row["ap50"] is not None for row in rows) >= 5  # three classes, two buckets
    for row in rows:
        if row["ap50"] is None:  # the class "none", a bucket without objects
            assert row["ap50_interval"] is None
        else:
            assert row["ap50_interval"]["low"] == pytest.approx(row["ap50"], abs=1e-12)
            assert row["ap50_interval"]["high"] == pytest.approx(row["ap50"], abs=1e-12)
    for row, name in [(row, "ap") for row in rows] + [
        (row, "recall") for row in ap["size_buckets"].values()
    ]:  # and each class's and bucket's AP@[.5:.95], each bucket's recall
        if row[name] is None:
            assert row[f"{name}_interval"] is None
        else:
            assert row[f"{name}_interval"]["low"] == pytest.approx(row[name], abs=1e-12)
            assert row[f"{name}_interval"]["high"] == pytest.approx(row[name], abs=1e-12)


def assert_same_figures(got: Any, want: Any, where: str = "") -> None:
    """Every figure of two coco_ap results: floats to 1e-12, everything else equal."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            assert_same_figures(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same_figures(a, b, f"{where}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-12, rel=0), where
    else:
        assert got == want, where


def plain_pycocotools(gts: list, dets: list, classes: int) -> list[float]:
    """AP, AP@.5, AP@.75 and each class's AP@.5 as a user of COCO's API gets them: results
    through loadRes, COCOeval's default area ranges and detection limits, summarize."""
    import contextlib
    import io

    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    images = [{"id": g["image_id"], "height": 128, "width": 128} for g in gts]
    annotations = []
    for g in gts:
        for crowd, boxes, labels in (
            (0, g["boxes"], g["labels"]),
            (1, g.get("ignore_boxes", []), g.get("ignore_labels", [])),
        ):
            for (x1, y1, x2, y2), label in zip(boxes, labels, strict=True):
                annotations.append(
                    {
                        "id": len(annotations) + 1,
                        "image_id": g["image_id"],
                        "category_id": int(label) + 1,
                        "bbox": [float(x1), float(y1), float(x2 - x1), float(y2 - y1)],
                        "area": float(x2 - x1) * float(y2 - y1),
                        "iscrowd": crowd,
                    }
                )
    results = [
        {
            "image_id": d["image_id"],
            "category_id": int(label) + 1,
            "bbox": [float(x1), float(y1), float(x2) - float(x1), float(y2) - float(y1)],
            "score": float(score),
        }
        for d in dets
        for (x1, y1, x2, y2), score, label in zip(
            np.asarray(d["boxes"], dtype=np.float64), d["scores"], d["labels"], strict=True
        )
    ]
    with contextlib.redirect_stdout(io.StringIO()):
        truth = COCO()
        truth.dataset = {
            "images": images,
            "annotations": annotations,
            "categories": [{"id": c + 1, "name": str(c)} for c in range(classes)],
        }
        truth.createIndex()
        evaluation = COCOeval(truth, truth.loadRes(results), "bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    at_50 = evaluation.eval["precision"][0, :, :, 0, -1]  # [R, K], all areas, 100 detections
    per_class = [float(at_50[:, k].mean()) for k in range(classes)]
    return [*(float(v) for v in evaluation.stats[:3]), *per_class]


def test_ap_figures_are_those_of_cocos_own_api_on_the_same_results() -> None:
    """coco_ap matches the boxes as COCO.loadRes would have completed them, and leaves empty
    size buckets out: AP, AP@.5, AP@.75 and each class's AP@.5 are, bit for bit, what
    pycocotools gives a user loading the same results, crowd regions included."""
    gts, dets = noisy_scene(30, seed=9)
    for truth in gts[::4]:
        truth.update(with_ignore(truth, [[90, 90, 120, 120]], [1]))
    result = coco_ap(gts, dets, 3, ["x", "y", "z"])
    expected = plain_pycocotools(gts, dets, 3)
    got = [result["ap"], result["ap50"], result["ap75"], *(r["ap50"] for r in result["per_class"])]
    assert got == expected
    assert 0.0 < result["ap75"] < result["ap"] < result["ap50"] < 1.0


def test_a_size_bucket_without_objects_is_left_out_of_the_matching_with_the_same_figures(
    monkeypatch,
) -> None:
    """No object is large here: "all", "small" and "medium" alone are matched (a quarter
    less work), and every figure, interval and match is what matching the empty bucket too
    gives."""
    from pipeline.evaluation import coco

    gts, dets = noisy_scene(40, seed=12)  # objects of 8 to 40 px
    seen: list[int] = []
    matching = coco.match

    def watching(*args: Any) -> Any:
        seen.append(len(args[4]))  # the area ranges
        return matching(*args)

    monkeypatch.setattr(coco, "match", watching)
    names = ["x", "y", "z"]
    lean = coco_ap(gts, dets, 3, names, score_threshold=0.4, ap_intervals=True)
    every = coco._area_ranges
    monkeypatch.setattr(coco, "_area_ranges", lambda buckets=(): every())
    whole = coco_ap(gts, dets, 3, names, score_threshold=0.4, ap_intervals=True)
    assert seen == [3, 4]
    assert lean["size_buckets"]["large"]["num_gt"] == 0
    assert lean["size_buckets"]["medium"]["ap50_interval"] is not None
    assert_same_figures(lean, whole)


def test_coco_ap_with_its_intervals_and_matches_is_plain_json(monkeypatch) -> None:
    """Every value is JSON's own type (no numpy scalar such as COCOeval's category ids): the
    eval JSON is written in one pass, not encoded, refused and converted first."""
    gts, dets = noisy_scene(20, seed=6)
    result = coco_ap(gts, dets, 3, ["x", "y", "z"], 0.4, ap_intervals=True)
    assert [row["label"] for row in result["ap50_matches"]["classes"]] == [0, 1, 2]
    json.dumps(result, allow_nan=False)


def test_the_ap_intervals_hold_their_figures_and_narrow_with_more_images() -> None:
    widths = []
    for images in (20, 80):
        gts, dets = noisy_scene(images, seed=images)
        ap = coco_ap(gts, dets, 3, ["x", "y", "z"], ap_intervals=True)
        for name in ("ap", "ap50", "ap75"):
            interval = ap[f"{name}_interval"]
            assert interval["low"] < ap[name] < interval["high"], name
            assert interval["images"] == images and interval["confidence"] == 0.95
        widths.append(ap["ap50_interval"]["high"] - ap["ap50_interval"]["low"])
    assert widths[1] < 0.75 * widths[0]
    unasked = coco_ap(gts, dets, 3, ["x", "y", "z"])
    assert unasked["ap50_interval"] is unasked["ap_interval"] is unasked["ap75_interval"] is None
    assert all(row["ap50_interval"] is row["ap_interval"] is None for row in unasked["per_class"])
    for row in unasked["size_buckets"].values():
        assert row["ap50_interval"] is row["ap_interval"] is row["recall_interval"] is None


def test_a_bucket_whose_mean_turns_on_two_objects_gets_a_wide_interval() -> None:
    """Medium objects: 40 of class a, all found, and 2 of class b, both missed. COCO's mean over
    classes puts the bucket at 0.5, and resamples that draw neither b object put it at 1: the
    interval must say so, while class a's own interval stays tight at 1."""
    gts, dets = [], []
    for image_id in range(1, 41):
        boxes, labels = [square(10, 10, 30)], [0]
        if image_id <= 2:
            boxes.append(square(60, 60, 30))
            labels.append(1)
        gts.append(gt(image_id, boxes, labels))
        dets.append(det(image_id, [square(10, 10, 30)], [0.9], [0]))
    ap = coco_ap(gts, dets, 2, ["a", "b"], ap_intervals=True)
    medium = ap["size_buckets"]["medium"]
    assert medium["ap50"] == pytest.approx(0.5)
    assert medium["ap50_interval"]["low"] == pytest.approx(0.5)
    assert medium["ap50_interval"]["high"] == pytest.approx(1.0)
    assert medium["ap_interval"]["high"] == pytest.approx(1.0)  # exact boxes: AP@.5 = AP here
    # recall pools the objects: 40 of 42 found, and resamples move it only a little
    assert medium["recall"] == pytest.approx(40 / 42)
    assert 0.85 < medium["recall_interval"]["low"] < 40 / 42 < medium["recall_interval"]["high"]
    assert medium["recall_interval"]["high"] == pytest.approx(1.0)
    class_a, class_b = ap["per_class"]
    assert class_a["ap50_interval"]["low"] == class_a["ap50_interval"]["high"] == 1.0
    assert class_a["ap_interval"]["low"] == class_a["ap_interval"]["high"] == 1.0  # exact boxes
    assert class_b["ap50_interval"]["high"] == class_b["ap_interval"]["high"] == 0.0  # never found


# --- size buckets (input pixels) -----------------------------------------------------------


def square(x: float, y: float, side: float) -> list[float]:
    return [x, y, x + side, y + side]


def test_size_buckets_split_ground_truth_by_side_in_input_pixels_with_half_open_bounds() -> None:
    # sides 8 | 16 (the medium bucket's lower bound), 40 | 64 (the large one's), 100
    gts = [gt(1, [square(0, 0, 8), square(20, 0, 16), square(40, 0, 40)], [0, 0, 1])]
    gts.append(gt(2, [square(0, 0, 64), square(100, 100, 100)], [1, 0]))
    buckets = coco_ap(gts, perfect(gts), 2, ["a", "b"], 0.5)["size_buckets"]
    assert list(buckets) == list(SIZE_BUCKETS) == ["small", "medium", "large"]
    assert [row["range_px"] for row in buckets.values()] == [
        [0.0, 16.0],
        [16.0, 64.0],
        [64.0, None],
    ]
    assert [row["num_gt"] for row in buckets.values()] == [1, 2, 2]
    for row in buckets.values():
        assert row["ap50"] == pytest.approx(1.0, abs=1e-9)
        assert row["ap"] == pytest.approx(1.0, abs=1e-9)
        assert row["recall"] == 1.0


def test_bucket_recall_counts_detections_at_the_score_threshold_and_ap_counts_every_one() -> None:
    gts = [gt(1, [square(0, 0, 8), square(50, 50, 10), square(100, 0, 90)], [0, 0, 0])]
    dets = [det(1, gts[0]["boxes"].tolist(), [0.9, 0.2, 0.8], [0, 0, 0])]
    buckets = coco_ap(gts, dets, 1, ["a"], score_threshold=0.5)["size_buckets"]
    small, medium, large = buckets.values()
    assert small["recall"] == 0.5  # the second small object is found only at score 0.2
    assert small["ap50"] == pytest.approx(1.0, abs=1e-9)  # ranked TP, TP: AP counts it
    assert large["recall"] == 1.0 and large["num_gt"] == 1
    assert medium == {
        "range_px": [16.0, 64.0],
        "num_gt": 0,
        "ap50": None,
        "ap50_interval": None,
        "ap": None,
        "ap_interval": None,
        "recall": None,
        "recall_interval": None,
        "per_class": [{"label": 0, "name": "a", "num_gt": 0, "ap50": None}],
    }


def test_a_bucket_averages_its_classes_and_per_class_shows_a_rare_one_dragging_it() -> None:
    """Four medium objects of class a found, one medium object of class b (a large object cut
    at the border, say) missed: the bucket's AP@.5 is COCO's mean over the two classes."""
    gts = [gt(1, [square(20 * i, 0, 20) for i in range(4)] + [square(0, 100, 30)], [0] * 4 + [1])]
    dets = [det(1, gts[0]["boxes"][:4].tolist(), [0.9] * 4, [0] * 4)]
    medium = coco_ap(gts, dets, 2, ["a", "b"], 0.5)["size_buckets"]["medium"]
    assert medium["ap50"] == pytest.approx(0.5, abs=1e-9) and medium["recall"] == 0.8
    assert medium["per_class"] == [
        {"label": 0, "name": "a", "num_gt": 4, "ap50": pytest.approx(1.0, abs=1e-9)},
        {"label": 1, "name": "b", "num_gt": 1, "ap50": pytest.approx(0.0, abs=1e-9)},
    ]


def test_bucket_ap_ignores_detections_of_other_sizes_as_cocoeval_does() -> None:
    gts = [gt(1, [square(0, 0, 10), square(100, 100, 80)], [0, 0])]
    # a confident false positive of large size; a correct small detection scored lower
    dets = [det(1, [square(0, 0, 10), square(20, 100, 70)], [0.6, 0.95], [0, 0])]
    small, _, large = coco_ap(gts, dets, 1, ["a"], 0.5)["size_buckets"].values()
    assert small["ap50"] == pytest.approx(1.0, abs=1e-9)  # the large false positive is not small
    assert large["ap50"] == pytest.approx(0.0, abs=1e-9) and large["recall"] == 0.0


def test_size_buckets_without_detections_are_zero_and_without_ground_truth_none() -> None:
    gts = [gt(1, [square(0, 0, 8)], [0]), gt(2, [], [])]
    for dets in ([], [det(1, [], [], [])]):
        buckets = coco_ap(gts, dets, 1, ["a"], 0.4)["size_buckets"]
        assert buckets["small"] == {
            "range_px": [0.0, 16.0],
            "num_gt": 1,
            "ap50": 0.0,
            "ap50_interval": None,
            "ap": 0.0,
            "ap_interval": None,
            "recall": 0.0,
            "recall_interval": None,
            "per_class": [{"label": 0, "name": "a", "num_gt": 1, "ap50": 0.0}],
        }
        assert buckets["medium"]["ap50"] is None and buckets["large"]["recall"] is None


def test_bucket_recalls_add_up_to_the_micro_recall_of_separated_objects() -> None:
    """The buckets partition the objects; apart from each other, they match as in P/R/F1."""
    rng = np.random.default_rng(3)
    gts, dets = [], []
    for image_id in range(1, 9):
        sides = np.exp(rng.uniform(np.log(4), np.log(120), size=4))
        corners = [(0, 0), (130, 0), (0, 130), (130, 130)]  # one object per 130-px quadrant
        boxes = [square(x, y, side) for (x, y), side in zip(corners, sides, strict=True)]
        labels = rng.integers(0, 2, size=4)
        gts.append(gt(image_id, boxes, labels.tolist()))
        jitter = np.asarray(boxes) + rng.normal(0, 1.0, size=(4, 4)) * (sides[:, None] / 10)
        flipped = np.where(rng.random(4) < 0.15, 1 - labels, labels)
        dets.append(det(image_id, jitter.tolist(), rng.random(4).tolist(), flipped.tolist()))
    threshold = 0.4
    buckets = coco_ap(gts, dets, 2, ["a", "b"], threshold)["size_buckets"]
    counts = precision_recall_f1(gts, dets, 2, threshold)
    assert sum(row["num_gt"] for row in buckets.values()) == counts["num_ground_truth"] == 32
    found = sum(row["recall"] * row["num_gt"] for row in buckets.values() if row["num_gt"])
    assert found == pytest.approx(counts["micro"]["tp"])
    assert 0 < counts["micro"]["tp"] < 32  # thresholds, jitter and wrong classes all bite


def test_detections_for_an_unknown_image_or_out_of_range_labels_are_refused() -> None:
    gts = [gt(1, [[0, 0, 10, 10]], [0])]
    with pytest.raises(ValueError, match="without ground truth"):
        precision_recall_f1(gts, [det(2, [[0, 0, 1, 1]], [0.9], [0])], 1, 0.3)
    with pytest.raises(DataError, match="outside"):
        precision_recall_f1([gt(1, [[0, 0, 10, 10]], [1])], [], 1, 0.3)


def test_an_out_of_range_label_is_refused_naming_the_first_image_with_one_and_its_label() -> None:
    truth = [gt(1, [[0, 0, 10, 10]], [0]), gt(2, [[0, 0, 9, 9], [5, 5, 9, 9]], [0, 3])]
    truth.append(gt(3, [[0, 0, 4, 4]], [5]))
    with pytest.raises(DataError, match=r"Ground truth of image 2 has label 3, outside \[0, 2\)"):
        precision_recall_f1(truth, [], 2, 0.3)
    fine = [gt(image_id, [[0, 0, 10, 10]], [0]) for image_id in (1, 2, 3)]
    found = [
        det(1, [[0, 0, 10, 10]], [0.9], [1]),
        det(3, [[0, 0, 9, 9], [1, 1, 5, 5]], [0.9, 0.8], [0, -1]),
    ]
    with pytest.raises(ValueError, match=r"Detections of image 3 has label -1, outside \[0, 2\)"):
        precision_recall_f1(fine, found, 2, 0.3)


def test_image_level_f1_on_a_known_matrix() -> None:
    scores = np.array(
        [
            [0.9, 0.2, 0.6, 0.0],
            [0.4, 0.5, 0.1, 0.1],  # 0.5 sits on the threshold: predicted
            [0.8, 0.1, 0.3, 0.2],
        ]
    )
    present = np.array(
        [
            [True, False, False, False],
            [True, True, False, False],
            [True, False, False, False],
        ]
    )
    result = image_level_f1(scores, present, threshold=0.5)
    # Class 0: TP 2, FN 1 (F1 0.8). Class 1: TP 1 (F1 1). Class 2: FP 1 (F1 0). Class 3: unused.
    assert (result["micro"]["tp"], result["micro"]["fp"], result["micro"]["fn"]) == (3, 1, 1)
    assert result["f1"] == pytest.approx(0.75)
    assert result["precision"] == pytest.approx(0.75)
    assert result["recall"] == pytest.approx(0.75)
    assert result["macro"]["num_classes"] == 3
    assert result["f1_macro"] == pytest.approx(0.6)
    assert result["macro"]["precision"] == pytest.approx(2 / 3)
    assert result["macro"]["recall"] == pytest.approx(5 / 9)


# --- Ignore regions (COCO crowd, VOC difficult) ------------------------------------------------


def with_ignore(
    record: dict[str, Any], boxes: list[list[float]], labels: list[int]
) -> dict[str, Any]:
    return {
        **record,
        "ignore_boxes": np.asarray(boxes, dtype=np.float32).reshape(-1, 4),
        "ignore_labels": np.asarray(labels, dtype=np.int64),
    }


# One object A (class 0) and a class-0 ignore region R. Detections, by score:
#   0.9 class 0 on A           -> TP
#   0.8 class 0 inside R       -> ignored: neither TP nor FP
#   0.7 class 1 inside R       -> FP: R ignores class 0 only
#   0.6 class 0 elsewhere      -> FP
CROWD_GT = with_ignore(gt(1, [[0, 0, 10, 10]], [0]), [[20, 20, 40, 40]], [0])
CROWD_DET = det(
    1,
    [[0, 0, 10, 10], [22, 22, 30, 30], [22, 22, 30, 30], [50, 50, 60, 60]],
    [0.9, 0.8, 0.7, 0.6],
    [0, 0, 1, 0],
)


def test_a_detection_on_an_ignore_region_of_its_class_counts_neither_as_true_nor_false() -> None:
    result = precision_recall_f1([CROWD_GT], [CROWD_DET], num_classes=2, score_threshold=0.5)
    assert (result["micro"]["tp"], result["micro"]["fp"], result["micro"]["fn"]) == (1, 2, 0)
    assert (result["num_detections"], result["num_ignored_detections"]) == (3, 1)
    assert result["num_ground_truth"] == 1  # the region is no object to find
    plain = precision_recall_f1([gt(1, [[0, 0, 10, 10]], [0])], [CROWD_DET], 2, 0.5)
    assert plain["micro"]["fp"] == 3 and plain["num_ignored_detections"] == 0


def test_ignore_regions_take_the_share_of_the_detections_own_area_they_cover() -> None:
    region = [[0, 0, 10, 10]]
    boxes = [
        [2, 2, 8, 8],  # inside (IoU 0.36): covered entirely -> ignored
        [0, 0, 30, 30],  # around it: covers 100 of its 900 px -> counted
        [5, 0, 15, 10],  # half inside: 0.5, at the threshold -> ignored
        [2, 2, 8, 8],  # inside, but it matched an object -> stays a true positive
    ]
    is_tp = np.array([False, False, False, True])
    flags = ignored_detections(boxes, [0, 0, 0, 0], is_tp, region, [0], threshold=0.5)
    assert flags.tolist() == [True, False, True, False]
    assert ignored_detections(boxes, [1, 1, 1, 1], is_tp, region, [0]).tolist() == [False] * 4
    assert ignored_detections(boxes, [0] * 4, is_tp, np.zeros((0, 4)), []).tolist() == [False] * 4


def test_a_region_absorbs_any_number_of_detections_but_never_an_object_match() -> None:
    truth = with_ignore(gt(1, [[20, 20, 30, 30]], [0]), [[0, 0, 40, 40]], [0])
    # the object lies inside the region: the best detection still matches it, the rest vanish
    found = det(1, [[20, 20, 30, 30], [21, 20, 30, 30], [0, 0, 10, 10]], [0.9, 0.8, 0.7], [0, 0, 0])
    result = precision_recall_f1([truth], [found], num_classes=1, score_threshold=0.5)
    assert (result["micro"]["tp"], result["micro"]["fp"], result["num_ignored_detections"]) == (
        1,
        0,
        2,
    )


def test_coco_ap_passes_ignore_regions_as_crowds_that_no_detection_counts_against() -> None:
    # a confident detection on the region, then the object: without the region AP@.5 is 0.5
    truth = with_ignore(gt(1, [[0, 0, 10, 10]], [0]), [[20, 20, 40, 40]], [0])
    found = det(1, [[22, 22, 38, 38], [0, 0, 10, 10]], [0.95, 0.9], [0, 0])
    plain = coco_ap([gt(1, [[0, 0, 10, 10]], [0])], [found], 1, ["thing"])
    assert plain["ap50"] == pytest.approx(0.5, abs=0.01)
    result = coco_ap([truth], [found], 1, ["thing"])
    assert result["ap50"] == pytest.approx(1.0)
    assert result["per_class"][0]["num_gt"] == 1
    counts = precision_recall_f1([truth], [found], 1, score_threshold=0.5)
    assert counts["best"]["f1"] == 1.0  # the matcher agrees with pycocotools


def test_ignore_regions_without_objects_give_zero_ap_not_a_crash() -> None:
    truth = with_ignore(gt(1, [], []), [[0, 0, 20, 20]], [0])
    result = coco_ap([truth], [det(1, [[0, 0, 20, 20]], [0.9], [0])], 1, ["thing"])
    assert result["ap50"] == 0.0 and result["per_class"][0]["ap"] is None


# --- The Evaluator loop --------------------------------------------------------------------

SIZE = 32
TRUTH = {  # image_id: (boxes, labels)
    10: ([[2, 2, 12, 12]], [0]),
    11: ([[4, 4, 20, 20]], [1]),
    12: ([[0, 10, 8, 30]], [0]),
    13: ([[16, 16, 30, 30]], [1]),
}
PREDICTIONS = {  # image_id: (boxes, scores, labels)
    10: ([[2, 2, 12, 12]], [0.9], [0]),
    11: ([[4, 4, 20, 20]], [0.8], [1]),
    12: ([[0, 10, 8, 30], [20, 0, 30, 8]], [0.7, 0.1], [0, 1]),  # 0.1: below the threshold
    13: ([[16, 16, 30, 30]], [0.6], [0]),  # right place, wrong class
}
IMAGE_SCORES = {10: [0.9, 0.1], 11: [0.2, 0.8], 12: [0.7, 0.6], 13: [0.4, 0.3]}


class SharedLog(list):
    """What a model's forward saw, shared with its deep copies (the evaluator runs a copy, its
    inference form)."""

    def __deepcopy__(self, memo: dict) -> SharedLog:
        return self


class FakeDetector(torch.nn.Module):
    """Each image is filled with its id; decode looks the fixed predictions up by that id."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.seen: list[dict[str, bool]] = SharedLog()
        self.eval()  # as `for_inference` hands a model to the evaluator

    def forward(self, images: torch.Tensor, flip_test: bool = False) -> torch.Tensor:
        self.seen.append(
            {
                "training": self.training,
                "inference_mode": torch.is_inference_mode_enabled(),
                "autocast": torch.is_autocast_enabled("cpu"),
            }
        )
        return images[:, 0, 0, 0] * self.weight

    def decode(
        self, outputs: torch.Tensor, max_detections: int, min_score: float
    ) -> list[dict[str, torch.Tensor]]:
        """As CenterNet.decode: each image's detections scoring at least `min_score`."""
        assert max_detections == 100
        decoded = []
        for image_id in outputs.round().long().tolist():
            boxes, scores, labels = PREDICTIONS[image_id]
            keep = torch.tensor(scores) >= min_score
            decoded.append(
                {
                    "boxes": torch.tensor(boxes, dtype=torch.float32)[keep],
                    "scores": torch.tensor(scores, dtype=torch.float16)[keep],  # as under autocast
                    "labels": torch.tensor(labels)[keep],
                }
            )
        return decoded

    def image_scores(self, outputs: torch.Tensor) -> torch.Tensor:
        return torch.tensor([IMAGE_SCORES[i] for i in outputs.round().long().tolist()])


def collate(
    batch: list[tuple[torch.Tensor, dict[str, Any]]],
) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    images, targets = zip(*batch, strict=True)
    return torch.stack(images), list(targets)


@pytest.fixture
def loader() -> DataLoader:
    samples = [
        (
            torch.full((3, SIZE, SIZE), float(image_id)),
            {
                "boxes": torch.tensor(boxes, dtype=torch.float32),
                "labels": torch.tensor(labels),
                "image_id": image_id,
            },
        )
        for image_id, (boxes, labels) in TRUTH.items()
    ]
    return DataLoader(samples, batch_size=2, collate_fn=collate)


def test_evaluator_reports_metrics_timing_and_each_images_detections(loader: DataLoader) -> None:
    model = FakeDetector()
    evaluator = Evaluator(["circle", "square"], label_mode="multilabel")
    metrics, detections = evaluator.evaluate(model, loader, "cpu")

    # At score >= 0.3: three exact hits, one wrong-class detection (FP) and its missed object.
    assert (metrics["micro"]["tp"], metrics["micro"]["fp"], metrics["micro"]["fn"]) == (3, 1, 1)
    assert metrics["f1"] == metrics["precision"] == metrics["recall"] == pytest.approx(0.75)
    assert metrics["f1_macro"] == pytest.approx((0.8 + 2 / 3) / 2)
    # Sweep: TP 0.9, TP 0.8, TP 0.7, FP 0.6, FP 0.1 over 4 objects -> best 6/7 at 0.7.
    assert metrics["best_f1"] == pytest.approx(6 / 7)
    assert metrics["best_f1_threshold"] == pytest.approx(0.7, abs=1e-3)
    # Class 0 ranks TP, TP, FP: AP 1. Class 1 reaches recall 0.5 at precision 1. Boxes are
    # exact, so AP@[.5:.95] = AP@.5 = AP@.75.
    class1_ap = np.mean(RECALL_THRESHOLDS <= 0.5)
    for key in ("ap", "ap50", "ap75"):
        assert metrics[key] == pytest.approx((1.0 + class1_ap) / 2, abs=1e-6)
    circle, square = metrics["per_class"]
    assert circle["name"] == "circle" and circle["num_gt"] == 2
    assert circle["ap"] == pytest.approx(1.0, abs=1e-9)
    assert circle["precision"] == pytest.approx(2 / 3) and circle["recall"] == 1.0
    assert square["ap50"] == pytest.approx(class1_ap, abs=1e-6)
    assert square["f1"] == pytest.approx(2 / 3)
    assert metrics["image_level"]["f1"] == pytest.approx(0.75)
    assert (metrics["num_images"], metrics["num_ground_truth"], metrics["num_detections"]) == (
        4,
        4,
        5,
    )
    assert (metrics["score_threshold"], metrics["iou_threshold"]) == (0.3, 0.5)
    # Sides 10, 8x20 and 14 are small (the last one wrongly classed), 16 x 16 is medium.
    small, medium, large = metrics["size_buckets"].values()
    assert (small["num_gt"], medium["num_gt"], large["num_gt"]) == (3, 1, 0)
    assert small["recall"] == pytest.approx(2 / 3) and medium["recall"] == 1.0
    assert large["ap50"] is None

    assert set(metrics["timing"]) == set(TIMING_KEYS)
    assert metrics["timing"]["model_s"] > 0 and metrics["timing"]["images_per_s"] > 0
    assert metrics["timing"]["ms_per_image"] == pytest.approx(
        1000 * metrics["timing"]["model_s"] / 4
    )

    assert [d["image_id"] for d in detections] == [10, 11, 12, 13]
    third = detections[2]
    assert third["boxes"].dtype == np.float32 and third["boxes"].shape == (2, 4)
    assert third["boxes"].tolist() == [[0.0, 10.0, 8.0, 30.0], [20.0, 0.0, 30.0, 8.0]]
    assert third["labels"].tolist() == [0, 1] and third["scores"].shape == (2,)
    json.dumps({"metrics": metrics})

    # Two batches, each run under inference_mode, the model as given (in eval mode).
    assert model.seen == [{"training": False, "inference_mode": True, "autocast": False}] * 2


def test_evaluator_times_the_loaders_batches_and_the_metrics_apart_from_the_model(
    loader: DataLoader, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a pass spends beside the forward pass, divided: waiting for each batch (and for
    the loader's end) is `loader_s`, computing the metrics `metrics_s`."""
    pause = 0.05

    def slow_batches() -> Iterator[Any]:
        for batch in loader:
            time.sleep(pause)
            yield batch
        time.sleep(pause)  # the loader's end takes a while too (its workers stop)

    counting = evaluator_module.precision_recall_f1

    def slow_metrics(*args: Any, **kwargs: Any) -> dict[str, Any]:
        time.sleep(pause)
        return counting(*args, **kwargs)

    monkeypatch.setattr(evaluator_module, "precision_recall_f1", slow_metrics)
    metrics, _ = Evaluator(["circle", "square"], label_mode="single").evaluate(
        FakeDetector(), slow_batches(), "cpu"
    )
    timing = metrics["timing"]
    assert timing["loader_s"] >= 3 * pause  # two batches and the end
    assert pause <= timing["metrics_s"]
    assert timing["model_s"] < 2 * pause  # none of the waits


def test_evaluator_refuses_a_model_in_training_mode(loader: DataLoader) -> None:
    """BatchNorm in training mode would normalise each batch by its own statistics: the
    evaluator runs the model as given, so it must be the inference form (`for_inference`)."""
    model = FakeDetector().train()
    with pytest.raises(ValueError, match="training mode: pass its inference form"):
        Evaluator(["circle", "square"], label_mode="single").evaluate(model, loader, "cpu")
    assert model.seen == []


def test_evaluator_single_label_mode_skips_image_level_metrics(loader: DataLoader) -> None:
    class NoImageScores(FakeDetector):
        def image_scores(self, outputs: torch.Tensor) -> torch.Tensor:
            raise AssertionError("single-label evaluation must not ask for image scores")

    evaluator = Evaluator(["circle", "square"], label_mode="single")
    metrics, _ = evaluator.evaluate(NoImageScores(), loader, "cpu")
    assert metrics["image_level"] is None
    assert metrics["f1"] == pytest.approx(0.75)


def test_evaluator_autocasts_the_forward_when_precision_is_not_fp32(loader: DataLoader) -> None:
    model = FakeDetector()
    evaluator = Evaluator(["circle", "square"], label_mode="multilabel")
    metrics, _ = evaluator.evaluate(model, loader, "cpu", precision="bf16")
    assert [seen["autocast"] for seen in model.seen] == [True, True]
    assert metrics["f1"] == pytest.approx(0.75)


def test_evaluator_synchronizes_the_device_around_each_timed_forward(
    loader: DataLoader, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    monkeypatch.setattr(
        evaluator_module, "synchronize", lambda device: events.append(f"sync {device}")
    )

    class Recording(FakeDetector):
        def forward(self, images: torch.Tensor, flip_test: bool = False) -> torch.Tensor:
            events.append("forward")
            return super().forward(images, flip_test)

    evaluator = Evaluator(["circle", "square"], label_mode="single")
    evaluator.evaluate(Recording(), loader, "cpu")
    assert events == ["sync cpu", "forward", "sync cpu"] * 2


def test_each_images_detections_are_clipped_to_its_own_region_and_not_to_anothers() -> None:
    """A letterboxed image's detections reaching into the padding are clipped to the image's
    region; in the same batch, an image without a region keeps its boxes as decoded."""
    regions = {10: None, 11: [5.0, 5.0, 32.0, 32.0], 12: [0.0, 0.0, 25.0, 25.0], 13: None}
    samples = []
    for image_id, (boxes, labels) in TRUTH.items():
        target = {"boxes": torch.tensor(boxes, dtype=torch.float32), "labels": torch.tensor(labels)}
        if regions[image_id] is not None:
            target["region"] = torch.tensor(regions[image_id])
        samples.append(
            (torch.full((3, SIZE, SIZE), float(image_id)), target | {"image_id": image_id})
        )
    loader = DataLoader(samples, batch_size=4, collate_fn=collate)
    _, found = Evaluator(["circle", "square"], label_mode="single").evaluate(
        FakeDetector(), loader, "cpu"
    )
    assert [d["boxes"].tolist() for d in found] == [
        [[2.0, 2.0, 12.0, 12.0]],
        [[5.0, 5.0, 20.0, 20.0]],
        [[0.0, 10.0, 8.0, 25.0], [20.0, 0.0, 25.0, 8.0]],
        [[16.0, 16.0, 30.0, 30.0]],
    ]
    assert all(d["boxes"].dtype == np.float32 for d in found)


def test_the_score_floor_drops_detections_below_it_from_every_figure_and_the_detections(
    loader: DataLoader,
) -> None:
    """eval.min_score: what scores below it is gone as decoded, so neither P/R/F1, AP, the
    best-F1 sweep nor the detections handed back (the predictions file) see it."""
    kept_all = Evaluator(["circle", "square"], label_mode="single")
    floored = Evaluator(["circle", "square"], label_mode="single", min_score=0.65)
    every, every_found = kept_all.evaluate(FakeDetector(), loader, "cpu")
    metrics, found = floored.evaluate(FakeDetector(), loader, "cpu")
    # 0.1 (an FP of class 1) and 0.6 (the wrong-class FP) fall below 0.65
    assert (every["num_detections"], metrics["num_detections"]) == (5, 3)
    assert [d["scores"].size for d in every_found] == [1, 1, 2, 1]
    assert [d["scores"].size for d in found] == [1, 1, 1, 0]
    assert all((d["scores"] >= 0.65).all() for d in found)
    assert found[2]["boxes"].tolist() == [[0.0, 10.0, 8.0, 30.0]] and found[3]["boxes"].shape == (
        0,
        4,
    )
    # the wrong-class FP at 0.6 counted at threshold 0.3 before; now it is gone
    assert (every["micro"]["fp"], metrics["micro"]["fp"]) == (1, 0)
    assert metrics["best_f1_threshold"] >= 0.65
    # class 1 ranked its 0.1 FP last: below the floor it moved no AP
    assert metrics["ap50"] == pytest.approx(every["ap50"])
    assert (every["min_score"], metrics["min_score"]) == (0.0, 0.65)


def test_an_evaluation_passs_metrics_run_without_the_cyclic_collector_and_turn_it_back_on(
    loader: DataLoader, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every detection makes objects (pycocotools' dicts, the matches), none in a cycle: a
    full collection would walk them all and everything else the process holds, again and
    again. The loop over the loader keeps it (its workers run as long as the loader does)."""
    seen: dict[str, list[bool]] = {"decode": [], "metrics": []}

    class Watching(FakeDetector):
        def decode(
            self, outputs: torch.Tensor, max_detections: int, min_score: float
        ) -> list[dict[str, Any]]:
            seen["decode"].append(gc.isenabled())
            return super().decode(outputs, max_detections, min_score)

    counting = evaluator_module.precision_recall_f1

    def watching(*args: Any, **kwargs: Any) -> dict[str, Any]:
        seen["metrics"].append(gc.isenabled())
        return counting(*args, **kwargs)

    monkeypatch.setattr(evaluator_module, "precision_recall_f1", watching)
    assert gc.isenabled()
    Evaluator(["circle", "square"], label_mode="single").evaluate(Watching(), loader, "cpu")
    assert seen == {"decode": [True, True], "metrics": [False]}
    assert gc.isenabled()


@pytest.mark.parametrize("floor", [-0.1, 1.0, 1.5])
def test_evaluator_refuses_a_score_floor_outside_0_to_1(floor: float) -> None:
    with pytest.raises(ConfigError, match=r"eval\.min_score"):
        Evaluator(["a"], label_mode="single", min_score=floor)


def test_evaluator_refuses_an_unknown_label_mode() -> None:
    with pytest.raises(ConfigError, match="label_mode"):
        Evaluator(["a"], label_mode="multi")


def test_evaluator_reports_p_r_f1_at_a_threshold_chosen_elsewhere(loader: DataLoader) -> None:
    evaluator = Evaluator(["circle", "square"], label_mode="single")
    metrics, _ = evaluator.evaluate(FakeDetector(), loader, "cpu", chosen_threshold=0.65)
    # at 0.65 the three exact hits stay, the wrong-class 0.6 goes: P 1, R 3/4
    chosen = dict(metrics["chosen_threshold"])
    interval = chosen.pop("f1_interval")
    assert chosen == {
        "threshold": 0.65,
        "precision": 1.0,
        "recall": 0.75,
        "f1": pytest.approx(6 / 7),
        "tp": 3,
        "fp": 0,
        "fn": 1,
    }
    assert interval["low"] <= 6 / 7 <= interval["high"] and interval["images"] == 4
    assert metrics["f1"] == pytest.approx(0.75)  # the fixed threshold's figures are unchanged
    plain, _ = evaluator.evaluate(FakeDetector(), loader, "cpu")
    assert plain["chosen_threshold"] is None


def test_evaluator_takes_ignore_regions_from_the_targets(loader: DataLoader) -> None:
    samples = list(loader.dataset)
    image, target = samples[3]  # image 13: a class-0 detection on a class-1 object
    samples[3] = (
        image,
        {
            **target,
            "ignore_boxes": torch.tensor([[16.0, 16.0, 30.0, 30.0]]),
            "ignore_labels": torch.tensor([0]),
        },
    )
    evaluator = Evaluator(["circle", "square"], label_mode="single")
    metrics, _ = evaluator.evaluate(
        FakeDetector(), DataLoader(samples, batch_size=2, collate_fn=collate), "cpu"
    )
    assert (metrics["micro"]["tp"], metrics["micro"]["fp"], metrics["micro"]["fn"]) == (3, 0, 1)
    assert metrics["num_ignored_detections"] == 1
    assert metrics["per_class"][0]["ap"] == pytest.approx(1.0)


def test_the_kept_matches_give_back_pycocotools_ap50_and_pair_a_run_with_itself() -> None:
    """`ap50_matches` is what the report pairs two runs' AP@.5 by: read back, it must give
    pycocotools' AP@.5 with every image drawn once, and a run against itself changes by 0."""
    gts, dets = noisy_scene(30, seed=5)
    ap = coco_ap(gts, dets, 3, ["x", "y", "z"], ap_intervals=True)
    image_ids, labels, classes = paired_ap.read_ap50_matches(ap["ap50_matches"])
    assert sorted(image_ids) == sorted(g["image_id"] for g in gts) and labels == [0, 1, 2]
    ones = np.ones((1, len(image_ids)))
    assert weighted_ap.class_mean(weighted_ap.weighted_class_ap(classes, ones))[0] == pytest.approx(
        ap["ap50"], abs=1e-12
    )
    shuffled = {**ap["ap50_matches"], "classes": ap["ap50_matches"]["classes"][::-1]}
    same = paired_ap.ap50_change(ap["ap50_matches"], shuffled, tolerance=0.01)
    assert (same.change, same.low, same.high, same.verdict) == (0.0, 0.0, 0.0, "held")
    relabelled = {
        **ap["ap50_matches"],
        "classes": [{**row, "label": row["label"] + 1} for row in ap["ap50_matches"]["classes"]],
    }
    with pytest.raises(ValueError, match="different classes"):
        paired_ap.ap50_change(ap["ap50_matches"], relabelled, tolerance=0.01)
    assert coco_ap(gts, dets, 3, ["x", "y", "z"])["ap50_matches"] is None


def test_a_paired_ap50_change_does_not_depend_on_the_order_each_file_lists_its_images() -> None:
    gts, dets = noisy_scene(30, seed=5)
    _, worse = noisy_scene(30, seed=6)  # another scene's detections: mostly wrong here
    matches = [
        coco_ap(gts, found, 3, ["x", "y", "z"], ap_intervals=True)["ap50_matches"]
        for found in (dets, worse)
    ]
    ids = matches[1]["image_ids"]
    moved = list(range(len(ids)))[::-1]  # position i is listed at moved[i]
    reversed_file = {
        "image_ids": ids[::-1],
        "classes": [
            {
                **row,
                "detections": [moved[i] for i in row["detections"]],
                "objects": [moved[i] for i in row["objects"]],
            }
            for row in matches[1]["classes"]
        ],
    }
    as_written = paired_ap.ap50_change(matches[0], matches[1], tolerance=0.01)
    assert paired_ap.ap50_change(matches[0], reversed_file, tolerance=0.01) == as_written
    assert as_written.change != 0.0


def greedy_every_detection(boxes, scores, labels, truth, truth_labels, threshold=0.5):
    """The matching rule written out: every detection in descending score (stable) takes the
    free object of its class with the highest IoU, if that IoU reaches the threshold."""
    import torchvision

    matched = np.full(len(scores), -1)
    if len(scores) == 0 or len(truth_labels) == 0:
        return matched
    iou = torchvision.ops.box_iou(torch.as_tensor(boxes), torch.as_tensor(truth)).numpy()
    iou[labels[:, None] != truth_labels[None, :]] = -1.0
    free = np.ones(len(truth_labels), dtype=bool)
    for index in np.argsort(-scores, kind="stable"):
        candidates = np.where(free, iou[index], -1.0)
        best = int(np.argmax(candidates))
        if candidates[best] >= threshold:
            free[best], matched[index] = False, best
    return matched


def test_matching_gives_the_greedy_rules_matches_on_crowded_images_of_mostly_misses() -> None:
    """A detector's top 100: a few near its objects (ties, duplicates, other classes) and many
    far off; every detection's match is the plain greedy loop's."""
    gts, dets = noisy_scene(60, seed=21)
    rng = np.random.default_rng(2)
    matches = 0
    for truth, found in zip(gts, dets, strict=True):
        far = np.concatenate([rng.uniform(0, 100, (60, 2)), rng.uniform(0, 100, (60, 2)) + 5], 1)
        boxes = np.concatenate([found["boxes"], truth["boxes"] + 0.5, far]).astype(np.float32)
        scores = np.round(rng.random(len(boxes)), 1).astype(np.float32)  # many ties
        labels = rng.integers(0, 3, len(boxes))
        for threshold in (0.5, 0.75):
            expected = greedy_every_detection(
                boxes, scores, labels, truth["boxes"], truth["labels"], threshold
            )
            found_matches = matched_objects(
                boxes, scores, labels, truth["boxes"], truth["labels"], threshold
            )
            assert found_matches.tolist() == expected.tolist()
            matches += int((expected >= 0).sum())
    assert matches > 60  # a fixture where matches happen, among many more misses


def test_matching_every_image_at_once_gives_each_images_own_greedy_matches() -> None:
    """pool matches all images in one pass: each detection's fate is still decided among its
    own image's objects, by the greedy rule, with images without detections or objects."""
    gts, dets = noisy_scene(80, seed=5)
    rng = np.random.default_rng(4)
    for found in dets:
        near = np.asarray(found["boxes"]) + rng.normal(0, 2, (len(found["boxes"]), 4))
        found["boxes"] = np.concatenate([found["boxes"], near]).astype(np.float32)
        found["scores"] = np.round(rng.random(len(found["boxes"])), 1)  # ties across copies
        found["labels"] = np.concatenate([found["labels"], found["labels"]])
    gts[3] = gt(gts[3]["image_id"], [], [])  # no objects: all its detections miss
    dets = [found for index, found in enumerate(dets) if index % 9 != 0]  # some found nothing
    pooled = pool(gts, dets, 3, 0.5)
    by_id = {found["image_id"]: found for found in dets}
    expected = [
        greedy_every_detection(
            np.asarray(by_id[truth["image_id"]]["boxes"], dtype=np.float64),
            np.asarray(by_id[truth["image_id"]]["scores"]),
            np.asarray(by_id[truth["image_id"]]["labels"]),
            np.asarray(truth["boxes"], dtype=np.float64).reshape(-1, 4),
            np.asarray(truth["labels"], dtype=np.int64),
        )
        >= 0
        for truth in gts
        if truth["image_id"] in by_id
    ]
    assert pooled.is_tp.tolist() == np.concatenate(expected).tolist()
    assert 40 < pooled.is_tp.sum() < pooled.is_tp.size / 2  # duplicates lose: both kinds occur


def test_ap_figures_are_cocoeval_summarize_at_its_default_parameters() -> None:
    """Matched and accumulated at 100 detections alone, AP, AP@.5 and AP@.75 are bit for bit
    what pycocotools' summarize gives with its default maxDets (1, 10, 100)."""
    gts, dets = noisy_scene(30, seed=4)
    for found in dets:  # more than 10 detections of an image: maxDets matters to AR, not AP
        found["boxes"] = np.concatenate([found["boxes"]] * 4).astype(np.float32)
        found["scores"] = np.concatenate([found["scores"] * f for f in (1, 0.9, 0.8, 0.7)])
        found["labels"] = np.concatenate([found["labels"]] * 4)
    result = coco_ap(gts, dets, 3, ["x", "y", "z"])
    assert [result["ap"], result["ap50"], result["ap75"]] == plain_pycocotools(gts, dets, 3)[:3]
    assert 0.0 < result["ap75"] < result["ap"] < result["ap50"] < 1.0


def test_pr_f1_refuses_the_first_image_whose_fields_disagree_in_length() -> None:
    """The images' fields are converted all at once; a disagreement is still refused with the
    one image's own words."""
    box = [[0.0, 0.0, 10.0, 10.0]]
    gts = [
        {"image_id": 1, "boxes": box, "labels": [0]},
        {"image_id": 2, "boxes": box * 2, "labels": [0, 1]},
    ]
    good = {"image_id": 1, "boxes": box, "scores": [0.9], "labels": [0]}
    bad = {"image_id": 2, "boxes": box * 2, "scores": [0.9, 0.8, 0.7], "labels": [0, 1]}
    with pytest.raises(ValueError, match=r"^Detections disagree in length: 2 boxes, 3 scores, 2 "):
        precision_recall_f1(gts, [good, bad], 2, 0.5)
    gts[1]["labels"] = [0]
    with pytest.raises(ValueError, match=r"^Ground truth disagrees in length: 2 boxes, 1 labels"):
        precision_recall_f1(gts, [good], 2, 0.5)
    assert precision_recall_f1(gts[:1], [good], 2, 0.5)["micro"]["tp"] == 1


@pytest.fixture
def torch_threads() -> Iterator[Any]:
    """torch's thread count set by the test (the CPUs an evaluation believes it has), then put
    back."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_metrics_with_p_r_f1_beside_coco_ap_are_those_computed_one_after_the_other(
    torch_threads: Any,
) -> None:
    """With two CPUs and a score threshold given, P/R/F1 runs on a thread beside COCO AP's
    matching and intervals: every figure, interval and count is the one computed in turn."""
    gts, dets = noisy_scene(40, seed=5)
    evaluator = Evaluator(["x", "y", "z"], label_mode="single", score_threshold=0.4)
    found = {}
    for threads in (1, 2):
        torch_threads(threads)
        found[threads] = evaluator._metrics(gts, dets, [], chosen_threshold=0.6, ap_intervals=True)
    assert found[2] == found[1]
    assert found[1]["ap50_interval"] is not None and found[1]["chosen_threshold"] is not None


def test_a_record_both_p_r_f1_and_coco_ap_refuse_is_refused_by_p_r_f1_on_any_threads(
    torch_threads: Any,
) -> None:
    """Detections whose scores disagree with their boxes: P/R/F1's words whether it ran first
    or beside COCO AP (which refuses them in words of its own)."""
    gts, dets = noisy_scene(6, seed=2)
    dets[3] = {**dets[3], "scores": dets[3]["scores"][:-1]}
    evaluator = Evaluator(["x", "y", "z"], label_mode="single", score_threshold=0.4)
    for threads in (1, 2):
        torch_threads(threads)
        with pytest.raises(ValueError, match=r"^Detections disagree in length"):
            evaluator._metrics(gts, dets, [], ap_intervals=True)
