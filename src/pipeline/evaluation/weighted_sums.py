"""Weighted counts of a ranking's detections for every resample at once: each resample's
weight (how often it drew each detection's image) of chosen detections, summed up to chosen
ranks; and which of those sums a class ranking's AP reads in each area range at each IoU
(pipeline.evaluation.intervals reads AP's precision and recall off them).

torch (its sparse products) is imported where a sum is made, not with this module: the summary
and the report import the intervals' module and must start without torch."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from pipeline.evaluation.intervals import ClassRanking

_FLOAT32_EXACT = 1 << 24  # float32 holds every integer below this exactly
# a row of a product's output and of its running sum, in product terms of one member (both
# R-long): what `_base_iou` weighs rows by
_ROW_COST = 6


class Weights:
    """A block's image weights [I, R]: rows by image, as numpy (read per image) and as the
    floating-point arrays the sums multiply (made once for every class; none where the weights
    are of that type already)."""

    def __init__(self, by_image: np.ndarray) -> None:
        self.by_image = by_image
        self.largest = int(by_image.max(initial=0))
        self._floats: dict[type, np.ndarray] = {}

    def floats(self, dtype: type) -> np.ndarray:
        if dtype not in self._floats:
            self._floats[dtype] = self.by_image.astype(dtype, copy=False)
        return self._floats[dtype]

    def exact_type(self, members: int) -> type:
        """The floating-point type whose sums of `members` of these weights are exact
        integers: float32 while they cannot reach 2**24, else float64 (up to 2**53)."""
        return np.float32 if members * self.largest < _FLOAT32_EXACT else np.float64

    def weighed(self, counts: np.ndarray) -> np.ndarray:
        """[..., R] int64: non-negative integer counts by image [..., I] weighed by each
        resample, as a floating-point matrix product (BLAS: numpy's integer product is a plain
        loop several times slower), exact (see exact_type)."""
        dtype = self.exact_type(int(counts.sum()))
        return (counts.astype(dtype) @ self.floats(dtype)).astype(np.int64)


class SumsAt:
    """Each resample's weight of `members` (ranks, ascending) ranked at or above each of
    `positions` (ascending), prepared once for every block of resamples: called with a block's
    weights, [P, R].

    Each position's new members by image, a sparse [P, I] matrix of counts, times the weights
    [I, R]: work in proportion to the members, not to positions x images, then summed down the
    positions. In float32 while a position's sum cannot reach 2**24 (integers all the way,
    exact in any order), else float64 (exact up to 2**53).

    `signs`: each member counted +1 or -1 (what changed between two sets of members): every
    partial sum is still an integer, of absolute value at most members x the largest weight,
    the bound the type is chosen by, so as exact in any order."""

    def __init__(
        self,
        image_index: np.ndarray,
        members: np.ndarray,
        positions: np.ndarray,
        images: int,
        signs: np.ndarray | None = None,
    ) -> None:
        kept = np.searchsorted(members, positions[-1], side="right")
        members = members[:kept]
        self.size = positions.size
        self.members = members.size
        segment = np.searchsorted(positions, members, side="left")  # first position at or below
        # each (position, image) once, with how many of its members it holds: a CSR matrix's
        # columns are sorted and distinct within a row
        cells = segment * images + image_index[members]
        if signs is None:
            cells, counts = np.unique(cells, return_counts=True)
        else:  # a member gained and one lost in the same cell cancel out
            cells, inverse = np.unique(cells, return_inverse=True)
            counts = np.bincount(inverse, weights=signs[:kept], minlength=cells.size)
            cells, counts = cells[counts != 0], counts[counts != 0]
        rows = np.zeros(positions.size + 1, dtype=np.int64)
        np.cumsum(np.bincount(cells // images, minlength=positions.size), out=rows[1:])
        # made here, where the plan is made (one thread); float64 where a block needs it
        self._matrices = {np.float32: _csr(rows, cells % images, counts, (positions.size, images))}

    def __call__(self, weights: Weights) -> np.ndarray:
        """[P, R] integers, in the floating-point type that holds them exactly."""
        import torch

        dtype = weights.exact_type(self.members)
        if dtype not in self._matrices:  # two workers may both make it: the same matrix
            self._matrices[dtype] = self._matrices[np.float32].to(torch.float64)
        # into an array of numpy's: torch's own output of the product (`@`) costs several
        # times more per row; beta 0: its contents are not read
        sums = np.empty((self.size, weights.by_image.shape[1]), dtype=dtype)
        out = torch.from_numpy(sums)
        matrix, by_image = self._matrices[dtype], torch.from_numpy(weights.floats(dtype))
        torch.addmm(out, matrix, by_image, beta=0, out=out)
        return accumulate_rows(sums, np.add)


class StepsAt:
    """What a few `members` (SumsAt's, signed or not; one at least, ranked at or above the
    last position) add to sums at `positions`, prepared
    once: summed only at the positions where it steps (the first at or below each member),
    then added in place to each span of positions it holds on. Work in proportion to the
    steps and one pass over the sums, not a product's output and running sum over every
    position."""

    def __init__(
        self,
        image_index: np.ndarray,
        members: np.ndarray,
        positions: np.ndarray,
        images: int,
        signs: np.ndarray | None = None,
    ) -> None:
        members = members[: np.searchsorted(members, positions[-1], side="right")]
        steps = np.unique(np.searchsorted(positions, members, side="left"))
        self.members = members.size
        self.spans = np.append(steps, positions.size).tolist()
        self._sums = SumsAt(image_index, members, positions[steps], images, signs)

    def added_to(self, sums: np.ndarray, members: int, weights: Weights) -> np.ndarray:
        """`sums` [P, R] (of `members` members; a copy of the caller's own) with this change
        added, in a type that holds them, the change and the result exactly."""
        sums = sums.astype(weights.exact_type(members + self.members), copy=False)
        change = self._sums(weights)
        for row in range(change.shape[0]):
            sums[self.spans[row] : self.spans[row + 1]] += change[row]
        return sums


@dataclass(frozen=True)
class _IoUSums:
    iou: int
    rows: np.ndarray  # each run end's row of the area's sums at every run end
    tp: SumsAt | None  # the true positives' weight at each run end; None: off the base IoU's
    tp_change: StepsAt | None  # what they add to the base IoU's (None: nothing)
    more: StepsAt | None  # what this IoU counts beyond `always`


@dataclass(frozen=True)
class AreaSums:
    """What AP reads in one area range, at each IoU with a true positive: made once for every
    block of resamples (it depends on the ranking alone)."""

    always: SumsAt  # what every IoU counts, at every IoU's run ends
    base: SumsAt | None  # the base IoU's true positives (`_base_iou`), at every IoU's run ends
    lookups: int  # run ends over all IoUs
    ious: list[_IoUSums]

    def read(self, weights: Weights) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """Each IoU's index, its true positives and what it counts, summed up to each of its
        run ends [P, R], IoU by IoU: each one's arrays stay in the cache through the passes
        the caller makes over them."""
        seen_always = self.always(weights)
        base = None if self.base is None else self.base(weights)
        for at in self.ious:
            seen = np.take(seen_always, at.rows, axis=0)
            if at.more is not None:
                seen = at.more.added_to(seen, self.always.members, weights)
            if at.tp is not None:
                tp = at.tp(weights)
            else:
                tp = np.take(base, at.rows, axis=0)
                if at.tp_change is not None:
                    tp = at.tp_change.added_to(tp, self.base.members, weights)
            yield at.iou, tp, seen


def plan_sums(ranking: ClassRanking, images: int) -> list[AreaSums | None]:
    """What AP reads of the ranking in every area range (None: no true positive there)."""
    plans: list[AreaSums | None] = []
    for a, ends in enumerate(ranking.run_ends):
        every_end = np.unique(np.concatenate(ends))
        if every_end.size == 0:
            plans.append(None)
            continue
        is_tp = ranking.is_tp[a]
        base, on_base = _base_iou(is_tp, ends, every_end.size)
        # what is counted at every IoU, summed up to each run end of any IoU once; an IoU
        # counts more only where a match to an ignored object came or went
        always = ranking.counted[a].all(axis=0)
        by_iou: list[_IoUSums] = []
        for t, at in enumerate(ends):
            if at.size == 0:
                continue
            # what is ranked below the last run end moves nothing read here
            ranked = slice(0, at[-1] + 1)
            tp, tp_change = None, None
            if not on_base[t]:
                tp = SumsAt(ranking.image_index, np.flatnonzero(is_tp[t]), at, images)
            elif (changed := np.flatnonzero(is_tp[t, ranked] != is_tp[base, ranked])).size:
                signs = np.where(is_tp[t, changed], 1.0, -1.0)  # matched here alone: +1
                tp_change = StepsAt(ranking.image_index, changed, at, images, signs)
            more = np.flatnonzero(ranking.counted[a, t, ranked] & ~always[ranked])
            by_iou.append(
                _IoUSums(
                    t,
                    np.searchsorted(every_end, at),
                    tp,
                    tp_change,
                    StepsAt(ranking.image_index, more, at, images) if more.size else None,
                )
            )
        plans.append(
            AreaSums(
                SumsAt(ranking.image_index, np.flatnonzero(always), every_end, images),
                None
                if base is None
                else SumsAt(ranking.image_index, np.flatnonzero(is_tp[base]), every_end, images),
                sum(at.size for at in ends),
                by_iou,
            )
        )
    return plans


def _base_iou(
    is_tp: np.ndarray, ends: Sequence[np.ndarray], every_end: int
) -> tuple[int | None, np.ndarray]:
    """The IoU (of is_tp [T, D]) whose true positives are summed at every run end of the area
    range once, so that other IoUs add only what they match differently (a detection matched
    at .55 is nearly always matched at .5 as well), and which IoUs [T] read theirs off it:
    those where that is less work than their own sums; None (and none) where the base costs
    more than it saves.

    The work of sums is in proportion to their members and rows; a change's rows are at
    most the members that make it, and it is added to rows taken off the base."""
    hits = is_tp.sum(axis=1)
    rows = np.array([at.size for at in ends])
    as_float = is_tp.astype(np.float64)
    changed = hits[:, None] + hits[None, :] - 2 * (as_float @ as_float.T)  # [base, T]
    own = hits + _ROW_COST * rows
    steps = np.minimum(changed, rows[None, :])
    cost = np.minimum(own[None, :], changed + (_ROW_COST + 1) * steps + 2 * rows[None, :])
    with_base = hits + _ROW_COST * every_end + cost.sum(axis=1)
    base = int(np.argmin(with_base))
    if with_base[base] >= own.sum():
        return None, np.zeros(hits.size, dtype=bool)
    return base, cost[base] < own


def accumulate_rows(values: np.ndarray, ufunc: np.ufunc, *, upward: bool = False) -> np.ndarray:
    """`ufunc.accumulate` down the first axis of `values` (up it, from the last row, where
    `upward`), in place, row by row: a block's rows are long (a thousand resamples or more),
    so each step is one vectorised call, where an accumulation along the first axis (numpy's,
    torch's) steps through memory column by column, several times slower."""
    rows = list(values)  # views made once: a step is then the ufunc alone
    if upward:
        for row in range(len(rows) - 2, -1, -1):
            ufunc(rows[row], rows[row + 1], out=rows[row])
    else:
        for row in range(1, len(rows)):
            ufunc(rows[row], rows[row - 1], out=rows[row])
    return values


def _csr(
    rows: np.ndarray, columns: np.ndarray, values: np.ndarray, shape: tuple[int, int]
) -> torch.Tensor:
    """A float32 CSR matrix; its rows' columns are sorted and distinct as made above, so
    torch need not check them (a fifth of a COCO-scale plan's time)."""
    import torch

    with warnings.catch_warnings():  # older torch: CSR support "in beta"; what is used is tested
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta", UserWarning)
        return torch.sparse_csr_tensor(
            torch.from_numpy(rows),
            torch.from_numpy(columns),
            torch.from_numpy(values.astype(np.float32)),
            size=shape,
            check_invariants=False,
        )


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[Callable[[], None]]:
    """torch's threads (its sparse products') set to `count` for the threads started inside,
    then put back. What it yields is to be run first in each of those threads (a pool's
    initializer): torch sets a thread's own count the first time it runs a parallel loop
    there, but the products (MKL's, into an array given) start before it does, with MKL's
    count: the machine's CPUs, in every thread."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield functools.partial(torch.set_num_threads, count)
    finally:
        torch.set_num_threads(before)
