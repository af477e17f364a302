"""AP of one class's ranked detections with each image weighted (how often a resample drew
it), every resample at once (an array dimension): COCOeval.accumulate's arithmetic, or the VOC
devkit's all-point AP, on pycocotools' own matches. AP's intervals (`intervals`) and AP@.5's
paired change (`paired_ap`) read it.

A resample reweighs images, it never matches again: a detection's fate is the one pycocotools
gave it. One class's detections are ranked once, as COCOeval.accumulate ranks them; that order
holds in every area range and at every IoU threshold, so each resample's image weights are
gathered and summed along it once per class, and each (area range, IoU) reads its true and
false positives off those sums.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.evaluation.weighted_sums import SumsAt, Weights, accumulate_rows

RECALL_THRESHOLDS = np.linspace(0.0, 1.0, 101)  # COCOeval's recThrs


@dataclass(frozen=True)
class ClassMatches:
    """One class's detections as COCOeval matched them at one IoU in one area range (at most
    maxDets[-1] per image), in the order COCOeval.accumulate ranks them, up to the last true
    positive. Detections COCOeval ignores are left out (they move neither count), and the false
    positives after the last true positive too: they lower precision at a recall already
    reached, so no resample's AP depends on them (and most of a detector's top 100 are those)."""

    image_index: np.ndarray  # int64 [D]: each detection's image, a position in the image list
    is_tp: np.ndarray  # bool [D]; the others are false positives
    gt_per_image: np.ndarray  # int64 [I]: objects that count (not crowd, not ignored)

    def as_document(self, label: int) -> dict[str, Any]:
        """The eval JSON's form (`metrics.ap50_matches.classes[]`): every object's image
        position once, so an image with three objects is listed three times."""
        return {
            "label": label,
            "detections": self.image_index.tolist(),
            "true_positive": self.is_tp.astype(int).tolist(),
            "objects": np.repeat(np.arange(self.gt_per_image.size), self.gt_per_image).tolist(),
        }

    @classmethod
    def from_document(cls, found: Mapping[str, Any], images: int) -> ClassMatches:
        image_index = np.asarray(found["detections"], dtype=np.int64)
        is_tp = np.asarray(found["true_positive"], dtype=bool)
        objects = np.asarray(found["objects"], dtype=np.int64)
        if image_index.shape != is_tp.shape or ((image_index < 0) | (image_index >= images)).any():
            raise ValueError(f"class {found.get('label')}'s matches do not fit {images} images")
        if ((objects < 0) | (objects >= images)).any():
            raise ValueError(f"class {found.get('label')}'s objects do not fit {images} images")
        return cls(image_index, is_tp, np.bincount(objects, minlength=images))

    def reordered(self, order: np.ndarray) -> ClassMatches:
        """The same matches with images renumbered: image i becomes order[i]."""
        placed = np.zeros_like(self.gt_per_image)
        placed[order] = self.gt_per_image
        return ClassMatches(order[self.image_index], self.is_tp, placed)

    def ranking(self) -> ClassRanking:
        """These matches as a ranking of one area range at one IoU."""
        return ClassRanking(
            self.image_index,
            self.is_tp[None, None],
            np.ones((1, 1, self.is_tp.size), dtype=bool),
            self.gt_per_image[None],
        )


@dataclass(frozen=True)
class ClassRanking:
    """One class's detections ranked once, as COCOeval.accumulate ranks them (the same order in
    every area range and at every IoU threshold), with what each one is in each area range [A]
    at each IoU threshold [T]; cut after the last true positive of any of them."""

    image_index: np.ndarray  # int64 [D]: each detection's image, a position in the image list
    is_tp: np.ndarray  # bool [A, T, D]: matched an object that counts there
    counted: np.ndarray  # bool [A, T, D]: not ignored by COCOeval there (true positives are)
    gt_per_image: np.ndarray  # int64 [A, I]: objects that count in each area range

    @functools.cached_property
    def run_ends(self) -> list[list[np.ndarray]]:
        """[A][T] the ranks of the true positives that end a run in each area range at each
        IoU (`_run_ends`): where the intervals read precision and recall."""
        areas, ious, _ = self.is_tp.shape
        return [
            [_run_ends(self.is_tp[a, t], self.counted[a, t]) for t in range(ious)]
            for a in range(areas)
        ]

    @property
    def run_end_count(self) -> int:
        """The run ends of every area range and IoU: the rows a resample's AP is read off."""
        return sum(ends.size for area in self.run_ends for ends in area)

    @property
    def rows(self) -> int:
        """The most ranks that end a run at some IoU in one area range: the rows of the
        largest arrays the intervals make of a block of resamples."""
        return max(np.unique(np.concatenate(area)).size for area in self.run_ends)

    def matches(self, area: int, iou: int) -> ClassMatches:
        """The matches of one area range at one IoU, as the eval JSON keeps them."""
        counted = self.counted[area, iou]
        is_tp = self.is_tp[area, iou][counted]
        end = int(np.flatnonzero(is_tp)[-1]) + 1 if is_tp.any() else 0
        return ClassMatches(self.image_index[counted][:end], is_tp[:end], self.gt_per_image[area])


class _RecallPoints:
    """How many recall thresholds n true positives reach, for each resample's object count
    [R]; the recall is n / objects in float64, as accumulate divides. Read from one table of
    every n up to each distinct count, laid end to end: for COCO's points always (each
    count's table shared by resamples, blocks and classes); for other thresholds where an
    area range's IoUs read more points than its resamples hold objects (detections that
    rarely follow one another as true positives)."""

    def __init__(self, objects: np.ndarray, thresholds: np.ndarray, lookups: int) -> None:
        self.objects = np.maximum(objects, 1)
        self.thresholds = thresholds
        self.count = thresholds.size
        self.table = None
        if thresholds is not RECALL_THRESHOLDS and lookups * objects.size <= objects.sum():
            return
        counts, which = np.unique(objects, return_inverse=True)
        sizes = counts + 1
        self.offsets = (np.cumsum(sizes) - sizes)[which.reshape(-1)]
        if thresholds is RECALL_THRESHOLDS:
            self.table = np.concatenate(_coco_tables(counts))
        else:
            self.table = _tables(counts, thresholds)

    def __call__(self, tp: np.ndarray) -> np.ndarray:
        """[H, R] the thresholds reached by the true positives [H, R] (integers, at most
        `objects`; floating-point as the sums make them)."""
        if self.table is None:
            return _thresholds_reached(tp / self.objects[None, :], self.thresholds)
        at = tp.astype(np.intp)  # then added to in place: faster than adding to floats
        at += self.offsets
        return np.take(self.table, at)


def _tables(counts: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """How many of the (ascending) thresholds n true positives of each count's objects
    reach, n = 0..count, the counts' tables end to end: each table steps up at the fewest
    true positives that reach a threshold, found for each threshold (not a search for every
    n: a block draws hundreds of counts of thousands of objects)."""
    sizes = counts + 1
    objects = np.maximum(counts, 1)[:, None]  # as accumulate divides recall
    # the fewest n with threshold <= n / objects: ceil(threshold x objects), or one either
    # side of it where the product rounded; `sizes`: none
    fewest = np.clip(np.ceil(thresholds * objects), 0, sizes[:, None]).astype(np.int64)
    fewest -= (fewest > 0) & (thresholds <= (fewest - 1) / objects)
    fewest += (fewest < sizes[:, None]) & (thresholds > fewest / objects)
    reached = fewest < sizes[:, None]
    starts = np.cumsum(sizes) - sizes
    steps = np.bincount((starts[:, None] + fewest)[reached], minlength=int(sizes.sum()))
    steps[starts[1:]] -= reached[:-1].sum(axis=1)  # each table counts from 0
    # the smallest type: less to move
    return np.cumsum(steps).astype(np.min_scalar_type(thresholds.size))


_COCO_TABLES: dict[int, np.ndarray] = {}  # by count; emptied after each evaluation's intervals


def _coco_tables(counts: np.ndarray) -> list[np.ndarray]:
    """Each count's table of COCO's points (`_tables`), those not made yet made together
    (read-only: shared)."""
    missing = np.asarray([c for c in counts.tolist() if c not in _COCO_TABLES], dtype=np.int64)
    if missing.size:
        made = _tables(missing, RECALL_THRESHOLDS)
        made.flags.writeable = False
        parts = np.split(made, np.cumsum(missing + 1)[:-1])
        _COCO_TABLES.update(zip(missing.tolist(), parts, strict=True))
    return [_COCO_TABLES[count] for count in counts.tolist()]


def forget_recall_tables() -> None:
    """Let go of COCO's recall tables, kept while one evaluation's resamples are read (shared by
    its blocks and classes)."""
    _COCO_TABLES.clear()


def _average_precision(
    tp: np.ndarray, seen: np.ndarray, objects: np.ndarray, points: _RecallPoints | None
) -> np.ndarray:
    """AP [R] from the true positives and the counted detections ranked at or above each true
    positive [H, R], as accumulate computes it: the precision envelope read at each recall
    threshold; NaN where a resample drew no objects.

    Recall rises only at true positives, so the first detection that reaches a recall
    threshold is one, and the envelope there is the highest precision at a true positive from
    there on (after a false positive precision only falls until the next one). Each true
    positive stands for the thresholds its recall reaches first: those it reaches, less those
    the one before it reached.

    `points` None: all-point AP, as the VOC devkit computes it (VOC2010 and later): the
    envelope summed over the recall each true positive adds.
    """
    if points is None:
        envelope = tp / np.maximum(seen, np.finfo(np.float64).eps)  # the devkit's division
        added = _steps(tp) / np.maximum(objects, 1)[None, :]
    else:
        # accumulate's tp / (tp + fp + eps) in float64, and its envelope, in one array in place
        envelope = np.add(
            seen, np.spacing(1), dtype=np.float64, out=seen if seen.dtype == np.float64 else None
        )
        np.divide(tp, envelope, out=envelope)
        added = _steps(points(tp))  # >= 0: tp never falls
    # the envelope: the highest precision at or below each row
    accumulate_rows(envelope, np.maximum, upward=True)
    ap = np.multiply(envelope, added, out=envelope).sum(axis=0)
    if points is not None:
        ap /= points.count
    return np.where(objects > 0, ap, np.nan)


def _steps(values: np.ndarray) -> np.ndarray:
    """Each row less the one above it, the first row less nothing (np.diff with prepend=0,
    without its copy)."""
    steps = np.empty_like(values)
    np.subtract(values[1:], values[:-1], out=steps[1:])
    steps[0] = values[0]
    return steps


def _thresholds_reached(recall: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """How many of the (ascending) thresholds each recall reaches (threshold <= recall).

    COCO's 101 evenly spaced points are found by arithmetic, then put right where rounding
    put a point a hair off its place (a binary search for every value costs several times
    as much); other thresholds by a search."""
    if thresholds is not RECALL_THRESHOLDS:
        return np.searchsorted(thresholds, recall, side="right")
    last = thresholds.size - 1
    guess = np.minimum((recall * last).astype(np.int64), last)  # floor: recall >= 0
    reached = guess + 1 - (thresholds[guess] > recall)
    above = np.minimum(guess + 1, last)
    return reached + ((guess < last) & (thresholds[above] <= recall))


def _run_ends(is_tp: np.ndarray, counted: np.ndarray) -> np.ndarray:
    """The ranks of the true positives that end a run: the last of true positives with no
    counted false positive between them. Within a run precision only rises (each step adds the
    same weight to the true positives and to what is counted), so the envelope is the same at
    every true positive of a run, and a run stands for them all: its recall points are those its
    last one reaches less those the run before reached."""
    ranks = np.flatnonzero(counted)
    hits = is_tp[ranks]
    last = np.ones_like(hits)
    last[:-1] = ~hits[1:]
    return ranks[hits & last]


@dataclass(frozen=True)
class _IoUPlan:
    iou: int
    tp: SumsAt  # the true positives' weight at each run end
    seen: np.ndarray  # each run end's row of the area's `always` sums
    more: SumsAt | None  # what this IoU counts beyond `always`


@dataclass(frozen=True)
class AreaPlan:
    """Where `ranked_ap` reads its sums in one area range (`plan_sums`): made from a ranking
    once, read by every block of its resamples."""

    always: SumsAt  # what every IoU counts, at every IoU's run ends
    lookups: int  # run ends over all IoUs
    ious: list[_IoUPlan]  # those with a true positive


def plan_sums(ranking: ClassRanking, images: int) -> list[AreaPlan | None]:
    """What ranked_ap sums where, for every area range and IoU: it depends on the ranking
    alone, not on the weights, so it is made once for every block of resamples."""
    plans: list[AreaPlan | None] = []
    for a, ends in enumerate(ranking.run_ends):
        every_end = np.unique(np.concatenate(ends))
        if every_end.size == 0:
            plans.append(None)
            continue
        # what is counted at every IoU, summed up to each run end of any IoU once; an IoU
        # counts more only where a match to an ignored object came or went
        always = ranking.counted[a].all(axis=0)
        by_iou: list[_IoUPlan] = []
        for t, at in enumerate(ends):
            if at.size == 0:
                continue
            hits = np.flatnonzero(ranking.is_tp[a, t])
            more = np.flatnonzero(ranking.counted[a, t] & ~always)
            by_iou.append(
                _IoUPlan(
                    t,
                    SumsAt(ranking.image_index, hits, at, images),
                    np.searchsorted(every_end, at),
                    SumsAt(ranking.image_index, more, at, images) if more.size else None,
                )
            )
        always_sums = SumsAt(ranking.image_index, np.flatnonzero(always), every_end, images)
        plans.append(AreaPlan(always_sums, sum(at.size for at in ends), by_iou))
    return plans


def ranked_ap(
    ranking: ClassRanking,
    by_image: np.ndarray | Weights,
    thresholds: np.ndarray | None = RECALL_THRESHOLDS,
    plan: list[AreaPlan | None] | None = None,
) -> np.ndarray:
    """AP [A, T, R] of one class in each area range at each IoU threshold, for each column of
    image weights [I, R] (how often a resample drew each image); NaN where a resample drew none
    of the class's objects there. All-ones weights give pycocotools' per-class AP (thresholds
    None: the VOC devkit's all-point AP). `plan`: the ranking's `plan_sums`, made once where many
    blocks of weights are read (each block's `Weights` made once for every class)."""
    ious = ranking.is_tp.shape[1]
    weights = by_image if isinstance(by_image, Weights) else Weights(by_image)
    objects = weights.weighed(ranking.gt_per_image)  # [A, R]
    # an IoU without a true positive: AP 0 where the resample drew objects
    result = np.repeat(np.where(objects > 0, 0.0, np.nan)[:, None], ious, axis=1)
    images = weights.by_image.shape[0]
    for a, area in enumerate(plan if plan is not None else plan_sums(ranking, images)):
        if area is None:
            continue
        seen_always = area.always(weights)
        points = None if thresholds is None else _RecallPoints(objects[a], thresholds, area.lookups)
        # IoU by IoU: each one's arrays stay in the cache through the passes over them
        for at in area.ious:
            seen = np.take(seen_always, at.seen, axis=0)
            if at.more is not None:  # integers: exact in float64
                seen = np.add(seen, at.more(weights), dtype=np.float64)
            result[a, at.iou] = _average_precision(at.tp(weights), seen, objects[a], points)
    return result


def weighted_class_ap(
    classes: Sequence[ClassMatches],
    weights: np.ndarray,
    recall_thresholds: np.ndarray | None = RECALL_THRESHOLDS,
) -> np.ndarray:
    """AP [K, R] of each class at the IoU its matches were made at, for each row of image
    weights [R, I]; NaN where a resample drew none of the class's objects. Recall thresholds
    None: all-point AP (VOC)."""
    if not classes:
        return np.full((0, len(weights)), np.nan)
    by_image = np.ascontiguousarray(np.asarray(weights).T, dtype=np.int64)  # draw counts
    return np.stack(
        [ranked_ap(found.ranking(), by_image, recall_thresholds)[0, 0] for found in classes]
    )


def class_mean(per_class: np.ndarray) -> np.ndarray:
    """The mean over the classes with objects [R] of per-class AP [K, R], as pycocotools
    averages; NaN where a resample drew no objects at all.

    A class a resample drew none of is left out of its mean, as pycocotools leaves it out of
    a set of images without it: whether a rare class is in the images is part of how the
    figure moves from one set to another (a mean that turns on two objects must show it).
    Where the rare classes are found worse this raises the resamples' mean, as the envelope
    does: the interval is centred on the figure (`interval_of`), its spread kept."""
    counted = np.isfinite(per_class).sum(axis=0)
    totals = np.where(np.isfinite(per_class), per_class, 0.0).sum(axis=0)
    return np.divide(totals, counted, out=np.full(per_class.shape[1], np.nan), where=counted > 0)
