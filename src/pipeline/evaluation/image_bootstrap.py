"""Bootstrap intervals over the images of a detection run: its micro F1, precision and
recall, and the paired change of F1 (AP@.5's is pipeline.evaluation.paired_ap's) between two
runs scored on the same images. Without torch: the summary reads it too."""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.stats import BOOTSTRAP_RESAMPLES, CONFIDENCE, percentile_interval

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
    draws). Seeded: the same call gives the same rows (read-only: one evaluation asks for
    them once per figure, so they are drawn once, also where two of its threads ask at once)."""
    with _DRAWING:
        drawn = _drawn(images, resamples, seed)
    yield from drawn


_DRAWING = threading.Lock()  # a thread asking while another draws waits for its rows


@functools.lru_cache(maxsize=1)
def _drawn(images: int, resamples: int, seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    chunks = []
    for start in range(0, resamples, _RESAMPLE_CHUNK):
        chunk = drawn_counts(rng, images, min(_RESAMPLE_CHUNK, resamples - start))
        chunk.flags.writeable = False
        chunks.append(chunk)
    return tuple(chunks)


def drawn_counts(rng: np.random.Generator, images: int, rows: int) -> np.ndarray:
    """[rows, images] int64: each row the counts of `images` uniform draws of an image, the
    draws themselves counted (one bincount over every row, each offset to a range of its own).
    The same distribution as a multinomial draw of `images` over equal shares, which numpy
    draws image by image as a chain of binomials, several times slower at thousands of
    images."""
    draws = rng.integers(0, images, size=(rows, images))
    draws += np.arange(rows)[:, None] * images
    return np.bincount(draws.ravel(), minlength=rows * images).reshape(rows, images)


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


def centred_percentile_interval(
    samples: np.ndarray,
    estimate: float,
    confidence: float = CONFIDENCE,
    within: tuple[float, float] = (-math.inf, math.inf),
) -> tuple[float, float, float]:
    """(low, high, shift): the percentile interval of bootstrap samples moved by `shift`, their
    median less the estimate, so that the estimate is their median (and always inside).

    For a figure that resampling itself moves: AP's precision envelope is a running maximum,
    and on a resample (images drawn twice, others not at all) it rises above the figure of
    the images drawn from, as the figure rises above the AP of unlimited images. The plain
    percentile interval then lies beside the figure, even wholly above it. Its spread is
    kept, its place is the figure's: the interval of the figure over sets of as many images,
    not of the AP of unlimited images (which the figure overstates by about `shift`). The
    bias-corrected percentile method (BC, BCa) reads the share of resamples below the
    estimate: where that is nearly none its quantiles leave the resamples altogether.
    `within`: the figure's own range (AP's 0 to 1), which a moved bound is held to."""
    shift = float(np.median(samples) - estimate)
    low, high = percentile_interval(samples - shift, confidence)
    return max(low, within[0]), min(high, within[1]), shift


def bootstrap_interval(
    samples: np.ndarray,
    images: int,
    method: str,
    confidence: float = CONFIDENCE,
    estimate: float | None = None,
    within: tuple[float, float] = (-math.inf, math.inf),
) -> dict[str, Any]:
    """An interval over images as the eval JSON records it (`f1_interval`, `ap50_interval`, ...);
    with an `estimate`, centred on it (`centred_percentile_interval`, held `within`) and its
    `shift` kept."""
    if estimate is None:
        low, high = percentile_interval(samples, confidence)
        shift = {}
    else:
        low, high, moved = centred_percentile_interval(samples, estimate, confidence, within)
        shift = {"shift": moved}
    return {
        "low": low,
        "high": high,
        "confidence": confidence,
        "images": images,
        "method": method,
        **shift,
    }


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
    placed = reference_positions(reference["image_ids"], candidate["image_ids"])
    ref, cand = _per_image(reference), _per_image(candidate)[np.argsort(placed)]
    changes = np.concatenate(
        [
            f1_of_counts(*(weights @ cand).T) - f1_of_counts(*(weights @ ref).T)
            for weights in bootstrap_weights(len(ref), resamples, seed)
        ]
    )
    change = float(f1_of_counts(*cand.sum(axis=0)) - f1_of_counts(*ref.sum(axis=0)))
    return paired_change(change, changes, len(ref), tolerance, confidence)


def reference_positions(reference_ids: Sequence[Any], candidate_ids: Sequence[Any]) -> np.ndarray:
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


def paired_change(
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
