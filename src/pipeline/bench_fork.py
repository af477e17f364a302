"""The forked children that time the bench's CPU model instances (`bench_schedule.forked`):
each child draws its own speed mode as a new process would, at no import cost. The parent
must run no torch compute before forking (libgomp: a child forked after the parent ran an
OpenMP region hangs)."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any, TypeVar

from pipeline import forked

T = TypeVar("T")


class ChildFailed(RuntimeError):
    """A forked bench child raised, died or outlived its time: no record is written."""


# What the first training step of a process imports lazily (its optimizer: torch._dynamo and
# what that brings): imported in the parent, which computes nothing, every child has it from
# the fork instead of paying the import for each model instance.
LAZY_IMPORTS = ("torch._dynamo",)


def import_before_forking() -> None:
    for name in LAZY_IMPORTS:
        importlib.import_module(name)


def in_child(work: Callable[[], T], timeout_s: float, what: str) -> T:
    """`work()` run in a child forked from this process (`pipeline.forked`), its result back.

    The child's `PipelineError` is raised here as it is, any other error as `ChildFailed`
    with the child's traceback; a child that dies without a result, or runs past
    `timeout_s`, is killed and named, as it is where this process is interrupted.
    """
    try:
        kind, result = forked.Child(work).outcome(time.monotonic() + timeout_s)
    except TimeoutError:
        raise ChildFailed(
            f"The bench child timing {what} ran past {timeout_s:.0f} s and was killed; no "
            "record is written (a child forked after the parent ran OpenMP work hangs)."
        ) from None
    if kind == "died":
        raise ChildFailed(
            f"The bench child timing {what} ended with status {result} and sent no result; "
            "no record is written."
        )
    if kind == "raise":
        raise result
    if kind == "error":
        raise ChildFailed(f"The bench child timing {what} failed; no record is written:\n{result}")
    return result


def child_timeout_s(settings: dict[str, Any], precisions: int) -> float:
    """Time a child may take: every precision's warm-up and timing budgets twice over (a step
    runs whole past a budget), and a minute for building models and the numerics."""
    return 60.0 + 2 * precisions * (settings["warmup_budget_s"] + settings["time_budget_s"])
