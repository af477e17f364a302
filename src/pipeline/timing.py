"""Honest timing on any backend: warm up until the step time has settled, synchronize around
every timed region, keep every sample, bound everything by a budget, and record the conditions
of the run (did other work share the machine?). The statistics are in `pipeline.stats`."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from pipeline import device as dev
from pipeline.stats import settled

HIGH_LOAD_PER_CORE = 0.5  # 1-minute load average per core above which others shared the machine
FOREIGN_CPU_SHARE_LIMIT = 0.15  # share of all cores busy with other processes during a run

# Sees the step times so far; a reason (text) ends that phase of timed_runs, None lets it go on.
StopRule = Callable[[list[float]], str | None]


def timed_runs(
    step: Callable[[], Any],
    device: dev.DeviceLike,
    *,
    warmup: int,
    max_steps: int,
    budget_s: float,
    warmup_budget_s: float | None = None,
    memory: dev.PeakMemory | None = None,
    end_warmup: StopRule | None = None,
    stop: StopRule | None = None,
) -> tuple[list[float], dict[str, Any]]:
    """Warm up until the step time settles, then time up to `max_steps` steps within `budget_s`.

    Warm-up runs at least `warmup` steps and then until `settled()` (the first steps of a new
    model are slow while oneDNN builds its primitives and the allocator grows), for at most
    `warmup_budget_s` (default: `budget_s`); at least one step is warmed up when `warmup` > 0.
    The device is synchronized after every warm-up step and before and after every timed step,
    so queued work is never attributed to the wrong step. At least one step is always timed,
    even past the budget. `memory` is sampled after every step, outside the timed region.

    `end_warmup` sees the warm-up's step times once its fewest steps have run, `stop` the
    timed samples after every timed step (both outside the timed region): a reason they give
    ends that phase early, and the details say why (`warmup_ended_early`, `stopped_early`).
    """
    started = time.perf_counter()
    cap = budget_s if warmup_budget_s is None else warmup_budget_s
    warmup_times: list[float] = []
    is_settled = warmup == 0
    warmup_ended_early = stopped_early = None
    while warmup > 0:
        t0 = time.perf_counter()
        step()
        dev.synchronize(device)
        warmup_times.append(time.perf_counter() - t0)
        if memory is not None:
            memory.update()
        if len(warmup_times) >= warmup and settled(warmup_times):
            is_settled = True
            break
        if len(warmup_times) >= warmup and end_warmup is not None:
            warmup_ended_early = end_warmup(warmup_times)
            if warmup_ended_early:
                break
        if time.perf_counter() - started > cap:
            break
    warmed = time.perf_counter()
    samples: list[float] = []
    while len(samples) < max_steps:
        dev.synchronize(device)
        t0 = time.perf_counter()
        step()
        dev.synchronize(device)
        samples.append(time.perf_counter() - t0)
        if memory is not None:
            memory.update()
        if stop is not None and len(samples) < max_steps:
            stopped_early = stop(samples)
            if stopped_early:
                break
        if time.perf_counter() - warmed > budget_s:
            break
    return samples, {
        "warmup_steps": len(warmup_times),
        "warmup_s": warmed - started,
        "warmup_settled": is_settled,
        "total_s": time.perf_counter() - started,
        "budget_limited": len(samples) < max_steps and stopped_early is None,
        "warmup_ended_early": warmup_ended_early,
        "stopped_early": stopped_early,
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
