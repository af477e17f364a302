"""Weighted counts of a ranking's detections for every resample at once: each resample's
weight (how often it drew each detection's image) of chosen detections, summed up to chosen
ranks (pipeline.evaluation.weighted_ap reads AP's precision and recall off them).

torch (its sparse products) is imported where a sum is made, not with this module: the summary
and the report import weighted_ap (through paired_ap) and must start without torch."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

_FLOAT32_EXACT = 1 << 24  # float32 holds every integer below this exactly


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
    exact in any order), else float64 (exact up to 2**53)."""

    def __init__(
        self, image_index: np.ndarray, members: np.ndarray, positions: np.ndarray, images: int
    ) -> None:
        members = members[: np.searchsorted(members, positions[-1], side="right")]
        self.size = positions.size
        self.members = members.size
        segment = np.searchsorted(positions, members, side="left")  # first position at or below
        # each (position, image) once, with how many of its members it holds: a CSR matrix's
        # columns are sorted and distinct within a row
        cells, counts = np.unique(segment * images + image_index[members], return_counts=True)
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
        # times more per row. Zeros, though beta is 0: MKL's kernel ignores them, but torch's
        # own (builds without MKL, as on macOS) multiplies them by beta, and 0 x NaN is NaN
        sums = np.zeros((self.size, weights.by_image.shape[1]), dtype=dtype)
        out = torch.from_numpy(sums)
        matrix, by_image = self._matrices[dtype], torch.from_numpy(weights.floats(dtype))
        torch.addmm(out, matrix, by_image, beta=0, out=out)
        return accumulate_rows(sums, np.add)


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
