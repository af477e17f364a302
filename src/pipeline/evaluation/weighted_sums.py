"""Weighted counts of a ranking's detections for every resample at once: each resample's
weight (how often it drew each detection's image) of chosen detections, summed up to chosen
ranks, by whichever of three exact ways costs least for the sizes at hand
(pipeline.evaluation.intervals reads AP's precision and recall off them)."""

from __future__ import annotations

import functools

import numpy as np

_BLOCK_ELEMENTS = 1 << 22  # resamples x detections gathered at once: 16 MiB of int32 weights
_DENSE_ADVANTAGE = 100  # a matrix product's multiply-adds per gathered and summed weight, about
_FLOAT32_EXACT = 1 << 24  # float32 holds every integer below this exactly
# weights summed: at most 100 detections of a class per image (maxDets) times the draws, so
# int32 holds them up to 20 million images, at half int64's memory traffic
_SUMS = np.int32


class Weights:
    """A block's image weights [I, R] in the layouts the sums read: rows by image (gathered
    per detection), and where asked for, rows by resample (summed along) and float32 (matrix
    products); made once for every class."""

    def __init__(self, by_image: np.ndarray) -> None:
        self.by_image = by_image
        self.largest = int(by_image.max(initial=0))

    @functools.cached_property
    def by_resample(self) -> np.ndarray:
        return np.ascontiguousarray(self.by_image.T)

    @functools.cached_property
    def float32(self) -> np.ndarray:
        return self.by_image.astype(np.float32)


class SumsAt:
    """Each resample's weight of `members` (ranks, ascending) ranked at or above each of
    `positions` (ascending), prepared once for every block of resamples: called with a block's
    weights, [P, R].

    Three ways to the same integers, by what costs least. Many members and few positions (a
    class's counted detections at its run ends): each position's new members by image [P, I]
    times the weights, one matrix product in float32, exact while every sum stays below 2**24
    (integers all the way). About as many positions as members (true positives that rarely
    follow one another): their weights gathered and summed up. Else the members' weights
    gathered and summed between positions."""

    def __init__(
        self, image_index: np.ndarray, members: np.ndarray, positions: np.ndarray, images: int
    ) -> None:
        members = members[: np.searchsorted(members, positions[-1], side="right")]
        self.size = positions.size
        self.images = image_index[members]  # each member's image
        self.dense = positions.size * images < _DENSE_ADVANTAGE * members.size
        segment = np.searchsorted(positions, members, side="left")  # first position at or below
        if self.dense:
            self.added = (
                np.bincount(segment * images + self.images, minlength=positions.size * images)
                .reshape(positions.size, images)  # each position's members since the one before
                .astype(np.float32)
            )
        self.running = 2 * positions.size >= members.size
        if self.running:
            self.read = np.searchsorted(members, positions, side="right")
        else:  # members outnumber positions twice: none is empty
            self.starts = np.flatnonzero(np.r_[True, segment[1:] != segment[:-1]])
            self.segments = segment[self.starts]

    def __call__(self, weights: Weights) -> np.ndarray:
        if self.dense and self.images.size * weights.largest < _FLOAT32_EXACT:
            sums = self.added @ weights.float32
            return np.cumsum(sums, axis=0, dtype=_SUMS)
        if self.running:
            running = np.zeros((self.images.size + 1, weights.by_image.shape[1]), dtype=_SUMS)
            np.cumsum(weights.by_image[self.images], axis=0, out=running[1:])
            return running[self.read]
        step = max(1, _BLOCK_ELEMENTS // max(self.images.size, 1))  # resamples gathered at once
        by_resample = weights.by_resample
        return np.concatenate(
            [
                self._between(by_resample[start : start + step])
                for start in range(0, len(by_resample), step)
            ],
            axis=1,
        )

    def _between(self, by_resample: np.ndarray) -> np.ndarray:
        # [R, M]: the members' weights, each resample's row contiguous (summed along it)
        rows = by_resample.take(self.images, axis=1)
        result = np.zeros((self.size, rows.shape[0]), dtype=_SUMS)
        result[self.segments] = np.add.reduceat(rows, self.starts, axis=1).T
        return np.cumsum(result, axis=0, out=result)
