"""benchmarks/evaluation_speed.py with --checkpoint: what its record says of the evaluation it
timed comes from the config `evaluate` ran with, not from the checkpoint's raw dict."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from benchmark_modules import load
from tiny_runs import tiny_config

from pipeline.engine import checkpoint


def test_the_checkpoint_runs_image_size_is_the_one_evaluate_ran_at_settings_included(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint's config read with today's defaults and the script's settings on top, as
    `evaluate` reads it: a data.image_size setting is the size the figures were taken at."""
    speed = load("evaluation_speed")
    config = tiny_config(tmp_path / "data")  # data.image_size=64
    state = {"model": {}, "config": config, "class_names": ["a"], "epoch": 1}
    path = checkpoint.save(tmp_path / "best.pth", state)
    timed = {"timing": {"model_s": 1.0}, "num_images": 8}
    result = {"metrics": timed, "val_metrics": None, "model": "tiny_conv", "precision": "fp32"}
    monkeypatch.setattr(speed.harness, "evaluate_in_process", lambda argv, out: (result, 3.0))
    args = SimpleNamespace(
        cpu_threads=1, checkpoint=str(path), data_root=str(tmp_path / "data"), settings=[]
    )
    assert speed.time_evaluate_command(args, torch.device("cpu"))["image_size"] == 64
    args.settings = ["data.image_size=48"]
    assert speed.time_evaluate_command(args, torch.device("cpu"))["image_size"] == 48
