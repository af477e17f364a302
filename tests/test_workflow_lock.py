"""Snakemake's lock: a second run in the same directory is refused, clearly and quickly, while
the first finishes; a run killed outright leaves a stale lock that `--unlock` removes, and the
rerun resumes the interrupted training from its last.pth. Both run the `train` target (the data
and training; the environment check ran once for them, in the copy they start from: conftest's
checked_env): the lock is the workflow's, whatever the target, and the whole chain to the report
has its own end-to-end test (tests/test_workflow.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_workflow import BIN, CI_CONFIG, copy_checked_env, snakemake

from pipeline.engine import checkpoint

pytestmark = pytest.mark.slow
# The second run starts once the first is training. Started earlier, it can meet an output the
# first has just written (results/env.json) before the job that wrote it has finished, and
# Snakemake, which checks for incomplete files before it takes the lock, names that file as
# incomplete instead of refusing with the lock's message (docs/failure-modes.md).
TRAINING_STARTED = re.compile(r"^(local)?rule train_run:$", re.MULTILINE)
ARGS = ("train", "--cores", "1", "--configfile", CI_CONFIG)
LOCKED = (
    "Error: Directory cannot be locked.",
    "the remaining lock was likely caused by a kill signal or a power loss",
    "It can be removed with the --unlock argument.",
)
# On top of the CI config: no benchmarks before training (tests/config/ci.yaml asks for
# precision: measured, which trains with what they choose), and epochs enough that the first run
# is still training when the second starts, and that the kill test can kill mid-run: it kills in
# epoch 2, so its rerun resumes with one or two epochs left.
LOCKED_EPOCHS = 6
KILLED_EPOCHS = 3


def repository_with_longer_training(
    checked_env: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path, epochs: int
) -> tuple[Path, tuple[str, ...]]:
    """A copy of the repository whose environment check has run, and the arguments that run
    its `train` target with precision auto and `epochs` on top of the CI config."""
    root = copy_checked_env(checked_env, tmp_path / "repo")
    extra = tmp_path / "longer-training.yaml"
    extra.write_text(f"precision: auto\ntrain:\n  epochs: {epochs}\n")
    return root, (*ARGS, str(extra))


def start(root: Path, log: Path, *args: str) -> subprocess.Popen:
    """Snakemake in the background, in a session of its own so its jobs can be killed with it."""
    with open(log, "w") as output:
        return subprocess.Popen(
            [str(BIN / "snakemake"), *args],
            cwd=root,
            stdout=output,
            stderr=output,
            start_new_session=True,
        )


def wait_until(condition, process: subprocess.Popen, log: Path, what: str) -> None:
    deadline = time.monotonic() + 180
    while not condition():
        assert process.poll() is None, f"Snakemake ended before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within 180 s"
        time.sleep(0.05)


def kill_group(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_a_second_run_in_the_same_directory_is_refused_by_the_lock_and_the_first_finishes(
    checked_env: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    root, args = repository_with_longer_training(checked_env, tmp_path, LOCKED_EPOCHS)
    log = tmp_path / "first.log"
    first = start(root, log, *args)
    try:
        wait_until(lambda: TRAINING_STARTED.search(log.read_text()), first, log, "training")
        began = time.monotonic()
        second = snakemake(root, *args, timeout=120)
        seconds = time.monotonic() - began
        assert first.poll() is None, "the first run ended before the second one was refused"
        assert second.returncode != 0
        for text in LOCKED:
            assert text in second.stdout + second.stderr
        assert seconds < 60, f"the refusal took {seconds:.0f} s"
        assert first.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        kill_group(first)
    assert list((root / "results" / "train").glob("*/train_summary.json"))
    locks = root / ".snakemake" / "locks"
    assert not locks.exists() or not any(locks.iterdir()), "the first run left its lock behind"


def test_a_killed_run_leaves_a_stale_lock_that_unlock_removes_and_the_rerun_resumes_training(
    checked_env: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    root, args = repository_with_longer_training(checked_env, tmp_path, KILLED_EPOCHS)
    log = tmp_path / "killed.log"
    killed = start(root, log, *args)
    train_logs = root / "logs" / "train"

    def second_epoch_started() -> bool:
        logs = train_logs.glob("*.log") if train_logs.is_dir() else []
        return any(f" INFO epoch 2/{KILLED_EPOCHS} step " in path.read_text() for path in logs)

    try:
        wait_until(second_epoch_started, killed, log, "second training epoch")
    finally:
        kill_group(killed)  # Snakemake and its running job, as a power loss would
    (train_log,) = train_logs.glob("*.log")
    run_dir = root / "results" / "train" / train_log.stem
    assert checkpoint.load(run_dir / "last.pth")["epoch"] >= 1
    assert not (run_dir / "train_summary.json").exists()

    refused = snakemake(root, *args, timeout=120)
    assert refused.returncode != 0
    for text in LOCKED:
        assert text in refused.stdout + refused.stderr
    unlocked = snakemake(root, args[0], "--unlock", *args[1:], timeout=120)
    assert unlocked.returncode == 0, unlocked.stderr[-3000:]
    assert "Unlocked working directory." in unlocked.stdout + unlocked.stderr

    # train_run writes its one output last and atomically: a plain rerun reruns it, no
    # --rerun-incomplete needed, and --resume-if-possible continues from last.pth
    rerun = snakemake(root, *args, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "IncompleteFilesException" not in rerun.stdout + rerun.stderr
    assert f"resumed from {run_dir.relative_to(root)}/last.pth after epoch" in train_log.read_text()
    assert (run_dir / "train_summary.json").is_file()
