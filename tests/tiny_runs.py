"""Helpers for tests that train: a tiny synthetic data set and the settings of a seconds-long run.

Not a test module: test_trainer.py, test_profile.py and the data layouts' end-to-end tests import
it (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from pipeline.config import load_config
from pipeline.data.synthetic import SyntheticSpec, generate
from pipeline.engine.trainer import Trainer

SPEC = SyntheticSpec(num_train=16, num_val=8, num_test=8, image_size=64, max_object_size=32)


def make_data(root: Path) -> Path:
    generate(SPEC, root)
    return root


def tiny_settings(data_root: Path, *extra: str) -> list[str]:
    """Two epochs of two steps of 8 images at 64 px, a width-8 model, bit-reproducible on CPU,
    in precision=auto's static choice (fp32 on a CPU): the shipped precision=measured would need
    benchmarks first (tests/test_measured.py covers it)."""
    return [
        "device=cpu",
        "precision=auto",
        f"data.root={data_root}",
        "data.image_size=64",
        "model.width=8",
        "train.epochs=2",
        "train.batch_size=8",
        "train.val_interval=1",
        "train.log_interval=1",
        "deterministic=true",
        *extra,
    ]


# one epoch of a width-8 model at 64 px: a user's data set through the whole CLI in seconds
ONE_EPOCH = (
    "device=cpu",
    "data.image_size=64",
    "model.width=8",
    "train.epochs=1",
    "train.batch_size=4",
)


def train_then_evaluate(
    tmp_path: Path, settings: list[str]
) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess, Path, Path]:
    """`python -m pipeline train` with `settings` (then ONE_EPOCH), and `evaluate` of its
    best.pth, as a user runs them from tmp_path; both must exit 0. Returns the two processes,
    eval.json and the predictions file."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-m", "pipeline", "--cpu-threads", "1"]
    run, out, predictions = tmp_path / "run", tmp_path / "eval.json", tmp_path / "predictions.json"
    steps = (
        ["train", "--out", str(run), *settings, *ONE_EPOCH],
        ["evaluate", "--checkpoint", str(run / "best.pth"), "--out", str(out),
         "--predictions", str(predictions)],
    )  # fmt: skip
    done = []
    for step in steps:
        process = subprocess.run(
            [*command, *step], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert process.returncode == 0, process.stderr
        done.append(process)
    return done[0], done[1], out, predictions


def tiny_config(data_root: Path, *extra: str) -> dict[str, Any]:
    return load_config(None, tiny_settings(data_root, *extra))


@contextmanager
def global_torch_state() -> Iterator[None]:
    """`deterministic=true` switches torch's global flags: put them back for the other tests."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark = torch.backends.cudnn.benchmark
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.backends.cudnn.benchmark = benchmark
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace


@contextmanager
def one_cpu_thread() -> Iterator[None]:
    """Tiny models train 10-50x faster on one torch thread than on two fighting other jobs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextmanager
def pipeline_logger_restored() -> Iterator[None]:
    """conftest's `restore_pipeline_logger`, for module-scoped fixtures that call `cli.main`."""
    logger = logging.getLogger("pipeline")
    handlers, level, propagate = logger.handlers[:], logger.level, logger.propagate
    try:
        yield
    finally:
        for handler in logger.handlers:
            if handler not in handlers:
                handler.close()
        logger.handlers[:], logger.level, logger.propagate = handlers, level, propagate


class InterruptedInEpoch2(Trainer):
    """Killed after the first step row of epoch 2: last.pth holds epoch 1, metrics a stray row."""

    def _write_row(self, row: dict[str, Any]) -> None:
        super()._write_row(row)
        if row["type"] == "step" and row["epoch"] == 2:
            raise KeyboardInterrupt
