"""Statistics without torch, which the report reads too: robust summaries of step times
(median and IQR, as torch.utils.benchmark gives them), a drift check, the warm-up settling
rule, speed-ups with a bootstrap interval, and bootstrap intervals over images of a detection
run's F1, precision, recall and AP, and of its F1 and AP@.5 changes between two runs scored on
the same images."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

NOISY_IQR_RATIO = 0.10  # IQR/median above this marks a measurement as noisy
DRIFT_LIMIT = 0.05  # second-half median this far from the first half's marks a drifting record
SETTLE_WINDOW = 5  # warm-up ends when the median of the last steps ...
SETTLE_TOLERANCE = 0.05  # ... is within this of the median of the steps before them
SPEEDUP_TOLERANCE = 0.05  # a speed-up is claimed only where its whole interval is beyond this
CONFIDENCE = 0.95
BOOTSTRAP_RESAMPLES = 2000
MIN_SAMPLES_FOR_A_CLAIM = 5  # fewer timed steps than this in either set: no claim either way


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) of already sorted values."""
    if not sorted_values:
        return math.nan
    position = (len(sorted_values) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def percentile_interval(samples: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The central `confidence` interval of bootstrap samples (the percentile method)."""
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(samples, [tail, 100 - tail])
    return float(low), float(high)


def drift(samples_s: Sequence[float]) -> dict[str, Any]:
    """Median of the second half of the samples over the first half's, in timed order.

    A step time still falling (caches, allocator, clocks settling) or rising (another job, heat)
    shows here even when the spread around the median looks small.
    """
    half = len(samples_s) // 2
    if half < 2:
        return {"ratio": None, "drifting": False}
    first = statistics.median(samples_s[:half])
    second = statistics.median(samples_s[len(samples_s) - half :])
    ratio = second / first if first > 0 else math.inf
    return {"ratio": ratio, "drifting": abs(ratio - 1) > DRIFT_LIMIT}


def summarize(samples_s: list[float]) -> dict[str, Any]:
    """Median, mean, IQR, p10/p50/p90/p99, min, max (in ms), the noisy flag and the drift check."""
    values = sorted(samples_s)
    if not values:
        return {"count": 0}
    ms = [v * 1000 for v in values]
    median = percentile(ms, 50)
    iqr = percentile(ms, 75) - percentile(ms, 25)
    ratio = iqr / median if median > 0 else math.inf
    trend = drift(samples_s)
    return {
        "count": len(ms),
        "median_ms": median,
        "mean_ms": sum(ms) / len(ms),
        "iqr_ms": iqr,
        "iqr_ratio": ratio,
        "p10_ms": percentile(ms, 10),
        "p50_ms": median,
        "p90_ms": percentile(ms, 90),
        "p99_ms": percentile(ms, 99),
        "min_ms": ms[0],
        "max_ms": ms[-1],
        "noisy": ratio > NOISY_IQR_RATIO,
        "drift_ratio": trend["ratio"],
        "drifting": trend["drifting"],
    }


def quality_words(summary: dict[str, Any]) -> list[str]:
    """What a person should know about a timing before trusting it, in plain words."""
    words = []
    if summary.get("drifting"):
        ratio = summary["drift_ratio"]
        direction = "slower" if ratio > 1 else "faster"
        words.append(
            f"drifting: the second half of the timed steps ran {abs(ratio - 1):.0%} {direction} "
            "than the first (still warming up, or the machine got busier)"
        )
    if summary.get("noisy"):
        words.append(
            f"noisy: the middle half of the steps spans {summary['iqr_ratio']:.0%} of the median"
        )
    return words


def settled(step_times: Sequence[float], window: int = SETTLE_WINDOW) -> bool:
    """Whether the median of the last `window` steps is within tolerance of the `window` before."""
    if len(step_times) < 2 * window:
        return False
    recent = statistics.median(step_times[-window:])
    before = statistics.median(step_times[-2 * window : -window])
    if before == 0:
        return recent == 0
    return abs(recent / before - 1) <= SETTLE_TOLERANCE


@dataclass(frozen=True)
class Speedup:
    """How much faster a candidate ran than a reference, with a bootstrap interval.

    `ratio` is the reference's median step time over the candidate's (2.0: twice as fast);
    `low`/`high` bound it at `confidence`. `verdict` is 'faster' or 'slower' only where the
    whole interval lies beyond the tolerance, 'indistinguishable' where it does not, and
    'too few samples' where either set has fewer than MIN_SAMPLES_FOR_A_CLAIM steps, unless a
    well-timed set and at least two steps of the other do not even overlap (a much slower,
    budget-limited precision).
    """

    ratio: float
    low: float
    high: float
    verdict: str
    reference_count: int
    candidate_count: int
    confidence: float = CONFIDENCE
    tolerance: float = SPEEDUP_TOLERANCE
    method: str = (
        f"percentile bootstrap of the ratio of medians, {BOOTSTRAP_RESAMPLES} resamples of each set"
    )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def interval_text(self) -> str:
        """'95% interval 1.80-2.20x' (as a speed-up)."""
        return f"{self.confidence:.0%} interval {self.low:.2f}-{self.high:.2f}x"

    @property
    def text(self) -> str:
        """'2.00x faster (95% interval 1.80-2.20x)' and the like, for logs and the report."""
        interval = self.interval_text
        if self.verdict == "faster":
            return f"{self.ratio:.2f}x faster ({interval})"
        if self.verdict == "slower":
            slower = f"{self.confidence:.0%} interval {1 / self.high:.2f}-{1 / self.low:.2f}x"
            return f"{1 / self.ratio:.2f}x slower ({slower})"
        if self.verdict == "too few samples":
            return (
                f"{self.ratio:.2f}x, too few timed steps to tell "
                f"({self.candidate_count} against {self.reference_count}; {interval})"
            )
        return f"indistinguishable ({self.ratio:.2f}x, {interval})"


def speedup(
    reference_s: Sequence[float],
    candidate_s: Sequence[float],
    *,
    tolerance: float = SPEEDUP_TOLERANCE,
    confidence: float = CONFIDENCE,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> Speedup:
    """Speed-up of `candidate` over `reference` from their step times, with its interval.

    Both sets are resampled independently (they come from separate runs), and the interval is
    the percentile interval of the ratio of medians: no assumption about the shape of the
    step-time distribution, which on shared machines has long right tails. Seeded: the same
    samples always give the same interval.
    """
    reference = np.asarray(reference_s, dtype=np.float64)
    candidate = np.asarray(candidate_s, dtype=np.float64)
    if reference.size == 0 or candidate.size == 0:
        raise ValueError("A speed-up needs at least one timed step on each side.")
    rng = np.random.default_rng(seed)
    ref_medians = np.median(rng.choice(reference, (resamples, reference.size)), axis=1)
    cand_medians = np.median(rng.choice(candidate, (resamples, candidate.size)), axis=1)
    ratios = ref_medians / cand_medians
    low, high = percentile_interval(ratios, confidence)
    ratio = float(np.median(reference) / np.median(candidate))
    sizes = sorted((reference.size, candidate.size))
    enough = sizes[0] >= MIN_SAMPLES_FOR_A_CLAIM
    # a budget-limited slow side with a few steps, all beyond every step of a well-timed side
    apart = (
        sizes[0] >= 2
        and sizes[1] >= MIN_SAMPLES_FOR_A_CLAIM
        and (reference.min() > candidate.max() or candidate.min() > reference.max())
    )
    if not (enough or apart):
        verdict = "too few samples"
    elif low > 1 + tolerance:
        verdict = "faster"
    elif high < 1 / (1 + tolerance):
        verdict = "slower"
    else:
        verdict = "indistinguishable"
    return Speedup(
        ratio, low, high, verdict, int(reference.size), int(candidate.size), confidence, tolerance
    )


# ---- detection F1, precision and recall over images ------------------------------------------

IMAGES_METHOD = f"percentile bootstrap over images, {BOOTSTRAP_RESAMPLES} resamples"
_RESAMPLE_CHUNK = 200  # resamples drawn at once: bounds memory at 200 x images weights


def _share(part: np.ndarray, whole: np.ndarray) -> np.ndarray:
    """part / whole elementwise, 0 where whole is 0 (the evaluator's convention for 0/0)."""
    part, whole = np.asarray(part, dtype=np.float64), np.asarray(whole, dtype=np.float64)
    return np.divide(part, whole, out=np.zeros_like(whole), where=whole > 0)


def f1_of_counts(tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> np.ndarray:
    """Micro F1 = 2TP / (2TP + FP + FN) elementwise, 0 where nothing was found or expected."""
    tp, fp, fn = (np.asarray(v, dtype=np.float64) for v in (tp, fp, fn))
    return _share(2 * tp, 2 * tp + fp + fn)


def bootstrap_weights(
    images: int, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> Iterator[np.ndarray]:
    """Bootstrap resamples of `images` images as weights, [k, images] at a time and
    `resamples` rows in all: how often each image was drawn (with replacement, `images`
    draws; multinomial, which is the same thing). Seeded: the same call gives the same rows."""
    rng = np.random.default_rng(seed)
    uniform = np.full(images, 1.0 / images)
    for start in range(0, resamples, _RESAMPLE_CHUNK):
        yield rng.multinomial(images, uniform, size=min(_RESAMPLE_CHUNK, resamples - start))


def _per_image(counts: Mapping[str, Sequence[int]]) -> np.ndarray:
    """[images, 3] TP/FP/FN from an eval JSON's `per_image` counts."""
    return np.stack([np.asarray(counts[key], dtype=np.int64) for key in ("tp", "fp", "fn")], 1)


MICRO_FIGURES = ("f1", "precision", "recall")


def micro_intervals(
    per_image: Mapping[str, Sequence[int]],
    *,
    confidence: float = CONFIDENCE,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> dict[str, dict[str, Any] | None]:
    """The intervals of the micro F1, precision and recall over the images they were measured
    on, from per-image counts (`tp`, `fp`, `fn`), all three from the same resamples. Images are
    the unit resampled: objects of one image are not independent (one clutter patch makes
    several false positives). Each None without images."""
    counts = _per_image(per_image)
    if len(counts) == 0:
        return dict.fromkeys(MICRO_FIGURES)
    samples: dict[str, list[np.ndarray]] = {name: [] for name in MICRO_FIGURES}
    for weights in bootstrap_weights(len(counts), resamples, seed):
        tp, fp, fn = (weights @ counts).T
        samples["f1"].append(f1_of_counts(tp, fp, fn))
        samples["precision"].append(_share(tp, tp + fp))
        samples["recall"].append(_share(tp, tp + fn))
    return {
        name: bootstrap_interval(np.concatenate(found), len(counts), IMAGES_METHOD, confidence)
        for name, found in samples.items()
    }


def bootstrap_interval(
    samples: np.ndarray, images: int, method: str, confidence: float = CONFIDENCE
) -> dict[str, Any]:
    """An interval over images as the eval JSON records it (`f1_interval`, `ap50_interval`, ...)."""
    low, high = percentile_interval(samples, confidence)
    return {"low": low, "high": high, "confidence": confidence, "images": images, "method": method}


def interval_text(interval: Mapping[str, Any] | None) -> str:
    """'95% interval 0.914-0.957 over 256 images', for logs and the report."""
    if not interval:
        return "no interval: no images"
    return (
        f"{interval['confidence']:.0%} interval {interval['low']:.3f}-{interval['high']:.3f} "
        f"over {interval['images']} images"
    )


@dataclass(frozen=True)
class PairedChange:
    """A candidate run's F1 or AP@.5 against a reference's on the same images, with a paired
    interval.

    `change` is candidate minus reference (negative: accuracy lost), `low`/`high` bound it at
    `confidence`. `verdict` is 'held' where the whole interval lies above -tolerance (the
    candidate lost at most that), 'dropped' where the whole interval lies below it, and
    'undecided' where it straddles -tolerance: those images cannot tell.
    """

    change: float
    low: float
    high: float
    verdict: str
    images: int
    tolerance: float
    confidence: float = CONFIDENCE
    method: str = f"paired {IMAGES_METHOD} (both runs resampled at the same images)"

    def images_to_settle(self, limit: int = 16384) -> int | None:
        """About how many images would settle an undecided change, were it to stay where it
        is: the interval narrows as 1/sqrt(images), and must clear -tolerance by the distance
        the change lies from it. A multiple of 256; None above `limit` (a change sitting at
        the tolerance itself) or where the change is decided already."""
        margin = abs(self.change + self.tolerance)
        if self.verdict != "undecided" or margin == 0:
            return None
        needed = self.images * ((self.high - self.low) / 2 / margin) ** 2
        rounded = 256 * math.ceil(max(needed, self.images + 1) / 256)
        return rounded if rounded <= limit else None


def f1_change(
    reference: Mapping[str, Sequence[Any]],
    candidate: Mapping[str, Sequence[Any]],
    *,
    tolerance: float,
    confidence: float = CONFIDENCE,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> PairedChange:
    """The F1 change from `reference` to `candidate`, each an eval JSON's `per_image` counts
    (`image_ids`, `tp`, `fp`, `fn`), resampling images in pairs: the two runs' results on one
    image go together, so what both find easy or hard cancels out of the interval.

    ValueError where the two were not scored on the same images.
    """
    placed = _reference_positions(reference["image_ids"], candidate["image_ids"])
    ref, cand = _per_image(reference), _per_image(candidate)[np.argsort(placed)]
    changes = np.concatenate(
        [
            f1_of_counts(*(weights @ cand).T) - f1_of_counts(*(weights @ ref).T)
            for weights in bootstrap_weights(len(ref), resamples, seed)
        ]
    )
    change = float(f1_of_counts(*cand.sum(axis=0)) - f1_of_counts(*ref.sum(axis=0)))
    return _paired(change, changes, len(ref), tolerance, confidence)


def _reference_positions(reference_ids: Sequence[Any], candidate_ids: Sequence[Any]) -> np.ndarray:
    """Each candidate image's position among the reference's images, which pairs two
    evaluations image by image; ValueError where they did not score the same images."""
    reference_ids, candidate_ids = list(reference_ids), list(candidate_ids)
    if sorted(reference_ids) != sorted(candidate_ids) or len(set(reference_ids)) != len(
        reference_ids
    ):
        raise ValueError(
            f"the two evaluations scored different images ({len(reference_ids)} and "
            f"{len(candidate_ids)})"
        )
    if not reference_ids:
        raise ValueError("the evaluations scored no images")
    position = {image_id: index for index, image_id in enumerate(reference_ids)}
    return np.asarray([position[image_id] for image_id in candidate_ids], dtype=np.int64)


def _paired(
    change: float, changes: np.ndarray, images: int, tolerance: float, confidence: float
) -> PairedChange:
    """The verdict on a change from its resampled values: 'held' where the whole interval lies
    above -tolerance, 'dropped' where it lies below, else 'undecided'."""
    low, high = percentile_interval(changes, confidence)
    if low >= -tolerance:
        verdict = "held"
    elif high < -tolerance:
        verdict = "dropped"
    else:
        verdict = "undecided"
    return PairedChange(change, low, high, verdict, images, tolerance, confidence)


# ---- AP from pycocotools' matches, reweighed by image ----------------------------------------

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


def weighted_class_ap(
    classes: Sequence[ClassMatches],
    weights: np.ndarray,
    recall_thresholds: np.ndarray = RECALL_THRESHOLDS,
) -> np.ndarray:
    """AP [K, R] of each class, at the IoU its matches were made at, for each row of image
    weights [R, I] (how often a resample drew each image), computed as COCOeval.accumulate
    does: the precision envelope at 101 recall points; NaN where a resample drew none of the
    class's objects. All-ones weights give pycocotools' per-class AP at that IoU."""
    per_class = np.full((len(classes), len(weights)), np.nan)
    for k, found in enumerate(classes):
        objects = weights @ found.gt_per_image  # [R]
        hits = np.flatnonzero(found.is_tp)
        if hits.size == 0:
            per_class[k] = np.where(objects > 0, 0.0, np.nan)
            continue
        # Recall rises only at true positives, so the first detection that reaches a recall
        # threshold is one, and the envelope there is the highest precision at a true positive
        # from there on (after a false positive precision only falls until the next one): the
        # sums at the true positives give accumulate's AP exactly, in one pass over the detections.
        misses = np.flatnonzero(~found.is_tp)
        tp = np.cumsum(weights[:, found.image_index[hits]], axis=1, dtype=np.float64)
        fp = np.zeros((len(weights), hits.size))
        if misses.size:
            fp_sums = np.cumsum(weights[:, found.image_index[misses]], axis=1, dtype=np.float64)
            before = hits - np.arange(hits.size)  # false positives ranked above each hit
            counted = before > 0
            fp[:, counted] = fp_sums[:, before[counted] - 1]
        with np.errstate(divide="ignore", invalid="ignore"):
            recall = tp / objects[:, None]
        precision = tp / (tp + fp + np.spacing(1))
        envelope = np.maximum.accumulate(precision[:, ::-1], axis=1)[:, ::-1]
        for r in range(len(weights)):
            if objects[r] == 0:
                continue
            at = np.searchsorted(recall[r], recall_thresholds, side="left")
            reached = at < hits.size
            per_class[k, r] = envelope[r, at[reached]].sum() / len(recall_thresholds)
    return per_class


def class_mean(per_class: np.ndarray) -> np.ndarray:
    """The mean over the classes with objects [R] of per-class AP [K, R], as pycocotools
    averages; NaN where a resample drew no objects at all."""
    counted = np.isfinite(per_class).sum(axis=0)
    totals = np.where(np.isfinite(per_class), per_class, 0.0).sum(axis=0)
    return np.divide(totals, counted, out=np.full(per_class.shape[1], np.nan), where=counted > 0)


def read_ap50_matches(
    matches: Mapping[str, Any],
) -> tuple[list[Any], list[int], list[ClassMatches]]:
    """(image ids, class labels, their matches, in label order) from an eval JSON's
    `metrics.ap50_matches`; ValueError where it is malformed."""
    image_ids = list(matches["image_ids"])
    found = sorted(matches["classes"], key=lambda row: int(row["label"]))
    labels = [int(row["label"]) for row in found]
    return image_ids, labels, [ClassMatches.from_document(row, len(image_ids)) for row in found]


def ap50_change(
    reference: Mapping[str, Any],
    candidate: Mapping[str, Any],
    *,
    tolerance: float,
    confidence: float = CONFIDENCE,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> PairedChange:
    """The AP@.5 change from `reference` to `candidate`, each an eval JSON's
    `metrics.ap50_matches`, resampling images in pairs as `f1_change` does: each resample
    reweighs both runs' own matches at the same images.

    ValueError where the two were not scored on the same images and classes.
    """
    ref_ids, ref_labels, ref = read_ap50_matches(reference)
    cand_ids, cand_labels, cand = read_ap50_matches(candidate)
    placed = _reference_positions(ref_ids, cand_ids)
    if ref_labels != cand_labels:
        raise ValueError(
            f"the two evaluations scored different classes ({ref_labels}, {cand_labels})"
        )
    cand = [found.reordered(placed) for found in cand]

    def difference(weights: np.ndarray) -> np.ndarray:
        return class_mean(weighted_class_ap(cand, weights)) - class_mean(
            weighted_class_ap(ref, weights)
        )

    change = float(difference(np.ones((1, len(ref_ids))))[0])
    changes = np.concatenate(
        [difference(weights) for weights in bootstrap_weights(len(ref_ids), resamples, seed)]
    )
    changes = changes[np.isfinite(changes)]
    if changes.size == 0:
        raise ValueError("the evaluations hold no objects to compare AP@.5 on")
    return _paired(change, changes, len(ref_ids), tolerance, confidence)
