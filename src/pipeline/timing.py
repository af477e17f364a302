"""Honest timing on any backend: warm up until the step time has settled, synchronize around
every timed region, keep every sample, time steps to be compared in interleaved rounds of a
balanced order, bound everything by a budget, and record the conditions of the run (did other
work share the machine?). The statistics are in `pipeline.stats`."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from pipeline import device as dev
from pipeline.stats import settled

HIGH_LOAD_PER_CORE = 0.5  # 1-minute load average per core above which others shared the machine
FOREIGN_CPU_SHARE_LIMIT = 0.15  # share of all cores busy with other processes during a run

# Sees the warm-up's step times so far; a reason (text) ends the warm-up, None lets it go on.
StopRule = Callable[[list[float]], str | None]


def warm_up(
    step: Callable[[], Any],
    device: dev.DeviceLike,
    *,
    warmup: int,
    budget_s: float,
    memory: dev.PeakMemory | None = None,
    end_warmup: StopRule | None = None,
) -> dict[str, Any]:
    """Run untimed steps: at least `warmup`, then until `settled()` (the first steps of a new
    model are slow while oneDNN builds its primitives and the allocator grows), for at most
    `budget_s`; at least one step when `warmup` > 0. The device is synchronized after every
    step, and `memory` sampled. `end_warmup` sees the step times after every step, before the
    fewest have run too (it judges how many it needs): a reason it gives ends the warm-up
    there (`warmup_ended_early`).

    The details also keep the step times (`step_times`, not part of a record).
    """
    started = time.perf_counter()
    times: list[float] = []
    is_settled = warmup == 0
    ended_early = None
    while warmup > 0:
        t0 = time.perf_counter()
        step()
        dev.synchronize(device)
        times.append(time.perf_counter() - t0)
        if memory is not None:
            memory.update()
        if len(times) >= warmup and settled(times):
            is_settled = True
            break
        if end_warmup is not None:
            ended_early = end_warmup(times)
            if ended_early:
                break
        if time.perf_counter() - started > budget_s:
            break
    return {
        "warmup_steps": len(times),
        "warmup_s": time.perf_counter() - started,
        "warmup_settled": is_settled,
        "warmup_ended_early": ended_early,
        "step_times": times,
    }


def timed_step(step: Callable[[], Any], device: dev.DeviceLike) -> float:
    """Seconds of one call, with the device synchronized on both sides of it."""
    dev.synchronize(device)
    t0 = time.perf_counter()
    step()
    dev.synchronize(device)
    return time.perf_counter() - t0


def step_details(
    warmed: dict[str, Any],
    *,
    total_s: float,
    count: int,
    max_steps: int,
    stopped_early: str | None = None,
) -> dict[str, Any]:
    """The keys a record's `timing` carries beside the step statistics (schema `timed_steps`):
    the warm-up's (`warm_up`'s details, less its step times) and how timing `count` of
    `max_steps` steps ended."""
    return {
        **{key: value for key, value in warmed.items() if key != "step_times"},
        "total_s": total_s,
        "budget_limited": count < max_steps and stopped_early is None,
        "stopped_early": stopped_early,
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
    """Warm up until the step time settles (`warm_up`, for at most `budget_s`), then time up
    to `max_steps` steps within another `budget_s`.

    The device is synchronized before and after every timed step, so queued work is never
    attributed to the wrong step. At least one step is always timed, even past the budget.
    `memory` is sampled after every step, outside the timed region.
    """
    started = time.perf_counter()
    warmed_up = warm_up(step, device, warmup=warmup, budget_s=budget_s, memory=memory)
    warmed = time.perf_counter()
    samples: list[float] = []
    while len(samples) < max_steps:
        samples.append(timed_step(step, device))
        if memory is not None:
            memory.update()
        if time.perf_counter() - warmed > budget_s:
            break
    total_s = time.perf_counter() - started
    return samples, step_details(
        warmed_up, total_s=total_s, count=len(samples), max_steps=max_steps
    )


@dataclass
class Timed:
    """One step's timed samples in an interleaved schedule, with the round and the model
    instance of each."""

    samples: list[float] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)
    instances: list[int] = field(default_factory=list)
    spent_s: float = 0.0
    stopped_early: str | None = None
    failed: str | None = None


def balanced_order(names: Sequence[str], round_index: int) -> list[str]:
    """The order of the blocks in a round: as given in even rounds, reversed in odd ones, so
    that every step runs as often early as late in a round (ABBA for two) and a machine that
    speeds up or slows down steadily favours none."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


def instance_of_round(round_index: int, instances: int) -> int:
    """The instance a round times: each in turn for two rounds, an ABBA pair, so that every
    instance runs as often early as late in its rounds."""
    return round_index // 2 % instances


def interleaved_runs(
    steps: Mapping[str, Callable[[], Any] | Sequence[Callable[[], Any]]],
    device: dev.DeviceLike,
    *,
    block_steps: int,
    max_steps: int | Mapping[str, int],
    budget_s: float,
    stops: Mapping[str, Callable[[Timed], str | None] | None] | None = None,
    cannot_run: Callable[[BaseException], str | None] | None = None,
    timed: Mapping[str, Timed] | None = None,
    round_ids: Callable[[int], int] | None = None,
    instance_ids: Sequence[int] | None = None,
) -> dict[str, Timed]:
    """Time already warmed-up steps in rounds of one block of `block_steps` steps each, in
    `balanced_order`, synchronized around every step as `timed_runs`. Where a name has
    several steps (one per model instance), a round times the one `instance_of_round` says,
    so instance k of every name shares its rounds with instance k of the others. A name
    leaves the schedule once it has `max_steps` samples or has spent `budget_s` on its steps
    (checked after every round, so its blocks are whole and it has at least one); the others
    go on, as each would have had its own budget timed alone.

    `stops[name]` sees that step's `Timed` after each of its steps: a reason ends its timing
    there (`stopped_early`) and the others go on. A step that raises an error `cannot_run`
    gives a reason for leaves the schedule with it (`failed`); other errors propagate.
    `timed`: the `Timed` of each step to fill, where a stop rule reads another's; it may
    already hold samples of earlier schedules (a share of one timed in another process), and
    then `max_steps` (which may be given per name) and `budget_s` count them too. `round_ids` and
    `instance_ids` turn this schedule's round index and instance index into the ones
    recorded, where this schedule is such a share.
    """
    timed = {name: (timed or {}).get(name) or Timed() for name in steps}
    limit = {n: max_steps if isinstance(max_steps, int) else max_steps[n] for n in steps}
    instances = {name: [step] if callable(step) else list(step) for name, step in steps.items()}
    active = list(steps)
    round_index = 0
    while active:
        for name in balanced_order(active, round_index):
            own = timed[name]
            rule = (stops or {}).get(name)
            instance = instance_of_round(round_index, len(instances[name]))
            for _ in range(min(block_steps, limit[name] - len(own.samples))):
                try:
                    elapsed = timed_step(instances[name][instance], device)
                except Exception as error:
                    reason = cannot_run(error) if cannot_run is not None else None
                    if reason is None:
                        raise
                    own.failed = reason
                    break
                own.samples.append(elapsed)
                own.rounds.append(round_ids(round_index) if round_ids else round_index)
                own.instances.append(instance_ids[instance] if instance_ids else instance)
                own.spent_s += elapsed
                if rule is not None and len(own.samples) < limit[name]:
                    own.stopped_early = rule(own)
                    if own.stopped_early:
                        break
        active = [
            name
            for name in active
            if not (timed[name].stopped_early or timed[name].failed)
            and len(timed[name].samples) < limit[name]
            and timed[name].spent_s <= budget_s
        ]
        round_index += 1
    return timed


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
