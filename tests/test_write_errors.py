"""A full disk while writing a checkpoint, a metrics row, a JSON result or the report: one message
that names the file, the free space and what is intact, exit 2, nothing half-written; training
resumes once there is space and ends as an uninterrupted run does.

The disk is simulated (tests/full_disk.py) everywhere, and is a real 3 MiB tmpfs where this
process may mount one (root, and a kernel or container that allows it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from full_disk import FullDisk
from tiny_runs import make_data, pipeline_logger_restored, tiny_settings

from pipeline import cli
from pipeline.engine import checkpoint
from pipeline.errors import OutputError

pytestmark = pytest.mark.usefixtures("torch_flags_threads_and_logger")

EPOCHS = 3
# Fields of metrics rows that measure time or memory, and so differ between runs.
MEASURED = {"step_time_s", "epoch_time_s", "images_per_s", "memory", "host_peak_rss_mb"}
ENOSPC = "No space left on device (ENOSPC), with "


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("data") / "shapes")


def pipeline(*argv: str) -> int:
    return cli.main(["--cpu-threads", "1", *argv])


def train(run: Path, data_root: Path, *extra: str) -> int:
    return pipeline(
        "train", *extra, "--out", str(run), *tiny_settings(data_root, f"train.epochs={EPOCHS}")
    )


def user_error(capsys: pytest.CaptureFixture, code: int) -> str:
    """The one error line of a command that exited with `code`: 2, no traceback, nothing after."""
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if " ERROR " in line]
    assert errors == err.rstrip().splitlines()[-1:], err
    return errors[0].split(" ERROR ", 1)[1]


@pytest.fixture(scope="module")
def reference(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run, never interrupted."""
    run = tmp_path_factory.mktemp("reference") / "run"
    with pipeline_logger_restored():
        assert train(run, data_root) == 0
    return run


def rows(run: Path) -> list[dict[str, Any]]:
    return [
        {key: value for key, value in json.loads(line).items() if key not in MEASURED}
        for line in (run / "metrics.jsonl").read_text().splitlines()
    ]


def assert_intact_and_resumable(run: Path) -> None:
    """What a failed write leaves: last.pth of epoch 1, whole metrics rows, no temporary files."""
    assert checkpoint.load(run / "last.pth")["epoch"] == 1
    assert [path.name for path in run.iterdir() if path.name.endswith(".tmp")] == []
    assert all(row["epoch"] <= 2 for row in rows(run))  # every line is whole JSON


def assert_same_as(run: Path, reference: Path) -> None:
    assert rows(run) == rows(reference)
    for name in ("last.pth", "best.pth"):
        got, expected = checkpoint.load(run / name), checkpoint.load(reference / name)
        assert got["epoch"] == expected["epoch"], name
        assert [
            key
            for key in expected["model"]
            if not torch.equal(got["model"][key], expected["model"][key])
        ] == []
    summary = json.loads((run / "train_summary.json").read_text())
    expected_summary = json.loads((reference / "train_summary.json").read_text())
    for key in ("epochs", "steps", "best_epoch", "best_metric", "final_val"):
        assert summary[key] == expected_summary[key], key


def resume_advice(run: Path) -> str:
    return (
        f"Free some space (or write elsewhere) and run again. {run / 'last.pth'} holds the last "
        "epoch saved, and metrics.jsonl its rows: add --resume (the workflow passes "
        "--resume-if-possible) to continue from there."
    )


# --- simulated -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("full_at", "kept"),
    [
        # epoch 2's last.pth: the disk fills 1000 bytes into it
        (FullDisk("last.pth", nth=2, room=1000), "The previous last.pth is unchanged."),
        # the first row of epoch 2 (rows 1-3 are epoch 1's): 10 bytes of it fit
        (
            FullDisk("metrics.jsonl", nth=4, room=10),
            "metrics.jsonl keeps the lines written before.",
        ),
    ],
    ids=["checkpoint", "metrics-row"],
)
def test_a_full_disk_while_training_stops_with_one_message_and_resume_ends_as_an_uninterrupted_run(
    tmp_path: Path,
    data_root: Path,
    reference: Path,
    capsys: pytest.CaptureFixture,
    full_at: FullDisk,
    kept: str,
) -> None:
    run = tmp_path / "run"
    with pytest.MonkeyPatch.context() as patch:
        full_at.install(patch)
        message = user_error(capsys, train(run, data_root))
    written = run / full_at.name
    assert message.startswith(f"Could not write {written}: {ENOSPC}")
    assert f"free on the file system of {run}. {kept} " in message
    assert message.endswith(resume_advice(run))
    assert_intact_and_resumable(run)

    assert train(run, data_root, "--resume") == 0  # the space is back
    assert "resumed from" in capsys.readouterr().err
    assert_same_as(run, reference)


@pytest.mark.parametrize("output", ["eval", "summary", "report"])
def test_a_full_disk_while_writing_a_json_result_or_the_report_keeps_the_previous_file(
    tmp_path: Path, reference: Path, capsys: pytest.CaptureFixture, output: str
) -> None:
    if output == "eval":
        out = tmp_path / "eval.json"
        argv = ["eval", "--checkpoint", str(reference / "best.pth"), "--out", str(out)]
    elif output == "summary":
        out = tmp_path / "summary.json"
        (tmp_path / "results").mkdir()
        argv = ["summarize", "--results", str(tmp_path / "results"), "--out", str(out)]
    else:
        out = tmp_path / "report.html"
        (tmp_path / "results").mkdir()
        argv = ["report", "--results", str(tmp_path / "results"), "--out", str(out)]
    out.write_text("the previous result\n")
    with pytest.MonkeyPatch.context() as patch:
        FullDisk(out.name, room=100).install(patch)
        message = user_error(capsys, pipeline(*argv))
    assert message.startswith(f"Could not write {out}: {ENOSPC}")
    assert message.endswith(
        f"free on the file system of {tmp_path}. The previous {out.name} is unchanged. Free some "
        "space (or write elsewhere) and run again."
    )
    assert out.read_text() == "the previous result\n"
    assert [path.name for path in tmp_path.iterdir() if path.name.endswith(".tmp")] == []


def test_a_checkpoint_that_does_not_fit_leaves_the_previous_one_loadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.save reports the failed write as a RuntimeError; the error still names the disk."""
    path = tmp_path / "last.pth"
    state = {"model": {"w": torch.zeros(4)}, "config": {}, "class_names": [], "epoch": 1}
    checkpoint.save(path, state)
    FullDisk("last.pth", room=1000).install(monkeypatch)
    with pytest.raises(OutputError, match=re.escape(f"Could not write {path}: {ENOSPC}")):
        checkpoint.save(path, {**state, "model": {"w": torch.zeros(100_000)}, "epoch": 2})
    assert checkpoint.load(path)["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pth"]


# --- a real full file system ---------------------------------------------------------------------


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 3 MiB tmpfs, unmounted afterwards whatever happens."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"this machine does not let the test mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True, capture_output=True)


def test_training_into_a_full_file_system_stops_clearly_and_resumes_once_space_is_freed(
    tiny_tmpfs: Path, data_root: Path, reference: Path, capsys: pytest.CaptureFixture
) -> None:
    """Ballast leaves room for epoch 1's best.pth and last.pth and 64 KiB: epoch 2's checkpoint
    does not fit."""
    size = (reference / "last.pth").stat().st_size
    ballast = tiny_tmpfs / "ballast"
    ballast.write_bytes(bytes(shutil.disk_usage(tiny_tmpfs).free - 2 * size - 64 * 1024))
    run = tiny_tmpfs / "run"

    message = user_error(capsys, train(run, data_root))
    found = re.match(
        rf"Could not write {re.escape(str(run))}/(best|last)\.pth: {re.escape(ENOSPC)}([0-9.]+) KiB "
        rf"free on the file system of {re.escape(str(run))}\. The previous (best|last)\.pth is "
        r"unchanged\. ",
        message,
    )
    assert found, message
    assert abs(float(found.group(2)) * 1024 - shutil.disk_usage(run).free) <= 4096
    assert message.endswith(resume_advice(run))
    assert_intact_and_resumable(run)

    ballast.unlink()
    assert train(run, data_root, "--resume") == 0
    capsys.readouterr()
    assert_same_as(run, reference)
