"""What COCOeval keeps of each image, class and area range, read once as flat arrays: the
recall by size bucket at a score threshold, and each class's ranking for AP's intervals.

pycocotools keeps the per-image results as dicts in `evalImgs`; faster-coco-eval as C++
objects whose state is (detection matches, object matches, scores, object ignores, detection
ignores, pairs), the [T, D] ones flattened. Either way they are laid out [class][area][image],
and in every area range an image's detections of a class are the same ones in the same order
(sorted and cut to maxDets[-1] alike), matched with that range's objects ignored or not.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.evaluation.intervals import ClassRanking
from pipeline.evaluation.matching import ratio


@dataclass(frozen=True)
class Walked:
    """What one reading of COCOeval's per-image results gives: per area range and image, the
    objects found at IoU 0.5 by detections scoring >= the threshold and the objects that count
    ([A, I] each); and each class's ranking, where asked for."""

    found: np.ndarray
    total: np.ndarray
    rankings: list[ClassRanking]

    def recall(self, area: int) -> float:
        return ratio(int(self.found[area].sum()), int(self.total[area].sum()))


@dataclass(frozen=True)
class _Flat:
    """Every (class, area, image) entry's results end to end, in COCOeval's order."""

    detections: np.ndarray  # int64 [E]: each entry's detections
    objects: np.ndarray  # int64 [E]: each entry's objects that count (not ignored there)
    scores: np.ndarray  # float64 [N]: every entry's detections, in its ranking order
    matched: np.ndarray  # bool [T, N]: matched to an object (ignored or not) per IoU threshold
    ignored: np.ndarray  # bool [T, N]


def _flat_results(evaluation: Any) -> _Flat:
    thresholds = len(evaluation.params.iouThrs)
    if not hasattr(evaluation, "_evalImgs_cpp"):
        kept = [entry for entry in evaluation.evalImgs if entry is not None]
        detections = np.zeros(len(evaluation.evalImgs), dtype=np.int64)
        objects = np.zeros(len(evaluation.evalImgs), dtype=np.int64)
        for position, entry in enumerate(evaluation.evalImgs):
            if entry is not None:
                detections[position], objects[position] = (
                    len(entry["dtScores"]),
                    len(entry["gtIgnore"]),
                )
        gt_ignored = _concatenated([np.asarray(e["gtIgnore"], dtype=bool) for e in kept], bool)
        return _Flat(
            detections,
            _per_entry(~gt_ignored, objects),
            _concatenated([np.asarray(e["dtScores"], dtype=np.float64) for e in kept], np.float64),
            _columns(
                [np.asarray(e["dtMatches"]).reshape(thresholds, -1) > 0 for e in kept], thresholds
            ).astype(bool),
            _columns(
                [np.asarray(e["dtIgnore"], dtype=bool).reshape(thresholds, -1) for e in kept],
                thresholds,
            ).astype(bool),
        )
    # each field of every entry side by side: a list of lists per field, read end to end
    fields = list(zip(*(entry.__getstate__() for entry in evaluation._evalImgs_cpp), strict=True))
    if not fields:
        fields = [()] * 6
    detections = np.fromiter(map(len, fields[2]), np.int64, len(fields[2]))
    objects = np.fromiter(map(len, fields[3]), np.int64, len(fields[3]))
    every = int(detections.sum())

    def read(field: int, dtype: type, count: int) -> np.ndarray:
        return np.fromiter(itertools.chain.from_iterable(fields[field]), dtype, count)

    gt_ignored = read(3, bool, int(objects.sum()))
    # each entry's [T, D] rows, flattened one after another, read as [T, N] columns
    entry_start = np.repeat(thresholds * (np.cumsum(detections) - detections), detections)
    within = np.arange(every) - np.repeat(np.cumsum(detections) - detections, detections)
    rows = np.repeat(detections, detections) * np.arange(thresholds)[:, None]
    where = entry_start + within + rows
    return _Flat(
        detections,
        _per_entry(~gt_ignored, objects),
        read(2, np.float64, every),
        read(0, bool, thresholds * every)[where],  # matched object ids, 0 for none
        read(4, bool, thresholds * every)[where],
    )


def _concatenated(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _columns(parts: list[np.ndarray], thresholds: int) -> np.ndarray:
    return np.concatenate(parts, axis=1) if parts else np.zeros((thresholds, 0))


def _per_entry(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[E] the sum of each entry's `lengths` values, laid end to end."""
    entry = np.repeat(np.arange(lengths.size), lengths)
    return np.bincount(entry, weights=values, minlength=lengths.size).astype(np.int64)


def walk(evaluation: Any, at_50: int, score_threshold: float, rankings: bool) -> Walked:
    """Read COCOeval's per-image results once, every entry at once.

    Recall counts the matches of the detections scoring >= the threshold: COCOeval matches
    greedily in descending score, so a detection's match never depends on lower-scored ones,
    and the matches of the kept detections are those of the full matching. A detection
    matched and not ignored is matched to an object that counts, and each such object to
    one detection, so counting those detections counts the objects found.
    """
    params = evaluation.params
    classes, areas, images = len(params.catIds), len(params.areaRng), len(params.imgIds)
    flat = _flat_results(evaluation)
    entry = np.repeat(np.arange(flat.detections.size), flat.detections)  # [N]
    place = entry % (areas * images)  # area * images + image
    hit = flat.matched[at_50] & ~flat.ignored[at_50] & (flat.scores >= score_threshold)
    found = np.bincount(place[hit], minlength=areas * images).reshape(areas, images)
    objects = flat.objects.reshape(classes, areas, images)
    ranked: list[ClassRanking] = []
    if rankings:
        starts = np.concatenate([[0], np.cumsum(flat.detections)])
        for k in range(classes):
            blocks = [
                slice(starts[(k * areas + a) * images], starts[(k * areas + a + 1) * images])
                for a in range(areas)
            ]
            scores = flat.scores[blocks[0]]
            order = np.argsort(-scores, kind="mergesort")  # as accumulate sorts
            counted = ~np.stack([flat.ignored[:, block] for block in blocks])[:, :, order]
            is_tp = np.stack([flat.matched[:, block] for block in blocks])[:, :, order] & counted
            end = int(np.flatnonzero(is_tp.any(axis=(0, 1)))[-1]) + 1 if is_tp.any() else 0
            image_index = (entry[blocks[0]] % images)[order]
            ranked.append(
                ClassRanking(
                    image_index[:end].astype(np.int64),
                    is_tp[:, :, :end],
                    counted[:, :, :end],
                    objects[k],
                )
            )
    return Walked(found.astype(np.int64), objects.sum(axis=0), ranked)
