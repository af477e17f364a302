"""Inference profiling: latency per batch size, the operator table, the trace, and its command."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tiny_runs import make_data, pipeline_logger_restored, tiny_config
from torch.autograd import DeviceType

from pipeline import cli, profiling, timing
from pipeline import device as dev
from pipeline.engine.trainer import Trainer
from pipeline.models import build_model
from pipeline.models.centernet import CenterNet

pytestmark = pytest.mark.usefixtures(
    "torch_flags_threads_and_logger", "no_backend_env", "restore_pipeline_logger"
)


@pytest.fixture(scope="module")
def best_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """best.pth of a one-epoch tiny run (64 px inputs, width 8)."""
    root = tmp_path_factory.mktemp("profile")
    config = tiny_config(make_data(root / "shapes"), "train.epochs=1")
    trainer = Trainer(config, root / "run")
    trainer.fit()
    return trainer.paths["best"]


@pytest.fixture(scope="module")
def profiled(best_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("profiled") / "cpu"
    argv = [
        *("profile", "--cpu-threads", "1", "--checkpoint", str(best_checkpoint)),
        *("--device", "cpu", "--batch-sizes", "1,2", "--repeats", "3", "--warmup", "1"),
        *("--trace-steps", "1", "--out", str(out)),
    ]
    with pipeline_logger_restored():
        assert cli.main(argv) == 0
    return out


class MpsNamedCpu(str):
    """A device spec that torch runs on the CPU but whose `.type` says mps: the MPS output path
    of the profiler, without an Apple GPU."""

    type = "mps"


def read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("tiny_conv", 2, width=8).eval()


SETTINGS = {
    "batch_sizes": [1],
    "warmup": 0,
    "repeats": 2,
    "time_budget_s": 5.0,
    "trace_steps": 1,
    "flip_test": False,
}


# --- the command -----------------------------------------------------------------------------


def test_profile_writes_profile_operators_and_trace_and_no_temp_files(profiled: Path) -> None:
    names = sorted(path.name for path in profiled.iterdir())
    assert names == ["operators.json", "profile.json", "trace.json"]


def test_profile_json_has_latency_percentiles_throughput_and_memory_per_batch_size(
    profiled: Path, best_checkpoint: Path
) -> None:
    profile = read(profiled / "profile.json")
    assert profile["format"] == profiling.FORMAT
    assert profile["checkpoint"] == str(best_checkpoint)
    assert (profile["backend"], profile["device"], profile["precision"]) == ("cpu", "cpu", "fp32")
    assert (profile["model"], profile["image_size"]) == ("tiny_conv", 64)
    assert profile["settings"]["batch_sizes"] == [1, 2]
    assert [row["batch_size"] for row in profile["latency"]] == [1, 2]
    for row in profile["latency"]:
        wall = row["wall"]
        assert 1 <= wall["count"] <= 3 and wall["warmup_steps"] >= 1
        assert isinstance(wall["warmup_settled"], bool) and "drifting" in wall
        assert 0 < wall["p50_ms"] <= wall["p90_ms"] <= wall["p99_ms"] <= wall["max_ms"]
        assert row["throughput_images_per_s"] == pytest.approx(
            row["batch_size"] / (wall["p50_ms"] / 1000)
        )
        assert row["device_events"] is None  # the CPU has no device events
        assert set(row["memory"]) == {"peak_mb", "reserved_mb", "exact", "label"}
    assert profile["profiler"] == read(profiled / "operators.json")


def checkpoint_with_eval(source: Path, target: Path, flip_test: bool | None) -> Path:
    """A copy of `source` whose config sets eval.flip_test (None: names no such key, as a
    checkpoint of a version before it does)."""
    state = torch.load(source, weights_only=True)
    if flip_test is None:
        state["config"]["eval"].pop("flip_test")
    else:
        state["config"]["eval"]["flip_test"] = flip_test
    torch.save(state, target)
    return target


@pytest.mark.parametrize("flip_test", [True, False, None])
def test_profile_times_the_forward_pass_as_predict_runs_it_with_the_checkpoints_flip_test(
    best_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flip_test: bool | None
) -> None:
    checkpoint = checkpoint_with_eval(best_checkpoint, tmp_path / "best.pth", flip_test)
    forward = CenterNet.forward
    asked: list[bool] = []

    def spy(self, images, flip_test=False):
        asked.append(flip_test)
        return forward(self, images, flip_test)

    monkeypatch.setattr(CenterNet, "forward", spy)
    argv = [
        *("profile", "--cpu-threads", "1", "--checkpoint", str(checkpoint), "--device", "cpu"),
        *("--batch-sizes", "1", "--repeats", "1", "--warmup", "0", "--trace-steps", "1"),
        *("--out", str(tmp_path / "out")),
    ]
    with pipeline_logger_restored():
        assert cli.main(argv) == 0
    expected = bool(flip_test)  # a checkpoint from before the key: the default, off
    assert asked and set(asked) == {expected}
    assert read(tmp_path / "out" / "profile.json")["settings"]["flip_test"] is expected


def test_operators_json_lists_the_top_operators_by_self_time(profiled: Path) -> None:
    operators = read(profiled / "operators.json")
    assert operators["activities"] == ["CPU"]
    assert operators["sorted_by"] == "self_cpu_ms"
    assert operators["batch_size"] == 2 and operators["steps"] == 1  # middle of 1,2
    assert operators["trace"] == "trace.json"
    assert operators["note"] is None  # the CPU table is the real thing
    rows = operators["top_operators"]
    assert 0 < len(rows) <= profiling.TOP_OPERATORS
    for row in rows:
        assert isinstance(row["name"], str) and row["name"]
        assert row["calls"] >= 1
        assert row["self_cpu_ms"] >= 0 and row["cpu_total_ms"] >= row["self_cpu_ms"] - 1e-6
    times = [row["self_cpu_ms"] for row in rows]
    assert times == sorted(times, reverse=True)
    assert 0 < sum(row["share"] for row in rows) <= 1 + 1e-9
    assert any("conv" in row["name"] for row in rows)


def test_trace_json_is_a_chrome_trace_with_events(profiled: Path) -> None:
    trace = read(profiled / "trace.json")
    assert isinstance(trace["traceEvents"], list) and trace["traceEvents"]


@pytest.mark.parametrize("sizes", ["0", "1,a", "1,-2", ",", "1.5"])
def test_bad_batch_sizes_exit_2_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture, sizes: str
) -> None:
    argv = ["profile", "--cpu-threads", "1", "--checkpoint", str(tmp_path / "x.pth")]
    argv += ["--batch-sizes", sizes]
    assert cli.main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"--batch-sizes {sizes!r} must be positive integers" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "option",
    [
        ["--repeats", "0"],
        ["--trace-steps", "0"],
        ["--warmup", "-1"],
        ["--time-budget", "0"],
        ["--time-budget", "nan"],
    ],
)
def test_bad_repeat_settings_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture, option: list[str]
) -> None:
    argv = ["profile", "--cpu-threads", "1", "--checkpoint", str(tmp_path / "x.pth"), *option]
    assert cli.main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert "--repeats and --trace-steps must be at least 1" in capsys.readouterr().err


def test_a_missing_checkpoint_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    missing = tmp_path / "missing.pth"
    argv = ["profile", "--cpu-threads", "1", "--checkpoint", str(missing)]
    assert cli.main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"Checkpoint {missing} does not exist" in err and "Traceback" not in err


# --- the pieces ------------------------------------------------------------------------------


def profiler_row(name: str, cpu_us: float, device_us: float, device_type, **flags) -> Any:
    """One row of prof.key_averages() as torch fills it (times in microseconds)."""
    return SimpleNamespace(
        key=name,
        count=3,
        self_cpu_time_total=cpu_us,
        cpu_time_total=cpu_us,
        self_device_time_total=device_us,
        device_type=device_type,
        is_user_annotation=flags.get("annotation", False),
    )


# What key_averages() gives on CUDA: operators charged their kernels' device time, the kernels
# themselves, and a user annotation spanning the step.
CUDA_EVENTS = [
    profiler_row("aten::conv2d", 900.0, 6000.0, DeviceType.CPU),
    profiler_row("aten::add", 300.0, 2000.0, DeviceType.CPU),
    profiler_row("sm90_xmma_fprop_implicit_gemm", 0.0, 6000.0, DeviceType.CUDA),
    profiler_row("vectorized_elementwise_kernel", 0.0, 2000.0, DeviceType.CUDA),
    profiler_row("ProfilerStep#1", 0.0, 8000.0, DeviceType.CUDA, annotation=True),
]


def test_cuda_shares_are_of_the_kernel_time_so_each_kernel_counts_once() -> None:
    rows = {row["name"]: row for row in profiling.operator_rows(CUDA_EVENTS, "self_device_ms")}
    assert rows["sm90_xmma_fprop_implicit_gemm"]["share"] == pytest.approx(0.75)
    assert rows["vectorized_elementwise_kernel"]["share"] == pytest.approx(0.25)
    assert rows["aten::conv2d"]["share"] == pytest.approx(
        0.75
    )  # its kernels' share, as torch prints
    kernels = [row for row in rows.values() if row["kind"] == "kernel"]
    assert sum(row["share"] for row in kernels) == pytest.approx(1.0)
    assert rows["aten::add"]["kind"] == "operator" and rows["aten::add"]["self_device_ms"] == 2.0


def test_cpu_shares_are_of_the_self_cpu_time_of_every_row() -> None:
    rows = profiling.operator_rows(CUDA_EVENTS[:2], "self_cpu_ms")
    assert [row["name"] for row in rows] == ["aten::conv2d", "aten::add"]
    assert [row["share"] for row in rows] == pytest.approx([0.75, 0.25])


def test_operator_profile_on_mps_carries_the_note_that_only_cpu_dispatch_is_shown(
    tmp_path: Path,
) -> None:
    def profile_on(device) -> dict[str, Any]:
        trace = tmp_path / f"{device.type}.json"
        return profiling.operator_profile(
            tiny_model(), device, "fp32", 32, 1, 1, trace, torch.contiguous_format
        )

    mps = profile_on(MpsNamedCpu("cpu"))
    assert mps["note"] == profiling.MPS_NOTE
    assert "CPU-side dispatch only" in mps["note"]
    assert mps["activities"] == ["CPU"]
    assert profile_on(torch.device("cpu"))["note"] is None


def test_profiling_run_on_mps_warns_with_the_note_and_writes_it_to_operators_json(
    tmp_path: Path, pipeline_log: pytest.LogCaptureFixture
) -> None:
    result = profiling.run(
        tiny_model(), MpsNamedCpu("cpu"), "fp32", 32, SETTINGS, tmp_path, torch.contiguous_format
    )
    assert result["profiler"]["note"] == profiling.MPS_NOTE
    assert read(tmp_path / "operators.json")["note"] == profiling.MPS_NOTE
    warnings = [r.getMessage() for r in pipeline_log.records if r.levelno == logging.WARNING]
    assert warnings == [profiling.MPS_NOTE]


def test_latency_summarizes_device_event_times_of_the_timed_runs_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    event_ms = iter([100.0, 1.0, 2.0, 3.0])  # the first is the warm-up run

    class FakeTimer:
        def __init__(self, device) -> None:
            pass

        def start(self) -> None:
            pass

        def stop_ms(self) -> float:
            return next(event_ms)

    monkeypatch.setattr(dev, "DeviceTimer", FakeTimer)
    monkeypatch.setattr(timing, "settled", lambda step_times: True)  # one warm-up run
    settings = {**SETTINGS, "warmup": 1, "repeats": 3}
    row = profiling.latency(
        tiny_model(), torch.device("cpu"), "fp32", 32, 2, settings, torch.contiguous_format
    )
    assert row["wall"]["count"] == 3
    events = row["device_events"]
    assert events["count"] == 3
    assert (events["min_ms"], events["median_ms"], events["max_ms"]) == pytest.approx((1, 2, 3))


def test_latency_under_autocast_runs_the_forward_in_half_precision(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dtypes: list[torch.dtype] = []
    model = tiny_model()
    model.heatmap_head.register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))
    settings = {**SETTINGS, "repeats": 1}
    profiling.latency(model, torch.device("cpu"), "bf16", 32, 1, settings, torch.contiguous_format)
    assert dtypes and set(dtypes) == {torch.bfloat16}


@pytest.mark.parametrize(
    ("without_gpu", "users", "read"),
    [(True, None, "5"), (True, "2", "2"), (False, None, None)],
    ids=["cuda build, no gpu", "the user's own level", "a gpu found"],
)
def test_the_profile_silences_kinetos_gpu_count_error_only_where_a_cuda_build_finds_no_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, without_gpu: bool, users: str | None, read
) -> None:
    """Kineto's 'ERROR: gpuGetDeviceCount failed' is harmless there, and reads as a failure."""
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    if users is not None:
        monkeypatch.setenv("KINETO_LOG_LEVEL", users)
    monkeypatch.setattr(dev, "cuda_build_without_gpu", lambda: without_gpu)
    profiling.operator_profile(
        tiny_model(),
        torch.device("cpu"),
        "fp32",
        32,
        1,
        1,
        tmp_path / "t.json",
        torch.contiguous_format,
    )
    assert os.environ.get("KINETO_LOG_LEVEL") == read


def test_a_cuda_build_without_gpu_is_told_from_a_cpu_build_and_from_one_with_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dev.cuda_build_without_gpu()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert not dev.cuda_build_without_gpu()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # every GPU hidden: none usable
    assert dev.cuda_build_without_gpu()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not dev.cuda_build_without_gpu()
