"""COCO AP as pycocotools computes it, with object size buckets in input pixels, and the
intervals of every AP figure from pycocotools' matches (pipeline.evaluation.intervals).

The matching and accumulation are pycocotools' COCOeval on arrays
(pipeline.evaluation.coco_matching: the same matches and precision, bit for bit, which
tests/test_coco_matching.py and tests/test_evaluator.py hold against pycocotools itself);
its matches give the recall by size bucket and the rankings the intervals reweigh.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.evaluation.coco_matching import IOU_THRESHOLDS, accumulate, as_arrays, match
from pipeline.evaluation.image_bootstrap import bootstrap_weights
from pipeline.evaluation.intervals import APSamples, interval_of, resampled_ap
from pipeline.evaluation.matching import ratio
from pipeline.evaluation.records import Record, by_image
from pipeline.evaluation.weighted_ap import ClassRanking

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


def _area_ranges(buckets: Iterable[str] = SIZE_BUCKETS) -> tuple[list[list[float]], list[str]]:
    """pycocotools' areaRng and areaRngLbl for "all" and `buckets` (of SIZE_BUCKETS).

    pycocotools keeps areas with lower <= area <= upper; an upper bound one float below
    upper**2 makes each bucket [lower**2, upper**2).
    """
    ranges, labels = [[0.0, _NO_LIMIT**2]], ["all"]
    for name, (lower, upper) in SIZE_BUCKETS.items():
        if name in buckets:
            top = _NO_LIMIT**2 if upper is None else float(np.nextafter(upper**2, 0.0))
            ranges.append([lower**2, top])
            labels.append(name)
    return ranges, labels


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


@dataclass(frozen=True)
class _Matching:
    """What the intervals read of one matching: the images (ids, in the matches' order), the
    area ranges matched, each class's ranking, and per area range and image the objects found
    at IoU 0.5 at the score threshold and the objects that count ([A, I] each)."""

    image_ids: list[int]
    area_labels: list[str]
    rankings: list[ClassRanking]
    found: np.ndarray
    total: np.ndarray


def _ap_intervals(
    matching: _Matching,
    at_50: int,
    at_75: int,
    with_recall: Sequence[str],
    figures: np.ndarray,
    threads: int = 1,
) -> _APIntervals:
    """AP's intervals, resampling images as `image_bootstrap.micro_intervals` does, with pycocotools'
    matches kept: a resample reweighs images, it does not match again. Every figure is read
    from the same resamples. A class's or a bucket's interval is over the resamples that drew
    objects of it: with a handful of objects it is wide, which is the point. AP@[.5:.95] is,
    as pycocotools averages it, the mean over classes of each class's mean over the IoUs.
    `figures` [A, T, K]: pycocotools' per-class AP (NaN: no objects), which every interval
    is centred on (`intervals.interval_of`)."""
    labels = matching.area_labels
    images = len(matching.image_ids)
    samples = resampled_ap(matching.rankings, images, threads=threads)
    found = APSamples(figures[..., None])  # the figures themselves, as one resample
    everything = labels.index("all")
    by_class = samples.by_class[everything]  # [T, K, R]
    estimate = figures[everything]  # [T, K]
    per_class: list[dict[str, dict[str, Any] | None]] = []
    for k in range(len(matching.rankings)):
        per_class.append(
            {
                "ap50_interval": interval_of(by_class[at_50, k], images, estimate[at_50, k]),
                "ap_interval": interval_of(
                    by_class[:, k].mean(axis=0), images, estimate[:, k].mean(axis=0)
                ),
            }
        )
    buckets = {}
    for name in SIZE_BUCKETS:
        if name not in labels:  # no objects there: not matched, no intervals
            continue
        area = labels.index(name)
        buckets[name] = {
            "ap50_interval": _centred(samples, found, images, area, at_50),
            "ap_interval": _centred(samples, found, images, area),
            "recall_interval": _recall_interval(matching, area, images)
            if name in with_recall
            else None,
        }
    return _APIntervals(
        ap50=_centred(samples, found, images, everything, at_50),
        ap=_centred(samples, found, images, everything),
        ap75=_centred(samples, found, images, everything, at_75),
        per_class=per_class,
        size_buckets=buckets,
        matches={
            "image_ids": [int(image_id) for image_id in matching.image_ids],
            "classes": [
                ranking.matches(everything, at_50).as_document(label)
                for label, ranking in enumerate(matching.rankings)
            ],
        },
    )


def _class_figures(found: np.ndarray) -> np.ndarray:
    """[A, T, K] each class's AP in each area range at each IoU from COCOeval's precision
    [T, R, K, A]; NaN where it had no objects (-1)."""
    figures = np.where((found > -1).all(axis=1), found.mean(axis=1), np.nan)  # [T, K, A]
    return np.moveaxis(figures, -1, 0)


def _centred(
    samples: APSamples, figures: APSamples, images: int, area: int, iou: int | None = None
) -> dict[str, Any] | None:
    """The interval of a class mean's resamples in one area range, at one IoU (None: over the
    IoUs, AP@[.5:.95]), centred on the same class mean of the figures."""
    if iou is None:
        return interval_of(samples.mean_over_ious(area), images, figures.mean_over_ious(area)[0])
    return interval_of(samples.mean_at(area, iou), images, figures.mean_at(area, iou)[0])


def _recall_interval(matching: _Matching, area: int, images: int) -> dict[str, Any] | None:
    samples = []
    for weights in bootstrap_weights(images):
        found, total = (
            (weights @ matching.found[area]).astype(float),
            weights @ matching.total[area],
        )
        with np.errstate(invalid="ignore", divide="ignore"):
            samples.append(np.where(total > 0, found / total, np.nan))
    return interval_of(np.concatenate(samples), images)


def _summarized(found: np.ndarray, iou: float | None) -> float:
    """COCOeval.summarize's AP at one IoU threshold (None: averaged over them) from the
    precision [T, R, K] of all areas at 100 detections, computed as it computes it: the mean
    of the precisions that exist (-1 where none does)."""
    if iou is not None:
        found = found[np.where(iou == IOU_THRESHOLDS)[0]]
    return float(np.mean(found[found > -1])) if (found > -1).any() else -1.0


@contextlib.contextmanager
def without_cyclic_gc() -> Iterator[None]:
    """Evaluation makes an object or several per detection (the records' arrays, a
    predictions file's lists), none of them in a cycle: the cyclic collector would walk them
    all, and every object the process holds, again at every full collection. Nested, the
    outermost one turns it back on."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@without_cyclic_gc()
def coco_ap(
    gts: Iterable[Record],
    dets: Iterable[Record],
    num_classes: int,
    class_names: Sequence[str],
    score_threshold: float = 0.0,
    ap_intervals: bool = False,
    threads: int = 1,
) -> dict[str, Any]:
    """COCO box AP as pycocotools computes it, so our figures are comparable with published
    ones.

    `ap` is AP@[.5:.95], `ap50` AP@.5, `ap75` AP@.75 (all areas, 100 detections per image
    and class). With `ap_intervals`, `ap_interval`, `ap50_interval` and `ap75_interval` are
    their 95% intervals over the images, each class and size bucket has its AP@.5's and
    AP@[.5:.95]'s intervals too, and each size bucket its recall's, from the same resamples
    (seconds per 500 images on a CPU, so the evaluate stage asks for them and validation
    during training does not), and `ap50_matches` holds pycocotools' matches at IoU 0.5
    (`weighted_ap.ClassMatches`); else they are None. `threads`: the classes' intervals are
    computed on that many threads (numpy lets go of the GIL), the same figures. Per-class AP
    is None for a class without ground truth (pycocotools' -1).
    Ignore regions are matched as COCO's `iscrowd=1` annotations, which pycocotools neither
    counts nor lets a detection on them count against.
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
    truth, found = by_image(gts, dets)
    image_ids = sorted(truth)  # as COCOeval orders them: the matches' image positions
    objects, crowd, detections, scores = as_arrays(truth, found, image_ids, num_classes)
    counted = ~crowd  # ignore regions not counted
    gt_per_class = np.bincount(objects.labels[counted], minlength=num_classes)
    areas, labels = objects.area[counted], objects.labels[counted]
    counts = _bucket_counts(areas)
    class_counts = [_bucket_counts(areas[labels == c]) for c in range(num_classes)]

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

    # pycocotools' loadRes([]) raises; without objects (ignore regions alone) its stats stay
    # at -1: both are reported as 0
    if not scores.size or not gt_per_class.any():
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

    # a bucket without objects has no figures: it need not be matched (the default run's
    # "large" at 128 px)
    area_ranges, area_labels = _area_ranges([name for name, count in counts.items() if count])
    matched = match(detections, scores, objects, crowd, area_ranges, num_classes, len(image_ids))
    rankings = matched.rankings()
    # precision: [IoU thresholds T, recall thresholds R, classes K, area ranges A]
    all_precision = accumulate(rankings)
    precision = all_precision[..., area_labels.index("all")]
    at_50 = int(np.argmin(np.abs(IOU_THRESHOLDS - 0.5)))

    def by_class(values: np.ndarray) -> tuple[list[float | None], list[float | None]]:
        """AP and AP@.5 per class label from one area range's precision [T, R, K]; None for
        a class without ground truth there (pycocotools' -1)."""
        class_ap: list[float | None] = [None] * num_classes
        class_ap50: list[float | None] = [None] * num_classes
        for k in range(num_classes):
            found = values[:, :, k]
            if (found > -1).any():
                class_ap[k] = float(found[found > -1].mean())
                class_ap50[k] = float(found[at_50].mean())
        return class_ap, class_ap50

    ap, ap50 = by_class(precision)
    bucket_ap50: dict[str, float | None] = {}
    bucket_ap: dict[str, float | None] = {}
    bucket_recall: dict[str, float | None] = {}
    found_at_50 = matched.found(at_50, score_threshold)  # [A, I]
    total = matched.objects.sum(axis=0)  # [A, I]
    bucket_class_ap50: dict[str, list[float | None]] = {}
    for name in SIZE_BUCKETS:
        if name not in area_labels:  # no objects there
            bucket_class_ap50[name] = [None] * num_classes
            bucket_ap50[name] = bucket_ap[name] = bucket_recall[name] = None
            continue
        area = area_labels.index(name)
        values = all_precision[..., area]  # [T, R, K]
        present = (values > -1).any(axis=(0, 1))  # classes with ground truth in this bucket
        _, bucket_class_ap50[name] = by_class(values)
        if counts[name] == 0 or not present.any():
            bucket_ap50[name] = bucket_ap[name] = bucket_recall[name] = None
            continue
        bucket_ap50[name] = float(values[at_50][:, present].mean())
        bucket_ap[name] = float(values[:, :, present].mean())
        bucket_recall[name] = ratio(int(found_at_50[area].sum()), int(total[area].sum()))
    stats = [_summarized(precision, iou) for iou in (None, 0.5, 0.75)]
    at_75 = int(np.argmin(np.abs(IOU_THRESHOLDS - 0.75)))
    intervals = (
        _ap_intervals(
            _Matching(image_ids, area_labels, rankings, found_at_50, total),
            at_50,
            at_75,
            [b for b, r in bucket_recall.items() if r is not None],
            _class_figures(all_precision),
            threads,
        )
        if ap_intervals
        else _NO_AP_INTERVALS
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
