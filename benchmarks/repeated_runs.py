"""Figures of repeated runs: a time as the median of the runs with their range, a ratio as
the median of the per-run ratios with its bootstrap interval over the runs.

One run's figure on a shared or frequency-scaling machine can land either side of a target;
the runs' spread says how far to trust it (see benchmarks/README.md, evaluation_speed.py).
"""

from __future__ import annotations

from typing import Any

import harness
import numpy as np

from pipeline import stats

Times = list[tuple[str, str, dict[str, float], str]]  # (key, label, spread, unit) per time


def spread(values: list[float]) -> dict[str, float]:
    """The median of the runs' values, and the smallest and largest of them."""
    return {"median": float(np.median(values)), "low": min(values), "high": max(values)}


def paired_ratio(numerators: list[float], denominators: list[float]) -> dict[str, float]:
    """The median of the per-run ratios and its bootstrap interval over the runs (each run a
    round of `stats.paired_speedup`: both halves of a ratio were timed in the same run, so
    what the machine did then is in both)."""
    rounds = list(range(len(numerators)))
    paired = stats.paired_speedup(numerators, denominators, rounds, rounds)
    if paired is None:  # parse_args refuses fewer runs
        raise ValueError(f"{len(numerators)} runs, fewer than {stats.MIN_ROUNDS_TO_PAIR}")
    ratio, low, high, _rounds, _pairs = paired
    return {"median": ratio, "low": low, "high": high}


def with_spread(value: dict[str, float], digits: int = 3) -> str:
    """'0.950 (0.910-1.020)': a median and its interval, for the printed tables."""
    return f"{value['median']:.{digits}f} ({value['low']:.{digits}f}-{value['high']:.{digits}f})"


def spread_figures(times: Times, runs: int) -> list[dict[str, Any]]:
    """Each time as the median of the runs, the smallest and largest of them as its interval."""
    return [
        harness.figure(
            key,
            f"{label}, median of {runs} runs (the interval: their smallest and largest)",
            value["median"],
            unit,
            interval=(value["low"], value["high"]),
        )
        for key, label, value, unit in times
    ]


def ratio_figure(
    key: str, label: str, value: dict[str, float], target: float, over: str
) -> dict[str, Any]:
    """A ratio as the median of the ratios of `over` ('5 runs'), with its interval over them."""
    return harness.figure(
        key,
        f"{label}, median of the ratios of {over} (the interval: {stats.CONFIDENCE:.0%} "
        "bootstrap over them)",
        value["median"],
        "ratio",
        target=("<=", target),
        interval=(value["low"], value["high"]),
    )
