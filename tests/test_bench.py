"""Timing statistics, the timed-run loop, benchmark records and `python -m pipeline bench`.

The CUDA and MPS branches of timing and memory run here on simulated hardware (conftest's
`fake_cuda` / `fake_mps` and fake device events); real kernels run only on the CPU.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from fake_clock import FakeClock
from jsonschema import Draft202012Validator

from pipeline import bench, bench_record, bench_stops, cli, formats, measured, stats, timing
from pipeline import device as dev
from pipeline import numerics as numerics_
from pipeline.bench_schedule import BLOCK_STEPS, instances_to_build
from pipeline.config import load_config
from pipeline.device import DeviceTimer, PeakMemory, available_backends
from pipeline.models import build_model
from pipeline.summary import decisions

MB = 1024 * 1024
CONDITION_KEYS = {
    "started",
    "finished",
    "load_1m_start",
    "load_1m_end",
    "cpu_count",
    "foreign_cpu_share",
    "high_load",
}
TINY = ["--device", "cpu", "--model", "tiny_conv", "--batch-size", "2", "--image-size", "32"]

pytestmark = pytest.mark.usefixtures(
    "torch_flags_threads_and_logger", "no_backend_env", "restore_pipeline_logger"
)


@pytest.fixture
def one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU bench in this process, as CUDA and MPS run it, for tests whose spies count what
    the bench does in the test process (a forked child's calls never reach them)."""
    monkeypatch.setattr(bench, "FORK_CPU_INSTANCES", False)


@pytest.fixture(scope="module")
def validator() -> Draft202012Validator:
    return formats.validator("bench")


def run_bench(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any] | None]:
    """`python -m pipeline bench` in this process; returns the exit code and the written file."""
    out = tmp_path / "bench.json"
    code = cli.main(["bench", "--cpu-threads", "1", *args, "--out", str(out)])
    return code, json.loads(out.read_text()) if out.exists() else None


def assert_valid(validator: Draft202012Validator, document: dict[str, Any]) -> None:
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(document)]
    assert errors == []


def one_record(tmp_path: Path, validator: Draft202012Validator, *args: str) -> dict[str, Any]:
    """The one record of a `bench` run with `args` that exits 0 with a schema-valid file."""
    code, document = run_bench(tmp_path, *args)
    assert code == 0
    assert_valid(validator, document)
    (record,) = document["records"]
    return record


def plan(**bench_keys: Any) -> dict[str, Any]:
    """What `bench.run` takes: a tiny training config's settings, with bench keys on top."""
    keys = {"batch_size": 2, "image_size": 32, "warmup_steps": 1, "steps": 2, **bench_keys}
    config = load_config(None, ["model.width=8", *(f"bench.{k}={v}" for k, v in keys.items())])
    return bench_record.settings_from_config(config, num_classes=4)


def _tiny_model_and_batch() -> tuple[torch.nn.Module, torch.Tensor, list[dict]]:
    torch.manual_seed(0)
    model = build_model("tiny_conv", 4, "single", width=8)
    images, targets = bench.rendered_batch(2, 32, 4, torch.device("cpu"))
    return model, images, targets


# --- statistics ------------------------------------------------------------------------------


# --- timed_runs ------------------------------------------------------------------------------


def test_timed_runs_warms_up_until_settled_then_stops_at_max_steps(clock: FakeClock) -> None:
    calls: list[int] = []

    def step() -> None:
        calls.append(1)
        clock.now += 0.5

    samples, details = timing.timed_runs(step, "cpu", warmup=2, max_steps=4, budget_s=100.0)
    settle = 2 * stats.SETTLE_WINDOW  # two windows of equal steps are the first proof of settling
    assert len(calls) == settle + 4
    assert samples == [0.5] * 4
    assert details == {
        "warmup_steps": settle,
        "warmup_s": 0.5 * settle,
        "warmup_settled": True,
        "total_s": 0.5 * (settle + 4),
        "budget_limited": False,
        "warmup_ended_early": None,
        "stopped_early": None,
    }


def test_a_stop_rule_is_asked_after_every_warm_up_step_and_ends_it_at_its_reason(
    clock: FakeClock,
) -> None:
    def step() -> None:
        clock.now += 0.5

    seen: list[int] = []

    def end_warmup(times: list[float]) -> str | None:
        seen.append(len(times))
        return "far behind" if len(times) == 2 else None

    details = timing.warm_up(step, "cpu", warmup=5, budget_s=100.0, end_warmup=end_warmup)
    assert seen == [1, 2]  # before the fewest warm-up steps too: the rule judges its evidence
    assert details["warmup_steps"] == 2 and details["warmup_settled"] is False
    assert details["warmup_ended_early"] == "far behind"


def test_warm_up_goes_on_while_the_step_time_still_falls(clock: FakeClock) -> None:
    times = iter([0.118, 0.097, 0.088, 0.080, 0.074, 0.069, 0.064, 0.060, 0.057] + [0.045] * 50)

    def step() -> None:
        clock.now += next(times)

    samples, details = timing.timed_runs(step, "cpu", warmup=2, max_steps=10, budget_s=100.0)
    # past the nine falling steps, until the medians of two windows of steps agree
    assert 9 < details["warmup_steps"] <= 9 + 2 * stats.SETTLE_WINDOW
    assert details["warmup_settled"] is True
    assert samples == pytest.approx([0.045] * 10)
    assert stats.summarize(samples)["drifting"] is False


def test_an_unsettled_warm_up_stops_at_its_budget_and_says_so(clock: FakeClock) -> None:
    times = iter([1.0, 0.5] * 100)  # never settles

    def step() -> None:
        clock.now += next(times)

    samples, details = timing.timed_runs(step, "cpu", warmup=1, max_steps=2, budget_s=3.0)
    assert details["warmup_settled"] is False
    assert details["warmup_steps"] == 5  # 1 + 0.5 + 1 + 0.5 = 3.0 is within it, 4.0 is past it
    assert len(samples) == 2


def test_timed_runs_samples_memory_after_every_step_outside_the_timed_region(
    clock: FakeClock,
) -> None:
    class SlowMemory:
        updates = 0

        def update(self) -> None:  # as slow as a step: it must not show in the samples
            self.updates += 1
            clock.now += 0.5

    def step() -> None:
        clock.now += 0.5

    memory = SlowMemory()
    samples, details = timing.timed_runs(
        step, "cpu", warmup=2, max_steps=3, budget_s=100.0, memory=memory
    )
    assert memory.updates == details["warmup_steps"] + 3
    assert samples == [0.5] * 3


def test_timed_runs_stops_at_the_budget_after_a_timed_step(clock: FakeClock) -> None:
    def step() -> None:
        clock.now += 1.0

    samples, details = timing.timed_runs(step, "cpu", warmup=1, max_steps=10, budget_s=2.5)
    assert details["warmup_steps"] == 3  # past the budget after three unsettled steps
    assert samples == [1.0, 1.0, 1.0]  # the timing budget counts from the end of the warm-up
    assert details["budget_limited"] is True
    assert details["total_s"] == 6.0


def test_timed_runs_times_one_step_even_when_warmup_spent_the_budget(clock: FakeClock) -> None:
    def step() -> None:
        clock.now += 1.0

    samples, details = timing.timed_runs(step, "cpu", warmup=5, max_steps=10, budget_s=0.1)
    assert details["warmup_steps"] == 1  # the budget cut the warm-up short
    assert samples == [1.0]
    assert details["budget_limited"] is True


def test_no_warm_up_asked_for_means_none(clock: FakeClock) -> None:
    def step() -> None:
        clock.now += 1.0

    samples, details = timing.timed_runs(step, "cpu", warmup=0, max_steps=2, budget_s=100.0)
    assert details["warmup_steps"] == 0 and samples == [1.0, 1.0]


def test_timed_runs_synchronizes_before_and_after_every_timed_step(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []

    def synchronize(device) -> None:
        events.append(f"sync {device}")
        clock.now += 0.25  # time spent waiting before the step must not count

    def step() -> None:
        events.append("step")
        clock.now += 1.0

    monkeypatch.setattr(dev, "synchronize", synchronize)
    samples, details = timing.timed_runs(step, "cuda:1", warmup=1, max_steps=2, budget_s=100.0)
    assert details["warmup_steps"] == 2 * stats.SETTLE_WINDOW  # equal steps settle it
    assert events == [
        *("step", "sync cuda:1") * details["warmup_steps"],  # warm-up: drain after each step
        *("sync cuda:1", "step", "sync cuda:1"),
        *("sync cuda:1", "step", "sync cuda:1"),
    ]
    assert samples == [1.25, 1.25]  # the step and the wait for its own work


def test_timed_runs_on_simulated_cuda_synchronizes_the_device(fake_cuda) -> None:
    samples, details = timing.timed_runs(
        lambda: None,
        torch.device("cuda", 1),
        warmup=2,
        max_steps=3,
        budget_s=0.5,
    )
    assert len(samples) == 3 and details["warmup_steps"] >= 2
    warmed = details["warmup_steps"]
    assert fake_cuda.synchronized == [torch.device("cuda", 1)] * (warmed + 2 * 3)


def test_timed_runs_on_simulated_mps_synchronizes_the_device(fake_mps) -> None:
    samples, details = timing.timed_runs(lambda: None, "mps", warmup=1, max_steps=2, budget_s=0.5)
    assert len(samples) == 2
    assert fake_mps.synchronized == details["warmup_steps"] + 2 * 2


# --- run conditions and settings -------------------------------------------------------------


def test_run_conditions_finish_returns_the_documented_keys() -> None:
    conditions = timing.RunConditions().finish()
    assert set(conditions) == CONDITION_KEYS
    assert conditions["started"] <= conditions["finished"]  # ISO 8601 UTC sorts by time
    assert conditions["cpu_count"] >= 1
    assert isinstance(conditions["high_load"], bool)


@pytest.mark.parametrize(
    ("machine_busy_s", "share", "high"), [(2.0, 0.0, False), (4.0, 0.1, False), (6.0, 0.2, True)]
)
def test_high_load_follows_the_busy_cpu_time_of_other_processes(
    monkeypatch: pytest.MonkeyPatch, machine_busy_s: float, share: float, high: bool
) -> None:
    # 10 s of wall time on 2 cores; this process itself was busy for 2 s of it
    clock = SimpleNamespace(perf_counter=lambda: 0.0, process_time=lambda: 0.0)
    monkeypatch.setattr(timing, "time", clock)
    monkeypatch.setattr(timing.os, "cpu_count", lambda: 2)
    readings = iter([100.0, 100.0 + machine_busy_s])
    monkeypatch.setattr(timing, "_busy_jiffies", lambda: next(readings))
    monkeypatch.setattr(timing, "_load_average", lambda: 1000.0)  # ignored when busy time is known
    conditions = timing.RunConditions()
    clock.perf_counter, clock.process_time = (lambda: 10.0), (lambda: 2.0)
    finished = conditions.finish()
    assert finished["foreign_cpu_share"] == pytest.approx(share)
    assert finished["high_load"] is high


@pytest.mark.parametrize(("load_per_core", "high"), [(0.1, False), (0.6, True)])
def test_without_proc_stat_high_load_falls_back_to_the_load_average(
    monkeypatch: pytest.MonkeyPatch, load_per_core: float, high: bool
) -> None:
    monkeypatch.setattr(timing, "_busy_jiffies", lambda: None)
    monkeypatch.setattr(timing.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(timing, "_load_average", lambda: 4 * load_per_core)
    conditions = timing.RunConditions().finish()
    assert conditions["foreign_cpu_share"] is None
    assert conditions["high_load"] is high
    assert conditions["load_1m_start"] == conditions["load_1m_end"] == 4 * load_per_core


def test_torch_settings_record_threads_and_tf32_flags() -> None:
    settings = timing.torch_settings()
    assert settings["torch_threads"] == torch.get_num_threads() == 1
    assert settings["tf32_matmul"] == torch.backends.cuda.matmul.allow_tf32
    assert settings["tf32_cudnn"] == torch.backends.cudnn.allow_tf32
    assert settings["cudnn_benchmark"] == torch.backends.cudnn.benchmark


# --- the command on the CPU ------------------------------------------------------------------


def test_bench_fp32_train_writes_a_schema_valid_ok_record(tmp_path, validator) -> None:
    record = one_record(
        tmp_path,
        validator,
        *TINY,
        *("--precision", "fp32", "--mode", "train", "--steps", "2", "--warmup", "1"),
    )
    assert record["status"] == "ok" and record["reason"] is None
    assert (record["backend"], record["precision"], record["mode"]) == ("cpu", "fp32", "train")
    assert (record["batch_size"], record["image_size"], record["model"]) == (2, 32, "tiny_conv")
    assert record["parameters"] > 0
    timing_ = record["timing"]
    assert 1 <= timing_["count"] <= 2 and timing_["warmup_steps"] >= 1
    assert timing_["median_ms"] > 0
    assert record["throughput_images_per_s"] == pytest.approx(2 / (timing_["median_ms"] / 1000))
    assert record["numerics"] is None  # fp32 is the reference
    assert record["memory"]["exact"] is True and record["memory"]["peak_mb"] == 0.0
    assert record["host_peak_rss_mb"] > 0
    assert set(record["conditions"]) == CONDITION_KEYS
    assert record["settings"]["max_steps"] == 2 and record["settings"]["torch_threads"] == 1
    assert record["environment"]["cpu_native"] == {
        p: dev.cpu_native_precision(p).native for p in ("bf16", "fp16")
    }


def test_the_benchmark_times_what_training_runs_unless_a_bench_key_overrides_it(
    tmp_path,
) -> None:
    code, document = run_bench(
        tmp_path,
        *("--device", "cpu", "--precision", "fp32", "--mode", "infer", "--steps", "1"),
        *("--warmup", "0", "--image-size", "32"),
        *("model.width=8", "model.label_mode=multilabel", "train.batch_size=3"),
        *("train.channels_last=false", "data.classes=[a, b]"),
    )
    assert code == 0
    (record,) = document["records"]
    configuration = record["configuration"]
    assert configuration["model"] == {
        "name": "tiny_conv",
        "label_mode": "multilabel",
        "width": 8,
        "max_stride": 32,
        "iou_score": False,
    }
    assert (configuration["batch_size"], record["batch_size"]) == (3, 3)  # train.batch_size
    assert configuration["channels_last"] is False and configuration["num_classes"] == 2
    assert configuration["image_size"] == 32
    assert configuration["overridden"] == ["image_size"]
    assert configuration["source"] == "training config with bench.image_size"


@pytest.mark.parametrize(("precision", "mode"), [("fp16", "train"), ("bf16", "infer")])
def test_bench_half_precision_on_cpu_records_numerics_against_fp32(
    tmp_path, validator, precision: str, mode: str
) -> None:
    record = one_record(
        tmp_path,
        validator,
        *TINY,
        *("--precision", precision, "--mode", mode, "--steps", "2", "--warmup", "0"),
        *("--time-budget", "0.3", "bench.numerics_steps=3"),
    )
    assert record["status"] == "ok" and record["timing"]["count"] >= 1
    numerics = record["numerics"]
    assert numerics["reference"] == "fp32" and numerics["trained_steps"] == 3
    assert numerics["finite"] is True
    for key in (
        *("loss_fp32", "loss", "loss_abs_diff", "loss_rel_diff", "output_max_abs_diff"),
        *("grad_cosine", "grad_rel_diff"),
    ):
        assert math.isfinite(numerics[key]), key
    assert numerics["loss_abs_diff"] == pytest.approx(abs(numerics["loss"] - numerics["loss_fp32"]))
    assert numerics["output_max_abs_diff"] > 0  # half precision really ran
    assert numerics["grad_rel_diff"] > 0 and -1 <= numerics["grad_cosine"] <= 1
    within = (
        numerics["loss_rel_diff"] <= numerics_.ACCEPTABLE_LOSS_REL_DIFF
        and numerics["grad_cosine"] >= numerics_.ACCEPTABLE_GRAD_COSINE
    )
    assert numerics["acceptable"] is within
    assert (numerics["problem"] is None) is within
    assert set(numerics["outputs"]) == {"heatmap", "box"}


def test_numerics_compare_a_trained_model_whose_box_head_is_no_longer_zero(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[float] = []
    original = numerics_._loss_and_grads

    def spy(model, *args):
        seen.append(model.box_head[-1].weight.abs().max().item())
        return original(model, *args)

    monkeypatch.setattr(numerics_, "_loss_and_grads", spy)
    numerics = numerics_.compare_numerics(
        *_tiny_model_and_batch(),
        torch.device("cpu"),
        "bf16",
        plan(numerics_steps=2),
        torch.contiguous_format,
    )
    assert len(seen) == 2 and min(seen) > 0  # fresh, the box head's last layer is all zeros
    assert numerics["trained_steps"] == 2


def test_numerics_that_go_astray_are_not_acceptable_and_say_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = numerics_._loss_and_grads

    def astray(model, loss_fn, images, targets, device, precision):
        # the candidate computes in fp32 too, so its own rounding cannot move the 10%
        loss, grads, outputs = original(model, loss_fn, images, targets, device, "fp32")
        if precision != "fp32":
            return loss * 1.1, -grads, outputs
        return loss, grads, outputs

    monkeypatch.setattr(numerics_, "_loss_and_grads", astray)
    numerics = numerics_.compare_numerics(
        *_tiny_model_and_batch(),
        torch.device("cpu"),
        "bf16",
        plan(numerics_steps=0),
        torch.contiguous_format,
    )
    assert numerics["acceptable"] is False
    assert "the loss is 10.0% off fp32's" in numerics["problem"]
    assert "the gradients point elsewhere (cosine -1.000 with" in numerics["problem"]


def test_bench_infer_mode_times_forward_passes(tmp_path, validator) -> None:
    record = one_record(
        tmp_path,
        validator,
        *TINY,
        *("--precision", "fp32", "--mode", "infer", "--steps", "3", "--warmup", "1"),
    )
    assert record["mode"] == "infer" and record["status"] == "ok"
    assert record["timing"]["count"] >= 1


def test_bench_writes_one_record_per_model(tmp_path, validator) -> None:
    code, document = run_bench(
        tmp_path,
        *("--device", "cpu", "--model", "tiny_conv,resnet18", "--batch-size", "1"),
        *("--image-size", "32", "--precision", "fp32", "--mode", "infer"),
        *("--steps", "1", "--warmup", "0"),
    )
    assert code == 0
    assert_valid(validator, document)
    assert [r["model"] for r in document["records"]] == ["tiny_conv", "resnet18"]


def run_bench_dir(tmp_path: Path, *args: str) -> tuple[int, dict[str, dict[str, Any]]]:
    """`python -m pipeline bench ... --out-dir`; returns the exit code and the files by name."""
    out = tmp_path / "bench"
    code = cli.main(["bench", "--cpu-threads", "1", *args, "--out-dir", str(out)])
    files = {path.name: json.loads(path.read_text()) for path in sorted(out.glob("*.json"))}
    return code, files


EVERY_COMBINATION = ("--precision", "fp32,fp16,bf16", "--mode", "train,infer")


@pytest.mark.usefixtures("one_process")
def test_one_process_times_every_precision_and_mode_fp32_first_with_a_file_each(
    tmp_path, validator, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches: list[int] = []
    original = bench.rendered_batch

    def counted(*args, **kwargs):
        batches.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(bench, "rendered_batch", counted)
    code, files = run_bench_dir(
        tmp_path,
        *TINY,
        *("--model", "tiny_conv,resnet18", "--steps", "2", "--warmup", "1"),
        *(*EVERY_COMBINATION, "--time-budget", "0.2", "bench.numerics_steps=1"),
        "bench.warmup_budget_s=0.2",
    )
    assert code == 0
    assert sorted(files) == sorted(
        f"cpu-{p}-{m}.json" for p in ("fp32", "fp16", "bf16") for m in ("train", "infer")
    )
    started, schedules = {}, {}
    for name, document in files.items():
        assert_valid(validator, document)
        _, precision, mode = name.removesuffix(".json").split("-")
        assert [r["model"] for r in document["records"]] == ["tiny_conv", "resnet18"]
        for record in document["records"]:
            assert (record["precision"], record["mode"], record["status"]) == (
                precision,
                mode,
                "ok",
            )
            started[record["model"], precision, mode] = record["conditions"]["started"]
            timed = record["timing"]
            assert len(timed["rounds"]) == len(timed["samples_ms"])
            schedules.setdefault((record["model"], mode), set()).add(timed["schedule_id"])
    assert len(batches) == 1  # the batch is rendered once for every model and combination
    # the precisions of one model and mode share a schedule, so their speed-ups pair
    assert all(len(ids) == 1 for ids in schedules.values())
    assert len(set.union(*schedules.values())) == len(schedules) == 4
    for model in ("tiny_conv", "resnet18"):
        for mode in ("train", "infer"):  # fp32 warms up first among the precisions of a mode
            assert started[model, "fp32", mode] < min(
                started[model, p, mode] for p in ("fp16", "bf16")
            )


@pytest.mark.usefixtures("one_process")
def test_the_numerics_reference_is_trained_once_and_gives_each_precision_its_own_figures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = plan(numerics_steps=2, warmup_steps=0, steps=1)
    alone = {
        (p, m): bench.run(torch.device("cpu"), p, m, "tiny_conv", settings)["numerics"]
        for p in ("fp16", "bf16")
        for m in ("train", "infer")
    }
    references: list[int] = []
    original = numerics_.NumericsReference.__init__

    def counted(self, *args, **kwargs):
        references.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(numerics_.NumericsReference, "__init__", counted)
    compared: list[str] = []
    compare = numerics_.NumericsReference.compare

    def counted_compare(self, precision):
        compared.append(precision)
        return compare(self, precision)

    monkeypatch.setattr(numerics_.NumericsReference, "compare", counted_compare)
    records = bench.run_backend(
        torch.device("cpu"), ["fp32", "fp16", "bf16"], ["train", "infer"], ["tiny_conv"], settings
    )
    assert references == [1]
    assert compared == ["fp16", "bf16"]  # one comparison per precision, whatever the mode
    together = {(r["precision"], r["mode"]): r["numerics"] for r in records}
    assert together.pop(("fp32", "train")) is None and together.pop(("fp32", "infer")) is None
    assert together == alone
    assert together["fp16", "train"]["loss"] != together["bf16", "train"]["loss"]


def test_a_combination_the_backend_cannot_run_still_gets_its_record_beside_the_others(
    tmp_path, validator, monkeypatch: pytest.MonkeyPatch
) -> None:
    reason = "fp16 autocast is not available in this test"
    monkeypatch.setattr(
        dev,
        "autocast_unsupported_reason",
        lambda device, precision: reason if precision == "fp16" else None,
    )
    code, files = run_bench_dir(
        tmp_path, *TINY, *EVERY_COMBINATION, "--steps", "1", "--warmup", "0"
    )
    assert code == 0 and len(files) == 6
    for name, document in files.items():
        assert_valid(validator, document)
        (record,) = document["records"]
        if "-fp16-" in name:
            assert record["status"] == "skipped" and record["reason"] == reason
        else:
            assert record["status"] == "ok" and record["timing"]["count"] == 1


def fake_steps(monkeypatch: pytest.MonkeyPatch, clock: FakeClock, ms: dict[str, float]) -> None:
    """Replace the timed step by one that takes `ms[precision]` on the fake clock, +-2% (one
    jitter sequence per precision, whichever of its model instances steps)."""
    jitter = (1.0, 1.02, 0.99, 1.01, 0.98)
    calls = {precision: iter(range(10**6)) for precision in ms}

    def fake_step(model, images, targets, device, precision, mode, settings, layout):
        def step() -> None:
            clock.now += ms[precision] / 1000 * jitter[next(calls[precision]) % len(jitter)]

        return step

    monkeypatch.setattr(bench, "_step", fake_step)


def test_a_precision_slower_than_fp32_stops_after_the_fewest_steps_and_says_why(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, validator
) -> None:
    fake_steps(monkeypatch, clock, {"fp32": 50.0, "fp16": 700.0, "bf16": 30.0})
    acceptable = {"acceptable": True, "problem": None}  # what the choice reads of the numerics
    monkeypatch.setattr(bench._Shared, "numerics", lambda self, model, precision: acceptable)
    settings = plan(numerics_steps=0, warmup_steps=5, steps=30, time_budget_s=1000.0)
    settings["warmup_budget_s"] = 1000.0
    records = bench.run_backend(
        torch.device("cpu"), ["bf16", "fp16", "fp32"], ["train"], ["tiny_conv"], settings
    )
    by_precision = {r["precision"]: r for r in records}
    assert [r["precision"] for r in records] == ["fp32", "bf16", "fp16"]
    faked = {"numerics": None}  # the faked numerics are no part of the record format
    assert_valid(validator, {"format": records[2]["format"], "records": [{**records[2], **faked}]})
    slow = by_precision["fp16"]["timing"]
    # one block of timed steps, every one far behind fp32's: the fewest a verdict rests on
    assert slow["count"] == stats.MIN_STEPS_APART == BLOCK_STEPS
    assert slow["budget_limited"] is False and slow["rounds"] == [0, 0]
    assert slow["stopped_early"].startswith(f"after {stats.MIN_STEPS_APART} timed steps, fp16 is ")
    ratio = float(slow["stopped_early"].split(" is ")[1].split("x")[0])
    assert ratio == pytest.approx(14.0, rel=0.05)
    assert "x slower than fp32's median so far" in slow["stopped_early"]
    assert slow["stopped_early"].endswith("so it cannot be the faster precision")
    # its warm-up judged it from its second step (the first builds the primitives)
    assert (
        slow["warmup_steps"] == bench_stops.FEWEST_STEPS_TO_JUDGE
        and slow["warmup_settled"] is False
    )
    assert "more than settling gains" in slow["warmup_ended_early"]
    # ... and no second model instance: its first one's steps already stop it
    assert slow["instances_timed"] == 1 and set(slow["instances"]) == {0}
    # the precision that wins, and fp32 itself, are timed in full after a settled warm-up
    for precision in ("fp32", "bf16"):
        timed = by_precision[precision]["timing"]
        assert timed["count"] == 30 and timed["warmup_settled"] is True
        assert timed["stopped_early"] is None and timed["warmup_ended_early"] is None
        assert timed["instances_timed"] == settings["instances"]
    # the choice reads the same verdict from the records: bf16, with fp16 slower
    choice = measured.choose_precision(
        [(record, "bench.json") for record in records], "cpu", "tiny_conv", {}
    )
    assert choice.precision == "bf16", choice.reason
    fp16 = next(c for c in choice.candidates if c.precision == "fp16")
    assert fp16.speedup["verdict"] == "slower"
    assert fp16.speedup["text"].startswith(f"{1 / fp16.speedup['ratio']:.2f}x slower (95% interval")
    # ... and the summary's flags say why it has so few steps
    flags = " ".join(decisions.flags_of(by_precision["fp16"]))
    assert f"stopped early: {stats.MIN_STEPS_APART} of 30 steps" in flags
    assert f"warm-up ended after {bench_stops.FEWEST_STEPS_TO_JUDGE} steps" in flags


@pytest.mark.usefixtures("one_process")
def test_a_hopeless_precision_costs_two_fp32_steps_more_that_no_record_or_peak_keeps(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    """CPU fp16 14x slower than fp32 at every moment: judged from its second warm-up step
    against FRESH_REFERENCE_STEPS fp32 steps run right after it (once, though its instance
    is judged again after the warm-up), which fp32's record does not count and fp16's peak
    memory leaves out; then its first timed block stops it, on one instance."""
    fake_steps(monkeypatch, clock, {"fp32": 50.0, "fp16": 700.0})
    faked, ran = bench._step, Counter()

    def counted(model, images, targets, device, precision, *rest):
        step = faked(model, images, targets, device, precision, *rest)

        def run() -> None:
            ran[precision] += 1
            step()

        return run

    set_aside = []
    keep = PeakMemory.set_aside
    monkeypatch.setattr(bench, "_step", counted)
    monkeypatch.setattr(
        PeakMemory, "set_aside", lambda self, w: set_aside.append(1) or keep(self, w)
    )
    settings = plan(numerics_steps=0, warmup_steps=5, steps=30, time_budget_s=1000.0, instances=3)
    settings["warmup_budget_s"] = 1000.0
    monkeypatch.setattr(bench._Shared, "numerics", lambda self, model, precision: None)
    fp32, fp16 = (
        r["timing"]
        for r in bench.run_backend(
            torch.device("cpu"), ["fp32", "fp16"], ["train"], ["tiny_conv"], settings
        )
    )
    assert fp16["warmup_steps"] == bench_stops.FEWEST_STEPS_TO_JUDGE and fp16["count"] == 2
    assert "fp32's median of 2 steps run right after it" in fp16["warmup_ended_early"]
    assert fp16["instances_timed"] == 1 and ran["fp16"] == 2 + 2
    assert ran["fp32"] == fp32["warmup_steps"] + fp32["count"] + bench_stops.FRESH_REFERENCE_STEPS
    assert fp32["count"] == 30 and len(set_aside) == 1


def settling_steps(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, ms: dict[str, float], first: list[float]
) -> None:
    """Steps of `ms[precision]` (+-1%) on every model built, its first steps `first[i]` times
    slower (the first builds the primitives, the allocator grows over the next ones)."""

    def fake_step(model, images, targets, device, precision, mode, settings, layout):
        jitter = np.random.default_rng(len(precision))
        count = iter(range(10**6))

        def step() -> None:
            index = next(count)
            factor = first[index] if index < len(first) else 1.0
            clock.now += ms[precision] / 1000 * factor * (1 + 0.01 * jitter.standard_normal())

        return step

    monkeypatch.setattr(bench, "_step", fake_step)


def test_a_precision_slow_at_first_that_settles_faster_than_fp32_is_timed_in_full_and_chosen(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    """Its first step 20x its settled time, its second 2.8x (beyond SETTLING_GAIN_LIMIT x
    fp32's median in its first step alone, within it from the second): its warm-up waits to
    settle, every instance is built, every step timed, and it wins."""
    slow_start = [20.0, 2.8, 2.0, 1.4]
    settling = {"fp32": 50.0, "bf16": 40.0}
    settling_steps(monkeypatch, clock, settling, slow_start)
    acceptable = {"acceptable": True, "problem": None}
    monkeypatch.setattr(bench._Shared, "numerics", lambda self, model, precision: acceptable)
    settings = plan(numerics_steps=0, warmup_steps=5, steps=30, time_budget_s=1000.0, instances=3)
    settings["warmup_budget_s"] = 1000.0
    records = bench.run_backend(
        torch.device("cpu"), ["fp32", "bf16"], ["train"], ["tiny_conv"], settings
    )
    fp32, bf16 = (r["timing"] for r in records)
    assert bf16["count"] == 30 and bf16["stopped_early"] is None
    assert bf16["warmup_ended_early"] is None and bf16["warmup_settled"] is True
    assert bf16["instances_timed"] == fp32["instances_timed"] == 3
    choice = measured.choose_precision(
        [(record, "bench.json") for record in records], "cpu", "tiny_conv", {}
    )
    assert choice.precision == "bf16", choice.reason


def machine_steps(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, ms: dict[str, float], speed, built=None
) -> None:
    """Steps of `ms[precision]` (+-2%, seeded) on a machine whose step times are scaled by
    `speed(now)` (drift, a jump); `built(precision)` is told of every model built."""

    def fake_step(model, images, targets, device, precision, mode, settings, layout):
        if built is not None:
            built(precision)
        jitter = np.random.default_rng(len(precision) + ord(precision[0]))

        def step() -> None:
            scale = speed(clock.now) * (1 + 0.02 * jitter.standard_normal())
            clock.now += ms[precision] / 1000 * scale

        return step

    monkeypatch.setattr(bench, "_step", fake_step)


MACHINES = {
    # another tenant arrives 2 s in: what fp32 timed on its own ran on the quiet machine
    "jump": lambda now: 1.0 if now < 2.0 else 1.4,
    # the clock falls steadily (heat, a growing co-tenant)
    "drift": lambda now: 1.0 + 0.25 * now,
}


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_a_machine_that_slows_mid_run_leaves_the_speed_up_interval_around_the_true_ratio(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, machine: str
) -> None:
    """fp32 and bf16 take 50 and 50/1.5 ms on the same machine at every moment; timed one
    after another, bf16 would take the slowdown alone and look barely faster."""
    machine_steps(monkeypatch, clock, {"fp32": 50.0, "bf16": 50.0 / 1.5}, MACHINES[machine])
    acceptable = {"acceptable": True, "problem": None}
    monkeypatch.setattr(bench._Shared, "numerics", lambda self, model, precision: acceptable)
    settings = plan(numerics_steps=0, warmup_steps=5, steps=30, time_budget_s=1000.0)
    settings["warmup_budget_s"] = 1000.0
    records = bench.run_backend(
        torch.device("cpu"), ["fp32", "bf16"], ["train"], ["tiny_conv"], settings
    )
    choice = measured.choose_precision(
        [(record, "bench.json") for record in records], "cpu", "tiny_conv", {}
    )
    speed = next(c for c in choice.candidates if c.precision == "bf16").speedup
    assert speed["low"] <= 1.5 <= speed["high"], speed["text"]
    assert speed["paired_rounds"] == 30 // BLOCK_STEPS
    assert choice.precision == "bf16"


BUSY_FACTOR = 50.0  # every step of any precision this much slower while the machine is busy


def busy_machine(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, *, since: str, busy: tuple[float, float]
) -> dict[str, float]:
    """fp32 takes 50 ms and bf16 50/1.4 ms at every moment, and the machine is BUSY_FACTOR x
    slower between `busy` seconds after `since`: 'bf16' (its first model is built, right
    after fp32's warm-up), 'bf16:2' (its second), or 'timing' (the interleaved schedule
    starts). Returns when that was."""
    burst: dict[str, float] = {}
    began_count: Counter = Counter()

    def speed(now: float) -> float:
        return BUSY_FACTOR if burst and busy[0] <= now - burst["start"] < busy[1] else 1.0

    def began(what: str) -> None:
        began_count[what] += 1
        if since in (what, f"{what}:{began_count[what]}"):
            burst.setdefault("start", clock.now)

    machine_steps(monkeypatch, clock, {"fp32": 50.0, "bf16": 50.0 / 1.4}, speed, built=began)
    interleaved = timing.interleaved_runs

    def timed(*args, **kwargs):
        began("timing")
        return interleaved(*args, **kwargs)

    monkeypatch.setattr(timing, "interleaved_runs", timed)
    acceptable = {"acceptable": True, "problem": None}
    monkeypatch.setattr(bench._Shared, "numerics", lambda self, model, precision: acceptable)
    return burst


def run_fp32_and_bf16_train(instances: int = 3) -> tuple[list[dict[str, Any]], Any]:
    """Both precisions' records of 30 timed steps over `instances` models, and the choice."""
    settings = plan(
        numerics_steps=0, warmup_steps=5, steps=30, time_budget_s=1000.0, instances=instances
    )
    settings["warmup_budget_s"] = 1000.0
    records = bench.run_backend(
        torch.device("cpu"), ["fp32", "bf16"], ["train"], ["tiny_conv"], settings
    )
    choice = measured.choose_precision(
        [(record, "bench.json") for record in records], "cpu", "tiny_conv", {}
    )
    return records, choice


@pytest.mark.usefixtures("one_process")
def test_a_machine_busy_since_fp32s_warm_up_does_not_judge_a_faster_precision_far_behind(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    """fp32 warmed up on the quiet machine; from bf16's first model on, every step is 50x
    slower for a while (bf16 still 1.4x faster than fp32 at the same moment): beyond
    SETTLING_GAIN_LIMIT x fp32's earlier warm-up, not x fp32's steps run right after it.
    bf16 settles, gets every instance, is timed in full and chosen."""
    burst = busy_machine(monkeypatch, clock, since="bf16", busy=(0.0, 30.0))
    records, choice = run_fp32_and_bf16_train()
    fp32, bf16 = (record["timing"] for record in records)
    assert burst["start"] > 0  # fp32's first warm-up was quiet
    assert bf16["warmup_ended_early"] is None and bf16["warmup_settled"] is True
    assert bf16["instances_timed"] == fp32["instances_timed"] == 3
    assert bf16["count"] == fp32["count"] == 30 and bf16["stopped_early"] is None
    assert choice.precision == "bf16", choice.reason


def test_a_burst_that_hits_only_a_later_instances_judged_warm_up_steps_leaves_it_its_instances(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    """bf16's second model's first two warm-up steps run 50x slower, the fp32 steps right
    after them on the quiet machine again: beyond SETTLING_GAIN_LIMIT x those, but also x
    bf16's own first instance, so the moment is to blame and no fp32 steps are run for it."""
    # bf16's two busy steps take 50x 35.7 ms each; the burst ends before fp32 could step
    busy_machine(monkeypatch, clock, since="bf16:2", busy=(0.0, 2.5))
    reference_steps = []
    monkeypatch.setattr(bench, "_reference_steps_now", lambda *a: reference_steps.append(a) or [])
    records, choice = run_fp32_and_bf16_train()
    bf16 = records[1]["timing"]
    assert bf16["warmup_ended_early"] is None and bf16["instances_timed"] == 3
    assert reference_steps == [] and choice.precision == "bf16", choice.reason


def test_a_burst_that_hits_only_a_precisions_first_timed_block_stops_nothing(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    """fp32's first block is quiet and bf16's right after it 50x slower (every step beyond
    SETTLING_GAIN_LIMIT x fp32's median so far): one moment, its warm-up was not far behind,
    so bf16 is timed on and chosen."""
    # fp32's two quiet steps take 0.1 s, bf16's next two 50x 35.7 ms each; then its round 1
    busy_machine(monkeypatch, clock, since="timing", busy=(0.09, 3.0))
    records, choice = run_fp32_and_bf16_train(instances=1)
    fp32, bf16 = (record["timing"] for record in records)
    first_block = bf16["samples_ms"][:BLOCK_STEPS]
    assert bf16["rounds"][:BLOCK_STEPS] == [0] * BLOCK_STEPS
    fp32_first_block = fp32["samples_ms"][:BLOCK_STEPS]  # timed right before bf16's
    assert min(first_block) > bench_stops.SETTLING_GAIN_LIMIT * max(fp32_first_block)
    assert max(fp32_first_block) < 60.0 and max(bf16["samples_ms"][BLOCK_STEPS:]) < 40.0
    assert bf16["count"] == 30 and bf16["stopped_early"] is None
    assert choice.precision == "bf16", choice.reason


def test_far_behind_runs_fp32_steps_only_where_its_warm_up_screens_the_precision_out() -> None:
    """Within SETTLING_GAIN_LIMIT x fp32's warm-up: judged at no cost. Beyond it: fp32 steps
    run now decide, and stand until the precision's fastest step halves (the machine
    changed): then fp32 steps again."""
    now = {"ms": 50.0}
    calls: list[float] = []

    def fp32_now() -> list[float]:
        calls.append(now["ms"])
        return [now["ms"] / 1000] * bench_stops.FRESH_REFERENCE_STEPS

    judge = bench_stops.FarBehind([0.05] * 10, fp32_now)
    assert judge([2.0, 0.14]) is False and calls == []
    now["ms"] = 50.0 * BUSY_FACTOR  # the machine became busy: fp32 too
    assert judge([2.0, 1.8]) is False and calls == [2500.0]
    assert "fp32's median of 2 steps run right after it (2500.0 ms)" in judge.reference_text
    assert judge([2.0, 1.8, 1.7]) is False and calls == [2500.0]  # the same moment, near enough
    now["ms"] = 50.0  # quiet again: a precision 14x slower than fp32 is caught now
    assert judge([2.0, 1.8, 1.7, 0.7]) is True and calls == [2500.0, 50.0]
    assert judge([2.0, 1.8, 1.7, 0.7]) is True and len(calls) == 2  # judged already
    # without fp32 steps to run now (or none it could run), the warm-up alone judges
    assert bench_stops.FarBehind([0.05] * 10, lambda: [])([2.0, 0.7]) is True
    assert bench_stops.FarBehind([0.05] * 10)([2.0, 0.14]) is False
    assert bench_stops.FarBehind([], fp32_now)([2.0, 0.7]) is False and len(calls) == 2
    # a later instance: far behind only where its own first instance was as slow
    assert bench_stops.FarBehind([0.05] * 10, fp32_now, [0.036] * 10)([2.0, 1.8]) is False
    assert len(calls) == 2  # no fp32 steps: the moment, not the precision
    assert bench_stops.FarBehind([0.05] * 10, fp32_now, [0.7] * 10)([2.0, 0.7]) is True
    assert len(calls) == 3


def instance_steps(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, ms: dict[str, float], modes: list[float]
) -> list[tuple[str, int]]:
    """Steps of `ms[precision]` times the speed mode of the model instance they step
    (`modes[k]` for the k-th model built of a precision), +-2%; returns (precision, seed)
    of every model built, in order."""
    built: list[tuple[str, int]] = []
    count: dict[str, int] = {}

    def fake_step(model, images, targets, device, precision, mode, settings, layout):
        built.append((precision, torch.initial_seed()))
        mode_factor = modes[count.setdefault(precision, 0)]
        count[precision] += 1
        jitter = np.random.default_rng(len(built))

        def step() -> None:
            clock.now += ms[precision] / 1000 * mode_factor * (1 + 0.02 * jitter.standard_normal())

        return step

    monkeypatch.setattr(bench, "_step", fake_step)
    return built


@pytest.mark.usefixtures("one_process")
def test_each_precision_is_timed_on_fresh_instances_seeded_alike_and_paired_by_instance(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, validator
) -> None:
    """Three instances per precision, each in a speed mode of its own (the same modes for
    both precisions, so the true speed-up is 1.5 whatever the instance): instance k of fp32
    and of bf16 are built from seed k, time the same rounds, and the interval is over their
    pairs; only the first instances' warm-ups measure memory."""
    built = instance_steps(monkeypatch, clock, {"fp32": 50.0, "bf16": 50.0 / 1.5}, [1.0, 1.25, 0.9])
    acceptable = {"acceptable": True, "problem": None}
    monkeypatch.setattr(bench._Shared, "numerics", lambda self, model, precision: acceptable)
    measured_peaks: list[float] = []

    class Spy(PeakMemory):
        def __init__(self, device, reader=None, exclude_mb: float = 0.0) -> None:
            super().__init__(device, reader, exclude_mb)
            measured_peaks.append(exclude_mb)

    monkeypatch.setattr(dev, "PeakMemory", Spy)
    settings = plan(numerics_steps=0, warmup_steps=5, steps=30, time_budget_s=1000.0, instances=3)
    settings["warmup_budget_s"] = 1000.0
    records = bench.run_backend(
        torch.device("cpu"), ["fp32", "bf16"], ["train"], ["tiny_conv"], settings
    )
    # every precision's first instance before any second one; instance k from seed k
    assert built == [(p, k) for k in range(3) for p in ("fp32", "bf16")]
    assert len(measured_peaks) == 2
    for record in records:
        faked = {"numerics": None}  # the faked numerics are no part of this test
        assert_valid(validator, {"format": record["format"], "records": [{**record, **faked}]})
        timed = record["timing"]
        assert record["settings"]["instances"] == 3 and timed["instances_timed"] == 3
        assert len(timed["instances"]) == len(timed["samples_ms"]) == 30
        # an ABBA pair of rounds per instance, in turn
        assert timed["instances"] == [timing.instance_of_round(r, 3) for r in timed["rounds"]]
        assert timed["warmup_steps"] >= 3 * 10  # each instance warmed up until it settled
    fp32, bf16 = (r["timing"] for r in records)
    assert fp32["rounds"] == bf16["rounds"] and fp32["instances"] == bf16["instances"]
    speed = stats.speedup_between(fp32, bf16)
    assert speed.paired_instances == 3 and speed.paired_rounds == 15
    assert speed.low <= 1.5 <= speed.high and "over 3 model instances" in speed.text
    choice = measured.choose_precision(
        [(record, "bench.json") for record in records], "cpu", "tiny_conv", {}
    )
    assert choice.precision == "bf16" and "over 3 model instances" in choice.reason


@pytest.mark.usefixtures("one_process")
def test_one_instance_times_every_round_on_one_model_and_pairs_over_rounds_as_before(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    built = instance_steps(monkeypatch, clock, {"fp32": 50.0, "bf16": 40.0}, [1.0, 1.3])
    settings = plan(numerics_steps=0, warmup_steps=1, steps=20, time_budget_s=1000.0, instances=1)
    records = bench.run_backend(
        torch.device("cpu"), ["fp32", "bf16"], ["infer"], ["tiny_conv"], settings
    )
    assert built == [("fp32", 0), ("bf16", 0)]
    fp32, bf16 = (r["timing"] for r in records)
    assert fp32["instances"] == [0] * 20 and bf16["instances_timed"] == 1
    speed = stats.speedup_between(fp32, bf16)
    before = stats.speedup(
        [v / 1000 for v in fp32["samples_ms"]],
        [v / 1000 for v in bf16["samples_ms"]],
        rounds=(fp32["rounds"], bf16["rounds"]),
    )
    assert speed == before and speed.paired_instances == 1


@pytest.mark.usefixtures("one_process")
def test_a_precision_far_slower_than_fp32_gets_one_instance_even_when_its_budget_ended_the_warm_up(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    """On a busy machine a CPU fp16 step can outlast the warm-up budget before its fewest
    steps: its warm-up's own rule is not asked, yet its steps show it far slower than fp32,
    and a second and third instance would only cost two more warm-up budgets."""
    built = instance_steps(monkeypatch, clock, {"fp32": 50.0, "fp16": 700.0}, [1.0, 1.0, 1.0])
    settings = plan(numerics_steps=0, warmup_steps=5, steps=30, time_budget_s=1000.0, instances=3)
    settings["warmup_budget_s"] = 0.5
    records = bench.run_backend(
        torch.device("cpu"), ["fp32", "fp16"], ["train"], ["tiny_conv"], settings
    )
    assert [precision for precision, _ in built].count("fp16") == 1
    slow = records[1]["timing"]
    assert slow["warmup_ended_early"] is None and slow["warmup_steps"] == 1
    assert slow["instances_timed"] == 1 and records[0]["timing"]["instances_timed"] == 3
    assert "slower" in slow["stopped_early"]


def test_the_instances_option_sets_how_many_models_are_timed(tmp_path, validator) -> None:
    record = one_record(
        tmp_path,
        validator,
        *TINY,
        *("--precision", "fp32", "--steps", "8", "--warmup", "0", "--instances", "2"),
    )
    assert record["settings"]["instances"] == 2
    assert record["timing"]["instances"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert record["timing"]["instances_timed"] == 2


def test_no_more_instances_are_built_than_the_timed_steps_reach() -> None:
    """Each instance times an ABBA pair of rounds of BLOCK_STEPS steps: 30 steps reach 8."""
    assert instances_to_build({"instances": 3, "steps": 30}) == 3
    assert instances_to_build({"instances": 20, "steps": 30}) == 8
    assert instances_to_build({"instances": 3, "steps": 3}) == 1
    assert instances_to_build({"instances": 1, "steps": 1}) == 1


def _timed(ms: list[float], rounds: list[int]) -> timing.Timed:
    return timing.Timed(samples=[v / 1000 for v in ms], rounds=rounds)


def test_a_precision_only_a_little_behind_in_unpaired_blocks_is_not_stopped_before_pairing() -> (
    None
):
    """The machine got 1.5x slower right after fp32's first block: the candidate's five steps
    are all behind fp32's two, yet they were timed on another machine, so to speak."""
    fp32 = _timed([50.0, 50.5], [0, 0])
    _, stop = bench_stops.slower_than(bench_stops.FarBehind([0.05] * 10), fp32, "fp16")
    later = _timed([78.0, 78.5, 77.5, 78.2, 77.8], [0, 0, 1, 1, 2])
    assert stop(later) is None
    # paired over the rounds that follow, on the slower machine, it is as fast as fp32
    rounds = stats.MIN_ROUNDS_TO_PAIR + 1
    fp32.samples += [0.075 * (1 + 0.01 * (i % 3)) for i in range(2 * rounds - 2)]
    fp32.rounds += [r for r in range(1, rounds) for _ in range(2)]
    later.samples += [0.078 * (1 + 0.01 * (i % 2)) for i in range(2 * rounds - 5)]
    later.rounds += [2] + [r for r in range(3, rounds) for _ in range(2)]
    assert stop(later) is None
    # ... and where the paired rounds show it slower beyond the tolerance, it stops
    slower = timing.Timed([s * 1.3 for s in later.samples], later.rounds)
    reason = stop(slower)
    assert reason is not None and "slower" in reason
    assert stats.speedup(
        fp32.samples, slower.samples, rounds=(fp32.rounds, slower.rounds)
    ).paired_rounds


def test_a_precision_many_times_slower_stops_after_its_first_block_of_timed_steps() -> None:
    fp32 = _timed([50.0, 50.5], [0, 0])
    end_warmup, stop = bench_stops.slower_than(bench_stops.FarBehind([0.05] * 10), fp32, "fp16")
    assert end_warmup([2.0, 0.7]) is not None  # its warm-up showed it first
    assert stop(_timed([700.0], [0])) is None  # one step supports no verdict
    reason = stop(_timed([700.0, 705.0], [0, 0]))
    assert reason.startswith(f"after {stats.MIN_STEPS_APART} timed steps, fp16 is 13.9")
    # every step must be beyond SETTLING_GAIN_LIMIT x fp32's median, not just the median
    within = bench_stops.SETTLING_GAIN_LIMIT * 50.25 * 0.99
    assert stop(_timed([700.0, within], [0, 0])) is None
    assert stop(_timed([700.0, within, 705.0], [0, 0, 1])) is None


def test_a_burst_of_other_work_in_one_moment_does_not_stop_a_precision_after_one_block() -> None:
    """Far behind in its timed steps but not in its warm-up, or the other way round: one of
    two moments seconds apart, so a burst of other work may have caused it."""
    fp32 = _timed([50.0, 50.5], [0, 0])
    end_warmup, stop = bench_stops.slower_than(bench_stops.FarBehind([0.05] * 10), fp32, "bf16")
    assert end_warmup([2.0, 0.06]) is None
    burst = [700.0, 705.0, 698.0, 702.0]
    assert all(stop(_timed(burst[:n], [0, 0, 1, 1][:n])) is None for n in (2, 3, 4))
    # ... still, five steps every one that far behind stop it, unpaired, as before
    fp32 = _timed([50.0, 50.5, 49.5, 49.8], [0, 0, 1, 1])
    _, stop = bench_stops.slower_than(bench_stops.FarBehind([0.05] * 10), fp32, "bf16")
    reason = stop(_timed([*burst, 701.0], [0, 0, 1, 1, 2]))
    assert reason.startswith(f"after {stats.MIN_SAMPLES_FOR_A_CLAIM} timed steps, bf16 is 14.")
    # a warm-up that was far behind, then a first block that is not: timed on
    end_warmup, stop = bench_stops.slower_than(
        bench_stops.FarBehind([0.05] * 10), _timed([50.0, 50.5], [0, 0]), "bf16"
    )
    assert end_warmup([2.0, 0.7]) is not None
    assert stop(_timed([40.0, 41.0], [0, 0])) is None


def test_the_warm_up_judges_a_precision_from_its_second_step_not_its_first() -> None:
    """The first step of a new model builds its primitives: alone, however slow, it ends
    nothing; from the second on, the fastest step is judged."""
    end_warmup, _ = bench_stops.slower_than(
        bench_stops.FarBehind([0.05] * 10), _timed([50.0], [0]), "fp16"
    )
    assert end_warmup([2.0]) is None
    assert end_warmup([2.0, 0.14]) is None  # within SETTLING_GAIN_LIMIT x 50 ms: may settle
    reason = end_warmup([2.0, 0.7])
    assert reason is not None and "its fastest warm-up step took 700.0 ms" in reason
    # without fp32 warm-up steps to compare with, never
    end_warmup, _ = bench_stops.slower_than(bench_stops.FarBehind([]), _timed([50.0], [0]), "fp16")
    assert end_warmup([2.0, 0.7]) is None


def _recording_steps(ran: list[str], clock: FakeClock):
    """Steps that note their name in `ran` and take 10 ms of `clock` each."""

    def step_of(name: str):
        def step() -> None:
            ran.append(name)
            clock.now += 0.01

        return step

    return step_of


def test_blocks_alternate_in_an_order_reversed_every_round(clock: FakeClock) -> None:
    ran: list[str] = []
    step_of = _recording_steps(ran, clock)
    timed = timing.interleaved_runs(
        {name: step_of(name) for name in "ABC"},
        "cpu",
        block_steps=2,
        max_steps=8,
        budget_s=100.0,
    )
    assert "".join(ran) == "AABBCCCCBBAAAABBCCCCBBAA"
    for name in "ABC":
        assert timed[name].rounds == [0, 0, 1, 1, 2, 2, 3, 3]
        assert timed[name].samples == pytest.approx([0.01] * 8)
        # over every two rounds each name sits as often early as late: its mean place is the middle
        places = [ran.index(name, 6 * r) // 2 - 3 * r for r in range(4)]
        assert sum(places) / len(places) == pytest.approx(1.0)


def test_model_instances_take_turns_by_abba_pairs_of_rounds(clock: FakeClock) -> None:
    ran: list[str] = []
    step_of = _recording_steps(ran, clock)
    timed = timing.interleaved_runs(
        {"A": [step_of("A0"), step_of("A1")], "B": [step_of("B0"), step_of("B1")]},
        "cpu",
        block_steps=1,
        max_steps=6,
        budget_s=100.0,
    )
    assert " ".join(ran) == "A0 B0 B0 A0 A1 B1 B1 A1 A0 B0 B0 A0"
    assert timed["A"].instances == timed["B"].instances == [0, 0, 1, 1, 0, 0]
    assert timed["A"].rounds == list(range(6))


def test_a_step_that_spent_its_budget_leaves_the_schedule_and_the_others_go_on(
    clock: FakeClock,
) -> None:
    def step_of(seconds: float):
        def step() -> None:
            clock.now += seconds

        return step

    timed = timing.interleaved_runs(
        {"slow": step_of(0.1), "fast": step_of(0.01)},
        "cpu",
        block_steps=3,
        max_steps=30,
        budget_s=0.5,
    )
    # slow spends 0.3 s per round: past 0.5 s after its second round, which still ends whole
    assert len(timed["slow"].samples) == 6 and timed["slow"].rounds == [0, 0, 0, 1, 1, 1]
    assert len(timed["fast"].samples) == 30 and timed["fast"].rounds[-1] == 9


def test_a_step_that_cannot_run_leaves_the_schedule_and_the_others_go_on(
    clock: FakeClock,
) -> None:
    calls = iter(range(100))

    def failing() -> None:
        if next(calls) == 4:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        clock.now += 0.01

    def fine() -> None:
        clock.now += 0.01

    timed = timing.interleaved_runs(
        {"fp32": fine, "bf16": failing},
        "cpu",
        block_steps=3,
        max_steps=9,
        budget_s=100.0,
        cannot_run=bench_record.cannot_run_reason,
    )
    assert timed["bf16"].failed.startswith("RuntimeError: CUDA out of memory")
    assert len(timed["bf16"].samples) == 4 and len(timed["fp32"].samples) == 9
    with pytest.raises(ValueError, match="a real bug"):

        def buggy() -> None:
            raise ValueError("a real bug")

        timing.interleaved_runs(
            {"x": buggy},
            "cpu",
            block_steps=1,
            max_steps=1,
            budget_s=1.0,
            cannot_run=bench_record.cannot_run_reason,
        )


def test_interleaved_runs_on_simulated_cuda_synchronize_around_every_step(fake_cuda) -> None:
    ran: list[tuple[str, int]] = []

    def step_of(name: str):
        return lambda: ran.append((name, len(fake_cuda.synchronized)))

    timed = timing.interleaved_runs(
        {"a": step_of("a"), "b": step_of("b")},
        torch.device("cuda", 1),
        block_steps=1,
        max_steps=2,
        budget_s=100.0,
    )
    assert [name for name, _ in ran] == ["a", "b", "b", "a"]
    # one synchronization before each step (none queued is timed) and one after it
    assert [synced for _, synced in ran] == [1, 3, 5, 7]
    assert fake_cuda.synchronized == [torch.device("cuda", 1)] * 8
    assert timed["a"].rounds == timed["b"].rounds == [0, 1]


def test_fp32_steps_that_judge_a_precision_on_simulated_cuda_are_synced_and_set_aside(
    fake_cuda,
) -> None:
    """Synchronized around each step as the timed ones; the judged precision's peak leaves
    them out; where they cannot run now (out of memory beside its model), no steps, so the
    judgement rests on fp32's warm-up rather than failing the precision."""
    memory = PeakMemory("cuda:0")

    def fp32_step() -> None:
        fake_cuda.allocate(300 * MB)
        fake_cuda.free(300 * MB)

    times = bench._reference_steps_now(fp32_step, torch.device("cuda", 0), memory)
    assert len(times) == bench_stops.FRESH_REFERENCE_STEPS
    assert fake_cuda.synchronized == [torch.device("cuda", 0)] * 2 * len(times)
    assert memory.peak_mb == 0.0

    def out_of_memory() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    assert bench._reference_steps_now(out_of_memory, torch.device("cuda", 0), memory) == []


def test_interleaved_runs_on_simulated_mps_synchronize_the_device(fake_mps) -> None:
    timing.interleaved_runs(
        {"a": lambda: None, "b": lambda: None}, "mps", block_steps=2, max_steps=2, budget_s=1.0
    )
    assert fake_mps.synchronized == 2 * 2 * 2


@pytest.mark.usefixtures("one_process")
def test_each_precisions_peak_leaves_out_the_models_warmed_before_it(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    """Every precision's model stays on the device while the blocks alternate: what the ones
    built before it hold is taken out of its peak (a device's allocated memory, simulated)."""
    fake_steps(monkeypatch, clock, {"fp32": 50.0, "fp16": 45.0, "bf16": 30.0})
    held = {"allocated_mb": 5.0}  # the batch, before any model
    build = bench.build_from_config

    def built(*args, **kwargs):
        held["allocated_mb"] += 10.0  # each model and its optimizer state
        return build(*args, **kwargs)

    excluded: dict[str, float] = {}

    class Spy(PeakMemory):
        def __init__(self, device, reader=None, exclude_mb: float = 0.0) -> None:
            super().__init__(device, reader, exclude_mb)
            excluded[f"model {len(excluded) + 1}"] = exclude_mb

    monkeypatch.setattr(bench, "build_from_config", built)
    monkeypatch.setattr(dev, "memory_stats", lambda device: dict(held))
    monkeypatch.setattr(dev, "PeakMemory", Spy)
    monkeypatch.setattr(bench._Shared, "numerics", lambda self, model, precision: None)
    settings = plan(numerics_steps=0, warmup_steps=1, steps=3)
    bench.run_backend(
        torch.device("cpu"), ["fp32", "fp16", "bf16"], ["train"], ["tiny_conv"], settings
    )
    assert excluded == {"model 1": 0.0, "model 2": 10.0, "model 3": 20.0}


def test_a_peak_leaves_out_what_other_precisions_models_hold(fake_cuda) -> None:
    fake_cuda.allocate(70 * MB)  # fp32's model and optimizer state, waiting for its blocks
    memory = PeakMemory("cuda:0", exclude_mb=70.0)
    fake_cuda.allocate(30 * MB)
    fake_cuda.free(30 * MB)
    assert memory.peak_mb == pytest.approx(30.0)


@pytest.mark.parametrize("fp16_ms", [50.0, 51.5, 40.0])
def test_a_precision_not_shown_slower_than_fp32_is_never_stopped(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, fp16_ms: float
) -> None:
    """As fast, a little slower (within the speed-up tolerance), or faster: timed in full."""
    fake_steps(monkeypatch, clock, {"fp32": 50.0, "fp16": fp16_ms})
    settings = plan(numerics_steps=0, warmup_steps=5, steps=30, time_budget_s=1000.0)
    settings["warmup_budget_s"] = 1000.0
    records = bench.run_backend(
        torch.device("cpu"), ["fp32", "fp16"], ["infer"], ["tiny_conv"], settings
    )
    timed = records[1]["timing"]
    assert timed["count"] == 30 and timed["stopped_early"] is None
    assert timed["warmup_ended_early"] is None


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux only")
def test_each_combination_reports_its_own_host_peak_not_the_largest_so_far() -> None:
    assert dev.reset_host_peak_rss() is True
    before = dev.host_peak_rss_mb()
    ballast = bytearray(200 * MB)
    ballast[::4096] = b"x" * len(ballast[::4096])  # resident, not only reserved
    del ballast
    assert dev.host_peak_rss_mb() > before + 150  # the peak so far holds the freed ballast
    assert dev.reset_host_peak_rss() is True
    assert dev.host_peak_rss_mb() < before + 50  # a fresh start forgets it


@pytest.mark.parametrize("backend", ["cuda", "mps"])
def test_bench_on_a_missing_backend_exits_2_with_the_device_error(
    tmp_path, capsys, backend: str
) -> None:
    if backend in available_backends():
        pytest.skip(f"this machine has {backend}")
    code, document = run_bench(tmp_path, "--device", backend, "--precision", "fp32")
    assert code == 2 and document is None
    err = capsys.readouterr().err
    assert f"Device '{backend}' is not available" in err
    assert f"Available backends: {available_backends()}" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "yolo"], "Unknown model(s) ['yolo']"),
        (["--image-size", "40"], "multiple of 32"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--instances", "0"], "--instances must be at least 1"),
        (["--time-budget", "0"], "--time-budget must be positive"),
        (["--mode", "train,infer"], "--out writes one precision and mode"),
    ],
)
def test_bench_with_bad_options_exits_2_without_traceback(
    tmp_path, capsys, args: list[str], message: str
) -> None:
    code, document = run_bench(tmp_path, "--device", "cpu", "--precision", "fp32", *args)
    assert code == 2 and document is None
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("option", "path", "message"),
    [
        (
            "--out-dir",
            "taken",
            "Could not create the folder {root}/taken (--out-dir): {root}/taken is a file",
        ),
        (
            "--out",
            "taken/bench.json",
            "Could not create the folder {root}/taken for --out {root}/taken/bench.json: "
            "{root}/taken is a file",
        ),
        (
            "--out",
            "folder",
            "--out {root}/folder is a folder: give --out the path of a file to write (in that "
            "folder, say). Nothing was written. Or give --out-dir {root}/folder for one "
            "BACKEND-PRECISION-MODE.json per precision and mode there.",
        ),
    ],
)
def test_an_output_path_that_cannot_be_written_is_refused_before_any_timing(
    tmp_path, capsys, monkeypatch: pytest.MonkeyPatch, option: str, path: str, message: str
) -> None:
    """A file where --out-dir's folder would go (or --out's folder, or a folder named by --out)
    was found only when the records were written, after minutes of timing."""
    (tmp_path / "taken").write_text("a file\n")
    (tmp_path / "folder").mkdir()
    monkeypatch.setattr(bench, "run_backend", lambda *args: pytest.fail("timing started"))
    command = ["bench", "--device", "cpu", "--precision", "fp32", option, str(tmp_path / path)]
    assert cli.main(command) == 2
    err = capsys.readouterr().err
    assert message.format(root=tmp_path) in err and "Traceback" not in err
    assert (tmp_path / "taken").read_text() == "a file\n"


def test_an_unknown_name_among_several_precisions_exits_2_naming_it(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as caught:
        run_bench_dir(tmp_path, "--device", "cpu", "--precision", "fp32,fp8,bf16")
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "argument --precision: invalid choice: 'fp8' (choose from fp32, fp16, bf16" in err
    assert not (tmp_path / "bench").exists()


def test_an_unsupported_precision_is_recorded_as_skipped_with_the_reason(
    tmp_path, validator, monkeypatch: pytest.MonkeyPatch
) -> None:
    reason = "fp16 autocast is not available in this test"
    monkeypatch.setattr(dev, "autocast_unsupported_reason", lambda device, precision: reason)
    record = one_record(tmp_path, validator, *TINY, "--precision", "fp16", "--steps", "1")
    assert record["status"] == "skipped" and record["reason"] == reason
    for key in ("timing", "throughput_images_per_s", "numerics", "memory", "conditions"):
        assert record[key] is None, key


def test_a_step_the_backend_cannot_run_is_recorded_as_skipped_with_the_error(
    tmp_path, validator, monkeypatch: pytest.MonkeyPatch
) -> None:
    def cannot_run(*args, **kwargs):
        def step() -> None:
            raise RuntimeError("\"addmm_impl_cpu_\" not implemented for 'Half'\nmore detail")

        return step

    monkeypatch.setattr(bench, "_step", cannot_run)
    record = one_record(tmp_path, validator, *TINY, "--precision", "fp16", "--mode", "train")
    assert record["status"] == "skipped"
    assert record["reason"] == "RuntimeError: \"addmm_impl_cpu_\" not implemented for 'Half'"
    assert record["timing"] is None and record["throughput_images_per_s"] is None


# --- simulated CUDA and MPS ------------------------------------------------------------------


def test_bf16_on_a_simulated_gpu_without_bf16_is_a_schema_valid_skipped_record(
    fake_cuda, validator
) -> None:
    fake_cuda.bf16 = False
    record = bench.run(torch.device("cuda", 0), "bf16", "train", "tiny_conv", plan())
    assert record["status"] == "skipped"
    assert "no bf16 support" in record["reason"]
    assert record["backend"] == "cuda" and record["device"] == "cuda:0"
    assert record["device_description"] == "CUDA: NVIDIA Fake A100, 80 GiB, sm_80"
    assert_valid(
        validator, json.loads(json.dumps({"format": bench_record.FORMAT, "records": [record]}))
    )


def test_mps_autocast_on_old_torch_is_a_skipped_record(
    fake_mps, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dev, "_torch_version", lambda: (2, 4))
    record = bench.run(torch.device("mps"), "fp16", "infer", "tiny_conv", plan())
    assert record["status"] == "skipped" and "needs torch >= 2.5" in record["reason"]
    assert record["backend"] == "mps"


def test_sampled_steps_give_the_exact_cuda_peak_of_the_timed_steps(fake_cuda) -> None:
    fake_cuda.allocate(100 * MB)  # before the measurement: reset forgets this peak
    fake_cuda.free(100 * MB)
    memory = PeakMemory("cuda:0")

    def step() -> None:
        fake_cuda.allocate(30 * MB)
        fake_cuda.free(30 * MB)

    samples, _ = timing.timed_runs(
        step, "cuda:0", warmup=1, max_steps=2, budget_s=0.5, memory=memory
    )
    assert len(samples) == 2
    assert fake_cuda.resets == [torch.device("cuda", 0)]
    assert memory.as_dict() == {
        "peak_mb": 30.0,
        "reserved_mb": 100.0,
        "exact": True,
        "label": "exact",
    }


def test_sampled_steps_give_a_labelled_lower_bound_on_mps(
    fake_mps, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dev, "_mps_accelerator_peak_available", lambda: False)
    sizes = iter([10, 40, 20])

    def step() -> None:
        fake_mps.allocated = next(sizes) * MB
        fake_mps.driver_allocated = 64 * MB

    memory = PeakMemory("mps")
    timing.timed_runs(step, "mps", warmup=0, max_steps=3, budget_s=100.0, memory=memory)
    assert memory.as_dict() == {
        "peak_mb": 40.0,
        "reserved_mb": 64.0,
        "exact": False,
        "label": "lower bound (sampled)",
    }


class FakeEvent:
    """A device event: `record()` reads the shared clock; elapsed_time is in milliseconds."""

    clock_ms: ClassVar[float] = 0.0
    created: ClassVar[list[FakeEvent]] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing, "timing events must be created with enable_timing=True"
        self.recorded_at: float | None = None
        self.recorded_on: list[FakeStream | None] = []
        self.synchronized = False
        FakeEvent.created.append(self)

    def record(self, stream: FakeStream | None = None) -> None:
        self.recorded_at = FakeEvent.clock_ms
        self.recorded_on.append(stream)

    def synchronize(self) -> None:
        self.synchronized = True

    def elapsed_time(self, end: FakeEvent) -> float:
        assert end.synchronized, "elapsed_time before the end event completed"
        return end.recorded_at - self.recorded_at


@dataclass(frozen=True)
class FakeStream:
    """A CUDA stream, known by the device it belongs to."""

    device: torch.device


def current_stream(device: torch.device | str | int | None = None) -> FakeStream:
    """torch.cuda.current_stream: without a device, the current device's, which is cuda:0."""
    if device is None:
        return FakeStream(torch.device("cuda", 0))
    if isinstance(device, int):
        return FakeStream(torch.device("cuda", device))
    device = torch.device(device)
    return FakeStream(device if device.index is not None else torch.device("cuda", 0))


@pytest.fixture
def fake_events(monkeypatch: pytest.MonkeyPatch) -> type[FakeEvent]:
    FakeEvent.clock_ms, FakeEvent.created = 0.0, []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.mps, "Event", FakeEvent, raising=False)
    return FakeEvent


@pytest.mark.parametrize("backend", ["cuda", "mps"])
def test_device_timer_reports_the_event_time_between_start_and_stop(
    fake_cuda, fake_mps, fake_events, backend: str
) -> None:
    timer = DeviceTimer(backend)
    assert timer.available is True and len(fake_events.created) == 2
    fake_events.clock_ms = 5.0
    timer.start()
    fake_events.clock_ms = 12.5
    assert timer.stop_ms() == 7.5
    fake_events.clock_ms = 20.0
    timer.start()
    fake_events.clock_ms = 21.0
    assert timer.stop_ms() == 1.0  # the same pair of events is reused


@pytest.mark.parametrize("spec", ["cuda:1", "cuda:0", "cuda"])
def test_device_timer_records_on_the_stream_of_the_timed_device(
    fake_cuda, fake_events, spec: str
) -> None:
    """Recorded without a stream, events land on the current device's stream (cuda:0), which
    is idle during a run on cuda:1: the timer would read about 0 ms."""
    timer = DeviceTimer(spec)
    timer.start()
    timer.stop_ms()
    expected = current_stream(torch.device(spec))
    assert [event.recorded_on for event in fake_events.created] == [[expected], [expected]]


def test_device_timer_has_no_events_on_cpu_or_on_mps_without_event_support(
    fake_mps, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu = DeviceTimer("cpu")
    cpu.start()
    assert cpu.available is False and cpu.stop_ms() is None
    monkeypatch.delattr(torch.mps, "Event", raising=False)
    assert DeviceTimer("mps").available is False
