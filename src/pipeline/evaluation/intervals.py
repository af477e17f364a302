"""AP's intervals over images: the images resampled as every other interval resamples them
(`image_bootstrap`), each resample's AP of every class read off pycocotools' own matches
(`weighted_ap`), in blocks of resamples with classes side by side on threads; then the class
means and the intervals, centred on their figures.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
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
from pipeline.evaluation.weighted_ap import (
    RECALL_THRESHOLDS,
    ClassMatches,
    ClassRanking,
    class_mean,
    forget_recall_tables,
    plan_sums,
    ranked_ap,
)
from pipeline.evaluation.weighted_sums import Weights, torch_threads
from pipeline.stats import BOOTSTRAP_RESAMPLES

AP_METHOD = (
    IMAGES_METHOD + ", pycocotools' matches reweighed, centred on the figure (the resamples'"
    " median moved onto it, by `shift`)"
)
# resamples x rows (`ClassRanking.rows`) per block, at most: a block's arrays at run ends
# within a few tens of MiB
_RESAMPLE_BLOCK = 1 << 21


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
                plan = plan_sums(ranking, images)
                found = pool.map(lambda block: ranked_ap(ranking, block, plan=plan), blocks)  # noqa: B023
                by_class.append(np.concatenate(list(found), axis=2))  # [A, T, R]
        else:
            # the costliest first (the most run ends: rows of the largest arrays), so that the
            # last to start is among the shortest
            order = sorted(range(len(rankings)), key=lambda k: -rankings[k].run_end_count)
            found = pool.map(lambda k: _class_samples(rankings[k], blocks, images), order)
            by_label = dict(zip(order, found, strict=True))
            by_class = [by_label[k] for k in range(len(rankings))]
    forget_recall_tables()
    return APSamples(np.stack(by_class, axis=2))


def _class_samples(
    ranking: ClassRanking,
    blocks: Sequence[Weights],
    images: int,
    recall_thresholds: np.ndarray | None = RECALL_THRESHOLDS,
) -> np.ndarray:
    """One class's AP [A, T, R] over every block of resamples, its plan made once for them."""
    plan = plan_sums(ranking, images)
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
