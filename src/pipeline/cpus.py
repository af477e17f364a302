"""How many CPUs this process may use (no torch here: the data generator needs it too)."""

from __future__ import annotations

import os


def usable_cpu_count() -> int:
    """CPUs this process may run on: its affinity (a cluster job's allocation), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity API
        return os.cpu_count() or 1
