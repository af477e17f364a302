"""benchmarks/evaluation_speed.py: with --checkpoint, what its record says of the evaluation it
timed comes from the config `evaluate` ran with, not from the checkpoint's raw dict; each part
is timed --repeats times, its figures the medians with their spread and intervals."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from types import SimpleNamespace
from typing import Any

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


def test_with_a_checkpoint_the_timed_runs_come_after_one_untimed_run_that_pays_the_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    speed = load("evaluation_speed")
    config = tiny_config(tmp_path / "data")
    path = checkpoint.save(
        tmp_path / "best.pth", {"model": {}, "config": config, "class_names": ["a"], "epoch": 1}
    )
    totals = iter([100.0, 3.0, 4.0, 5.0, 6.0, 7.0])  # the first: the imports paid

    def evaluated(argv: list[str], out: Path) -> tuple[dict[str, Any], float]:
        parts = {"postprocess_s": 0.25, "loader_s": 0.125, "metrics_s": 0.5}
        timed = {"timing": {"model_s": 1.0, **parts}, "num_images": 8}
        return {"metrics": timed, "val_metrics": None, "model": "m", "precision": "fp32"}, next(
            totals
        )

    monkeypatch.setattr(speed.harness, "evaluate_in_process", evaluated)
    args = SimpleNamespace(
        cpu_threads=1,
        checkpoint=str(path),
        data_root=str(tmp_path / "data"),
        settings=[],
        repeats=5,
    )
    runs = speed.default_size_runs(args, torch.device("cpu"))["runs"]
    assert [run["total_s"] for run in runs] == [3.0, 4.0, 5.0, 6.0, 7.0]
    summary = speed.default_summary(runs)
    assert summary["else_s"] == {"median": 4.0, "low": 2.0, "high": 6.0}
    assert summary["ratio"]["median"] == 4.0  # else / forward, not forward / else
    assert summary["ratio"]["low"] <= 4.0 <= summary["ratio"]["high"]


def test_repeats_below_the_fewest_rounds_a_paired_interval_needs_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    speed = load("evaluation_speed")
    fewest = speed.stats.MIN_ROUNDS_TO_PAIR
    with pytest.raises(SystemExit) as refused:
        speed.parse_args(["--repeats", str(fewest - 1)])
    assert refused.value.code == 2
    assert f"--repeats must be at least {fewest}, got {fewest - 1}" in capsys.readouterr().err
    assert speed.parse_args(["--repeats", str(fewest)]).repeats == fewest


def test_the_record_holds_medians_of_the_repeated_runs_and_each_ratio_with_its_interval(
    tmp_path: Path,
) -> None:
    """The whole script at its smallest settings: every part timed --repeats times (the COCO
    sizes in ABBA order), the times the medians of the runs, each ratio the median of the
    per-run ratios inside its interval, and the settings naming the repeats."""
    speed = load("evaluation_speed")
    root = make_data(tmp_path / "data")
    repeats = speed.stats.MIN_ROUNDS_TO_PAIR
    threads = torch.get_num_threads()
    try:
        status = speed.main(
            [
                *("--small", "2", "--large", "3", "--repeats", str(repeats)),
                *("--cpu-threads", "1", "--data-root", str(root)),
                *("--record", str(tmp_path / "record.json"), "--out", str(tmp_path / "out.json")),
                *tiny_settings(root)[2:],
            ]
        )
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    record = json.loads((tmp_path / "record.json").read_text(encoding="utf-8"))
    out = json.loads((tmp_path / "out.json").read_text(encoding="utf-8"))
    assert record["settings"]["repeats"] == repeats
    figures = {figure["key"]: figure for figure in record["figures"]}
    runs = out["default_size"]["runs"]
    rounds = out["coco_scale"]["rounds"]
    assert len(runs) == repeats and len(rounds) == repeats
    assert [r["order"] for r in rounds[:2]] == [["small", "large"], ["large", "small"]]
    per_run = {
        "default.ratio": [run["else_s"] / run["forward_s"] for run in runs],
        "coco.scale_ratio": [
            r["large"]["ms_per_image"] / r["small"]["ms_per_image"] for r in rounds
        ],
    }
    for key, ratios in per_run.items():
        figure = figures[key]
        assert figure["value"] == pytest.approx(statistics.median(ratios))
        assert figure["interval"]["low"] <= figure["value"] <= figure["interval"]["high"]
        assert f"median of the ratios of {repeats} " in figure["label"]
    for key in ("forward_s", "else_s", "metrics_s"):
        values = [run[key] if key in run else run["parts"][key] for run in runs]
        figure = figures[f"default.{key}"]
        assert figure["value"] == pytest.approx(statistics.median(values))
        assert figure["interval"] == {"low": min(values), "high": max(values)}
        assert f"median of {repeats} runs" in figure["label"]
    large = [r["large"]["ms_per_image"] for r in rounds]
    assert figures["coco_3.ms_per_image"]["value"] == pytest.approx(statistics.median(large))
