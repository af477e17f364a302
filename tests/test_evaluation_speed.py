"""benchmarks/evaluation_speed.py with --checkpoint: what its record says of the evaluation it
timed comes from the config `evaluate` ran with, not from the checkpoint's raw dict."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from benchmark_modules import load
from tiny_runs import make_data, tiny_config, tiny_settings

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
    parts = {"postprocess_s": 0.25, "loader_s": 0.125, "metrics_s": 0.5}
    timed = {"timing": {"model_s": 1.0, **parts}, "num_images": 8}
    result = {"metrics": timed, "val_metrics": None, "model": "tiny_conv", "precision": "fp32"}
    monkeypatch.setattr(speed.harness, "evaluate_in_process", lambda argv, out: (result, 3.0))
    args = SimpleNamespace(
        cpu_threads=1, checkpoint=str(path), data_root=str(tmp_path / "data"), settings=[]
    )
    timed_run = speed.time_evaluate_command(args, torch.device("cpu"))
    assert timed_run["image_size"] == 64
    # everything but the forward pass (3.0 - 1.0 s), divided: the passes' own parts, the rest
    assert timed_run["parts"] == {**parts, "outside_passes_s": 2.0 - 0.875}
    args.settings = ["data.image_size=48"]
    assert speed.time_evaluate_command(args, torch.device("cpu"))["image_size"] == 48


def test_the_default_size_part_times_evaluate_on_made_detections_and_divides_the_rest(
    tmp_path: Path,
) -> None:
    """Without --checkpoint: `evaluate`'s work on validation then test with an untrained
    model's detections replaced by ones made from the ground truth; the parts of everything
    but the forward pass add up to it."""
    speed = load("evaluation_speed")
    root = make_data(tmp_path / "data")
    args = SimpleNamespace(
        data_root=str(root), settings=tiny_settings(root)[2:], seed=0, cpu_threads=1
    )
    timed = speed.time_default_size(args, torch.device("cpu"))
    assert timed["images"] == 16  # validation's 8 and test's 8
    assert timed["forward_s"] > 0 and timed["else_s"] > 0
    assert sum(timed["parts"].values()) == pytest.approx(timed["else_s"])
    assert timed["parts"]["metrics_s"] > 0
