"""The CPU bench's model instances timed in forked children (`pipeline.bench_fork`): records as
one process makes them, instance ids and rounds merged in schedule order, a precision stopped
in one child not run in later ones, a child's failure named, CUDA and MPS never forked.

Simulated step times (monkeypatches and the fake clock are inherited by a forked child), so
the real fork path runs; this process stays at one thread, as a child forked after OpenMP
work with several threads hangs."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_clock import FakeClock

from pipeline import bench, bench_fork, bench_record, bench_schedule, cli
from pipeline.config import load_config
from pipeline.errors import ConfigError

pytestmark = pytest.mark.usefixtures(
    "torch_flags_threads_and_logger", "no_backend_env", "restore_pipeline_logger"
)

# the speed mode of model instance k (seed k), alike for every precision
MODES = [1.0, 1.25, 0.9, 1.1, 0.95, 1.05]


def plan(**bench_keys: Any) -> dict[str, Any]:
    keys = {"batch_size": 2, "image_size": 32, "numerics_steps": 0, **bench_keys}
    config = load_config(None, ["model.width=8", *(f"bench.{k}={v}" for k, v in keys.items())])
    settings = bench_record.settings_from_config(config, num_classes=4)
    settings["warmup_budget_s"] = 1000.0
    return settings


def seeded_steps(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, ms: dict[str, Any], log: Path
) -> None:
    """Steps of `ms[precision]` (or its item `seed`) x the speed mode of the instance's
    seed, the same on every
    call (so one process and forked children time exactly alike); every model built is
    logged to `log` as 'pid precision seed' (a child's writes reach the file)."""

    def fake_step(model, images, targets, device, precision, mode, settings, layout):
        seed = torch.initial_seed()
        with open(log, "a") as sink:
            sink.write(f"{os.getpid()} {precision} {seed}\n")

        own = ms[precision][seed] if isinstance(ms[precision], list) else ms[precision]

        def step() -> None:
            clock.now += own / 1000 * MODES[seed]

        return step

    monkeypatch.setattr(bench, "_step", fake_step)
    acceptable = {"acceptable": True, "problem": None}
    monkeypatch.setattr(bench._Shared, "numerics", lambda self, model, precision: acceptable)


def built(log: Path) -> list[tuple[int, str, int]]:
    lines = log.read_text().split("\n") if log.exists() else []
    return [(int(pid), p, int(seed)) for pid, p, seed in (line.split() for line in lines if line)]


def _numbers(value: Any) -> bool:
    items = value if isinstance(value, list) else [value]
    return all(isinstance(v, float) for v in items) and bool(items)


def bench_both_ways(monkeypatch, precisions: list[str], settings: dict[str, Any]):
    """The records of one process and of forked children, from the same simulated steps."""
    monkeypatch.setattr(bench, "FORK_CPU_INSTANCES", False)
    alone = bench.run_backend(torch.device("cpu"), precisions, ["train"], ["tiny_conv"], settings)
    monkeypatch.setattr(bench, "FORK_CPU_INSTANCES", True)
    forked = bench.run_backend(torch.device("cpu"), precisions, ["train"], ["tiny_conv"], settings)
    return alone, forked


# what differs between two runs whatever the process: when, where, and the host's real memory
DIFFER = {"created", "conditions", "memory", "host_peak_rss_mb"}


@pytest.mark.parametrize("steps", [30, 25])
def test_forked_instances_give_the_records_one_process_gives_with_rounds_merged_in_order(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, tmp_path: Path, steps: int
) -> None:
    log = tmp_path / "built.txt"
    seeded_steps(monkeypatch, clock, {"fp32": 50.0, "bf16": 50.0 / 1.5}, log)
    settings = plan(warmup_steps=5, steps=steps, time_budget_s=1000.0, instances=3)
    alone, forked = bench_both_ways(monkeypatch, ["fp32", "bf16"], settings)
    builds = built(log)
    in_process = builds[:6]
    assert {pid for pid, _, _ in in_process} == {os.getpid()}
    children = builds[6:]
    # instance k of every precision in the k-th child, none in this process
    assert [(p, k) for _, p, k in children] == [(p, k) for k in range(3) for p in ("fp32", "bf16")]
    pids = [pid for pid, _, _ in children]
    assert os.getpid() not in pids and len(set(pids)) == 3
    assert pids[0::2] == pids[1::2]  # fp32 and bf16 of one instance share a child
    for one, other in zip(alone, forked, strict=True):
        assert set(one) == set(other)
        assert {k: v for k, v in one.items() if k not in DIFFER | {"timing"}} == {
            k: v for k, v in other.items() if k not in DIFFER | {"timing"}
        }
        ids = one["timing"].pop("schedule_id"), other["timing"].pop("schedule_id")
        assert ids[0] != ids[1]
        # samples, rounds, instances (in the rounds' order), warm-ups alike
        assert set(other["timing"]) == set(one["timing"])
        for key, value in one["timing"].items():
            assert other["timing"][key] == (pytest.approx(value) if _numbers(value) else value)
        assert other["timing"]["count"] == steps and other["timing"]["instances_timed"] == 3
        assert other["conditions"]["started"] and other["memory"] is not None


def test_a_hopeless_precision_runs_in_the_first_child_only_and_keeps_its_record(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, tmp_path: Path
) -> None:
    log = tmp_path / "built.txt"
    seeded_steps(monkeypatch, clock, {"fp32": 50.0, "bf16": 30.0, "fp16": 700.0}, log)
    settings = plan(warmup_steps=5, steps=30, time_budget_s=1000.0, instances=3)
    records = bench.run_backend(
        torch.device("cpu"), ["fp32", "fp16", "bf16"], ["train"], ["tiny_conv"], settings
    )
    builds = built(log)
    assert [(p, k) for _, p, k in builds if p == "fp16"] == [("fp16", 0)]
    first_child = {pid for pid, p, k in builds if k == 0}
    assert len(first_child) == 1 and os.getpid() not in first_child
    assert [k for _, p, k in builds if p == "bf16"] == [0, 1, 2]
    slow = next(r for r in records if r["precision"] == "fp16")["timing"]
    assert slow["rounds"] == [0, 0] and slow["instances"] == [0, 0]
    assert slow["stopped_early"] and "more than settling gains" in slow["warmup_ended_early"]
    fast = next(r for r in records if r["precision"] == "bf16")["timing"]
    assert fast["count"] == 30 and fast["instances_timed"] == 3


def test_a_precision_stopped_in_a_later_child_is_not_built_in_the_ones_after_it(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, tmp_path: Path
) -> None:
    """Slower than fp32 but never far behind, and an ABBA pair of rounds per instance: too few
    rounds in the first child for a verdict, so the stop rule of a later child, seeing every
    sample before it, ends its timing there."""
    log = tmp_path / "built.txt"
    seeded_steps(monkeypatch, clock, {"fp32": 50.0, "fp16": 75.0}, log)
    settings = plan(warmup_steps=5, steps=24, time_budget_s=1000.0, instances=6)
    records = bench.run_backend(
        torch.device("cpu"), ["fp32", "fp16"], ["train"], ["tiny_conv"], settings
    )
    slow = records[1]["timing"]
    assert slow["stopped_early"].endswith("so it cannot be the faster precision")
    last = max(slow["instances"])
    assert 1 <= last < 5 and slow["count"] < 24
    builds = built(log)
    assert [k for _, p, k in builds if p == "fp16"] == list(range(last + 1))
    assert [k for _, p, k in builds if p == "fp32"] == list(range(6))
    assert records[0]["timing"]["count"] == 24 and records[0]["timing"]["instances_timed"] == 6


def failing_step(monkeypatch: pytest.MonkeyPatch, clock: FakeClock, what) -> None:
    """Steps of 50 ms, but instance 1's does `what` (raise, hang, die)."""

    def fake_step(model, images, targets, device, precision, mode, settings, layout):
        seed = torch.initial_seed()

        def step() -> None:
            if seed == 1:
                what()
            clock.now += 0.05

        return step

    monkeypatch.setattr(bench, "_step", fake_step)


def test_a_childs_error_stops_the_bench_with_its_message_and_writes_nothing(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, tmp_path: Path
) -> None:
    def bug() -> None:
        raise ValueError("a bug in the second model instance's step")

    failing_step(monkeypatch, clock, bug)
    out = tmp_path / "bench"
    argv = ["bench", "--cpu-threads", "1", "--device", "cpu", "--model", "tiny_conv"]
    argv += ["--batch-size", "2", "--image-size", "32", "--precision", "fp32,bf16"]
    argv += ["--mode", "train", "--steps", "8", "--instances", "2", "--out-dir", str(out)]
    with pytest.raises(bench_fork.ChildFailed) as failed:
        cli.main(argv)
    message = str(failed.value)
    assert "tiny_conv train model instance 1 failed" in message
    assert "ValueError: a bug in the second model instance's step" in message
    assert not out.exists() or not list(out.glob("*.json"))


def test_a_child_that_hangs_is_killed_at_its_timeout_and_named(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    failing_step(monkeypatch, clock, lambda: time.sleep(60))
    monkeypatch.setattr(bench_fork, "child_timeout_s", lambda settings, precisions: 2.0)
    settings = plan(warmup_steps=1, steps=8, time_budget_s=1000.0, instances=2)
    started = time.monotonic()
    with pytest.raises(
        bench_fork.ChildFailed, match="model instance 1 ran past 2 s and was killed"
    ):
        bench.run_backend(torch.device("cpu"), ["fp32"], ["train"], ["tiny_conv"], settings)
    assert time.monotonic() - started < 30


def test_a_child_that_dies_without_a_result_is_named_with_its_status(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    failing_step(monkeypatch, clock, lambda: os._exit(3))
    settings = plan(warmup_steps=1, steps=8, time_budget_s=1000.0, instances=2)
    with pytest.raises(bench_fork.ChildFailed, match="instance 1 ended with status 3"):
        bench.run_backend(torch.device("cpu"), ["fp32"], ["train"], ["tiny_conv"], settings)


def test_a_users_error_in_a_child_is_raised_here_as_it_is(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    def wrong() -> None:
        raise ConfigError("bench.steps=7 is wrong: give an even number.")

    failing_step(monkeypatch, clock, wrong)
    settings = plan(warmup_steps=1, steps=8, time_budget_s=1000.0, instances=2)
    with pytest.raises(ConfigError, match=r"^bench.steps=7 is wrong: give an even number.$"):
        bench.run_backend(torch.device("cpu"), ["fp32"], ["train"], ["tiny_conv"], settings)


@pytest.mark.parametrize("backend", ["fake_cuda", "fake_mps", "cpu, fork=False", "cpu on macOS"])
def test_cuda_mps_and_a_cpu_told_not_to_fork_time_their_instances_in_this_process(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, backend: str
) -> None:
    """Nor does a CPU where forking is unsafe (macOS: its system libraries' threads)."""
    if backend.startswith("fake"):
        request.getfixturevalue(backend)
    device = {"fake_cuda": torch.device("cuda", 0), "fake_mps": torch.device("mps")}.get(
        backend, torch.device("cpu")
    )
    fork = {"fork": False} if backend == "cpu, fork=False" else {}
    if backend == "cpu on macOS":
        monkeypatch.setattr(sys, "platform", "darwin")
    prepared: list[tuple[int, str, list[int]]] = []

    def prepare(shared, precisions, mode, model_name, instances, records, ready):
        prepared.append((os.getpid(), shared.device.type, list(instances)))
        for precision in precisions:
            record = bench_record.base_record(device, precision, mode, model_name, shared.settings)
            records[precision] = record
            bench_record.skipped(record, "simulated")

    def no_fork(*args, **kwargs):
        raise AssertionError("forked")

    monkeypatch.setattr(bench, "_prepare", prepare)
    monkeypatch.setattr(bench_fork, "in_child", no_fork)
    settings = plan(warmup_steps=1, steps=8, instances=2)
    records = bench.run_backend(device, ["fp32"], ["train"], ["tiny_conv"], settings, **fork)
    assert prepared == [(os.getpid(), device.type, [0, 1])]
    assert records[0]["reason"] == "simulated"
    monkeypatch.setattr(sys, "platform", "linux")
    with pytest.raises(AssertionError, match="forked"):  # where the CPU bench forks
        bench.run_backend(torch.device("cpu"), ["fp32"], ["train"], ["tiny_conv"], settings)


def test_the_time_budget_bounds_the_children_together_as_it_bounds_one_process(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, tmp_path: Path
) -> None:
    """Each child may spend the budget's share of the steps timed so far, less what the
    children before it spent: the total stays within a block of the budget, as in one process,
    and the steps reach every instance rather than the first ones."""
    seeded_steps(monkeypatch, clock, {"fp32": 50.0, "bf16": 40.0}, tmp_path / "built.txt")
    settings = plan(warmup_steps=5, steps=60, time_budget_s=0.5, instances=6)
    alone, forked = bench_both_ways(monkeypatch, ["fp32", "bf16"], settings)
    for one, other in zip(alone, forked, strict=True):
        timed = other["timing"]
        spent_s = sum(timed["samples_ms"]) / 1000
        assert one["timing"]["budget_limited"] and timed["budget_limited"]
        assert 0.5 < spent_s <= 0.5 + bench_schedule.BLOCK_STEPS * max(timed["samples_ms"]) / 1000
        assert abs(timed["count"] - one["timing"]["count"]) <= bench_schedule.BLOCK_STEPS
        assert timed["instances_timed"] > one["timing"]["instances_timed"]


def test_the_parent_imports_what_a_first_training_step_would_import_in_every_child() -> None:
    """In a fresh process: after `import_before_forking`, building the bench's first training
    step imports no large package (torch._dynamo, sympy) that each child would import again."""
    script = (
        "import sys, torch\n"
        "from pipeline import bench, bench_fork, bench_record\n"
        "from pipeline.config import load_config\n"
        "from pipeline.models import build_from_config\n"
        "settings = bench_record.settings_from_config(load_config(None, ['model.width=8']), 4)\n"
        "bench_fork.import_before_forking()\n"
        "before = set(sys.modules)\n"
        "model = build_from_config({**settings['model_options'], 'name': 'tiny_conv'}, 4)\n"
        "bench._step(model, None, None, torch.device('cpu'), 'fp32', 'train', settings,\n"
        "            torch.contiguous_format)\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    imported = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    heavy = [name for name in imported if name.split(".")[0] in ("sympy", "mpmath")]
    assert not heavy and not [name for name in imported if name.startswith("torch._dynamo")]
