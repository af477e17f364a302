"""The bench's schedules of one model and mode: every precision's model instances timed in
interleaved ABBA rounds, all in this process, or instance k in the k-th child forked from it
(`bench_fork`) with the children's timed steps merged back in the order of their rounds."""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from pipeline import bench_fork, bench_record, timing

if TYPE_CHECKING:
    from pipeline.bench import _Shared

# Steps of one precision timed in a row before the next precision's block. Short blocks make
# many rounds (30 steps: 15), and the bootstrap over rounds needs many to hold its confidence
# (tests/test_stats.py simulates it); whatever a switch of model costs the first step of a
# block, every precision's blocks pay alike.
BLOCK_STEPS = 2


@dataclass
class Ready:
    """A precision's model instances built and warmed up, waiting for their timed blocks."""

    steps: list[Callable[[], Any]]
    warmups: list[dict[str, Any]]
    conditions: timing.RunConditions
    stop: Callable[[timing.Timed], str | None] | None
    timed: timing.Timed
    complete: bool = False  # no further instance: far slower than fp32, or one cannot run


# Builds and warms up model instances (the indices given) of the precisions given into
# `ready`, the first instance also making each precision's record into `records`.
Prepare = Callable[[list[str], Sequence[int], dict[str, dict[str, Any]], dict[str, Ready]], None]


def instances_to_build(settings: dict[str, Any]) -> int:
    """`bench.instances`, but no more than the timed steps can reach: every instance times
    an ABBA pair of rounds (`timing.instance_of_round`) before the next one starts."""
    rounds = math.ceil(settings["steps"] / BLOCK_STEPS)
    return max(1, min(settings["instances"], math.ceil(rounds / 2)))


def in_one_process(
    shared: _Shared, precisions: list[str], prepare: Prepare
) -> dict[str, dict[str, Any]]:
    """Every instance of every precision prepared here, then timed in interleaved rounds
    (`timing.interleaved_runs`, instance k of every precision in the same rounds)."""
    settings = shared.settings
    records: dict[str, dict[str, Any]] = {}
    ready: dict[str, Ready] = {}
    prepare(precisions, range(instances_to_build(settings)), records, ready)
    if not ready:
        return records
    timing.interleaved_runs(
        {precision: r.steps for precision, r in ready.items()},
        shared.device,
        block_steps=BLOCK_STEPS,
        max_steps=settings["steps"],
        budget_s=settings["time_budget_s"],
        stops={p: r.stop for p, r in ready.items()},
        cannot_run=bench_record.cannot_run_reason,
        timed={p: r.timed for p, r in ready.items()},
    )
    finish(records, ready, settings)
    return records


def forked(
    shared: _Shared, precisions: list[str], prepare: Prepare, what: str
) -> dict[str, dict[str, Any]]:
    """`in_one_process` with model instance k of every precision built, warmed up and timed
    in the k-th child forked from this process (which runs no torch compute itself), one
    child after another: each child times the ABBA rounds the one-process schedule gives
    instance k, within the share of `steps` and `time_budget_s` they would have had, and
    sends back everything merged so far; the next child starts from it, so its stop rules see
    every sample before it, and a precision stopped early, failed or judged far behind (no
    further instance) is not run again. Records are finished here once, as in one process,
    their samples in the order of their rounds. The conditions span all children. `what`
    (model and mode) names a child that fails."""
    settings = shared.settings
    count = instances_to_build(settings)
    records: dict[str, dict[str, Any]] = {}
    ready: dict[str, Ready] = {}
    conditions = timing.RunConditions()
    bench_fork.import_before_forking()
    timeout_s = bench_fork.child_timeout_s(settings, len(precisions))
    steps_so_far = 0
    for instance in range(count):
        share = steps_of_instance(instance, count, settings["steps"])
        steps_so_far += share
        if instance > 0 and not any(_goes_on(r) for r in ready.values()):
            break

        child = partial(
            _instance_in_child,
            shared,
            precisions,
            prepare,
            instance,
            count,
            share,
            steps_so_far,
            records,
            ready,
        )
        got_records, ready, compared = bench_fork.in_child(
            child, timeout_s, f"{what} model instance {instance}"
        )
        if instance == 0:
            records = got_records
            shared.remember_numerics(compared)
    for prepared in ready.values():
        prepared.conditions = conditions
        in_schedule_order(prepared.timed)
    finish(records, ready, settings)
    return records


def _goes_on(prepared: Ready) -> bool:
    """Whether a precision gets a further model instance."""
    timed = prepared.timed
    return not (prepared.complete or timed.stopped_early or timed.failed)


def _instance_in_child(
    shared: _Shared,
    precisions: list[str],
    prepare: Prepare,
    instance: int,
    count: int,
    share: int,
    steps_so_far: int,
    records: dict[str, dict[str, Any]],
    ready: dict[str, Ready],
):
    """In a forked child: model instance `instance` of each precision that goes on, warmed up
    and timed for `share` more steps, within the budget's share of `steps_so_far` (one that
    has already spent it, timed in the children before, is not built here: the budget then
    bounds the children together, as it bounds the rounds of one process)."""
    settings = shared.settings
    budget_s = settings["time_budget_s"] * steps_so_far / settings["steps"]
    ready = {p: replace(r, steps=[]) for p, r in ready.items()}
    if instance == 0:
        going = precisions
    else:
        going = [
            p
            for p in precisions
            if p in ready and _goes_on(ready[p]) and ready[p].timed.spent_s <= budget_s
        ]
    prepare(going, [instance], records, ready)
    now = {p: r for p, r in ready.items() if r.steps}
    limits = {p: len(r.timed.samples) + share for p, r in now.items()}
    if now:
        timing.interleaved_runs(
            {p: r.steps for p, r in now.items()},
            shared.device,
            block_steps=BLOCK_STEPS,
            max_steps=limits,
            budget_s=budget_s,
            stops={p: r.stop for p, r in now.items()},
            cannot_run=bench_record.cannot_run_reason,
            timed={p: r.timed for p, r in now.items()},
            round_ids=lambda local: round_id(local, instance, count),
            instance_ids=[instance],
        )
    for precision, prepared in now.items():  # one process judges every step but the last
        timed = prepared.timed
        ended_here = len(timed.samples) == limits[precision] < settings["steps"]
        if prepared.stop and ended_here and not (timed.stopped_early or timed.failed):
            timed.stopped_early = prepared.stop(timed)
    back = {p: replace(r, steps=[], stop=None) for p, r in ready.items()}
    return (records if instance == 0 else None), back, dict(shared.compared)


def finish(
    records: dict[str, dict[str, Any]], ready: dict[str, Ready], settings: dict[str, Any]
) -> None:
    """Each timed precision's record filled from its merged warm-ups and timed steps."""
    schedule_id = uuid.uuid4().hex
    for precision, prepared in ready.items():
        record = records[precision]
        if prepared.timed.failed:
            bench_record.skipped(record, prepared.timed.failed)
        else:
            bench_record.finish(
                record,
                prepared.warmups,
                prepared.conditions,
                prepared.timed,
                schedule_id=schedule_id,
                max_steps=settings["steps"],
                block_steps=BLOCK_STEPS,
            )


def steps_of_instance(instance: int, instances: int, max_steps: int) -> int:
    """The steps the one-process schedule gives `instance` of `instances` (each in turn for an
    ABBA pair of rounds, `timing.instance_of_round`), out of `max_steps` in blocks."""
    rounds = math.ceil(max_steps / BLOCK_STEPS)
    return sum(
        min(BLOCK_STEPS, max_steps - r * BLOCK_STEPS)
        for r in range(rounds)
        if timing.instance_of_round(r, instances) == instance
    )


def round_id(local_round: int, instance: int, instances: int) -> int:
    """The round of the one-process schedule that the child of `instance` times as its
    `local_round`: its ABBA pairs in turn with the other instances', order kept."""
    return (local_round // 2 * instances + instance) * 2 + local_round % 2


def in_schedule_order(timed: timing.Timed) -> None:
    """The children's samples in the order of their rounds, as one process times them: each
    child's instance then stands in its rounds among the others', and the drift check sees
    the schedule's halves, not one child's speed mode against another's."""
    order = sorted(range(len(timed.rounds)), key=timed.rounds.__getitem__)
    timed.samples = [timed.samples[i] for i in order]
    timed.rounds = [timed.rounds[i] for i in order]
    timed.instances = [timed.instances[i] for i in order]
