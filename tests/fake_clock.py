"""A clock for tests of timed code: `timing`'s perf_counter moves only when a test says so."""

from __future__ import annotations


class FakeClock:
    """perf_counter that moves only when a step says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
