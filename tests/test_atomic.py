"""Atomic writes: a file is either its old complete self or its new complete self, never half."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from full_disk import FullDisk

from pipeline import atomic
from pipeline.errors import OutputError


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

    with pytest.raises(OutputError, match=r"out\.bin: disk full, .* No partial file is left\."):
        atomic.write_with(tmp_path / "out.bin", write)
    assert list(tmp_path.iterdir()) == []


def free_space_of(folder: Path) -> str:
    """The part of a write error that gives the free space, as a pattern."""
    return rf"with [0-9.]+ (bytes|KiB|MiB|GiB|TiB) free on the file system of {re.escape(str(folder))}\."


def test_a_full_disk_names_the_file_the_free_space_and_that_the_previous_file_is_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "eval.json"
    atomic.write_json(target, {"epoch": 1})
    FullDisk("eval.json", room=10).install(monkeypatch)
    with pytest.raises(OutputError) as caught:
        atomic.write_json(target, {"epoch": 2, "values": list(range(1000))})
    assert re.fullmatch(
        rf"Could not write {re.escape(str(target))}: No space left on device \(ENOSPC\), "
        + free_space_of(tmp_path)
        + r" The previous eval\.json is unchanged\. Free some space \(or write elsewhere\) and "
        r"run again\.",
        str(caught.value),
    ), caught.value
    assert json.loads(target.read_text()) == {"epoch": 1}
    assert [path.name for path in tmp_path.iterdir()] == ["eval.json"]


def test_an_os_error_that_a_library_replaced_is_still_named_with_the_callers_advice(
    tmp_path: Path,
) -> None:
    """torch.save into a file object turns a full disk into RuntimeError('unexpected pos ...')."""

    def write(tmp: Path) -> None:
        try:
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
        except OSError:
            raise RuntimeError("unexpected pos 704 vs 598") from None

    with pytest.raises(OutputError) as caught:
        atomic.write_with(tmp_path / "last.pth", write, advice="Resume from best.pth.")
    message = str(caught.value)
    assert message.startswith(
        f"Could not write {tmp_path / 'last.pth'}: Disk quota exceeded (EDQUOT)"
    )
    assert message.endswith(
        "Free some space (or write elsewhere) and run again. Resume from best.pth."
    )


def test_a_permission_error_is_named_without_advice_to_free_space(tmp_path: Path) -> None:
    def write(tmp: Path) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    with pytest.raises(OutputError) as caught:
        atomic.write_with(tmp_path / "report.html", write)
    assert str(caught.value).startswith(
        f"Could not write {tmp_path / 'report.html'}: Permission denied (EACCES), with "
    )
    assert "Free some space" not in str(caught.value)


def test_a_failed_append_cuts_the_file_back_to_its_last_whole_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "metrics.jsonl"
    atomic.append_line(log, '{"epoch": 1}')
    FullDisk("metrics.jsonl", room=5).install(monkeypatch)  # 5 bytes of the next line fit
    with pytest.raises(OutputError) as caught:
        atomic.append_line(log, '{"epoch": 2, "loss": 0.5}', advice="Resume.")
    assert log.read_text() == '{"epoch": 1}\n'
    message = str(caught.value)
    assert message.startswith(f"Could not write {log}: No space left on device (ENOSPC), with ")
    assert message.endswith(
        "metrics.jsonl keeps the lines written before. Free some space (or write elsewhere) and "
        "run again. Resume."
    )


def test_written_file_has_the_permissions_of_a_plain_write(tmp_path: Path) -> None:
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    written = atomic.write_text(tmp_path / "atomic.txt", "x")
    assert _mode(written) == _mode(plain)


@pytest.mark.parametrize("indent", [2, None], ids=["indented", "compact"])
def test_write_json_round_trips_and_ends_with_a_newline(tmp_path: Path, indent: int | None) -> None:
    data = {"name": "run", "values": [1, 2.5, None, True], "nested": {"a": {"b": "c"}}}
    target = atomic.write_json(tmp_path / "data.json", data, indent=indent)
    text = target.read_text()
    assert text.endswith("}\n")
    assert json.loads(text) == data
    if indent is None:  # one line without spaces: what keeps a predictions file small
        assert text == '{"name":"run","values":[1,2.5,null,true],"nested":{"a":{"b":"c"}}}\n'
    else:
        assert '\n  "name": "run",\n' in text


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


def test_json_keeps_each_list_of_numbers_on_one_line_and_strings_as_they_are(
    tmp_path: Path,
) -> None:
    data = {
        "tp": list(range(12)),
        "interval": [0.5, -1e-05, 3],
        "nested": [[1, 2], [3, 4]],
        "mixed": [1, "x"],
        "empty": [],
        "text": "a list [\n1, 2\n] in a string",
    }
    text = atomic.write_json(tmp_path / "a.json", data).read_text()
    assert json.loads(text) == data
    assert '  "tp": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],\n' in text
    assert "    [1, 2],\n    [3, 4]\n" in text
    assert '"mixed": [\n    1,\n    "x"\n  ]' in text
    assert atomic.write_json(tmp_path / "b.json", data, indent=None).read_text().count("\n") == 1


def test_a_compact_file_reads_back_as_json_wrote_it_and_is_its_text_for_rounded_numbers(
    tmp_path: Path,
) -> None:
    """Compact files (a predictions file) are encoded by orjson, not json: numbers rounded as
    the predictions file rounds them come out as json's own text, byte for byte; any other
    value reads back as what json's way gives (tiny floats, non-ASCII, NaN, numpy scalars,
    paths, int keys, integers past 64 bits)."""
    rng = np.random.default_rng(0)
    rounded = {
        "boxes": rng.uniform(-5, 2000, (500, 4)).round(2).tolist(),
        "scores": [*rng.uniform(0, 1, 500).round(4).tolist(), 0.0001, 0.0, -0.0, 1.0],
        "labels": rng.integers(0, 80, 500).tolist(),
        "file": "images/a b.png",
    }
    text = atomic.write_json(tmp_path / "p.json", rounded, indent=None).read_text()
    assert text == json.dumps(rounded, separators=(",", ":")) + "\n"
    odd = {
        "tiny": [1e-05, 9.08294244761354e-05, 1e300, -2.5e-310],
        "name": "Bäckerei ✓",
        "nan": [math.nan, math.inf],
        "numpy": np.float32(0.5),
        "path": Path("a/b"),
        1: "int key",
        "huge": 2**70,
    }
    written = atomic.write_json(tmp_path / "o.json", odd, indent=None).read_text(encoding="utf-8")
    assert written.count("\n") == 1 and written.endswith("\n")
    assert json.loads(written) == json.loads(json.dumps(atomic.jsonable(odd)))


def test_an_indented_file_reads_back_as_json_wrote_it_float_for_float(tmp_path: Path) -> None:
    """Indented files (an eval JSON) are encoded by orjson too: every value, each float to the
    bit, reads back as json's own indented text gives it, with or without values beyond JSON's
    types (written json's way), and each list of numbers stays on one line either way."""
    rng = np.random.default_rng(0)
    plain = {
        "per_image": {"tp": rng.integers(0, 9, 300).tolist(), "f": rng.uniform(0, 1, 300).tolist()},
        "tiny": [1e-05, 9.08294244761354e-05, 1e300, -2.5e-310, 1e16, -0.0],
        "name": "Bäckerei ✓",
        "nan": [math.nan, -math.inf],
        "rows": [{"low": 0.1, "high": None, "ok": True}, []],
    }
    beyond = {**plain, "numpy": np.float32(0.5), "path": Path("a/b"), 1: "int key", "huge": 2**70}
    for data in (plain, beyond):
        text = atomic.write_json(tmp_path / "i.json", data).read_text(encoding="utf-8")
        assert json.loads(text) == json.loads(json.dumps(atomic.jsonable(data), indent=2))
        lines = text.splitlines()
        tp = ", ".join(str(count) for count in plain["per_image"]["tp"])
        assert f'    "tp": [{tp}],' in lines
        assert any(line.startswith('    "f": [0.') and line.endswith("]") for line in lines)


def _record_flushes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """os.fsync and os.sync, recorded as 'fsync <file name>' and 'sync' (and still done)."""
    calls: list[str] = []
    fsync, sync = os.fsync, os.sync

    def recording_fsync(fd: int) -> None:
        calls.append(f"fsync {Path(os.readlink(f'/proc/self/fd/{fd}')).name}")
        fsync(fd)

    def recording_sync() -> None:
        calls.append("sync")
        sync()

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "sync", recording_sync)
    return calls


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names open files via /proc")
def test_a_file_written_not_durable_is_not_fsynced_alone_and_sync_flushes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _record_flushes(monkeypatch)
    target = atomic.write_with(tmp_path / "a.png", lambda tmp: tmp.write_bytes(b"x"), durable=False)
    assert target.read_bytes() == b"x" and calls == []
    atomic.write_text(tmp_path / "b.txt", "y")
    assert len(calls) == 1 and calls[0].startswith("fsync .b.txt.")
    atomic.sync([target])
    assert calls[1:] == ["sync"]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names open files via /proc")
def test_sync_fsyncs_each_file_where_the_os_has_no_system_wide_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _record_flushes(monkeypatch)
    monkeypatch.delattr(os, "sync")
    paths = [atomic.write_with(tmp_path / n, lambda t: t.write_bytes(b"x"), durable=False)
             for n in ("a", "b")]  # fmt: skip
    atomic.sync(paths)
    assert calls == ["fsync a", "fsync b"]


@pytest.mark.parametrize("indent", [2, None], ids=["indented", "compact"])
def test_plain_and_mixed_data_are_written_as_their_converted_form(
    tmp_path: Path, indent: int | None
) -> None:
    """Data of JSON's own types is written as it is (a predictions file holds a million
    numbers); anything else first becomes JSON's: both give the text the converted data gives."""
    plain = {"boxes": [[1.5, 2.0], [3.25, 4.0]], 7: (1, 2), "f": np.float64(0.1), "n": None}
    mixed = {**plain, "path": Path("a/b"), "scalar": np.int64(3), "nan": [math.nan]}
    for data in (plain, mixed):
        separators = None if indent is not None else (",", ":")
        expected = json.dumps(atomic.jsonable(data), indent=indent, separators=separators)
        text = atomic.write_json(tmp_path / "data.json", data, indent=indent).read_text()
        assert json.loads(text) == json.loads(expected)
        if indent is None:
            assert text == expected + "\n"


@pytest.mark.parametrize("indent", [2, None], ids=["indented", "compact"])
def test_numpy_arrays_are_written_as_the_text_of_the_lists_they_hold(
    tmp_path: Path, indent: int | None
) -> None:
    """numpy_arrays (a predictions file: each image's numbers views of one array): float64 and
    int64 arrays, empty ones and rows sliced off a larger array included, come out byte for
    byte as their lists would; an array orjson refuses (not C-contiguous) and arrays without
    the option are still written, as their lists."""
    rng = np.random.default_rng(1)
    every = rng.uniform(-5, 2000, (60, 4)).round(2)
    every[:3] = [[0.0, -0.0, 1e-05, 1e16], [math.nan, math.inf, 2.5e-310, 0.1], [1, 2, 3, 4]]
    scores = rng.uniform(0, 1, 60).round(4)
    arrays = {
        "images": [
            {"boxes": every[a:b], "scores": scores[a:b], "labels": np.arange(a, b)}
            for a, b in ((0, 3), (3, 3), (3, 60))
        ],
        "empty": np.zeros((0, 4)),
    }
    as_lists = {
        "images": [
            {key: value.tolist() for key, value in image.items()} for image in arrays["images"]
        ],
        "empty": [],
    }
    expected = atomic.write_json(tmp_path / "lists.json", as_lists, indent=indent).read_bytes()
    written = atomic.write_json(tmp_path / "a.json", arrays, indent=indent, numpy_arrays=True)
    assert written.read_bytes() == expected
    strided = {**arrays, "empty": every[:, ::2]}
    written = atomic.write_json(tmp_path / "s.json", strided, indent=indent, numpy_arrays=True)
    assert json.loads(written.read_text()) == json.loads(json.dumps(atomic.jsonable(strided)))
    assert json.loads(written.read_text())["empty"] == atomic.jsonable(every[:, ::2].tolist())
    plain = atomic.write_json(tmp_path / "p.json", arrays, indent=indent)
    assert json.loads(plain.read_text()) == json.loads(expected)
