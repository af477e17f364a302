"""COCOeval's bbox matching (`evaluateImg`) and accumulation (`accumulate`) on arrays: the
same matches and precision as pycocotools, bit for bit (tests/test_coco_matching.py), with
every image matched at once and each class's ranking handed to AP's intervals as arrays.

pycocotools matches each image and class in Python, one detection and object at a time, and
keeps a dict per image, class and area range; at a few thousand images that is most of an
evaluation's time. Here the detection-object pairs of every image are measured in one array
operation and the greedy matching steps through the detections' ranks within their image
and class (at most maxDets steps), every image, area range and IoU threshold at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.evaluation.matching import same_class_pairs
from pipeline.evaluation.records import Record, check_joined_labels, end_to_end
from pipeline.evaluation.weighted_ap import RECALL_THRESHOLDS, ClassRanking

IOU_THRESHOLDS = np.linspace(0.5, 0.95, 10)  # COCOeval's iouThrs, as it makes them
MAX_DETECTIONS = 100  # per image and class: COCO's AP, AP@.5 and AP@.75 (stats[0:3])
# a pair below the lowest threshold is never a candidate: pycocotools compares each IoU with
# min(threshold, 1 - 1e-10)
_LOWEST = min(float(IOU_THRESHOLDS[0]), 1 - 1e-10)


@dataclass(frozen=True)
class Boxes:
    """Boxes of many images, as COCO's files hold them: xywh float64, with the image's position
    in the sorted image ids and the 0-based class of each."""

    xywh: np.ndarray  # float64 [N, 4]
    image: np.ndarray  # int64 [N]
    labels: np.ndarray  # int64 [N]

    @property
    def area(self) -> np.ndarray:
        """w * h, what COCO.loadRes gives a bbox result and our annotations carry."""
        return self.xywh[:, 2] * self.xywh[:, 3]


def as_arrays(
    truth: Mapping[int, Record],
    found: Mapping[int, Record],
    image_ids: Sequence[int],
    num_classes: int,
) -> tuple[Boxes, np.ndarray, Boxes, np.ndarray]:
    """(objects, which of them are crowd regions, detections, their scores) of the records as
    COCO's files would hold them (xywh in float64, w = x2 - x1), by image position in
    `image_ids`: each image's objects, then its ignore regions (iscrowd=1), in their order.
    Each field is laid end to end once and checked once (a record per image is thousands)."""
    dt_ids = [i for i in image_ids if i in found]
    gt_boxes, gt_labels = (
        [np.asarray(truth[i].get(key, _NONE[key])) for i in image_ids for key in keys]
        for keys in (("boxes", "ignore_boxes"), ("labels", "ignore_labels"))
    )
    dt_boxes, dt_labels, scores = (
        [np.asarray(found[i][key]) for i in dt_ids] for key in ("boxes", "labels", "scores")
    )
    gt_ids = [i for i in image_ids for _ in range(2)]
    objects, gt_sizes = _laid_out(gt_boxes, gt_labels, gt_ids, num_classes, "Ground truth")
    detections, dt_sizes = _laid_out(dt_boxes, dt_labels, dt_ids, num_classes, "Detections")
    score_sizes = np.fromiter((part.size for part in scores), np.int64, len(scores))
    if (score_sizes != dt_sizes).any():
        at = int(np.flatnonzero(score_sizes != dt_sizes)[0])
        raise ValueError(
            f"Detections of image {dt_ids[at]} disagree in length: {dt_sizes[at]} boxes and "
            f"labels, {score_sizes[at]} scores."
        )
    position = {image_id: n for n, image_id in enumerate(image_ids)}
    gt_image = np.repeat(np.arange(len(image_ids)).repeat(2), gt_sizes)
    dt_image = np.repeat(
        np.fromiter((position[i] for i in dt_ids), np.int64, len(dt_ids)), dt_sizes
    )
    crowd = np.repeat(np.tile([False, True], len(image_ids)), gt_sizes)
    joined_scores = end_to_end(scores)
    return (
        Boxes(objects.xywh, gt_image, objects.labels),
        crowd,
        Boxes(detections.xywh, dt_image, detections.labels),
        joined_scores.astype(np.float64),
    )


# what a record without ignore regions holds (shaped as a record's own arrays)
_NONE = {
    **dict.fromkeys(("boxes", "ignore_boxes"), np.zeros((0, 4))),
    **dict.fromkeys(("labels", "ignore_labels"), np.zeros(0)),
}


def _laid_out(
    boxes: list[np.ndarray], labels: list[np.ndarray], ids: list[int], classes: int, what: str
) -> tuple[Boxes, np.ndarray]:
    """Each part's xyxy boxes and labels end to end as xywh (image positions left for the
    caller), with each part's size; a part whose boxes and labels disagree, or a label out of
    range, refused naming its image."""
    box_sizes = np.fromiter((part.size for part in boxes), np.int64, len(boxes))
    sizes = np.fromiter((part.size for part in labels), np.int64, len(labels))
    if (box_sizes != 4 * sizes).any():
        at = int(np.flatnonzero(box_sizes != 4 * sizes)[0])
        raise ValueError(
            f"{what} of image {ids[at]} disagree in length: {box_sizes[at] / 4:g} boxes, "
            f"{sizes[at]} labels."
        )
    xyxy = end_to_end(boxes, 4).astype(np.float64)
    joined = end_to_end(labels).astype(np.int64)
    check_joined_labels(joined, np.repeat(np.arange(sizes.size), sizes), ids, classes, what)
    xywh = np.concatenate([xyxy[:, :2], xyxy[:, 2:] - xyxy[:, :2]], axis=1)
    return Boxes(xywh, np.zeros(0, np.int64), joined), sizes


@dataclass(frozen=True)
class Matched:
    """Every kept detection (at most maxDets per image and class, the highest scored) as
    COCOeval.evaluateImg leaves it in each area range [A] at each IoU threshold [T], and the
    objects that count there. The detections are laid out by image, class and rank."""

    scores: np.ndarray  # float64 [N]
    image: np.ndarray  # int64 [N]: position in the sorted image ids
    labels: np.ndarray  # int64 [N]
    rank: np.ndarray  # int64 [N]: the place in its image and class, by descending score
    matched: np.ndarray  # bool [A, T, N]: matched to an object, ignored or not
    ignored: np.ndarray  # bool [A, T, N]: COCOeval's dtIgnore
    objects: np.ndarray  # int64 [K, A, I]: each class's objects that count, by image

    def found(self, iou: int, score_threshold: float) -> np.ndarray:
        """[A, I] the objects found at one IoU by the detections scoring >= the threshold.

        COCOeval matches greedily in descending score, so a detection's match never depends
        on lower-scored ones: the kept detections' matches are those of the full matching. A
        detection matched and not ignored is matched to an object that counts, each such
        object to one detection: counting those detections counts the objects found."""
        hit = self.matched[:, iou] & ~self.ignored[:, iou] & (self.scores >= score_threshold)
        _, areas, images = self.objects.shape
        place = np.arange(areas)[:, None] * images + self.image[None, :]
        return np.bincount(place[hit], minlength=areas * images).reshape(areas, images)

    def rankings(self) -> list[ClassRanking]:
        """Each class's ranking, as COCOeval.accumulate ranks it (descending score, stable
        over the images in order and each image's own ranking), cut after its last true
        positive: what `accumulate` and AP's intervals read."""
        # the detections are laid out by image, class and rank (`_kept`): a stable sort by
        # class and descending score leaves the ties by image and rank
        order = _by_score_within(self.labels, self.scores)
        bounds = np.searchsorted(self.labels[order], np.arange(self.objects.shape[0] + 1))
        hit = self.matched & ~self.ignored
        anywhere = hit.any(axis=(0, 1))  # a true positive in some area range at some IoU
        result = []
        for k in range(self.objects.shape[0]):
            mine = order[bounds[k] : bounds[k + 1]]
            found = np.flatnonzero(anywhere[mine])
            mine = mine[: found[-1] + 1 if found.size else 0]  # cut: only these are gathered
            result.append(
                ClassRanking(
                    self.image[mine],
                    np.take(hit, mine, axis=2),
                    ~np.take(self.ignored, mine, axis=2),
                    self.objects[k],
                )
            )
        return result


def accumulate(rankings: Sequence[ClassRanking]) -> np.ndarray:
    """COCOeval.accumulate's precision [T, R, K, A] at maxDets from each class's ranking, -1
    where a class has no objects that count in an area range: its arithmetic, operation for
    operation, at the true positives only. The false positives a ranking leaves out after
    its last true positive move no figure: their precision is below the one there, and the
    recall they reach is reached there. So do those between: recall steps up only at a true
    positive, so each recall point is first reached at one, and a detection that is not one
    has a precision at most that of the last true positive before it, so the best precision
    at or after a true positive is the best over the true positives there."""
    areas, ious, _ = rankings[0].is_tp.shape
    result = -np.ones((ious, RECALL_THRESHOLDS.size, len(rankings), areas))
    for k, ranking in enumerate(rankings):
        objects = ranking.gt_per_image.sum(axis=1)  # [A]
        for a in range(areas):
            if objects[a] == 0:
                continue
            for t in range(ious):
                hits = np.flatnonzero(ranking.is_tp[a, t])
                counted = np.flatnonzero(ranking.counted[a, t])
                # the detections counted up to each true positive, less the true positives
                tp_count = np.arange(1, hits.size + 1)
                fp_sum = (np.searchsorted(counted, hits, side="right") - tp_count).astype(
                    np.float64
                )
                tp_sum = tp_count.astype(np.float64)
                recall = tp_sum / objects[a]
                precise = tp_sum / (fp_sum + tp_sum + np.spacing(1))
                # accumulate's backward pass: each precision the highest at or after it
                precise = np.maximum.accumulate(precise[::-1])[::-1]
                reached = np.searchsorted(recall, RECALL_THRESHOLDS, side="left")
                inside = reached < hits.size  # recall points never reached: 0
                result[t, inside, k, a] = precise[reached[inside]]
                result[t, ~inside, k, a] = 0.0
    return result


def _pair_iou(found: Boxes, truth: Boxes, crowd: np.ndarray, pairs: tuple) -> np.ndarray:
    """pycocotools' bbIou of each (detection, object) pair, its operations in its order:
    right and bottom edges as x + w, a crowd region's overlap over the detection's area."""
    d, g = pairs
    dt, gt = found.xywh[d], truth.xywh[g]
    width = np.fmin(dt[:, 2] + dt[:, 0], gt[:, 2] + gt[:, 0]) - np.fmax(dt[:, 0], gt[:, 0])
    height = np.fmin(dt[:, 3] + dt[:, 1], gt[:, 3] + gt[:, 1]) - np.fmax(dt[:, 1], gt[:, 1])
    overlap = (width > 0) & (height > 0)
    inter = np.where(overlap, width * height, 0.0)
    dt_area, gt_area = dt[:, 2] * dt[:, 3], gt[:, 2] * gt[:, 3]
    union = np.where(crowd[g], dt_area, dt_area + gt_area - inter)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(overlap, inter / np.where(overlap, union, 1.0), 0.0)


def _by_score_within(groups: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """np.lexsort((-scores, groups)): by group, then descending score, ties in their order,
    as two stable argsorts (numpy's lexsort compares a float key several times slower)."""
    order = np.argsort(-scores, kind="stable")
    return order[_stable_order(groups[order])]


def _stable_order(keys: np.ndarray) -> np.ndarray:
    """np.argsort(keys, kind="stable") of integer keys, sorted in the narrowest integer type
    that holds them: numpy sorts 8- and 16-bit integers by radix, several times faster than
    int64 (a class, or an image and class, of a few thousand images fits in 16 bits)."""
    if keys.size:
        keys = keys.astype(
            np.promote_types(
                np.min_scalar_type(int(keys.min())), np.min_scalar_type(int(keys.max()))
            )
        )
    return np.argsort(keys, kind="stable")


def _descending_within(blocks: np.ndarray, scores: np.ndarray) -> bool:
    """Whether `blocks` (of equal ids) lie one after the other, ascending, and within each the
    scores never rise: a detector's detections of each image, as decoded, best first."""
    same = blocks[1:] == blocks[:-1]
    return bool(((blocks[1:] > blocks[:-1]) | (same & (scores[1:] <= scores[:-1]))).all())


def _kept(found: Boxes, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(indices, ranks) of the detections COCOeval keeps: each image and class's highest
    `MAX_DETECTIONS` by score (a stable sort: ties keep their order), with their rank there.

    Where each image's detections come best first (as a detector decodes them), the order
    within an image and class is its ranking already: a stable sort by the group alone keeps
    it, and the sort by score (most of the work) is left out."""
    groups = found.image * (int(found.labels.max(initial=0)) + 1) + found.labels
    if _descending_within(found.image, scores):
        order = _stable_order(groups)
    else:
        order = _by_score_within(groups, scores)
    group = groups[order]
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    sizes = np.diff(np.r_[starts, order.size])
    rank = np.arange(order.size) - np.repeat(starts, sizes)
    kept = rank < MAX_DETECTIONS
    return order[kept], rank[kept]


def match(
    found: Boxes,
    scores: np.ndarray,
    truth: Boxes,
    crowd: np.ndarray,
    area_ranges: list[list[float]],
    classes: int,
    images: int,
) -> Matched:
    """Match as COCOeval.evaluateImg does, every image at once, in each area range.

    `truth` is laid out by image position ascending, each image's boxes in annotation order;
    `crowd` marks its crowd regions (iscrowd=1: never counted, matched by the overlap over
    the detection's area, any number of times). pycocotools' rules: in each image and class,
    each detection in descending score takes, at each IoU threshold, the unmatched object
    that counts with the highest IoU >= the threshold (the last in annotation order among
    equals); only where none is left, the ignored ones alike (crowds, and objects outside
    the area range, those once). A detection matched to an ignored object is ignored, and
    one matched to nothing outside the area range too. Detections are laid out by position
    in their image and class (`Matched.rank`), so the greedy loop runs over ranks (at most
    MAX_DETECTIONS), all images and thresholds at each: within a rank, no two detections
    share an image and class, so none competes with another for an object."""
    kept, rank = _kept(found, scores)
    areas = len(area_ranges)
    bounds = np.asarray(area_ranges, dtype=np.float64)  # [A, 2]
    gt_area = truth.area
    outside = (gt_area[None, :] < bounds[:, :1]) | (gt_area[None, :] > bounds[:, 1:])  # [A, G]
    gt_ignored = outside | crowd[None, :]
    dt_area = found.area[kept]
    dt_outside = (dt_area[None, :] < bounds[:, :1]) | (dt_area[None, :] > bounds[:, 1:])
    # pairs of a kept detection (its position in `kept`) and an object that may match it
    detection, obj = same_class_pairs(
        found.image[kept], found.labels[kept], truth.image, truth.labels
    )
    iou = _pair_iou(found, truth, crowd, (kept[detection], obj))
    close = iou >= _LOWEST
    detection, obj, iou = detection[close], obj[close], iou[close]
    ious = IOU_THRESHOLDS.size
    thresholds = np.minimum(IOU_THRESHOLDS, 1 - 1e-10)[:, None]
    matched = np.zeros((areas, ious, kept.size), dtype=bool)
    ignored = np.repeat(dt_outside[:, None, :], ious, axis=1)  # matched to nothing: by area
    for a in range(areas):
        # within each detection its candidates in the order of preference, the best last:
        # objects that count over ignored ones, then IoU, then the later annotation
        order = np.lexsort((obj, iou, ~gt_ignored[a, obj], detection, rank[detection]))
        d, g, values = detection[order], obj[order], iou[order]
        rank_bounds = np.searchsorted(rank[d], np.arange(MAX_DETECTIONS + 1))
        taken = np.zeros((ious, truth.labels.size), dtype=bool)
        for r in range(MAX_DETECTIONS):
            start, stop = rank_bounds[r], rank_bounds[r + 1]
            if start == stop:
                continue
            mine, theirs = d[start:stop], g[start:stop]
            free = (values[start:stop] >= thresholds) & (crowd[theirs] | ~taken[:, theirs])
            firsts = np.flatnonzero(np.r_[True, mine[1:] != mine[:-1]])
            best = np.maximum.reduceat(
                np.where(free, np.arange(stop - start), -1), firsts, axis=1
            )  # [T, detections of this rank]: the last free candidate of each, -1 for none
            t, which = np.nonzero(best >= 0)
            chosen = theirs[best[t, which]]
            taken[t, chosen] = True
            found_it = mine[firsts[which]]
            matched[a, t, found_it] = True
            ignored[a, t, found_it] = gt_ignored[a, chosen]  # as its object
    counts = ~gt_ignored  # [A, G]
    objects = np.zeros((classes, areas, images), dtype=np.int64)
    for a in range(areas):
        objects[:, a] = np.bincount(
            truth.labels[counts[a]] * images + truth.image[counts[a]], minlength=classes * images
        ).reshape(classes, images)
    return Matched(
        scores[kept], found.image[kept], found.labels[kept], rank, matched, ignored, objects
    )
