"""The array matcher and accumulator against pycocotools itself: the same matches, the same
ignored detections and the same precision array, bit for bit, on random workloads with every
rule's corner (crowd regions, score and IoU ties, more than 100 detections of an image and
class, images without objects or detections, classes without objects, empty and degenerate
boxes, every size bucket)."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import numpy as np
import pytest

from pipeline.evaluation.coco_matching import (
    IOU_THRESHOLDS,
    MAX_DETECTIONS,
    Boxes,
    _descending_within,
    accumulate,
    match,
)
from pipeline.evaluation.weighted_ap import RECALL_THRESHOLDS

AREA_RANGES = [[0.0, 1e10], [0.0, float(np.nextafter(16.0**2, 0))], [256.0, 4095.9], [4096.0, 1e10]]


def workload(seed: int, images: int = 30, classes: int = 4) -> dict[str, Any]:
    """Random ground truth and detections with every corner the rules have. The last class
    has no objects (its detections are all false positives)."""
    rng = np.random.default_rng(seed)
    gt_rows, dt_rows = [], []
    for image in range(images):
        count = int(rng.integers(0, 8)) if image % 7 else 0  # some images without objects
        sides = np.exp(rng.uniform(np.log(2), np.log(90), (count, 2)))
        corners = rng.uniform(0, 128, (count, 2))
        boxes = np.concatenate([corners, sides], axis=1)
        if count and image % 5 == 1:
            boxes[0, 2] = 0.0  # an empty box
        if count > 1 and image % 6 == 2:
            boxes[1] = boxes[0]  # two identical objects: IoU ties
        labels = rng.integers(0, classes - 1, count)
        crowd = rng.random(count) < 0.15
        for box, label, is_crowd in zip(boxes, labels, crowd, strict=True):
            gt_rows.append((image, int(label), *box, bool(is_crowd)))
        found = 0 if image % 9 == 3 else int(rng.integers(0, 160))  # > 100 of a class, or none
        if image % 4 == 0:
            found = int(rng.integers(110, 220))
        for _ in range(found):
            if count and rng.random() < 0.7:
                pick = int(rng.integers(0, count))
                box = boxes[pick] + rng.normal(0, 0.15, 4) * np.r_[boxes[pick, 2:], boxes[pick, 2:]]
                label = int(labels[pick]) if rng.random() < 0.85 else int(rng.integers(0, classes))
            else:
                box = np.r_[rng.uniform(0, 128, 2), rng.uniform(0, 40, 2)]
                label = int(rng.integers(0, classes))
            if rng.random() < 0.03:
                box[3] = -box[3]  # a degenerate detection
            score = float(np.float32(np.round(rng.random(), 1)))  # many ties
            dt_rows.append((image, label, *box, score))
    for _ in range(130):  # more than 100 of one class in one image
        dt_rows.append((1, 0, *rng.uniform(0, 60, 4), float(np.float32(rng.random()))))
    gt = np.asarray(gt_rows, dtype=np.float64).reshape(-1, 7)
    dt = np.asarray(dt_rows, dtype=np.float64).reshape(-1, 7)
    return {"gt": gt, "dt": dt, "images": images, "classes": classes}


def ours(work: dict[str, Any]):
    gt, dt = work["gt"], work["dt"]
    truth = Boxes(gt[:, 2:6], gt[:, 0].astype(np.int64), gt[:, 1].astype(np.int64))
    found = Boxes(dt[:, 2:6], dt[:, 0].astype(np.int64), dt[:, 1].astype(np.int64))
    return match(found, dt[:, 6], truth, gt[:, 6] > 0, AREA_RANGES, work["classes"], work["images"])


def pycocotools_eval(work: dict[str, Any]) -> Any:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    gt, dt = work["gt"], work["dt"]
    categories = [{"id": c + 1, "name": str(c)} for c in range(work["classes"])]
    images = [{"id": i + 1, "height": 128, "width": 128} for i in range(work["images"])]

    def annotations(rows: np.ndarray, results: bool) -> list[dict[str, Any]]:
        return [
            {
                "id": n + 1,
                "image_id": int(row[0]) + 1,
                "category_id": int(row[1]) + 1,
                "bbox": [float(v) for v in row[2:6]],
                "area": float(row[4]) * float(row[5]),
                "iscrowd": 0 if results else int(row[6]),
                **({"score": float(row[6])} if results else {}),
            }
            for n, row in enumerate(rows)
        ]

    with contextlib.redirect_stdout(io.StringIO()):
        truth, found = COCO(), COCO()
        truth.dataset = {"images": images, "annotations": annotations(gt, False),
                         "categories": categories}  # fmt: skip
        found.dataset = {"images": images, "annotations": annotations(dt, True),
                         "categories": categories}  # fmt: skip
        truth.createIndex()
        found.createIndex()
        evaluation = COCOeval(truth, found, "bbox")
        evaluation.params.areaRng = AREA_RANGES
        evaluation.params.areaRngLbl = ["all", "small", "medium", "large"]
        evaluation.params.maxDets = [MAX_DETECTIONS]
        evaluation.evaluate()
        evaluation.accumulate()
    return evaluation


def best_first(work: dict[str, Any]) -> dict[str, Any]:
    """The workload's detections laid out as a detector decodes them: image by image, each
    image's best first (ties in their order)."""
    dt = work["dt"]
    return {**work, "dt": dt[np.lexsort((-dt[:, 6], dt[:, 0]))]}


@pytest.mark.parametrize("layout", ["as drawn", "best first in each image"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_matches_and_precision_are_pycocotools_own_bit_for_bit(seed: int, layout: str) -> None:
    """In any order; laid out best first in each image, the sort by score is left out (each
    image and class's order is its ranking already): the same matches."""
    work = workload(seed)
    if layout != "as drawn":
        work = best_first(work)
    dt = work["dt"]
    assert _descending_within(dt[:, 0].astype(np.int64), dt[:, 6]) == (layout != "as drawn")
    matched = ours(work)
    evaluation = pycocotools_eval(work)
    assert np.asarray(evaluation.params.iouThrs).tolist() == IOU_THRESHOLDS.tolist()
    assert np.asarray(evaluation.params.recThrs).tolist() == RECALL_THRESHOLDS.tolist()
    classes, areas, images = work["classes"], len(AREA_RANGES), work["images"]
    matches = ignored = repeated = cut = 0
    for k in range(classes):
        for a in range(areas):
            for i in range(images):
                entry = evaluation.evalImgs[(k * areas + a) * images + i]
                mine = np.flatnonzero((matched.labels == k) & (matched.image == i))
                mine = mine[np.argsort(matched.rank[mine])]
                if entry is None:
                    assert mine.size == 0
                    continue
                assert matched.scores[mine].tolist() == entry["dtScores"]
                assert (matched.matched[a][:, mine] == (entry["dtMatches"] > 0)).all()
                assert (matched.ignored[a][:, mine] == entry["dtIgnore"]).all()
                assert matched.objects[k, a, i] == int((~entry["gtIgnore"].astype(bool)).sum())
                matches += int((entry["dtMatches"] > 0).sum())
                ignored += int(entry["dtIgnore"].sum())
                for row in entry["dtMatches"]:  # a crowd region matched more than once
                    taken = row[row > 0]
                    repeated += int(taken.size - np.unique(taken).size)
                cut += int(len(entry["dtScores"]) == MAX_DETECTIONS)
    assert matches > 100 and ignored > 50 and repeated > 0 and cut > 0  # every rule is reached
    expected = evaluation.eval["precision"][..., 0]  # [T, R, K, A]
    precision = accumulate(matched.rankings())
    assert precision.tobytes() == expected.tobytes()
    assert (expected[:, :, -1] == -1).all() and (expected[:, :, :-1] > 0).any()


def test_more_than_100_detections_keep_the_highest_scored_ties_in_input_order() -> None:
    """One image and class with 150 detections of equal score: the first 100 in input order
    are kept, as pycocotools' stable sort and cut keep them."""
    found = Boxes(np.tile([[0.0, 0.0, 10.0, 10.0]], (150, 1)), np.zeros(150, np.int64),
                  np.zeros(150, np.int64))  # fmt: skip
    truth = Boxes(
        np.asarray([[0.0, 0.0, 10.0, 10.0]]), np.zeros(1, np.int64), np.zeros(1, np.int64)
    )
    scores = np.full(150, 0.5)
    scores[120] = 0.9  # the best is at 120: it takes the object
    matched = match(found, scores, truth, np.zeros(1, bool), [[0.0, 1e10]], 1, 1)
    assert matched.scores.size == MAX_DETECTIONS
    assert matched.rank.tolist() == list(range(MAX_DETECTIONS))
    assert matched.matched[0, :, 0].all() and not matched.matched[0, :, 1:].any()


def stacked(entries: list, field: str, kept: list[int], order: np.ndarray) -> np.ndarray:
    """[T, D] one field of the kept images' entries side by side, in `order`."""
    rows = [entries[i][field].reshape(len(IOU_THRESHOLDS), -1) for i in kept]
    return np.concatenate([*rows, np.zeros((len(IOU_THRESHOLDS), 0))], axis=1)[:, order]


def pycocotools_rankings(evaluation: Any, classes: int, images: int) -> list[list[np.ndarray]]:
    """Each class's ranking read off pycocotools' per-image results, as the evaluation read
    them before the array matcher (COCOeval.accumulate's order: every image's detections end
    to end, a stable sort on descending score), cut after the last true positive."""
    areas = len(evaluation.params.areaRng)
    result = []
    for k in range(classes):
        entries = [
            [evaluation.evalImgs[(k * areas + a) * images + i] for i in range(images)]
            for a in range(areas)
        ]
        kept = [i for i in range(images) if entries[0][i] is not None]
        scores = np.concatenate([entries[0][i]["dtScores"] for i in kept] + [np.zeros(0)])
        image = np.concatenate(
            [np.full(len(entries[0][i]["dtScores"]), i) for i in kept] + [np.zeros(0, int)]
        )
        order = np.argsort(-scores, kind="mergesort")

        counted = ~np.stack([stacked(e, "dtIgnore", kept, order).astype(bool) for e in entries])
        is_tp = np.stack([stacked(e, "dtMatches", kept, order) > 0 for e in entries]) & counted
        anywhere = is_tp.any(axis=(0, 1))
        end = int(np.flatnonzero(anywhere)[-1]) + 1 if anywhere.any() else 0
        result.append([image[order][:end], is_tp[:, :, :end], counted[:, :, :end]])
    return result


@pytest.mark.parametrize("seed", [4, 5])
def test_each_classs_ranking_for_the_intervals_is_the_one_read_off_pycocotools(seed: int) -> None:
    """AP's intervals reweigh each class's ranking: the same detections in the same order,
    with the same true positives and ignored ones in every area range at every IoU, as
    pycocotools' per-image results give, and the objects found at IoU 0.5 by bucket."""
    work = workload(seed)
    matched = ours(work)
    evaluation = pycocotools_eval(work)
    expected = pycocotools_rankings(evaluation, work["classes"], work["images"])
    rankings = matched.rankings()
    assert sum(ranking.image_index.size for ranking in rankings) > 200
    for ranking, (image, is_tp, counted) in zip(rankings, expected, strict=True):
        assert ranking.image_index.tolist() == image.tolist()
        assert (ranking.is_tp == is_tp).all() and (ranking.counted == counted).all()
    found = matched.found(0, 0.5)  # [A, I]
    for a in range(len(AREA_RANGES)):
        for i in range(work["images"]):
            hits = 0
            for k in range(work["classes"]):
                entry = evaluation.evalImgs[(k * len(AREA_RANGES) + a) * work["images"] + i]
                if entry is not None:
                    kept = np.asarray(entry["dtScores"]) >= 0.5
                    hits += int(((entry["dtMatches"][0] > 0) & ~entry["dtIgnore"][0] & kept).sum())
            assert found[a, i] == hits


def test_records_that_disagree_or_hold_a_label_out_of_range_are_refused_naming_the_image() -> None:
    from pipeline.errors import DataError
    from pipeline.evaluation.coco_matching import as_arrays

    box = np.asarray([[0.0, 0.0, 4.0, 4.0]], dtype=np.float32)
    good = {"boxes": box, "labels": np.asarray([0])}
    truth = {1: good, 2: {"boxes": box, "labels": np.asarray([5])}}
    with pytest.raises(DataError, match="Ground truth of image 2 has label 5"):
        as_arrays(truth, {}, [1, 2], 2)
    truth = {1: good, 2: {"boxes": np.zeros((2, 4)), "labels": np.asarray([1])}}
    with pytest.raises(ValueError, match="Ground truth of image 2 disagree in length: 2 boxes"):
        as_arrays(truth, {}, [1, 2], 2)
    found = {2: {**good, "scores": np.asarray([0.5, 0.4])}}
    with pytest.raises(ValueError, match="Detections of image 2 disagree in length"):
        as_arrays({1: good, 2: good}, found, [1, 2], 2)
    objects, crowd, detections, scores = as_arrays(
        {1: good, 2: {**good, "ignore_boxes": box, "ignore_labels": np.asarray([1])}},
        {2: {**good, "scores": np.asarray([0.5], dtype=np.float32)}},
        [1, 2],
        2,
    )
    assert objects.image.tolist() == [0, 1, 1] and crowd.tolist() == [False, False, True]
    assert objects.xywh.dtype == np.float64 and objects.xywh[0].tolist() == [0.0, 0.0, 4.0, 4.0]
    assert detections.image.tolist() == [1] and scores.tolist() == [0.5]
