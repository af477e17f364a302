"""Numbers and labels as the report shows them; each function is also a Jinja2 filter (FILTERS).

Every formatter takes what a results file may hold (null, NaN, a string where a number was
expected) and shows "n/a" rather than failing: one odd value never costs the whole report.
"""

from __future__ import annotations

import json
import math
import numbers
from datetime import UTC, datetime
from typing import Any

BACKEND_LABELS = {"cuda": "CUDA", "mps": "MPS", "cpu": "CPU"}


def number(value: Any) -> float | None:
    """A finite float, or None for null, NaN, infinity and anything that is not a number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value) if math.isfinite(value) else None


def fmt_ms(value: Any) -> str:
    value = number(value)
    if value is None:
        return "n/a"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def fmt_float(value: Any, digits: int = 3) -> str:
    value = number(value)
    return "n/a" if value is None else f"{value:.{digits}f}"


def fmt_percent(share: Any, digits: int = 1) -> str:
    """A share in [0, 1] as a percentage; a missing share counts as 0%."""
    return f"{100 * (number(share) or 0):.{digits}f}%"


def fmt_rel(value: Any) -> str:
    """Relative differences span decades: scientific notation keeps small ones readable."""
    value = number(value)
    return "n/a" if value is None else f"{value:.2e}"


def fmt_ratio(value: Any) -> str:
    value = number(value)
    if value is None:
        return "n/a"
    return f"{value:.1f}×" if value >= 10 else f"{value:.2f}×"


def fmt_speedup(speed: Any) -> str:
    """A summary's speed-up for a table cell: '2.00× (1.80–2.20)', its 95% interval in brackets."""
    if not isinstance(speed, dict):
        return "n/a"
    return f"{fmt_ratio(speed['ratio'])} ({speed['low']:.2f}–{speed['high']:.2f})"


def fmt_points(value: Any, digits: int = 1) -> str:
    """A change in points, always signed: '+0.4', '−1.2' (a minus sign, not a hyphen)."""
    value = number(value)
    if value is None:
        return "n/a"
    text = f"{abs(value):.{digits}f}"
    return ("−" if value < 0 and float(text) != 0 else "+") + text


def fmt_interval(interval: Any, digits: int = 3) -> str:
    """An interval {low, high} as '0.914–0.957'."""
    if not isinstance(interval, dict):
        return "n/a"
    low, high = number(interval.get("low")), number(interval.get("high"))
    return "n/a" if low is None or high is None else f"{low:.{digits}f}–{high:.{digits}f}"


def fmt_with_interval(value: Any, interval: Any, digits: int = 3) -> str:
    """A figure with its 95% interval in brackets, '0.937 (0.920–0.952)'; the figure alone where
    its file holds no interval (written before it had one, or nothing to resample)."""
    text = fmt_float(value, digits)
    spread = fmt_interval(interval, digits)
    return text if text == "n/a" or spread == "n/a" else f"{text} ({spread})"


def fmt_mb(value: Any) -> str:
    value = number(value)
    if value is None:
        return "n/a"
    return f"{value / 1024:.2f} GB" if value >= 10240 else f"{value:.0f} MB"


def fmt_seconds(value: Any) -> str:
    value = number(value)
    if value is None:
        return "n/a"
    if value < 60:
        return f"{value:.1f} s"
    minutes, seconds = divmod(round(value), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{seconds:02d}s"


def fmt_time(value: datetime | None) -> str:
    return "n/a" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def yes_no(value: Any) -> str:
    return "yes" if value else "no"


def backend_label(backend: Any) -> str:
    return BACKEND_LABELS.get(str(backend), str(backend).upper())


def setting_label(backend: Any, precision: Any) -> str:
    return f"{backend_label(backend)} {precision}"


def config_text(value: Any) -> str:
    """A config value as the user writes it: true/false rather than Python's True/False."""
    return json.dumps(value) if isinstance(value, bool) else str(value)


def memory_text(memory: Any, host_rss_mb: Any, backend: Any) -> str:
    """Peak memory as a table shows it: exact, a marked lower bound, or host RSS on the CPU."""
    memory = memory if isinstance(memory, dict) else {}
    if backend == "cpu":
        return f"host RSS {fmt_mb(host_rss_mb)}" if number(host_rss_mb) is not None else "n/a (CPU)"
    peak = number(memory.get("peak_mb"))
    if peak is None:
        return "n/a"
    if memory.get("exact") is False:
        return f"≥ {fmt_mb(peak)} (sampled lower bound)"
    return f"{fmt_mb(peak)} ({memory.get('label') or 'exact'})"


def device_memory_text(memory: Any, backend: Any) -> str:
    """Device memory where host RSS has its own column: the CPU has no device memory."""
    return "n/a (CPU)" if backend == "cpu" else memory_text(memory, None, backend)


FILTERS = {
    "ms": fmt_ms,
    "decimals": fmt_float,
    "percent": fmt_percent,
    "rel": fmt_rel,
    "ratio": fmt_ratio,
    "speedup": fmt_speedup,
    "points": fmt_points,
    "interval": fmt_interval,
    "with_interval": fmt_with_interval,
    "mb": fmt_mb,
    "seconds": fmt_seconds,
    "utc": fmt_time,
    "yes_no": yes_no,
    "backend": backend_label,
    "config_value": config_text,
    "memory": memory_text,
    "device_memory": device_memory_text,
}
