"""Write outputs through a temporary file and a rename, so a killed job never leaves a
truncated file that looks complete."""

from __future__ import annotations

import json
import math
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_with(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp)` on a temporary file beside `path`, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    # Exclusive create like mkstemp, but with mode 0o666 so the umask applies: mkstemp's 0600
    # would leave every output unreadable to the group, e.g. on a shared cluster.
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text(path: str | Path, text: str) -> Path:
    return write_with(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def jsonable(value: Any) -> Any:
    """Non-finite floats become null: JSON has no NaN, and a reader must not choke on one."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and callable(value.item):  # numpy and torch scalars
        return jsonable(value.item())
    return value


def write_json(path: str | Path, data: Any) -> Path:
    return write_text(path, json.dumps(jsonable(data), indent=2, allow_nan=False) + "\n")
