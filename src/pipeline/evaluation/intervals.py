"""AP's intervals over images: pycocotools' own matches reweighed by image, every resample at
once (an array dimension); the paired AP@.5 change of two runs reads them too
(`pipeline.evaluation.paired_ap`).

A resample reweighs images, it never matches again: a detection's fate is the one pycocotools
gave it. One class's detections are ranked once, as COCOeval.accumulate ranks them; that order
holds in every area range and at every IoU threshold, so each resample's image weights are
gathered and summed along it once per class, and each (area range, IoU) reads its true and
false positives off those sums.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from pipeline.evaluation.image_bootstrap import (
    IMAGES_METHOD,
    bootstrap_interval,
    bootstrap_weights,
)
from pipeline.evaluation.weighted_sums import SumsAt, Weights, accumulate_rows, torch_threads
from pipeline.stats import BOOTSTRAP_RESAMPLES

RECALL_THRESHOLDS = np.linspace(0.0, 1.0, 101)  # COCOeval's recThrs
AP_METHOD = (
    IMAGES_METHOD + ", pycocotools' matches reweighed, centred on the figure (the resamples'"
    " median moved onto it, by `shift`)"
)
# resamples x rows (`ClassRanking.rows`) per block, at most: a block's arrays at run ends
# within a few tens of MiB
_RESAMPLE_BLOCK = 1 << 21


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
class _AreaPlan:
    always: SumsAt  # what every IoU counts, at every IoU's run ends
    lookups: int  # run ends over all IoUs
    ious: list[_IoUPlan]  # those with a true positive


def _plan(ranking: ClassRanking, images: int) -> list[_AreaPlan | None]:
    """What ranked_ap sums where, for every area range and IoU: it depends on the ranking
    alone, not on the weights, so it is made once for every block of resamples."""
    plans: list[_AreaPlan | None] = []
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
        plans.append(_AreaPlan(always_sums, sum(at.size for at in ends), by_iou))
    return plans


def ranked_ap(
    ranking: ClassRanking,
    by_image: np.ndarray | Weights,
    thresholds: np.ndarray | None = RECALL_THRESHOLDS,
    plan: list[_AreaPlan | None] | None = None,
) -> np.ndarray:
    """AP [A, T, R] of one class in each area range at each IoU threshold, for each column of
    image weights [I, R] (how often a resample drew each image); NaN where a resample drew none
    of the class's objects there. All-ones weights give pycocotools' per-class AP (thresholds
    None: the VOC devkit's all-point AP). `plan`: the ranking's `_plan`, made once where many
    blocks of weights are read (each block's `Weights` made once for every class)."""
    ious = ranking.is_tp.shape[1]
    weights = by_image if isinstance(by_image, Weights) else Weights(by_image)
    objects = weights.weighed(ranking.gt_per_image)  # [A, R]
    # an IoU without a true positive: AP 0 where the resample drew objects
    result = np.repeat(np.where(objects > 0, 0.0, np.nan)[:, None], ious, axis=1)
    images = weights.by_image.shape[0]
    for a, area in enumerate(plan if plan is not None else _plan(ranking, images)):
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


def interval_of(
    samples: np.ndarray, images: int, estimate: float | None = None
) -> dict[str, Any] | None:
    """The interval of the finite samples (a resample may draw none of what a figure
    measures); None without any. With the figure's `estimate` (AP's), centred on it
    (`image_bootstrap.centred_percentile_interval`: AP on a resample lies above AP on the images it was
    drawn from); None where the figure is none either."""
    finite = samples[np.isfinite(samples)]
    if finite.size == 0 or (estimate is not None and not np.isfinite(estimate)):
        return None
    if estimate is None:
        return bootstrap_interval(finite, images, IMAGES_METHOD)
    return bootstrap_interval(
        finite, images, AP_METHOD, estimate=float(estimate), within=(0.0, 1.0)
    )


@dataclass(frozen=True)
class APSamples:
    """Resampled AP of one evaluation, `by_class` [A, T, K, R]: each class's in each area range
    at each IoU threshold, NaN where a resample drew none of its objects there. The figures
    on the images themselves are the same with one "resample" ([A, T, K, 1], NaN: no objects),
    so that their class means are taken by the same code."""

    by_class: np.ndarray

    def mean_at(self, area: int, iou: int) -> np.ndarray:
        """[R] the class mean at one IoU (AP@.5, AP@.75)."""
        return class_mean(self.by_class[area, iou])

    def mean_over_ious(self, area: int) -> np.ndarray:
        """[R] AP@[.5:.95] as pycocotools averages it: over classes of each class's mean
        over the IoUs."""
        return class_mean(self.by_class[area].mean(axis=0))


def resampled_ap(
    rankings: Sequence[ClassRanking],
    images: int,
    resamples: int = BOOTSTRAP_RESAMPLES,
    threads: int = 1,
) -> APSamples:
    """Every class's AP in every area range at every IoU for each resample of the images: the
    same resamples (`image_bootstrap.bootstrap_weights`, seeded) as the F1 intervals draw.
    `threads`: classes computed side by side, each over all its resamples on one thread (its
    plan, as large as its detections, made there and dropped with it), the same figures.
    numpy lets go of the GIL in its loops, but two threads' calls wait on each other for it in
    between: the fewer and longer the calls, the less they wait, so a class's resamples are
    divided between the threads only where the classes are fewer than the threads."""
    if not rankings:
        return APSamples(np.full((0, 0, 0, resamples), np.nan))
    rows = max(ranking.rows for ranking in rankings)
    drawn = bootstrap_weights(images, resamples)
    divided = len(rankings) < threads
    blocks = [Weights(block) for block in _blocks(drawn, rows, threads if divided else 1)]
    workers = max(1, min(threads, len(blocks) if divided else len(rankings)))
    # BLAS and torch (the sums' sparse products) would start threads of their own in every
    # worker: more threads than CPUs, each product waiting on a thread another one's core is
    # running (ten times slower where other work shares the machine); the workers share the
    # CPUs out
    with (
        threadpool_limits(max(1, threads // workers), user_api="blas"),
        torch_threads(max(1, threads // workers)) as start_thread,
        ThreadPoolExecutor(workers, initializer=start_thread) as pool,
    ):
        if divided:
            by_class = []
            for ranking in rankings:
                plan = _plan(ranking, images)
                found = pool.map(lambda block: ranked_ap(ranking, block, plan=plan), blocks)  # noqa: B023
                by_class.append(np.concatenate(list(found), axis=2))  # [A, T, R]
        else:
            # the costliest first (the most run ends: rows of the largest arrays), so that the
            # last to start is among the shortest
            order = sorted(range(len(rankings)), key=lambda k: -rankings[k].run_end_count)
            found = pool.map(lambda k: _class_samples(rankings[k], blocks, images), order)
            by_label = dict(zip(order, found, strict=True))
            by_class = [by_label[k] for k in range(len(rankings))]
    _COCO_TABLES.clear()
    return APSamples(np.stack(by_class, axis=2))


def _class_samples(
    ranking: ClassRanking,
    blocks: Sequence[Weights],
    images: int,
    recall_thresholds: np.ndarray | None = RECALL_THRESHOLDS,
) -> np.ndarray:
    """One class's AP [A, T, R] over every block of resamples, its plan made once for them."""
    plan = _plan(ranking, images)
    return np.concatenate(
        [ranked_ap(ranking, block, recall_thresholds, plan) for block in blocks], axis=2
    )


def _blocks(weights: Iterable[np.ndarray], rows: int, parts: int = 1) -> Iterator[np.ndarray]:
    """The resamples in blocks of whole chunks (as drawn), each as image weights [I, R] in
    float32, the type the sums multiply (exact: a weight is at most the images): as few as
    keep a block's [rows, R] arrays (sums and precision at run ends) within _RESAMPLE_BLOCK
    elements, and at least `parts` (one for each thread). Few and wide: each step of a running
    sum or maximum down the rows is one numpy call, whose overhead a long row spreads thin."""
    chunks = list(weights)
    resamples = sum(len(chunk) for chunk in chunks)
    count = min(len(chunks), max(parts, -(-resamples * rows // _RESAMPLE_BLOCK)))
    for group in np.array_split(np.arange(len(chunks)), count):
        block = np.empty((chunks[0].shape[1], sum(len(chunks[i]) for i in group)), np.float32)
        start = 0
        for i in group:
            # chunk by chunk: a transposed copy of a few hundred rows stays in the cache,
            # several times faster than transposing them all at once
            block[:, start : start + len(chunks[i])] = chunks[i].T
            start += len(chunks[i])
        yield block


def resampled_class_ap(
    classes: Sequence[ClassMatches],
    images: int,
    recall_thresholds: np.ndarray | None = RECALL_THRESHOLDS,
    resamples: int = BOOTSTRAP_RESAMPLES,
) -> np.ndarray:
    """[K, R] each class's AP at one IoU for each resample of the images (the same resamples
    as every other interval draws)."""
    rankings = [found.ranking() for found in classes]
    drawn = bootstrap_weights(images, resamples)
    blocks = [
        Weights(block) for block in _blocks(drawn, max((r.rows for r in rankings), default=0))
    ]
    return np.stack(
        [_class_samples(ranking, blocks, images, recall_thresholds)[0, 0] for ranking in rankings]
    )
