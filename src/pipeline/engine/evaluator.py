"""Detection metrics and the evaluation loop: the one place where P/R/F1 and COCO AP are computed.

Conventions: boxes are xyxy pixels in the model's input frame, labels are 0-based class
indices; ground truth and detections are per-image dicts of numpy arrays keyed by
`image_id`. Ratios whose denominator is zero (0/0) are defined as 0, never NaN.

Ground truth may carry ignore regions (`ignore_boxes`, `ignore_labels`: COCO crowd
regions, VOC difficult objects). A detection that matches no object but covers an
ignore region of its class is neither a true nor a false positive: it is left out.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torchvision.ops import box_iou

from pipeline.device import DeviceLike, autocast, synchronize
from pipeline.errors import ConfigError, DataError
from pipeline.stats import (
    IMAGES_METHOD,
    ClassMatches,
    bootstrap_interval,
    bootstrap_weights,
    class_mean,
    f1_of_counts,
    micro_intervals,
    weighted_class_ap,
)

LABEL_MODES = ("multilabel", "single")
TIMING_KEYS = ("model_s", "postprocess_s", "images_per_s", "ms_per_image")
# The operating point of a pass without detections: nothing is kept at any threshold.
NO_DETECTIONS_THRESHOLD = 1.0
# Object size buckets by the square root of the box area in the model's input pixels (after
# resizing): [lower, upper), upper None for no limit. COCO's own buckets are absolute (32 and 96
# px) and put nearly every object of a 128-px input in one bucket; what the model sees is the
# size at its input, which is what these measure. Half-open, unlike pycocotools' inclusive
# bounds: integer boxes of exactly 16 x 16 px are common and must count once.
SIZE_BUCKETS: dict[str, tuple[float, float | None]] = {
    "small": (0.0, 16.0),
    "medium": (16.0, 64.0),
    "large": (64.0, None),
}
_NO_LIMIT = 1e5  # pycocotools' own "no upper limit" side length

Record = Mapping[str, Any]


def _boxes(value: Any) -> np.ndarray:
    # float64 so that IoU at the threshold is decided as pycocotools (double precision) decides it
    return np.asarray(value, dtype=np.float64).reshape(-1, 4)


def _vector(value: Any, dtype: type) -> np.ndarray:
    return np.asarray(value, dtype=dtype).reshape(-1)


def _ratio(numerator: float, denominator: float) -> float:
    return float(numerator) / float(denominator) if denominator else 0.0


def _counts(tp: int, fp: int, fn: int) -> dict[str, float | int]:
    """P/R/F1 from counts; F1 = 2TP / (2TP + FP + FN), which is 0 rather than NaN when P = R = 0."""
    return {
        "precision": _ratio(tp, tp + fp),
        "recall": _ratio(tp, tp + fn),
        "f1": float(f1_of_counts(tp, fp, fn)),
        "tp": int(tp),
        "fp": int(fp),
        "fn": int(fn),
    }


def _macro(rows: Sequence[Mapping[str, Any]], active: np.ndarray) -> dict[str, float | int]:
    """Unweighted mean over the active classes; F1 is the mean of per-class F1s (as sklearn's)."""
    chosen = [row for row, keep in zip(rows, active, strict=True) if keep]
    if not chosen:
        return {"precision": 0.0, "recall": 0.0, "f1": 0.0, "num_classes": 0}
    return {
        "precision": float(np.mean([row["precision"] for row in chosen])),
        "recall": float(np.mean([row["recall"] for row in chosen])),
        "f1": float(np.mean([row["f1"] for row in chosen])),
        "num_classes": len(chosen),
    }


def match_detections(
    det_boxes: Any,
    det_scores: Any,
    det_labels: Any,
    gt_boxes: Any,
    gt_labels: Any,
    iou_threshold: float = 0.5,
) -> np.ndarray:
    """True-positive flag for each detection of one image, in the detections' original order.

    Greedy in descending score (stable for ties), each detection takes the unmatched ground
    truth of its class with the highest IoU >= threshold. Because a detection's fate never
    depends on lower-scored ones, matching once and then dropping detections below a score
    threshold gives the same flags as matching only those above it: one pass serves every
    threshold.
    """
    boxes, scores = _boxes(det_boxes), _vector(det_scores, np.float64)
    labels = _vector(det_labels, np.int64)
    truth_boxes, truth_labels = _boxes(gt_boxes), _vector(gt_labels, np.int64)
    if not len(boxes) == len(scores) == len(labels):
        raise ValueError(
            f"Detections disagree in length: {len(boxes)} boxes, {len(scores)} scores, "
            f"{len(labels)} labels."
        )
    if len(truth_boxes) != len(truth_labels):
        raise ValueError(
            f"Ground truth disagrees in length: {len(truth_boxes)} boxes, {len(truth_labels)} labels."
        )
    is_tp = np.zeros(len(scores), dtype=bool)
    if len(scores) == 0 or len(truth_labels) == 0:
        return is_tp
    iou = box_iou(torch.from_numpy(boxes), torch.from_numpy(truth_boxes)).numpy()
    iou[labels[:, None] != truth_labels[None, :]] = -1.0
    free = np.ones(len(truth_labels), dtype=bool)
    for index in np.argsort(-scores, kind="stable"):
        candidates = np.where(free, iou[index], -1.0)
        best = int(np.argmax(candidates))
        if candidates[best] >= iou_threshold:
            free[best] = False
            is_tp[index] = True
    return is_tp


def _intersection_over_detection(boxes: np.ndarray, regions: np.ndarray) -> np.ndarray:
    """[D, K] intersection area over each detection's own area (0 for an empty detection)."""
    top_left = np.maximum(boxes[:, None, :2], regions[None, :, :2])
    bottom_right = np.minimum(boxes[:, None, 2:], regions[None, :, 2:])
    intersection = np.prod(np.clip(bottom_right - top_left, 0, None), axis=2)
    area = np.prod(np.clip(boxes[:, 2:] - boxes[:, :2], 0, None), axis=1)
    return np.divide(
        intersection, area[:, None], out=np.zeros_like(intersection), where=area[:, None] > 0
    )


def ignored_detections(
    det_boxes: Any,
    det_labels: Any,
    is_tp: np.ndarray,
    ignore_boxes: Any,
    ignore_labels: Any,
    threshold: float = 0.5,
) -> np.ndarray:
    """Which detections of one image fall on an ignore region: neither true nor false positives.

    COCO's crowd rule, as pycocotools applies it to `iscrowd=1` regions: a detection that
    matched no object is ignored when the intersection with an ignore region of its class
    covers at least `threshold` of the detection's own area; one region may absorb many
    detections. The VOC devkit matches difficult objects by IoU instead; an IoU of at least
    the threshold implies this ratio is too, so this rule ignores those detections and
    also smaller ones lying inside a difficult object. One rule keeps F1 and COCO AP
    (which only knows the crowd rule) consistent.
    """
    boxes, labels = _boxes(det_boxes), _vector(det_labels, np.int64)
    regions, region_labels = _boxes(ignore_boxes), _vector(ignore_labels, np.int64)
    if len(regions) != len(region_labels):
        raise ValueError(
            f"Ignore regions disagree in length: {len(regions)} boxes, {len(region_labels)} labels."
        )
    if len(boxes) == 0 or len(regions) == 0:
        return np.zeros(len(boxes), dtype=bool)
    overlap = _intersection_over_detection(boxes, regions)
    overlap[labels[:, None] != region_labels[None, :]] = -1.0
    return ~np.asarray(is_tp, dtype=bool) & (overlap.max(axis=1) >= threshold)


@dataclass(frozen=True)
class _Pooled:
    """Every detection of every image after one matching pass, plus ground-truth counts."""

    scores: np.ndarray  # float64 [D]
    labels: np.ndarray  # int64 [D]
    is_tp: np.ndarray  # bool [D]
    image_index: np.ndarray  # int64 [D]: the detection's image, a position in `image_ids`
    image_ids: list[int]  # [N], in ground-truth order
    gt_per_image: np.ndarray  # int64 [N]
    gt_per_class: np.ndarray  # int64 [C]
    ignored: int  # detections left out for falling on an ignore region

    def per_image(self, threshold: float) -> dict[str, list[int]]:
        """TP, FP and FN of each image at one score threshold: what a bootstrap over images
        resamples, and what finds the images a model gets wrong."""
        kept = self.scores >= threshold
        images = len(self.image_ids)
        tp = np.bincount(self.image_index[kept & self.is_tp], minlength=images)
        detected = np.bincount(self.image_index[kept], minlength=images)
        return {
            "image_ids": list(self.image_ids),
            "tp": tp.tolist(),
            "fp": (detected - tp).tolist(),
            "fn": (self.gt_per_image - tp).tolist(),
        }


def _index_by_image(records: Iterable[Record], what: str) -> dict[int, Record]:
    indexed: dict[int, Record] = {}
    for record in records:
        image_id = int(record["image_id"])
        if image_id in indexed:
            raise DataError(
                f"The {what} list holds image_id {image_id} twice; image ids must be unique."
            )
        indexed[image_id] = record
    return indexed


def _check_labels(labels: np.ndarray, num_classes: int, image_id: int, what: str) -> None:
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        bad = labels[(labels < 0) | (labels >= num_classes)][0]
        message = (
            f"{what} of image {image_id} has label {int(bad)}, outside [0, {num_classes}): "
            "labels are 0-based class indices, so check the class list against the data."
        )
        raise DataError(message) if what == "Ground truth" else ValueError(message)


def _pool(
    gts: Iterable[Record], dets: Iterable[Record], num_classes: int, iou_threshold: float
) -> _Pooled:
    truth = _index_by_image(gts, "ground truth")
    found = _index_by_image(dets, "detections")
    unknown = sorted(set(found) - set(truth))
    if unknown:
        raise ValueError(f"Detections for image ids without ground truth: {unknown[:10]}.")
    scores, labels, flags, image_index = [], [], [], []
    ignored = 0
    gt_per_class = np.zeros(num_classes, dtype=np.int64)
    gt_per_image = np.zeros(len(truth), dtype=np.int64)
    for position, (image_id, gt) in enumerate(truth.items()):
        gt_labels = _vector(gt["labels"], np.int64)
        _check_labels(gt_labels, num_classes, image_id, "Ground truth")
        gt_per_class += np.bincount(gt_labels, minlength=num_classes)
        gt_per_image[position] = gt_labels.size
        det = found.get(image_id)
        if det is None:
            continue
        det_labels = _vector(det["labels"], np.int64)
        _check_labels(det_labels, num_classes, image_id, "Detections")
        det_scores = _vector(det["scores"], np.float64)
        is_tp = match_detections(
            det["boxes"], det_scores, det_labels, gt["boxes"], gt_labels, iou_threshold
        )
        counted = ~ignored_detections(
            det["boxes"],
            det_labels,
            is_tp,
            gt.get("ignore_boxes", ()),
            gt.get("ignore_labels", ()),
            iou_threshold,
        )
        ignored += int((~counted).sum())
        flags.append(is_tp[counted])
        scores.append(det_scores[counted])
        labels.append(det_labels[counted])
        image_index.append(np.full(int(counted.sum()), position, dtype=np.int64))
    return _Pooled(
        scores=np.concatenate(scores) if scores else np.zeros(0, dtype=np.float64),
        labels=np.concatenate(labels) if labels else np.zeros(0, dtype=np.int64),
        is_tp=np.concatenate(flags) if flags else np.zeros(0, dtype=bool),
        image_index=np.concatenate(image_index) if image_index else np.zeros(0, dtype=np.int64),
        image_ids=list(truth),
        gt_per_image=gt_per_image,
        gt_per_class=gt_per_class,
        ignored=ignored,
    )


def _best_f1(pooled: _Pooled, fallback_threshold: float) -> dict[str, float]:
    """Sweep every distinct detection score as a threshold (keep score >= t) for the best micro F1.

    Tied scores stay together: a threshold cannot split them. Among equal F1s the highest
    threshold wins (fewer detections). With no detections there is nothing to sweep: F1 is 0
    and the threshold reported is the configured one.
    """
    num_gt = int(pooled.gt_per_class.sum())
    if pooled.scores.size == 0:
        return {"threshold": float(fallback_threshold), "precision": 0.0, "recall": 0.0, "f1": 0.0}
    order = np.argsort(-pooled.scores, kind="stable")
    sorted_scores = pooled.scores[order]
    cum_tp = np.cumsum(pooled.is_tp[order])
    kept = np.arange(1, len(order) + 1)
    group_ends = np.flatnonzero(np.r_[sorted_scores[1:] != sorted_scores[:-1], True])
    f1 = 2 * cum_tp[group_ends] / (kept[group_ends] + num_gt)
    end = int(group_ends[int(np.argmax(f1))])
    return {
        "threshold": float(sorted_scores[end]),
        "precision": _ratio(cum_tp[end], kept[end]),
        "recall": _ratio(cum_tp[end], num_gt),
        "f1": float(f1.max()),
    }


def _micro_at(pooled: _Pooled, threshold: float) -> dict[str, Any]:
    """Micro P/R/F1 of the detections scoring >= `threshold`, from one matching pass, with the
    F1's interval over the images."""
    kept = pooled.scores >= threshold
    tp = int((kept & pooled.is_tp).sum())
    return {
        "threshold": float(threshold),
        **_counts(tp, int(kept.sum()) - tp, int(pooled.gt_per_class.sum()) - tp),
        "f1_interval": micro_intervals(pooled.per_image(threshold))["f1"],
    }


def precision_recall_f1(
    gts: Iterable[Record],
    dets: Iterable[Record],
    num_classes: int,
    score_threshold: float | None,
    iou_threshold: float = 0.5,
    chosen_threshold: float | None = None,
) -> dict[str, Any]:
    """Micro, macro and per-class P/R/F1 at one score threshold, plus the best-F1 operating point.

    Detections with score >= score_threshold count; None takes the best-F1 threshold of these
    detections (what training's validation picks as the model's operating point; with no
    detections, 1.0). Micro pools TP/FP/FN over classes.
    Macro is the unweighted mean over classes that have ground truth or kept detections: a
    class absent from both has no defined P/R and would only drag the mean to 0, while a
    class with detections but no ground truth is all false positives and must count.
    0/0 is 0. With no ground truth at all, recall is 0/0 and precision is 0 (or 0/0), so every
    figure is 0 even for a model that rightly predicts nothing: check `num_ground_truth`.
    Detections on ignore regions count nowhere (`num_ignored_detections`).
    `chosen_threshold` adds the micro figures at that threshold too (`chosen_threshold`),
    from the same matching. `per_image` holds each image's TP/FP/FN at `score_threshold`, and
    `f1_interval`, `precision_interval` and `recall_interval` the 95% intervals of the micro
    figures over these images (None without images).
    """
    pooled = _pool(gts, dets, num_classes, iou_threshold)
    if score_threshold is None:
        score_threshold = _best_f1(pooled, NO_DETECTIONS_THRESHOLD)["threshold"]
    kept = pooled.scores >= score_threshold
    tp = np.bincount(pooled.labels[kept & pooled.is_tp], minlength=num_classes)
    detected = np.bincount(pooled.labels[kept], minlength=num_classes)
    fp = detected - tp
    fn = pooled.gt_per_class - tp
    per_image = pooled.per_image(score_threshold)
    intervals = micro_intervals(per_image)
    per_class = [
        {"label": c, "num_gt": int(pooled.gt_per_class[c]), **_counts(tp[c], fp[c], fn[c])}
        for c in range(num_classes)
    ]
    return {
        "score_threshold": float(score_threshold),
        "iou_threshold": float(iou_threshold),
        "micro": _counts(tp.sum(), fp.sum(), fn.sum()),
        "macro": _macro(per_class, (pooled.gt_per_class > 0) | (detected > 0)),
        "per_class": per_class,
        "best": _best_f1(pooled, score_threshold),
        "chosen_threshold": None
        if chosen_threshold is None
        else _micro_at(pooled, chosen_threshold),
        "num_ground_truth": int(pooled.gt_per_class.sum()),
        "num_detections": int(pooled.scores.size),
        "num_ignored_detections": pooled.ignored,
        "per_image": per_image,
        **{f"{name}_interval": interval for name, interval in intervals.items()},
    }


def _xywh(box: np.ndarray) -> list[float]:
    x1, y1, x2, y2 = (float(v) for v in box)
    return [x1, y1, x2 - x1, y2 - y1]


def _area_ranges() -> tuple[list[list[float]], list[str]]:
    """pycocotools' areaRng and areaRngLbl for "all" and SIZE_BUCKETS.

    pycocotools keeps areas with lower <= area <= upper; an upper bound one float below
    upper**2 makes each bucket [lower**2, upper**2).
    """
    ranges = [[0.0, _NO_LIMIT**2]]
    for lower, upper in SIZE_BUCKETS.values():
        top = _NO_LIMIT**2 if upper is None else float(np.nextafter(upper**2, 0.0))
        ranges.append([lower**2, top])
    return ranges, ["all", *SIZE_BUCKETS]


def _bucket_counts(areas: np.ndarray) -> dict[str, int]:
    """Ground truth per size bucket, with the bounds pycocotools is given."""
    ranges, labels = _area_ranges()
    return {
        label: int(((areas >= lower) & (areas <= upper)).sum())
        for (lower, upper), label in zip(ranges[1:], labels[1:], strict=True)
    }


def _bucket_rows(
    counts: Mapping[str, int],
    ap50: Mapping[str, float | None],
    ap: Mapping[str, float | None],
    recall: Mapping[str, float | None],
    class_counts: Sequence[Mapping[str, int]],
    class_ap50: Mapping[str, Sequence[float | None]],
    class_names: Sequence[str],
    intervals: _APIntervals,
) -> dict[str, dict[str, Any]]:
    return {
        name: {
            "range_px": [lower, upper],
            "num_gt": counts[name],
            "ap50": ap50[name],
            "ap": ap[name],
            "recall": recall[name],
            **intervals.of_bucket(name),
            "per_class": [
                {
                    "label": c,
                    "name": class_name,
                    "num_gt": class_counts[c][name],
                    "ap50": class_ap50[name][c],
                }
                for c, class_name in enumerate(class_names)
            ],
        }
        for name, (lower, upper) in SIZE_BUCKETS.items()
    }


def size_bucket_text(buckets: Mapping[str, Mapping[str, Any]]) -> str:
    """One line for logs: 'small 0.812 (95% 0.790-0.833, n=310), medium 0.954 (n=402), large -
    (n=0)': the interval where the figures have one."""

    def text(row: Mapping[str, Any]) -> str:
        if row["ap50"] is None:
            return f"- (n={row['num_gt']})"
        found = row.get("ap50_interval")
        spread = f"95% {found['low']:.3f}-{found['high']:.3f}, " if found else ""
        return f"{row['ap50']:.3f} ({spread}n={row['num_gt']})"

    return ", ".join(f"{name} {text(row)}" for name, row in buckets.items())


def _evaluated_images(evaluation: Any, area_index: int) -> Iterator[tuple[int, int, dict]]:
    """(class position, image position, COCOeval's per-image result) for one area range, in
    class then image order. evalImgs is laid out [class][area][image], None where an image has
    neither objects nor detections of the class."""
    num_areas, num_images = len(evaluation.params.areaRng), len(evaluation.params.imgIds)
    for index, image in enumerate(evaluation.evalImgs):
        k, rest = divmod(index, num_areas * num_images)
        area, i = divmod(rest, num_images)
        if image is not None and area == area_index:
            yield k, i, image


@dataclass(frozen=True)
class _RecallCounts:
    """Per image (a position in the image list), the objects of one area range found at one
    IoU by detections scoring >= the threshold, and the objects that count there."""

    found: np.ndarray  # int64 [I]
    total: np.ndarray  # int64 [I]

    @property
    def recall(self) -> float:
        return _ratio(int(self.found.sum()), int(self.total.sum()))


def _recall_counts(
    evaluation: Any, area_index: int, iou_index: int, score_threshold: float
) -> _RecallCounts:
    """Recall's counts in one area range at one IoU, matches counted by detections scoring >=
    the threshold.

    COCOeval matches greedily in descending score, so a detection's match never depends on
    lower-scored ones: the matches of the kept detections are those of the full matching.
    """
    num_images = len(evaluation.params.imgIds)
    found = np.zeros(num_images, dtype=np.int64)
    total = np.zeros(num_images, dtype=np.int64)
    for _, i, image in _evaluated_images(evaluation, area_index):
        wanted = ~np.asarray(image["gtIgnore"], dtype=bool)
        score_of = dict(zip(image["dtIds"], image["dtScores"], strict=True))
        matched = [
            score_of.get(int(dt_id), -1.0) >= score_threshold
            for dt_id in np.asarray(image["gtMatches"])[iou_index]
        ]
        found[i] += int((np.asarray(matched, dtype=bool) & wanted).sum())
        total[i] += int(wanted.sum())
    return _RecallCounts(found, total)


def _class_matches(
    evaluation: Any, iou_indices: Sequence[int], area_index: int
) -> list[list[ClassMatches]]:
    """COCOeval's own matches per class in one area range, at each IoU of `iou_indices`
    (outer list), read from evalImgs as accumulate reads them (objects outside the range and
    detections matching none there are ignored), in one walk over evalImgs."""
    params = evaluation.params
    num_classes, num_images, max_det = len(params.catIds), len(params.imgIds), params.maxDets[-1]
    rows = list(iou_indices)
    per_class: list[tuple[list, list, list, list]] = [([], [], [], []) for _ in range(num_classes)]
    gt_counts = np.zeros((num_classes, num_images), dtype=np.int64)
    for k, i, image in _evaluated_images(evaluation, area_index):
        scores, image_index, matched, ignored = per_class[k]
        image_scores = np.asarray(image["dtScores"][:max_det], dtype=np.float64)
        scores.append(image_scores)
        image_index.append(np.full(image_scores.size, i, dtype=np.int64))
        matched.append(np.asarray(image["dtMatches"])[rows, :max_det] > 0)
        ignored.append(np.asarray(image["dtIgnore"])[rows, :max_det].astype(bool))
        gt_counts[k, i] = int((~np.asarray(image["gtIgnore"], dtype=bool)).sum())
    by_iou: list[list[ClassMatches]] = [[] for _ in rows]
    for (scores, image_index, matched, ignored), gt_per_image in zip(
        per_class, gt_counts, strict=True
    ):
        if not scores:
            for classes in by_iou:
                classes.append(ClassMatches(np.zeros(0, np.int64), np.zeros(0, bool), gt_per_image))
            continue
        order = np.argsort(-np.concatenate(scores), kind="mergesort")  # as accumulate sorts
        ranked_images = np.concatenate(image_index)[order]
        all_matched = np.concatenate(matched, axis=1)[:, order]
        all_counted = ~np.concatenate(ignored, axis=1)[:, order]
        for classes, is_matched, counted in zip(by_iou, all_matched, all_counted, strict=True):
            is_tp = is_matched[counted]
            end = int(np.flatnonzero(is_tp)[-1]) + 1 if is_tp.any() else 0
            classes.append(ClassMatches(ranked_images[counted][:end], is_tp[:end], gt_per_image))
    return by_iou


_CLASS_INTERVALS = ("ap50_interval", "ap_interval")  # each class's, keyed as the eval JSON
_BUCKET_INTERVALS = ("ap50_interval", "ap_interval", "recall_interval")  # each size bucket's


@dataclass(frozen=True)
class _APIntervals:
    """95% intervals over the images: of AP@.5 and AP@[.5:.95] (the whole split's, each
    class's and each size bucket's), AP@.75, and each size bucket's recall at the score
    threshold; None where no resample drew an object of what it measures. `matches` is
    pycocotools' matches at IoU 0.5, as the eval JSON keeps them (`metrics.ap50_matches`),
    so that the report can pair two runs' AP@.5 image by image."""

    ap50: dict[str, Any] | None
    ap: dict[str, Any] | None
    ap75: dict[str, Any] | None
    per_class: list[dict[str, dict[str, Any] | None]]  # by class label, _CLASS_INTERVALS
    size_buckets: dict[str, dict[str, dict[str, Any] | None]]  # by bucket, _BUCKET_INTERVALS
    matches: dict[str, Any] | None

    def of_class(self, label: int) -> dict[str, dict[str, Any] | None]:
        return self.per_class[label] if self.per_class else dict.fromkeys(_CLASS_INTERVALS)

    def of_bucket(self, name: str) -> dict[str, dict[str, Any] | None]:
        return self.size_buckets.get(name) or dict.fromkeys(_BUCKET_INTERVALS)


_NO_AP_INTERVALS = _APIntervals(None, None, None, [], {}, None)


def _interval_of(samples: np.ndarray, images: int) -> dict[str, Any] | None:
    finite = samples[np.isfinite(samples)]
    if finite.size == 0:
        return None
    return bootstrap_interval(finite, images, IMAGES_METHOD + ", pycocotools' matches reweighed")


def _ap_intervals(
    evaluation: Any, at_50: int, at_75: int, recall: Mapping[str, _RecallCounts]
) -> _APIntervals:
    """AP's intervals, resampling images as `stats.micro_intervals` does, with pycocotools'
    matches kept: a resample reweighs images, it does not match again. Every figure is read
    from the same resamples. A class's or a bucket's interval is over the resamples that drew
    objects of it: with a handful of objects it is wide, which is the point. AP@[.5:.95] is,
    as pycocotools averages it, the mean over classes of each class's mean over the IoUs."""
    params = evaluation.params
    labels, images = list(params.areaRngLbl), len(params.imgIds)
    # every IoU threshold, in the area range "all" and in each size bucket
    every = range(len(params.iouThrs))
    by_iou = {label: _class_matches(evaluation, every, labels.index(label)) for label in labels}
    thresholds = np.asarray(params.recThrs, dtype=np.float64)
    class_samples, class_ap_samples, ap75_samples = [], [], []
    mean_samples: dict[str, list[np.ndarray]] = {label: [] for label in labels}  # AP@.5
    ap_samples: dict[str, list[np.ndarray]] = {label: [] for label in labels}  # AP@[.5:.95]
    recall_samples: dict[str, list[np.ndarray]] = {name: [] for name in recall}
    for weights in bootstrap_weights(images):
        for label, found_by_iou in by_iou.items():
            every_iou = np.stack(  # [T, K, resamples]
                [weighted_class_ap(found, weights, thresholds) for found in found_by_iou]
            )
            mean_samples[label].append(class_mean(every_iou[at_50]))
            ap_samples[label].append(class_mean(every_iou.mean(axis=0)))
            if label == "all":
                class_samples.append(every_iou[at_50])
                class_ap_samples.append(every_iou.mean(axis=0))
                ap75_samples.append(class_mean(every_iou[at_75]))
        for name, counts in recall.items():
            found, total = (weights @ counts.found).astype(float), weights @ counts.total
            with np.errstate(invalid="ignore", divide="ignore"):
                recall_samples[name].append(np.where(total > 0, found / total, np.nan))
    by_class = np.concatenate(class_samples, axis=1)
    by_class_ap = np.concatenate(class_ap_samples, axis=1)
    intervals, ap_intervals = (
        {label: _interval_of(np.concatenate(samples[label]), images) for label in labels}
        for samples in (mean_samples, ap_samples)
    )
    per_class: list[dict[str, dict[str, Any] | None]] = [{}] * len(params.catIds)
    for k, category_id in enumerate(params.catIds):
        per_class[category_id - 1] = {
            "ap50_interval": _interval_of(by_class[k], images),
            "ap_interval": _interval_of(by_class_ap[k], images),
        }
    kept = {
        "image_ids": [int(image_id) for image_id in params.imgIds],
        "classes": [
            found.as_document(category_id - 1)
            for category_id, found in zip(params.catIds, by_iou["all"][at_50], strict=True)
        ],
    }
    return _APIntervals(
        ap50=intervals["all"],
        ap=ap_intervals["all"],
        ap75=_interval_of(np.concatenate(ap75_samples), images),
        per_class=per_class,
        size_buckets={
            name: {
                "ap50_interval": intervals[name],
                "ap_interval": ap_intervals[name],
                "recall_interval": _interval_of(np.concatenate(recall_samples[name]), images)
                if name in recall_samples
                else None,
            }
            for name in SIZE_BUCKETS
        },
        matches=kept,
    )


def coco_ap(
    gts: Iterable[Record],
    dets: Iterable[Record],
    num_classes: int,
    image_size: tuple[int, int],
    class_names: Sequence[str],
    score_threshold: float = 0.0,
    ap_intervals: bool = False,
) -> dict[str, Any]:
    """COCO box AP through pycocotools itself, so our figures are comparable with published ones.

    `ap` is AP@[.5:.95], `ap50` AP@.5, `ap75` AP@.75 (all areas, 100 detections per image
    and class). With `ap_intervals`, `ap_interval`, `ap50_interval` and `ap75_interval` are
    their 95% intervals over the images, each class and size bucket has its AP@.5's and
    AP@[.5:.95]'s intervals too, and each size bucket its recall's, from the same resamples
    (seconds per 500 images on a CPU, so the evaluate stage asks for them and validation
    during training does not), and `ap50_matches` holds pycocotools' matches at IoU 0.5
    (`stats.ClassMatches`); else they are None. Per-class AP is None for a class without
    ground truth (pycocotools' -1).
    Ignore regions go in as `iscrowd=1` annotations, which pycocotools neither counts nor
    lets a detection on them count against.
    With no detections every AP is 0; with no ground truth at all AP is undefined and
    reported as 0 (per-class None).

    `size_buckets` holds, per SIZE_BUCKETS entry (sizes in input pixels), the ground-truth
    count, AP@.5 and AP (pycocotools with its area ranges set to the buckets) and the recall
    at IoU 0.5 of the detections scoring >= `score_threshold`; all None for a bucket
    without ground truth. A bucket's AP is pycocotools' mean over the classes with ground
    truth in it, so a class with two objects there weighs as much as one with hundreds:
    `per_class` gives each class's count and AP@.5 in the bucket, which shows when that is so.
    """
    if len(class_names) != num_classes:
        raise ValueError(f"{len(class_names)} class names given for {num_classes} classes.")
    truth = _index_by_image(gts, "ground truth")
    found = _index_by_image(dets, "detections")
    unknown = sorted(set(found) - set(truth))
    if unknown:
        raise ValueError(f"Detections for image ids without ground truth: {unknown[:10]}.")
    height, width = (int(v) for v in image_size)
    images, annotations, results = [], [], []
    gt_per_class = np.zeros(num_classes, dtype=np.int64)
    for image_id, gt in truth.items():
        images.append({"id": image_id, "height": height, "width": width})
        labels = _vector(gt["labels"], np.int64)
        _check_labels(labels, num_classes, image_id, "Ground truth")
        gt_per_class += np.bincount(labels, minlength=num_classes)
        ignore_labels = _vector(gt.get("ignore_labels", ()), np.int64)
        _check_labels(ignore_labels, num_classes, image_id, "Ground truth")
        for crowd, boxes, box_labels in (
            (0, gt["boxes"], labels),
            (1, gt.get("ignore_boxes", ()), ignore_labels),
        ):
            for box, label in zip(_boxes(boxes), box_labels, strict=True):
                xywh = _xywh(box)
                annotations.append(
                    {
                        # ids start at 1: COCOeval stores matched ids and reads 0 as "unmatched"
                        "id": len(annotations) + 1,
                        "image_id": image_id,
                        "category_id": int(label) + 1,
                        "bbox": xywh,
                        "area": xywh[2] * xywh[3],
                        "iscrowd": crowd,
                    }
                )
    for image_id, det in found.items():
        labels = _vector(det["labels"], np.int64)
        _check_labels(labels, num_classes, image_id, "Detections")
        for box, score, label in zip(
            _boxes(det["boxes"]), _vector(det["scores"], np.float64), labels, strict=True
        ):
            results.append(
                {
                    "image_id": image_id,
                    "category_id": int(label) + 1,
                    "bbox": _xywh(box),
                    "score": float(score),
                }
            )

    def per_class(
        ap: Sequence[float | None], ap50: Sequence[float | None], intervals: _APIntervals
    ) -> list[dict[str, Any]]:
        return [
            {
                "label": c,
                "name": class_names[c],
                "num_gt": int(gt_per_class[c]),
                "ap": ap[c],
                "ap50": ap50[c],
                **intervals.of_class(c),
            }
            for c in range(num_classes)
        ]

    objects = [a for a in annotations if not a["iscrowd"]]  # ignore regions not counted
    areas = np.asarray([a["area"] for a in objects], dtype=np.float64)
    labels = np.asarray([a["category_id"] - 1 for a in objects], dtype=np.int64)
    counts = _bucket_counts(areas)
    class_counts = [_bucket_counts(areas[labels == c]) for c in range(num_classes)]

    def buckets(
        ap50: Mapping[str, float | None],
        ap: Mapping[str, float | None],
        recall: Mapping[str, float | None],
        class_ap50: Mapping[str, Sequence[float | None]],
        intervals: _APIntervals,
    ) -> dict[str, dict[str, Any]]:
        return _bucket_rows(
            counts, ap50, ap, recall, class_counts, class_ap50, class_names, intervals
        )

    # loadRes([]) raises; without objects (ignore regions alone) the stats stay at -1
    if not results or not gt_per_class.any():
        zeros = [0.0 if n else None for n in gt_per_class]
        empty = {name: 0.0 if n else None for name, n in counts.items()}
        empty_per_class = {
            name: [0.0 if row[name] else None for row in class_counts] for name in SIZE_BUCKETS
        }
        return {
            "ap": 0.0,
            "ap_interval": None,
            "ap50": 0.0,
            "ap50_interval": None,
            "ap50_matches": None,
            "ap75": 0.0,
            "ap75_interval": None,
            "per_class": per_class(zeros, zeros, _NO_AP_INTERVALS),
            "size_buckets": buckets(empty, empty, empty, empty_per_class, _NO_AP_INTERVALS),
        }

    from pycocotools.coco import COCO  # imported here: only evaluation needs it
    from pycocotools.cocoeval import COCOeval

    dataset = {
        "info": {},
        "images": images,
        "annotations": annotations,
        "categories": [{"id": c + 1, "name": class_names[c]} for c in range(num_classes)],
    }
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO()
        coco_gt.dataset = dataset
        coco_gt.createIndex()
        coco_dt = coco_gt.loadRes(results)
        evaluation = COCOeval(coco_gt, coco_dt, "bbox")
        evaluation.params.areaRng, evaluation.params.areaRngLbl = _area_ranges()
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    params = evaluation.params
    # precision: [IoU thresholds T, recall thresholds R, classes K, area ranges A, maxDets M]
    precision = evaluation.eval["precision"][:, :, :, params.areaRngLbl.index("all"), -1]
    at_50 = int(np.argmin(np.abs(np.asarray(params.iouThrs) - 0.5)))

    def by_class(values: np.ndarray) -> tuple[list[float | None], list[float | None]]:
        """AP and AP@.5 per class label from one area range's precision [T, R, K]; None for
        a class without ground truth there (pycocotools' -1)."""
        class_ap: list[float | None] = [None] * num_classes
        class_ap50: list[float | None] = [None] * num_classes
        for k, category_id in enumerate(params.catIds):
            found = values[:, :, k]
            if (found > -1).any():
                class_ap[category_id - 1] = float(found[found > -1].mean())
                class_ap50[category_id - 1] = float(found[at_50].mean())
        return class_ap, class_ap50

    ap, ap50 = by_class(precision)
    bucket_ap50: dict[str, float | None] = {}
    bucket_ap: dict[str, float | None] = {}
    bucket_recall: dict[str, float | None] = {}
    recall_counts: dict[str, _RecallCounts] = {}
    bucket_class_ap50: dict[str, list[float | None]] = {}
    for name in SIZE_BUCKETS:
        area = params.areaRngLbl.index(name)
        values = evaluation.eval["precision"][:, :, :, area, -1]  # [T, R, K]
        present = (values > -1).any(axis=(0, 1))  # classes with ground truth in this bucket
        _, bucket_class_ap50[name] = by_class(values)
        if counts[name] == 0 or not present.any():
            bucket_ap50[name] = bucket_ap[name] = bucket_recall[name] = None
            continue
        bucket_ap50[name] = float(values[at_50][:, present].mean())
        bucket_ap[name] = float(values[:, :, present].mean())
        recall_counts[name] = _recall_counts(evaluation, area, at_50, score_threshold)
        bucket_recall[name] = recall_counts[name].recall
    stats = evaluation.stats
    at_75 = int(np.argmin(np.abs(np.asarray(params.iouThrs) - 0.75)))
    intervals = (
        _ap_intervals(evaluation, at_50, at_75, recall_counts) if ap_intervals else _NO_AP_INTERVALS
    )
    return {
        "ap": float(stats[0]),
        "ap_interval": intervals.ap,
        "ap50": float(stats[1]),
        "ap50_interval": intervals.ap50,
        "ap50_matches": intervals.matches,
        "ap75": float(stats[2]),
        "ap75_interval": intervals.ap75,
        "per_class": per_class(ap, ap50, intervals),
        "size_buckets": buckets(
            bucket_ap50, bucket_ap, bucket_recall, bucket_class_ap50, intervals
        ),
    }


def image_level_f1(image_scores: Any, present: Any, threshold: float = 0.5) -> dict[str, Any]:
    """Multi-label "which classes are in this image" F1: a class is predicted when score >= threshold.

    Micro pools over all (image, class) pairs; macro averages over classes present in the
    ground truth or predicted in some image, the same rule as the detection macro. 0/0 is 0.
    """
    scores = np.asarray(image_scores, dtype=np.float64)
    truth = np.asarray(present, dtype=bool)
    if scores.ndim != 2 or scores.shape != truth.shape:
        raise ValueError(
            f"image_scores {scores.shape} and present {truth.shape} must both be [images, classes]."
        )
    predicted = scores >= threshold
    tp = (predicted & truth).sum(axis=0)
    fp = (predicted & ~truth).sum(axis=0)
    fn = (~predicted & truth).sum(axis=0)
    per_class = [_counts(tp[c], fp[c], fn[c]) for c in range(scores.shape[1])]
    micro = _counts(tp.sum(), fp.sum(), fn.sum())
    macro = _macro(per_class, truth.any(axis=0) | predicted.any(axis=0))
    return {
        "threshold": float(threshold),
        "num_images": int(scores.shape[0]),
        "f1": micro["f1"],
        "precision": micro["precision"],
        "recall": micro["recall"],
        "f1_macro": macro["f1"],
        "micro": micro,
        "macro": macro,
    }


def _numpy(tensor: Any, dtype: torch.dtype) -> np.ndarray:
    # through the CPU in float32/int64 first: MPS has no float64, and metrics must not care
    return torch.as_tensor(tensor).detach().to(device="cpu", dtype=dtype).numpy()


_FIELDS = {
    "boxes": (torch.float32, (-1, 4)),
    "scores": (torch.float32, (-1,)),
    "labels": (torch.int64, (-1,)),
    "ignore_boxes": (torch.float32, (-1, 4)),
    "ignore_labels": (torch.int64, (-1,)),
}
IGNORE_KEYS = ("ignore_boxes", "ignore_labels")


def _record(image_id: int, tensors: Record, keys: Sequence[str]) -> dict[str, Any]:
    """One image's tensors as the numpy record the metric functions take."""
    record: dict[str, Any] = {"image_id": image_id}
    for key in keys:
        dtype, shape = _FIELDS[key]
        record[key] = _numpy(tensors[key], dtype).reshape(shape)
    return record


def _clip(boxes: np.ndarray, region: Any) -> np.ndarray:
    """Boxes clipped to the image's own area in the input frame (a target's `region`).

    A letterboxed image fills only part of the square input; a detection reaching into the
    padding is scored as it maps back to the image's own pixels (what the predictions file
    holds): IoU is unchanged by the per-axis scaling between the two frames, not by padding.
    """
    x1, y1, x2, y2 = (float(v) for v in _numpy(region, torch.float32).reshape(4))
    low = np.array([x1, y1, x1, y1], dtype=boxes.dtype)
    high = np.array([x2, y2, x2, y2], dtype=boxes.dtype)
    return np.clip(boxes, low, high)


class Evaluator:
    """Runs a model over a loader and turns its detections into the metrics every stage reports."""

    def __init__(
        self,
        class_names: Sequence[str],
        *,
        label_mode: str,
        image_size: int,
        score_threshold: float | None = 0.3,
        iou_threshold: float = 0.5,
        max_detections: int = 100,
        image_threshold: float = 0.5,
    ) -> None:
        if label_mode not in LABEL_MODES:
            raise ConfigError(
                f"label_mode={label_mode!r} is not understood: use one of {LABEL_MODES}."
            )
        if not class_names:
            raise ConfigError("The evaluator needs at least one class name.")
        self.class_names = list(class_names)
        self.label_mode = label_mode
        self.image_size = int(image_size)
        # None: each pass picks its own best-F1 threshold (see precision_recall_f1)
        self.score_threshold = None if score_threshold is None else float(score_threshold)
        self.iou_threshold = float(iou_threshold)
        self.max_detections = int(max_detections)
        self.image_threshold = float(image_threshold)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], class_names: Sequence[str]) -> Evaluator:
        """The evaluator a resolved config describes (training's validation and `eval` agree)."""
        settings = config["eval"]
        return cls(
            class_names,
            label_mode=config["model"]["label_mode"],
            image_size=config["data"]["image_size"],
            score_threshold=settings["score_threshold"],
            iou_threshold=settings["iou_threshold"],
            max_detections=settings["max_detections"],
        )

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def evaluate(
        self,
        model: torch.nn.Module,
        loader: Iterable[tuple[torch.Tensor, Sequence[Record]]],
        device: DeviceLike,
        precision: str = "fp32",
        chosen_threshold: float | None = None,
        ap_intervals: bool = False,
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Metrics and JSON-ready detections for one pass over `loader`.

        `timing.model_s` is the synchronized forward pass alone (the first batch's warm-up
        included); `images_per_s` and `ms_per_image` derive from it. Decoding and the copy
        to the CPU are `postprocess_s`. The model's train/eval mode is restored afterwards.
        `chosen_threshold` (one picked on other images, say validation's best-F1 threshold)
        adds the micro P/R/F1 at it as `chosen_threshold`; the split's own best-F1 point,
        picked on the very images it is measured on, is optimistic. `ap_intervals` adds AP's
        intervals over the images (see `coco_ap`).
        """
        device = torch.device(device)
        gts: list[dict[str, Any]] = []
        dets: list[dict[str, Any]] = []
        score_rows: list[np.ndarray] = []
        model_s = postprocess_s = 0.0
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode():
                for images, targets in loader:
                    images = images.to(device, non_blocking=True)
                    synchronize(device)
                    start = time.perf_counter()
                    with autocast(device, precision):
                        outputs = model(images)
                    synchronize(device)
                    model_s += time.perf_counter() - start

                    start = time.perf_counter()
                    decoded = model.decode(outputs, max_detections=self.max_detections)
                    if len(decoded) != len(targets) or len(targets) != images.shape[0]:
                        raise ValueError(
                            f"A batch of {images.shape[0]} images came with {len(targets)} targets "
                            f"and {len(decoded)} decoded predictions; they must match one to one."
                        )
                    for prediction, target in zip(decoded, targets, strict=True):
                        image_id = int(target["image_id"])
                        found = _record(image_id, prediction, ("boxes", "scores", "labels"))
                        if "region" in target:
                            found["boxes"] = _clip(found["boxes"], target["region"])
                        dets.append(found)
                        ignore = tuple(key for key in IGNORE_KEYS if key in target)
                        gts.append(_record(image_id, target, ("boxes", "labels", *ignore)))
                    if self.label_mode == "multilabel":
                        score_rows.append(_numpy(model.image_scores(outputs), torch.float32))
                    postprocess_s += time.perf_counter() - start
        finally:
            model.train(was_training)
        metrics = self._metrics(
            gts, dets, score_rows, model_s, postprocess_s, chosen_threshold, ap_intervals
        )
        return metrics, [
            {
                "image_id": det["image_id"],
                "boxes": det["boxes"].tolist(),
                "scores": det["scores"].tolist(),
                "labels": det["labels"].tolist(),
            }
            for det in dets
        ]

    def _metrics(
        self,
        gts: list[dict[str, Any]],
        dets: list[dict[str, Any]],
        score_rows: list[np.ndarray],
        model_s: float,
        postprocess_s: float,
        chosen_threshold: float | None = None,
        ap_intervals: bool = False,
    ) -> dict[str, Any]:
        counts = precision_recall_f1(
            gts,
            dets,
            self.num_classes,
            self.score_threshold,
            self.iou_threshold,
            chosen_threshold,
        )
        coco = coco_ap(
            gts,
            dets,
            self.num_classes,
            (self.image_size, self.image_size),
            self.class_names,
            counts["score_threshold"],
            ap_intervals,
        )
        image_level = None
        if self.label_mode == "multilabel":
            present = np.zeros((len(gts), self.num_classes), dtype=bool)
            for row, gt in enumerate(gts):
                present[row, gt["labels"]] = True
            scores = (
                np.concatenate(score_rows)
                if score_rows
                else np.zeros((0, self.num_classes), dtype=np.float32)
            )
            image_level = image_level_f1(scores, present, self.image_threshold)
        num_images = len(gts)
        per_class = [
            {
                "name": self.class_names[c],
                "num_gt": counts["per_class"][c]["num_gt"],
                "ap": coco["per_class"][c]["ap"],
                "ap_interval": coco["per_class"][c]["ap_interval"],
                "ap50": coco["per_class"][c]["ap50"],
                "ap50_interval": coco["per_class"][c]["ap50_interval"],
                "precision": counts["per_class"][c]["precision"],
                "recall": counts["per_class"][c]["recall"],
                "f1": counts["per_class"][c]["f1"],
                "tp": counts["per_class"][c]["tp"],
                "fp": counts["per_class"][c]["fp"],
                "fn": counts["per_class"][c]["fn"],
            }
            for c in range(self.num_classes)
        ]
        return {
            "f1": counts["micro"]["f1"],
            "f1_interval": counts["f1_interval"],
            "precision": counts["micro"]["precision"],
            "precision_interval": counts["precision_interval"],
            "recall": counts["micro"]["recall"],
            "recall_interval": counts["recall_interval"],
            "f1_macro": counts["macro"]["f1"],
            "best_f1": counts["best"]["f1"],
            "best_f1_threshold": counts["best"]["threshold"],
            "ap": coco["ap"],
            "ap_interval": coco["ap_interval"],
            "ap50": coco["ap50"],
            "ap50_interval": coco["ap50_interval"],
            "ap50_matches": coco["ap50_matches"],
            "ap75": coco["ap75"],
            "ap75_interval": coco["ap75_interval"],
            "per_class": per_class,
            "size_buckets": coco["size_buckets"],
            "micro": counts["micro"],
            "macro": counts["macro"],
            "best": counts["best"],
            "chosen_threshold": counts["chosen_threshold"],
            "image_level": image_level,
            "num_images": num_images,
            "num_ground_truth": counts["num_ground_truth"],
            "num_detections": counts["num_detections"],
            "num_ignored_detections": counts["num_ignored_detections"],
            "per_image": counts["per_image"],
            "score_threshold": counts["score_threshold"],
            "iou_threshold": self.iou_threshold,
            "timing": {
                "model_s": model_s,
                "postprocess_s": postprocess_s,
                "images_per_s": _ratio(num_images, model_s),
                "ms_per_image": 1000.0 * _ratio(model_s, num_images),
            },
        }
