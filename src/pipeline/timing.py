"""Honest timing on any backend: synchronize around every timed region, keep every sample,
report robust statistics (median and IQR, as torch.utils.benchmark does), bound by a budget."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from pipeline import device as dev

NOISY_IQR_RATIO = 0.10  # IQR/median above this marks a measurement as noisy
HIGH_LOAD_PER_CORE = 0.5  # 1-minute load average per core above which others shared the machine
FOREIGN_CPU_SHARE_LIMIT = 0.15  # share of all cores busy with other processes during a run


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) of already sorted values."""
    if not sorted_values:
        return math.nan
    position = (len(sorted_values) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def summarize(samples_s: list[float]) -> dict[str, Any]:
    """Median, mean, IQR, p10/p50/p90/p99, min, max (in ms) and the noisy flag."""
    values = sorted(samples_s)
    if not values:
        return {"count": 0}
    ms = [v * 1000 for v in values]
    median = percentile(ms, 50)
    iqr = percentile(ms, 75) - percentile(ms, 25)
    ratio = iqr / median if median > 0 else math.inf
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
    }


def timed_runs(
    step: Callable[[], Any],
    device: dev.DeviceLike,
    *,
    warmup: int,
    max_steps: int,
    budget_s: float,
    memory: dev.PeakMemory | None = None,
) -> tuple[list[float], dict[str, Any]]:
    """Run `step` `warmup` times untimed, then up to `max_steps` timed, within `budget_s` overall.

    The device is synchronized before and after every timed step, so queued work is never
    attributed to the wrong step. At least one step is always timed, even past the budget.
    `memory` is sampled after every step, outside the timed region (the MPS lower bound needs
    samples near each step's peak, and reading it must not count as the step's time).
    """
    started = time.perf_counter()
    warmup_done = 0
    for _ in range(warmup):
        step()
        warmup_done += 1
        dev.synchronize(device)
        if memory is not None:
            memory.update()
        if time.perf_counter() - started > budget_s:
            break
    samples: list[float] = []
    while len(samples) < max_steps:
        dev.synchronize(device)
        t0 = time.perf_counter()
        step()
        dev.synchronize(device)
        samples.append(time.perf_counter() - t0)
        if memory is not None:
            memory.update()
        if time.perf_counter() - started > budget_s:
            break
    return samples, {
        "warmup_steps": warmup_done,
        "total_s": time.perf_counter() - started,
        "budget_limited": len(samples) < max_steps,
    }


def _busy_jiffies() -> float | None:
    """CPU time spent busy by the whole machine (Linux /proc/stat), in seconds."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = stat.readline().split()[1:]
    except OSError:
        return None
    values = [int(v) for v in fields]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return (sum(values[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _live_children_cpu_s() -> float:
    """CPU seconds of this process's running children (DataLoader workers); Linux only."""
    me, tick, total = str(os.getpid()), os.sysconf("SC_CLK_TCK"), 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # the process has gone meanwhile
        if len(fields) > 12 and fields[1] == me:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _own_cpu_s() -> float:
    """CPU time of this process and its children (finished and running): not 'other work'."""
    times = os.times()
    return (
        time.process_time() + times.children_user + times.children_system + _live_children_cpu_s()
    )


def _now() -> str:
    """UTC time with milliseconds: enough to show that two measurements did not overlap."""
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


class RunConditions:
    """Did other work share the machine during a measurement?

    The 1-minute load average is recorded as asked, but it lags by a minute: right after a
    training job it is high although nothing else runs. Where Linux tells it, the busy CPU
    time of *other* processes during the run is the better signal, and decides `high_load`.
    """

    def __init__(self) -> None:
        self.started = _now()
        self.cores = os.cpu_count() or 1
        self.load_start = _load_average()
        self._busy = _busy_jiffies()
        self._own = _own_cpu_s()
        self._wall = time.perf_counter()

    def finish(self) -> dict[str, Any]:
        load_end = _load_average()
        wall = time.perf_counter() - self._wall
        busy = _busy_jiffies()
        foreign = None
        if busy is not None and self._busy is not None and wall > 0:
            others = (busy - self._busy) - (_own_cpu_s() - self._own)
            foreign = max(0.0, others) / (wall * self.cores)
        if foreign is not None:
            high = foreign > FOREIGN_CPU_SHARE_LIMIT
        else:
            worst = max((x for x in (self.load_start, load_end) if x is not None), default=0.0)
            high = worst / self.cores > HIGH_LOAD_PER_CORE
        return {
            "started": self.started,
            "finished": _now(),
            "load_1m_start": self.load_start,
            "load_1m_end": load_end,
            "cpu_count": self.cores,
            "foreign_cpu_share": foreign,
            "high_load": high,
        }


def torch_settings() -> dict[str, Any]:
    """Flags that change what a timing means (TF32 can silently replace fp32 on CUDA)."""
    return {
        "torch_threads": torch.get_num_threads(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
