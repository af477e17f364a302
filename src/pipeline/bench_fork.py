"""The forked children that time the bench's CPU model instances (`bench_schedule.forked`):
each child draws its own speed mode as a new process would, at no import cost. The parent
must run no torch compute before forking (libgomp: a child forked after the parent ran an
OpenMP region hangs)."""

from __future__ import annotations

import importlib
import os
import pickle
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from pipeline.errors import PipelineError

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
    """`work()` run in a child forked from this process, its result pickled back over a pipe.

    The child's `PipelineError` is raised here as it is, any other error as `ChildFailed`
    with the child's traceback; a child that dies without a result, or runs past
    `timeout_s`, is killed and named, as it is where this process is interrupted.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller
        os.close(read_end)
        status = 0
        try:
            try:
                payload = pickle.dumps(("ok", work()))
            except PipelineError as error:  # the user's to act on: raised again as it is
                payload = pickle.dumps(("raise", error))
                status = 1
            except BaseException:  # everything else the child meets goes back
                payload = pickle.dumps(("error", traceback.format_exc()))
                status = 1
            with os.fdopen(write_end, "wb") as pipe:
                pipe.write(payload)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    os.close(write_end)
    try:
        data = _read_all(read_end, time.monotonic() + timeout_s)
    except BaseException as error:  # past its time, or this process interrupted
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        if not isinstance(error, TimeoutError):
            raise
        raise ChildFailed(
            f"The bench child timing {what} ran past {timeout_s:.0f} s and was killed; no "
            "record is written (a child forked after the parent ran OpenMP work hangs)."
        ) from None
    finally:
        os.close(read_end)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if not data:
        raise ChildFailed(
            f"The bench child timing {what} ended with status {code} and sent no result; "
            "no record is written."
        )
    kind, result = pickle.loads(data)
    if kind == "raise":
        raise result
    if kind == "error":
        raise ChildFailed(f"The bench child timing {what} failed; no record is written:\n{result}")
    return result


def _read_all(fd: int, deadline: float) -> bytes:
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def child_timeout_s(settings: dict[str, Any], precisions: int) -> float:
    """Time a child may take: every precision's warm-up and timing budgets twice over (a step
    runs whole past a budget), and a minute for building models and the numerics."""
    return 60.0 + 2 * precisions * (settings["warmup_budget_s"] + settings["time_budget_s"])
