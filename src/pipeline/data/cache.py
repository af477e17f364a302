"""Whether a split's decoded images are kept in memory: their size at input size against a RAM
budget (`data.cache`, `data.cache_budget`), read from what this process may still allocate."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# a cgroup "limit" this large is the kernel's way of saying there is none
_UNLIMITED = 2**60


@dataclass(frozen=True)
class Memory:
    """Bytes this process may still allocate without swapping or being killed; None: unknown."""

    available: int | None
    source: str  # where the figure comes from, for the log line


@dataclass(frozen=True)
class CacheDecision:
    cache: bool
    reason: str  # one line: what was decided, with the sizes that decided it


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text(encoding="utf-8").splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] == key and words[1].isdigit():
                return int(words[1])
    except OSError:
        pass
    return 0


def _cgroup_headroom(proc: Path, cgroup_root: Path) -> int | None:
    """Limit minus usage (reclaimable page cache counted free) of this process's memory cgroup
    and, on cgroup v2, each of its ancestors; None where no limit is set.

    A SLURM job or a container sees the whole machine in /proc/meminfo but is killed at its
    cgroup's limit."""
    try:
        lines = (proc / "self" / "cgroup").read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    headrooms = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, relative = line.split(":", 2)
        relative = relative.lstrip("/")
        if controllers == "":  # cgroup v2: the limit may sit on any ancestor (a SLURM job's)
            folder = cgroup_root / relative
            while True:
                limit = _read_int(folder / "memory.max")  # "max" reads as None
                usage = _read_int(folder / "memory.current")
                if limit is not None and usage is not None and limit < _UNLIMITED:
                    reclaimable = _stat(folder / "memory.stat", "inactive_file")
                    headrooms.append(limit - usage + reclaimable)
                if folder == cgroup_root or not folder.is_relative_to(cgroup_root):
                    break
                folder = folder.parent
        elif "memory" in controllers.split(","):
            folder = cgroup_root / "memory" / relative
            stat = folder / "memory.stat"
            limit = _stat(stat, "hierarchical_memory_limit") or _read_int(
                folder / "memory.limit_in_bytes"
            )
            usage = _read_int(folder / "memory.usage_in_bytes")
            if limit is not None and usage is not None and limit < _UNLIMITED:
                headrooms.append(limit - usage + _stat(stat, "total_inactive_file"))
    return max(0, min(headrooms)) if headrooms else None


def available_memory(
    proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> Memory:
    """MemAvailable of /proc/meminfo, lowered to the memory cgroup's headroom where it has a
    limit; where /proc is missing (macOS), the physical memory as the best figure there is."""
    available = _stat(proc / "meminfo", "MemAvailable:")
    headroom = _cgroup_headroom(proc, cgroup_root)
    if available:
        available *= 1024  # kB
        if headroom is not None and headroom < available:
            return Memory(headroom, "available under this process's memory cgroup limit")
        return Memory(available, "available (MemAvailable)")
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return Memory(headroom, "available under the memory cgroup limit" if headroom else "")
    return Memory(total, "physical memory (what is free is unknown here)")


def decoded_bytes(count: int, image_size: int) -> int:
    """The decoded images of a split at the model's input size (uint8 RGB)."""
    return count * 3 * image_size * image_size


def size_text(value: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value / 2**10:.1f} KiB"


def decide(
    setting: bool | str,
    count: int,
    image_size: int,
    budget: float,
    memory: Callable[[], Memory] = available_memory,
) -> CacheDecision:
    """`data.cache` true or false as set; `auto`: cache when the decoded split fits into
    `budget` (a fraction) of the memory available now."""
    need = decoded_bytes(count, image_size)
    images = f"{count} decoded images at {image_size} px ({size_text(need)})"
    if setting is True:
        return CacheDecision(True, f"caching {images} in memory (data.cache: true)")
    if setting is False:
        return CacheDecision(False, f"not caching {images} (data.cache: false)")
    found = memory()
    if found.available is None:
        return CacheDecision(
            False,
            f"not caching {images}: the available memory is unknown here (data.cache: auto; "
            "set data.cache: true to cache anyway)",
        )
    allowed = budget * found.available
    within = (
        f"data.cache_budget {budget:g} x {size_text(found.available)} {found.source} "
        f"= {size_text(allowed)}"
    )
    if need <= allowed:
        return CacheDecision(True, f"caching {images} in memory: within {within}")
    return CacheDecision(False, f"not caching {images}: over {within}")
