"""Matching detections to objects, and P/R/F1 from the matches: the one matcher, whose rules
for ties and ignore regions (crowds, difficult objects) hold for every figure computed from it.

Conventions: boxes are xyxy pixels in the model's input frame, labels are 0-based class
indices; ground truth and detections are per-image dicts of numpy arrays keyed by
`image_id`. Ratios whose denominator is zero (0/0) are defined as 0, never NaN.

Ground truth may carry ignore regions (`ignore_boxes`, `ignore_labels`: COCO crowd
regions, VOC difficult objects). A detection that matches no object but covers an
ignore region of its class is neither a true nor a false positive: it is left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pipeline.evaluation.image_bootstrap import f1_of_counts, micro_intervals
from pipeline.evaluation.records import (
    NOTHING_FOUND,
    Images,
    Record,
    as_boxes,
    as_vector,
    by_image,
    check_joined_labels,
    image_detections,
    image_objects,
    laid_end_to_end,
)

# The operating point of a pass without detections: nothing is kept at any threshold.
NO_DETECTIONS_THRESHOLD = 1.0
# The matching rules a figure follows (config eval.protocol; auto: the data set's own format).
PROTOCOLS = ("coco", "voc", "voc2007")
# Which protocol each figure of an evaluation follows under each eval.protocol: AP@[.5:.95],
# AP@.75, the size buckets and the matches kept for pairing two runs exist only as COCO's.
FIGURE_PROTOCOLS = {
    "coco": dict.fromkeys(("f1", "ap50", "ap", "ap75", "size_buckets", "ap50_matches"), "coco"),
    **{
        voc: {
            "f1": "voc",  # VOC2007 matches as later VOC does
            "ap50": voc,
            **dict.fromkeys(("ap", "ap75", "size_buckets", "ap50_matches"), "coco"),
        }
        for voc in ("voc", "voc2007")
    },
}


def resolve_protocol(protocol: str, data_format: str) -> str:
    """eval.protocol as it applies: auto is the data set's own (VOC's for VOC data, else COCO's)."""
    if protocol == "auto":
        return "voc" if data_format == "voc" else "coco"
    if protocol not in PROTOCOLS:
        raise ValueError(f"eval.protocol {protocol!r} is not one of auto, {', '.join(PROTOCOLS)}")
    return protocol


def ratio(numerator: float, denominator: float) -> float:
    return float(numerator) / float(denominator) if denominator else 0.0


def count_figures(tp: int, fp: int, fn: int) -> dict[str, float | int]:
    """P/R/F1 from counts; F1 = 2TP / (2TP + FP + FN), which is 0 rather than NaN when P = R = 0."""
    return {
        "precision": ratio(tp, tp + fp),
        "recall": ratio(tp, tp + fn),
        "f1": float(f1_of_counts(tp, fp, fn)),
        "tp": int(tp),
        "fp": int(fp),
        "fn": int(fn),
    }


def measured_class_figures(counts: Mapping[str, Any], num_gt: int) -> dict[str, Any]:
    """One class's `count_figures` with None where its counts measure nothing: a class with no
    objects in the split has no recall (0/0, not a miss), and without kept detections either
    no precision or F1 (the classes the macro mean leaves out); its detections, all false,
    still give precision and F1 0."""
    if num_gt:
        return dict(counts)
    detected = counts["tp"] + counts["fp"]
    return {
        **counts,
        "recall": None,
        **({} if detected else {"precision": None, "f1": None}),
    }


def macro_figures(rows: Sequence[Mapping[str, Any]], active: np.ndarray) -> dict[str, float | int]:
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


def matched_objects(
    det_boxes: Any,
    det_scores: Any,
    det_labels: Any,
    gt_boxes: Any,
    gt_labels: Any,
    iou_threshold: float = 0.5,
) -> np.ndarray:
    """For each detection of one image, in the detections' original order, the index of the
    ground-truth object it matches, -1 for none (`matched_in_images`' rule)."""
    boxes, scores, labels = image_detections(det_boxes, det_scores, det_labels)
    truth_boxes, truth_labels = image_objects(gt_boxes, gt_labels)
    return matched_in_images(
        Images(boxes, scores, labels, np.zeros(len(scores), dtype=np.int64)),
        Images(truth_boxes, None, truth_labels, np.zeros(len(truth_labels), dtype=np.int64)),
        iou_threshold,
    )


def _paired_iou(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """IoU of each row of `first` with the same row of `second`, [P, 4] xyxy each, in float64,
    with torchvision's box_iou's operations in its order (the same values, bit for bit)."""
    area_first = (first[:, 2] - first[:, 0]) * (first[:, 3] - first[:, 1])
    area_second = (second[:, 2] - second[:, 0]) * (second[:, 3] - second[:, 1])
    sides = np.clip(
        np.minimum(first[:, 2:], second[:, 2:]) - np.maximum(first[:, :2], second[:, :2]), 0, None
    )
    inter = sides[:, 0] * sides[:, 1]
    with np.errstate(invalid="ignore", divide="ignore"):  # 0/0 of two empty boxes: never a match
        return inter / (area_first + area_second - inter)


def same_class_pairs(
    found_image: np.ndarray,
    found_labels: np.ndarray,
    truth_image: np.ndarray,
    truth_labels: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(detection, object) index pairs of every detection with every object of its image and
    class, detection by detection, each one's objects in their order; images ascending on
    both sides (as `Images` lays them): work in proportion to the pairs of a class, not to
    all boxes of an image."""
    if found_image.size == 0 or truth_image.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    lowest = min(int(found_labels.min()), int(truth_labels.min()))
    classes = max(int(found_labels.max()), int(truth_labels.max())) - lowest + 1
    images = int(max(found_image.max(), truth_image.max())) + 1
    # each (image, class) cell's objects together, in their order
    truth_cell = truth_image * classes + (truth_labels - lowest)
    by_cell = np.argsort(truth_cell, kind="stable")
    objects = np.bincount(truth_cell, minlength=images * classes)
    first_object = np.cumsum(objects) - objects
    found_cell = found_image * classes + (found_labels - lowest)
    per_detection = objects[found_cell]
    detection = np.repeat(np.arange(found_image.size), per_detection)
    within = np.arange(detection.size) - np.repeat(
        np.cumsum(per_detection) - per_detection, per_detection
    )
    return detection, by_cell[first_object[found_cell][detection] + within]


def matched_in_images(found: Images, truth: Images, iou_threshold: float) -> np.ndarray:
    """For each detection, the index (into `truth`) of the object it matches, -1 for none:
    every image matched at once.

    In each image, greedy in descending score (stable for ties), each detection takes the
    unmatched ground truth of its class with the highest IoU >= threshold (the lowest index
    among equals). Because a detection's fate never depends on lower-scored ones, matching
    once and then dropping detections below a score threshold gives the same flags as matching
    only those above it: one pass serves every threshold. The pairs of a detection and an
    object of its image and class are measured all at once; only those at the threshold or
    above (a few among a detector's top 100) go through the greedy loop.
    """
    matched = np.full(len(found.labels), -1, dtype=np.int64)
    if len(found.labels) == 0 or len(truth.labels) == 0:
        return matched
    detection, obj = same_class_pairs(found.image, found.labels, truth.image, truth.labels)
    iou = _paired_iou(found.boxes[detection], truth.boxes[obj])
    close = iou >= iou_threshold
    detection, obj, iou = detection[close], obj[close], iou[close]
    # the pairs by their detection's image, its descending score there (stable: ties by
    # position), then by IoU: ranking only the detections of pairs at the threshold (a few
    # among a detector's top 100), not all of them
    order = np.lexsort((obj, -iou, detection, -found.scores[detection], found.image[detection]))
    taken = bytearray(len(truth.labels))
    done = -1
    for index, best in zip(detection[order].tolist(), obj[order].tolist(), strict=True):
        if index != done and not taken[best]:
            taken[best], matched[index], done = 1, best, index
    return matched


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
    boxes, labels = as_boxes(det_boxes), as_vector(det_labels, np.int64)
    regions, region_labels = as_boxes(ignore_boxes), as_vector(ignore_labels, np.int64)
    if len(regions) != len(region_labels):
        raise ValueError(
            f"Ignore regions disagree in length: {len(regions)} boxes, {len(region_labels)} labels."
        )
    if len(boxes) == 0 or len(regions) == 0:
        return np.zeros(len(boxes), dtype=bool)
    overlap = _intersection_over_detection(boxes, regions)
    overlap[labels[:, None] != region_labels[None, :]] = -1.0
    return ~np.asarray(is_tp, dtype=bool) & (overlap.max(axis=1) >= threshold)


def match_voc(
    det_boxes: Any,
    det_scores: Any,
    det_labels: Any,
    gt_boxes: Any,
    gt_labels: Any,
    difficult_boxes: Any,
    difficult_labels: Any,
    iou_threshold: float = 0.5,
) -> tuple[np.ndarray, np.ndarray]:
    """(true positive, ignored) flags for each detection of one image, as the VOC devkit
    matches: in descending score (stable for ties), each detection looks only at the object of
    its class with the highest IoU, difficult objects included. Above the threshold (strictly),
    a difficult object makes it neither true nor false positive, a free object a true positive,
    an object already taken a false positive: no fallback to the next best. Else a false
    positive. IoU over continuous xyxy boxes equals the devkit's +1-pixel areas of the VOC
    files' inclusive pixel boxes, which the loader turns into these."""
    boxes, scores = as_boxes(det_boxes), as_vector(det_scores, np.float64)
    labels = as_vector(det_labels, np.int64)
    truth = np.concatenate([as_boxes(gt_boxes), as_boxes(difficult_boxes)])
    truth_labels = np.concatenate(
        [as_vector(gt_labels, np.int64), as_vector(difficult_labels, np.int64)]
    )
    difficult = np.arange(truth_labels.size) >= as_vector(gt_labels, np.int64).size
    is_tp = np.zeros(len(scores), dtype=bool)
    ignored = np.zeros(len(scores), dtype=bool)
    if len(scores) == 0 or truth_labels.size == 0:
        return is_tp, ignored
    from torchvision.ops import box_iou  # here: importing torchvision imports torch's compiler

    iou = box_iou(torch.from_numpy(boxes), torch.from_numpy(truth)).numpy()
    iou[labels[:, None] != truth_labels[None, :]] = -1.0
    taken = np.zeros(truth_labels.size, dtype=bool)
    for index in np.argsort(-scores, kind="stable"):
        best = int(np.argmax(iou[index]))
        if iou[index, best] > iou_threshold:
            if difficult[best]:
                ignored[index] = True
            elif not taken[best]:
                taken[best] = is_tp[index] = True
    return is_tp, ignored


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
    gt_by_class: np.ndarray  # int64 [C, N]: each image's objects of each class
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


def pool(
    gts: Iterable[Record],
    dets: Iterable[Record],
    num_classes: int,
    iou_threshold: float,
    protocol: str = "coco",
) -> _Pooled:
    """Match every image's detections by `protocol`'s rules, once: COCO's (greedy, the best
    unmatched object at IoU >= threshold, then the crowd rule on ignore regions) or VOC's
    (`match_voc`, ignore regions as difficult objects; VOC2007 matches alike)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol {protocol!r} is not one of {PROTOCOLS}")
    truth, found = by_image(gts, dets)
    # by image position, where it has any
    regions = {
        position: (gt["ignore_boxes"], gt.get("ignore_labels", ()))
        for position, gt in enumerate(truth.values())
        if len(gt.get("ignore_boxes", ()))
    }
    found_all = laid_end_to_end([found.get(image_id, NOTHING_FOUND) for image_id in truth], True)
    truth_all = laid_end_to_end(list(truth.values()), scores=False)
    for what, images in (("Ground truth", truth_all), ("Detections", found_all)):
        check_joined_labels(images.labels, images.image, list(truth), num_classes, what)
    cells = truth_all.labels * len(truth) + truth_all.image  # [class, image], flattened
    gt_by_class = np.bincount(cells, minlength=num_classes * len(truth)).reshape(num_classes, -1)
    gt_per_image, gt_per_class = gt_by_class.sum(axis=0), gt_by_class.sum(axis=1)
    if FIGURE_PROTOCOLS[protocol]["f1"] == "voc":
        is_tp, counted = _voc_flags(found_all, truth_all, regions, iou_threshold)
    else:
        is_tp = matched_in_images(found_all, truth_all, iou_threshold) >= 0
        counted = np.ones(len(is_tp), dtype=bool)
        for position, (boxes, labels) in regions.items():
            mine = found_all.of_image(position)
            counted[mine] = ~ignored_detections(
                found_all.boxes[mine], found_all.labels[mine], is_tp[mine], boxes, labels,
                iou_threshold,
            )  # fmt: skip
    return _Pooled(
        scores=found_all.scores[counted],
        labels=found_all.labels[counted],
        is_tp=is_tp[counted],
        image_index=found_all.image[counted],
        image_ids=list(truth),
        gt_per_image=gt_per_image,
        gt_per_class=gt_per_class,
        gt_by_class=gt_by_class,
        ignored=int((~counted).sum()),
    )


def _voc_flags(
    found: Images, truth: Images, regions: Mapping[int, tuple[Any, Any]], iou_threshold: float
) -> tuple[np.ndarray, np.ndarray]:
    """(true positive, counted) of every detection, matched image by image as the VOC devkit
    matches (`match_voc`, ignore regions as difficult objects)."""
    is_tp = np.zeros(len(found.labels), dtype=bool)
    counted = np.ones(len(found.labels), dtype=bool)
    for position in np.unique(found.image).tolist():
        mine, theirs = found.of_image(position), truth.of_image(position)
        difficult = regions.get(position, ((), ()))
        is_tp[mine], on_difficult = match_voc(
            found.boxes[mine], found.scores[mine], found.labels[mine],
            truth.boxes[theirs], truth.labels[theirs], *difficult, iou_threshold,
        )  # fmt: skip
        counted[mine] = ~on_difficult
    return is_tp, counted


def _best_f1(pooled: _Pooled, fallback_threshold: float) -> dict[str, float]:
    """Sweep every distinct detection score as a threshold (keep score >= t) for the best micro F1.

    Tied scores stay together: a threshold cannot split them. Among equal F1s the highest
    threshold wins (fewer detections). With no detections there is nothing to sweep: F1 is 0
    and the threshold reported is the configured one.
    """
    num_gt = int(pooled.gt_per_class.sum())
    if pooled.scores.size == 0:
        return {"threshold": float(fallback_threshold), "precision": 0.0, "recall": 0.0, "f1": 0.0}
    # tied scores are one threshold, read at the tie's end: their order changes no figure, so
    # numpy's quicksort serves, several times faster than its stable sort. Not where a NaN
    # (each one a threshold of its own) or -0.0 (equal to 0.0, written apart) is among them.
    zero = pooled.scores == 0
    odd = np.isnan(pooled.scores).any() or np.signbit(pooled.scores[zero]).any()
    order = np.argsort(-pooled.scores, kind="stable" if odd else None)
    sorted_scores = pooled.scores[order]
    cum_tp = np.cumsum(pooled.is_tp[order])
    kept = np.arange(1, len(order) + 1)
    group_ends = np.flatnonzero(np.r_[sorted_scores[1:] != sorted_scores[:-1], True])
    f1 = 2 * cum_tp[group_ends] / (kept[group_ends] + num_gt)
    end = int(group_ends[int(np.argmax(f1))])
    return {
        "threshold": float(sorted_scores[end]),
        "precision": ratio(cum_tp[end], kept[end]),
        "recall": ratio(cum_tp[end], num_gt),
        "f1": float(f1.max()),
    }


def _micro_at(
    pooled: _Pooled, threshold: float, intervals: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Micro P/R/F1 of the detections scoring >= `threshold`, from one matching pass, with the
    F1's interval over the images (`intervals`: the micro intervals at this threshold, where
    they are known already)."""
    kept = pooled.scores >= threshold
    tp = int((kept & pooled.is_tp).sum())
    if intervals is None:
        intervals = micro_intervals(pooled.per_image(threshold))
    return {
        "threshold": float(threshold),
        **count_figures(tp, int(kept.sum()) - tp, int(pooled.gt_per_class.sum()) - tp),
        "f1_interval": intervals["f1"],
    }


def precision_recall_f1(
    gts: Iterable[Record],
    dets: Iterable[Record],
    num_classes: int,
    score_threshold: float | None,
    iou_threshold: float = 0.5,
    chosen_threshold: float | None = None,
    protocol: str = "coco",
) -> dict[str, Any]:
    """Micro, macro and per-class P/R/F1 at one score threshold, plus the best-F1 operating point.

    Detections with score >= score_threshold count; None takes the best-F1 threshold of these
    detections (what training's validation picks as the model's operating point; with no
    detections, 1.0). Micro pools TP/FP/FN over classes.
    Macro is the unweighted mean over classes that have ground truth or kept detections: a
    class absent from both has no defined P/R and would only drag the mean to 0, while a
    class with detections but no ground truth is all false positives and must count.
    0/0 is 0, except in `per_class`, where what a class's counts cannot measure is None
    (`measured_class_figures`); the macro mean still counts recall 0 for a class with
    detections but no objects, as sklearn's does. With no ground truth at all, recall is 0/0
    and precision is 0 (or 0/0), so every figure is 0 even for a model that rightly predicts
    nothing: check `num_ground_truth`.
    Detections on ignore regions count nowhere (`num_ignored_detections`).
    `chosen_threshold` adds the micro figures at that threshold too (`chosen_threshold`),
    from the same matching. `per_image` holds each image's TP/FP/FN at `score_threshold`, and
    `f1_interval`, `precision_interval` and `recall_interval` the 95% intervals of the micro
    figures over these images (None without images). `protocol` names the matching rules
    (`pool`): COCO's, or the VOC devkit's.
    """
    pooled = pool(gts, dets, num_classes, iou_threshold, protocol)
    if score_threshold is None:
        score_threshold = _best_f1(pooled, NO_DETECTIONS_THRESHOLD)["threshold"]
    kept = pooled.scores >= score_threshold
    tp = np.bincount(pooled.labels[kept & pooled.is_tp], minlength=num_classes)
    detected = np.bincount(pooled.labels[kept], minlength=num_classes)
    fp = detected - tp
    fn = pooled.gt_per_class - tp
    per_image = pooled.per_image(score_threshold)
    intervals = micro_intervals(per_image)
    counts = [count_figures(tp[c], fp[c], fn[c]) for c in range(num_classes)]
    num_gt = pooled.gt_per_class.tolist()
    return {
        "score_threshold": float(score_threshold),
        "iou_threshold": float(iou_threshold),
        "micro": count_figures(tp.sum(), fp.sum(), fn.sum()),
        "macro": macro_figures(counts, (pooled.gt_per_class > 0) | (detected > 0)),
        "per_class": [
            {"label": c, "num_gt": num_gt[c], **measured_class_figures(counts[c], num_gt[c])}
            for c in range(num_classes)
        ],
        "best": _best_f1(pooled, score_threshold),
        # at the score threshold itself (evaluate's test split, at the operating point picked
        # on validation, is the usual case), its intervals are those just resampled
        "chosen_threshold": None
        if chosen_threshold is None
        else _micro_at(
            pooled, chosen_threshold, intervals if chosen_threshold == score_threshold else None
        ),
        "num_ground_truth": int(pooled.gt_per_class.sum()),
        "num_detections": int(pooled.scores.size),
        "num_ignored_detections": pooled.ignored,
        "per_image": per_image,
        **{f"{name}_interval": interval for name, interval in intervals.items()},
    }
