"""Shared fixtures: simulated CUDA and MPS hardware, so every device branch runs on a CPU-only machine."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fake_clock import FakeClock

from pipeline import atomic, formats, timing


class FakeCuda:
    """State behind the torch.cuda functions that `fake_cuda` replaces; tests change it freely."""

    def __init__(self) -> None:
        self.names = ["NVIDIA Fake A100", "NVIDIA Fake H100"]
        self.capabilities = [(8, 0), (9, 0)]
        self.multiprocessors = [108, 132]
        self.total_memory = 80 * 1024**3
        self.bf16 = True
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.resets: list[object] = []
        self.synchronized: list[object] = []

    @property
    def count(self) -> int:
        return len(self.names)

    def allocate(self, n_bytes: int) -> None:
        self.allocated += n_bytes
        self.reserved = max(self.reserved, self.allocated)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, n_bytes: int) -> None:
        self.allocated -= n_bytes

    def reset_peak(self, device: object = None) -> None:
        self.resets.append(device)
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved

    def properties(self, device: object = None) -> SimpleNamespace:
        if isinstance(device, torch.device):
            device = device.index
        index = 0 if device is None else int(device)
        if not 0 <= index < self.count:
            raise AssertionError(f"Invalid device id {index}")  # what torch raises
        major, minor = self.capabilities[index]
        return SimpleNamespace(
            name=self.names[index],
            total_memory=self.total_memory,
            major=major,
            minor=minor,
            multi_processor_count=self.multiprocessors[index],
        )


class FakeMps:
    """State behind the torch.mps functions that `fake_mps` replaces."""

    def __init__(self) -> None:
        self.allocated = 0
        self.driver_allocated = 0
        self.recommended_max = 16 * 1024**3
        self.synchronized = 0


@pytest.fixture
def no_backend_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clear the variables that hide backends, so a developer's shell cannot change the results."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("PIPELINE_DISABLE_BACKENDS", raising=False)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch, no_backend_env: None) -> FakeCuda:
    """Two simulated CUDA GPUs with memory counters; set `.names = []` for a build without devices."""
    fake = FakeCuda()
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: fake.count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: fake.count)
    monkeypatch.setattr(
        torch.cuda, "get_device_name", lambda device=None: fake.properties(device).name
    )
    monkeypatch.setattr(torch.cuda, "get_device_properties", fake.properties)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: fake.bf16)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: fake.allocated)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: fake.reserved)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: fake.peak_allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: fake.peak_reserved)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset_peak)
    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda device=None: fake.synchronized.append(device)
    )
    return fake


@pytest.fixture
def fake_mps(monkeypatch: pytest.MonkeyPatch, no_backend_env: None) -> FakeMps:
    """A simulated Apple GPU: MPS built and available, with the torch.mps memory readers."""
    fake = FakeMps()
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "current_allocated_memory", lambda: fake.allocated)
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: fake.driver_allocated)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: fake.recommended_max)

    def synchronize() -> None:
        fake.synchronized += 1

    monkeypatch.setattr(torch.mps, "synchronize", synchronize)
    return fake


@pytest.fixture
def two_torch_threads() -> Iterator[None]:
    """Torch on two threads, as a 2-CPU machine runs it, whatever this one has; restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch, no_backend_env: None) -> None:
    """A CUDA build of torch that sees no GPU, whatever the real machine has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def no_mps(monkeypatch: pytest.MonkeyPatch, no_backend_env: None) -> None:
    """A torch without MPS, whatever the real machine has."""
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


@pytest.fixture
def restore_pipeline_logger() -> Iterator[None]:
    """`cli.main` points the 'pipeline' logger at the current stderr; undo that after the test."""
    logger = logging.getLogger("pipeline")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    for handler in logger.handlers:
        if handler not in saved[0]:
            handler.close()
    logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]


@pytest.fixture
def pipeline_log(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> pytest.LogCaptureFixture:
    """caplog for the 'pipeline' logger, also after `cli.main` has stopped its propagation."""
    monkeypatch.setattr(logging.getLogger("pipeline"), "propagate", True)
    caplog.set_level(logging.INFO, logger="pipeline")
    return caplog


@pytest.fixture
def report_file(tmp_path: Path, restore_pipeline_logger: None) -> Path:
    """report.html that `python -m pipeline report` writes from report_fixtures' results tree."""
    from report_fixtures import write_results_tree

    from pipeline import cli

    out = tmp_path / "report.html"
    results = write_results_tree(tmp_path)
    assert cli.main(["report", "--results", str(results), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def checked_env(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A fresh copy of the repository whose environment check ran for real (results/env.json
    decides the runs), and that run: the venv's snakemake called by path, the venv not activated,
    a `python` that fails first on PATH (tests/test_workflow.py checks it ran no job). One
    check for every test that needs one: take a copy (test_workflow.copy_checked_env) to run or edit in."""
    from test_workflow import BIN, copy_repository

    folder = tmp_path_factory.mktemp("checked-env")
    root = copy_repository(folder / "repo")
    decoys = folder / "decoys"
    decoys.mkdir()
    for name in ("python", "python3"):
        (decoys / name).write_text("#!/bin/sh\necho 'the python on PATH ran a job' >&2\nexit 1\n")
        (decoys / name).chmod(0o755)
    env = {**os.environ, "PATH": os.pathsep.join([str(decoys), "/usr/bin", "/bin"])}
    result = subprocess.run(
        [str(BIN / "snakemake"), "--cores", "1", "results/env.json"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return root, result


@pytest.fixture(scope="module")
def torch_flags_threads_and_logger() -> Iterator[None]:
    """For a module that trains or runs models (by name: `pytestmark =
    pytest.mark.usefixtures("torch_flags_threads_and_logger")`): one torch thread throughout,
    and torch's global flags and the 'pipeline' logger put back after it (tests/tiny_runs.py)."""
    from tiny_runs import global_torch_state, one_cpu_thread, pipeline_logger_restored

    with global_torch_state(), one_cpu_thread(), pipeline_logger_restored():
        yield


@pytest.fixture(autouse=True)
def written_documents_match_their_schemas(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every JSON document with a format tag that code under test writes (atomic.write_json)
    is checked against its format's schema (src/pipeline/schemas), so that no writer drifts from
    the format it documents; tests/test_workflow.py checks the files a real workflow wrote."""
    write_json = atomic.write_json

    def checked(path, data, **options):
        document = atomic.jsonable(data)
        tag = document.get("format") if isinstance(document, dict) else None
        name = formats.name_for_tag(tag) if isinstance(tag, str) else None
        if name is not None:
            problem = formats.problem(document, name)
            assert problem is None, f"{path} {problem}"
        return write_json(path, data, **options)

    monkeypatch.setattr(atomic, "write_json", checked)


_CACHE_DIR_BEFORE = pytest.StashKey[str | None]()


def pytest_configure(config: pytest.Config) -> None:
    """The import graph's cache (pipeline.import_graph.user_cache) in a folder of this run for
    every Snakemake the tests start, set before collection (modules copy os.environ into the
    environments they start Snakemake with): the suite leaves the user's cache as it was."""
    from pipeline.import_graph import CACHE_DIR_ENV

    config.stash[_CACHE_DIR_BEFORE] = os.environ.get(CACHE_DIR_ENV)
    os.environ[CACHE_DIR_ENV] = tempfile.mkdtemp(prefix="pipeline-cache-")


def pytest_unconfigure(config: pytest.Config) -> None:
    from pipeline.import_graph import CACHE_DIR_ENV

    shutil.rmtree(os.environ[CACHE_DIR_ENV], ignore_errors=True)
    before = config.stash[_CACHE_DIR_BEFORE]
    if before is None:
        del os.environ[CACHE_DIR_ENV]
    else:
        os.environ[CACHE_DIR_ENV] = before


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the SLURM test last: it purges the SLURM packages it installed, but where SLURM was
    installed before, it only stops the daemons, and there, with the cluster extra installed,
    every Snakemake start waits 10 s for `scontrol` (the SLURM plugin calls it at import; see
    tests/test_install.py)."""
    items.sort(key=lambda item: Path(str(item.fspath)).name == "test_slurm.py")


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """`timing`'s perf_counter replaced by a FakeClock the test moves."""
    fake = FakeClock()
    monkeypatch.setattr(
        timing, "time", SimpleNamespace(perf_counter=fake, process_time=time.process_time)
    )
    return fake
