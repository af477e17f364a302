"""Atomic writes: a file is either its old complete self or its new complete self, never half."""

from __future__ import annotations

import json
import math
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline import atomic


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_write_text_creates_missing_parent_folders(tmp_path: Path) -> None:
    target = tmp_path / "results" / "deep" / "out.txt"
    assert atomic.write_text(target, "hello\n") == target
    assert target.read_text(encoding="utf-8") == "hello\n"


def test_write_text_replaces_the_previous_content(tmp_path: Path) -> None:
    target = tmp_path / "out.txt"
    target.write_text("old and longer\n")
    atomic.write_text(str(target), "new\n")
    assert target.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_target_keeps_its_old_content_until_the_new_file_is_complete(tmp_path: Path) -> None:
    target = tmp_path / "out.txt"
    target.write_text("old\n")
    seen: list[tuple[Path, str]] = []

    def write(tmp: Path) -> None:
        tmp.write_text("half")
        seen.append((tmp, target.read_text()))  # a reader in the middle of the write
        with tmp.open("a") as handle:
            handle.write(" and the rest\n")

    atomic.write_with(target, write)
    tmp, during = seen[0]
    assert during == "old\n"
    assert tmp != target
    assert tmp.parent == target.parent  # same file system, so the rename is atomic
    assert not tmp.exists()
    assert target.read_text() == "half and the rest\n"


@pytest.mark.parametrize("error", [ValueError("boom"), KeyboardInterrupt()])
def test_failed_write_keeps_the_previous_file_and_leaves_no_temp_file(tmp_path, error) -> None:
    target = tmp_path / "metrics.json"
    atomic.write_json(target, {"epoch": 1})

    def write(tmp: Path) -> None:
        tmp.write_text('{"epoch": 2, "trunc')
        raise error

    with pytest.raises(type(error)):
        atomic.write_with(target, write)
    assert json.loads(target.read_text()) == {"epoch": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]


def test_failed_first_write_leaves_nothing_behind(tmp_path: Path) -> None:
    def write(tmp: Path) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic.write_with(tmp_path / "out.bin", write)
    assert list(tmp_path.iterdir()) == []


def test_written_file_has_the_permissions_of_a_plain_write(tmp_path: Path) -> None:
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    written = atomic.write_text(tmp_path / "atomic.txt", "x")
    assert _mode(written) == _mode(plain)


def test_write_json_round_trips_and_ends_with_a_newline(tmp_path: Path) -> None:
    data = {"name": "run", "values": [1, 2.5, None, True], "nested": {"a": {"b": "c"}}}
    target = atomic.write_json(tmp_path / "data.json", data)
    text = target.read_text()
    assert text.endswith("}\n")
    assert json.loads(text) == data


def test_non_finite_floats_are_written_as_null(tmp_path: Path) -> None:
    data = {
        "nan": math.nan,
        "inf": math.inf,
        "rows": [{"loss": -math.inf, "ok": 0.5}],
        "pair": (math.nan, 1.0),
        "numpy": np.float32("nan"),
        "tensor": torch.tensor(float("inf")),
    }
    text = atomic.write_json(tmp_path / "data.json", data).read_text()
    assert "NaN" not in text
    assert "Infinity" not in text
    assert json.loads(text) == {
        "nan": None,
        "inf": None,
        "rows": [{"loss": None, "ok": 0.5}],
        "pair": [None, 1.0],
        "numpy": None,
        "tensor": None,
    }


def test_jsonable_converts_scalars_paths_and_keys() -> None:
    assert atomic.jsonable(
        {1: Path("a/b"), "t": torch.tensor(3), "n": np.int64(4), "f": np.float64(0.25)}
    ) == {"1": "a/b", "t": 3, "n": 4, "f": 0.25}
    assert atomic.jsonable(float("nan")) is None
    assert atomic.jsonable(1.5) == 1.5
    assert atomic.jsonable("text") == "text"
