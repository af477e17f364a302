"""Work run in a child forked from this process, what it returns or raises pickled back over a
pipe: the bench's CPU model instances (`pipeline.bench_fork`) and the image cache's decoding
(`pipeline.data.cache_fill`) use it, where `safe` says a fork is."""

from __future__ import annotations

import os
import pickle
import select
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any, Literal

from pipeline.errors import PipelineError

# Python 3.12+ warns at every fork of a process with threads (torch's idle OpenMP workers are
# some): see `Child` for why these forks are safe.
_THREADED_FORK_WARNING = r"This process \(pid=\d+\) is multi-threaded, use of fork\(\)"

Kind = Literal["ok", "raise", "error", "died"]


def safe(platform: str | None = None) -> bool:
    """Whether this package forks on `platform` (default: this one): on Linux alone. macOS's
    system libraries (Accelerate, libdispatch) keep threads and locks a child does not get,
    so a forked child can crash or hang there (Python itself spawns there since 3.8), and
    Windows has no fork."""
    return (sys.platform if platform is None else platform) == "linux" and hasattr(os, "fork")


class Child:
    """`work()` running in a child forked from this process; `outcome()` waits for its end.

    The child runs only `work` and leaves by `os._exit`, never returning into the caller nor
    running its exit handlers. Forking a process that has threads is safe here as long as
    `work` needs no lock another thread may hold at the fork: torch's OpenMP workers hold
    none between parallel regions. But where this process ran one before the fork, a child
    must not start one (libgomp's pool is not in the child: it hangs): such a child that runs
    torch operations sets one thread first, as DataLoader workers do.
    """

    def __init__(self, work: Callable[[], Any]) -> None:
        sys.stdout.flush()  # else what is buffered is written twice, by both processes
        sys.stderr.flush()
        read_end, write_end = os.pipe()
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", _THREADED_FORK_WARNING, DeprecationWarning)
                pid = os.fork()
        except BaseException:  # no child (out of processes or memory): no pipe either
            os.close(read_end)
            os.close(write_end)
            raise
        if pid == 0:
            os.close(read_end)
            _run_and_exit(work, write_end)
        os.close(write_end)
        self.pid = pid
        self._read_end: int | None = read_end
        self._reaped = False

    def outcome(self, deadline: float | None = None) -> tuple[Kind, Any]:
        """What the child sent, once it has ended: ("ok", what `work` returned), ("raise", the
        `PipelineError` it raised, the user's to act on), ("error", the traceback of anything
        else) or ("died", its exit code: negative, the signal that killed it) where it sent
        nothing. Past `deadline` (time.monotonic()) the child is killed and TimeoutError
        raised; so is it where this process is interrupted while waiting."""
        try:
            data = _read_all(self._read_end, deadline)
        except BaseException:
            self.kill()
            raise
        self._close()
        self._reaped = True
        if not data:
            _, status = os.waitpid(self.pid, 0)
            return "died", os.waitstatus_to_exitcode(status)
        # What it sent is whole: its exit, which unmaps an address space as large as this
        # process's (longer than a short work's last part), is reaped on a thread of its own.
        threading.Thread(target=os.waitpid, args=(self.pid, 0), daemon=True).start()
        return pickle.loads(data)

    def kill(self) -> None:
        """End the child now, if it has not been reaped, and reap it."""
        self._close()
        if not self._reaped:  # a reaped child's pid may be another process's by now
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self._reaped = True

    def _close(self) -> None:
        if self._read_end is not None:
            os.close(self._read_end)
            self._read_end = None


def _run_and_exit(work: Callable[[], Any], write_end: int) -> None:
    status = 0
    try:
        try:
            payload = pickle.dumps(("ok", work()))
        except PipelineError as error:
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


def _read_all(fd: int, deadline: float | None) -> bytes:
    chunks = []
    while True:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
