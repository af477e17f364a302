"""A simulated full disk: files that pipeline.atomic and checkpoint.save open for writing share
a budget of bytes; once it is spent, a write stores what still fits and then fails with ENOSPC,
as on a real file system that fills up.

Not a test module: test_atomic.py and test_write_errors.py import it.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
from pathlib import Path
from typing import Any

import pytest

from pipeline import atomic
from pipeline.engine import checkpoint


class FullDisk:
    """The disk fills up when the `nth` file whose name contains `name` is opened to write
    (not to fsync it): `room` more bytes fit, in that file or any other, then none."""

    def __init__(self, name: str, nth: int = 1, room: int = 0) -> None:
        self.name, self.nth, self.room_then = name, nth, room
        self.room: int | None = None  # None: not filling up yet
        self.matches = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FullDisk:
        for module in (atomic, checkpoint):
            monkeypatch.setattr(module, "open", self.open, raising=False)
        return self

    def open(
        self,
        file: Any,
        mode: str = "r",
        buffering: int = -1,
        encoding: str | None = None,
        errors: str | None = None,
        newline: str | None = None,
    ) -> Any:
        if not set(mode) & set("wax+"):
            return builtins.open(file, mode, buffering, encoding, errors, newline)
        if self.room is None and set(mode) & set("wax") and self.name in Path(file).name:
            self.matches += 1
            if self.matches == self.nth:
                self.room = self.room_then
        raw = _DiskFile(file, mode.replace("b", "").replace("t", ""), self)
        if buffering == 0:
            return raw
        buffered = io.BufferedRandom(raw) if "+" in mode else io.BufferedWriter(raw)
        if "b" in mode:
            return buffered
        return io.TextIOWrapper(buffered, encoding or "utf-8", errors, newline)

    def write(self, file: io.FileIO, data: bytes) -> int:
        if self.room is None:
            return io.FileIO.write(file, data)
        if self.room == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), file.name)
        written = io.FileIO.write(file, data[: self.room])
        self.room -= written
        return written


class _DiskFile(io.FileIO):
    def __init__(self, file: Any, mode: str, disk: FullDisk) -> None:
        super().__init__(file, mode)
        self.disk = disk

    def write(self, data: Any) -> int:
        return self.disk.write(self, bytes(data))
