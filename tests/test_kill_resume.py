"""Crashes and resumes of a real training process, and the guard that keeps outputs atomic.

SIGINT and SIGTERM stop training with one log line and a loadable last.pth; SIGKILL at
seeded random moments, each followed by `train --resume`, ends bit-identical to a run
that was never interrupted. Resume granularity is one epoch: last.pth is written after
each, and a resume drops the metric rows of the epoch it repeats.
"""

from __future__ import annotations

import ast
import json
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_runs import global_torch_state, make_data, one_cpu_thread, tiny_config, tiny_settings

from pipeline.engine import checkpoint
from pipeline.engine.trainer import Trainer

SRC = Path(__file__).resolve().parents[1] / "src" / "pipeline"
# Fields of metrics rows that measure time or memory, and so differ between runs.
MEASURED = {"step_time_s", "epoch_time_s", "images_per_s", "memory", "host_peak_rss_mb"}
STEP_LINE = re.compile(r" INFO epoch (\d+)/\d+ step ")
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("data") / "shapes")


@contextmanager
def sigint_not_ignored() -> Iterator[None]:
    """A child inherits an ignored SIGINT (as under `nohup` or a shell's `&`), and Python then
    raises no KeyboardInterrupt; a handled SIGINT is reset to the default in the child."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if previous is signal.SIG_IGN:
            signal.signal(signal.SIGINT, previous)


class Training:
    """`python -m pipeline --log LOG train --out RUN ...` as a child process."""

    def __init__(self, run: Path, data_root: Path, epochs: int, *extra: str) -> None:
        self.run, self.log = run, run.parent / f"{run.name}.log"
        self.stderr_path = run.parent / f"{run.name}.stderr"
        command = [sys.executable, "-m", "pipeline", "--cpu-threads", "1", "--log", str(self.log)]
        command += ["train", "--out", str(run), *extra]
        command += tiny_settings(data_root, f"train.epochs={epochs}")
        self.log.unlink(missing_ok=True)
        with sigint_not_ignored(), open(self.stderr_path, "w") as stderr:
            self.process = subprocess.Popen(
                command, cwd=run.parent, stdout=subprocess.DEVNULL, stderr=stderr
            )

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def epoch_seen(self) -> int:
        """The highest epoch the log has shown a step of (0 before training starts)."""
        text = self.log.read_text() if self.log.exists() else ""
        return max((int(m.group(1)) for m in STEP_LINE.finditer(text)), default=0)

    def wait_for_epoch(self, epoch: int) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while self.epoch_seen() < epoch:
            if self.process.poll() is not None:
                pytest.fail(f"training ended before epoch {epoch}:\n{self.stderr[-3000:]}")
            if time.monotonic() > deadline:
                self.process.kill()
                pytest.fail(
                    f"no step of epoch {epoch} within {TIMEOUT_S} s:\n{self.stderr[-3000:]}"
                )
            time.sleep(0.01)

    def wait(self) -> int:
        try:
            return self.process.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            pytest.fail(f"training did not end within {TIMEOUT_S} s:\n{self.stderr[-3000:]}")


def temp_files(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if path.name.endswith(".tmp"))


def rows(run: Path) -> list[dict[str, Any]]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [
        {key: value for key, value in json.loads(line).items() if key not in MEASURED}
        for line in lines
    ]


def model_state(path: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load(path)["model"]


# --- SIGINT and SIGTERM --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "status", "word"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")],
    ids=["SIGINT", "SIGTERM"],
)
def test_a_signal_mid_run_exits_with_one_line_keeps_last_pth_and_resume_finishes(
    tmp_path: Path, data_root: Path, signum: int, status: int, word: str
) -> None:
    # signalled at the first step of epoch 2, two epochs before the end: still training when
    # the signal lands, and the resume trains what is left (epochs 2 to 4, or 3 and 4)
    epochs = 4
    run = tmp_path / "run"
    training = Training(run, data_root, epochs)
    training.wait_for_epoch(2)  # epoch 1 finished: its last.pth is written before epoch 2 starts
    training.process.send_signal(signum)
    assert training.wait() == status, training.stderr[-3000:]
    stderr = training.stderr
    assert "Traceback" not in stderr
    assert stderr.rstrip().splitlines()[-1].endswith(f" ERROR {word}")
    assert training.log.read_text().rstrip().splitlines()[-1].endswith(f" ERROR {word}")
    state = checkpoint.load(run / "last.pth")
    assert 1 <= state["epoch"] < epochs
    assert temp_files(run) == []
    assert not (run / "train_summary.json").exists()

    resumed = Training(run, data_root, epochs, "--resume")
    assert resumed.wait() == 0, resumed.stderr[-3000:]
    assert f"resumed from {run / 'last.pth'} after epoch {state['epoch']}" in resumed.stderr
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["epochs"] == epochs
    assert [row["epoch"] for row in rows(run) if row["type"] == "epoch"] == list(
        range(1, epochs + 1)
    )


# --- SIGKILL -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_ends_bit_identical_to_an_uninterrupted_run(
    tmp_path: Path, data_root: Path
) -> None:
    epochs = 12
    reference = Training(tmp_path / "reference", data_root, epochs)  # runs alongside, on core 2
    run = tmp_path / "run"
    rng = random.Random(1234)
    # one kill in each third of the run: wait for a step of a random epoch, then a random delay
    # of up to a few epochs, so kills land in training steps, validation and checkpoint writes
    moments = [(rng.randint(lo, hi), rng.uniform(0.0, 0.3)) for lo, hi in ((1, 3), (4, 7), (8, 10))]
    outcomes, leftovers = [], []
    for epoch, delay in moments:
        resume = ["--resume"] if (run / "last.pth").exists() else []
        training = Training(run, data_root, epochs, *resume)
        training.wait_for_epoch(epoch)
        time.sleep(delay)
        training.process.send_signal(signal.SIGKILL)
        outcomes.append(training.wait())
        leftovers += temp_files(run)
        for name in ("last.pth", "best.pth"):
            if (run / name).exists():
                assert checkpoint.load(run / name)["epoch"] <= epochs
    assert -signal.SIGKILL in outcomes, f"every kill came after the run had ended: {moments}"

    final = Training(run, data_root, epochs, *(["--resume"] if (run / "last.pth").exists() else []))
    assert final.wait() == 0, final.stderr[-3000:]
    assert reference.wait() == 0, reference.stderr[-3000:]
    assert temp_files(run) == [], f"fit() removes stale temp files; the kills left {leftovers}"

    for name in ("best.pth", "last.pth"):
        got, expected = model_state(run / name), model_state(tmp_path / "reference" / name)
        assert set(got) == set(expected)
        assert [key for key in expected if not torch.equal(got[key], expected[key])] == [], name
    assert rows(run) == rows(tmp_path / "reference")
    epoch_rows = [row for row in rows(run) if row["type"] == "epoch"]
    assert [row["epoch"] for row in epoch_rows] == list(range(1, epochs + 1))
    summary = json.loads((run / "train_summary.json").read_text())
    expected_summary = json.loads((tmp_path / "reference" / "train_summary.json").read_text())
    for key in ("epochs", "steps", "best_epoch", "best_metric", "final_val"):
        assert summary[key] == expected_summary[key], key


def test_fit_removes_stale_temp_files_of_interrupted_writes_and_nothing_else(
    tmp_path: Path, data_root: Path
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    stale = [run / ".last.pth.0123456789ab.tmp", run / ".metrics.jsonl.a1b2c3d4e5f6.tmp"]
    kept = [run / "notes.tmp", run / ".hidden", run / "last.pth.tmp.keep"]
    for path in stale + kept:
        path.write_bytes(b"half a file")
    with global_torch_state(), one_cpu_thread():
        Trainer(tiny_config(data_root, "train.epochs=1"), run).fit()
    assert [path.name for path in stale if path.exists()] == []
    assert [path.name for path in kept if not path.exists()] == []
    assert checkpoint.load(run / "last.pth")["epoch"] == 1


# --- every output is written atomically ----------------------------------------------------------

# Calls that write a file named by one of their arguments.
SAVING_CALLS = {"dump", "save", "savefig", "export_chrome_trace", "to_csv", "to_json", "to_html"}
# Modules whose `open(path, mode)` takes the mode second; on anything else (a Path) it is first.
OPEN_FUNCTIONS = {"io", "gzip", "bz2", "lzma", "codecs", "builtins"}
# Modules whose writers are atomic themselves (checkpoint.save goes through atomic.write_with;
# atomic.append_line adds whole lines to metrics.jsonl, which a resume cuts back).
ATOMIC_MODULES = {"atomic", "checkpoint"}


def _is_bytesio(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute | ast.Name)
        and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "BytesIO"
    )


def _open_mode(call: ast.Call) -> str | None:
    for keyword in call.keywords:
        if keyword.arg == "mode" and isinstance(keyword.value, ast.Constant):
            return str(keyword.value.value)
    func = call.func
    index = (
        0
        if isinstance(func, ast.Attribute)
        and not (isinstance(func.value, ast.Name) and func.value.id in OPEN_FUNCTIONS)
        else 1
    )
    if len(call.args) > index and isinstance(call.args[index], ast.Constant):
        return str(call.args[index].value)
    return None


def direct_writes(source: str, name: str) -> list[str]:
    """Calls that write an output path directly instead of through pipeline.atomic.

    Safe targets: `tmp` (the temporary file `atomic.write_with` hands its callback), a file
    opened on it (`with open(tmp, "wb") as handle`), in-memory `io.BytesIO` buffers and the
    kernel's control files under /proc (a request to the kernel, not an output).
    """
    tree = ast.parse(source)
    in_memory = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and _is_bytesio(node.value)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    opened_on_tmp = {
        item.optional_vars.id
        for node in ast.walk(tree)
        if isinstance(node, ast.With)
        for item in node.items
        if isinstance(item.context_expr, ast.Call)
        and isinstance(item.context_expr.func, ast.Name)
        and item.context_expr.func.id == "open"
        and item.context_expr.args
        and isinstance(item.context_expr.args[0], ast.Name)
        and item.context_expr.args[0].id == "tmp"
        and isinstance(item.optional_vars, ast.Name)
    }

    def safe(node: ast.AST) -> bool:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str":
            node = node.args[0] if node.args else node
        if isinstance(node, ast.Constant) and str(node.value).startswith("/proc/"):
            return True
        return _is_bytesio(node) or (
            isinstance(node, ast.Name)
            and (node.id == "tmp" or node.id in in_memory or node.id in opened_on_tmp)
        )

    found = []
    for call in ast.walk(tree):
        if not isinstance(call, ast.Call):
            continue
        func, arguments = call.func, [*call.args, *(k.value for k in call.keywords)]
        attr = func.attr if isinstance(func, ast.Attribute) else None
        receiver = func.value.id if attr and isinstance(func.value, ast.Name) else None
        if receiver in ATOMIC_MODULES:
            continue
        if attr in ("write_text", "write_bytes"):
            unsafe = receiver != "tmp"
        elif attr in SAVING_CALLS:
            unsafe = (attr != "dump" or len(arguments) >= 2) and not any(map(safe, arguments))
        elif attr == "open" or (isinstance(func, ast.Name) and func.id == "open"):
            mode = _open_mode(call) or "r"
            unsafe = bool(set(mode) & set("wax+")) and not any(map(safe, call.args))
        else:
            continue
        if unsafe:
            found.append(f"{name}:{call.lineno}: {ast.unparse(call)[:100]}")
    return found


@pytest.mark.parametrize(
    "source",
    [
        "json.dump(data, handle)",
        "Path(out).write_text(text)",
        "(out / 'x.bin').write_bytes(data)",
        "figure.savefig(out / 'plot.png')",
        "torch.save(state, path)",
        "image.save(path, format='PNG')",
        "with open(out, 'w') as handle: pass",
        "with open(out, mode='a') as handle: pass",
        "handle = io.open(out, 'wb')",
        "with out.open('w') as handle: pass",
        "frame.to_csv(path)",
        "prof.export_chrome_trace(str(path))",
    ],
)
def test_the_atomic_write_guard_flags_direct_writes(source: str) -> None:
    assert len(direct_writes(source, "example.py")) == 1


@pytest.mark.parametrize(
    "source",
    [
        "atomic.write_text(path, text)",
        "atomic.write_json(path, data)",
        "checkpoint.save(path, state)",
        "atomic.write_with(path, lambda tmp: torch.save(state, tmp))",
        "atomic.write_with(path, lambda tmp: prof.export_chrome_trace(str(tmp)))",
        "with open(tmp, 'wb') as handle:\n    torch.save(state, handle)",
        "buffer = io.BytesIO()\nfigure.savefig(buffer, format='png')",
        "image.save(io.BytesIO(), format='PNG')",
        "with open(path, encoding='utf-8') as handle: pass",
        "with open(path, 'rb') as handle: pass",
        "with open('/proc/self/clear_refs', 'w') as refs: refs.write('5')",
        "Image.open(path)",
        "text = json.dumps(data)",
        "text = yaml.safe_dump(data)",
    ],
)
def test_the_atomic_write_guard_lets_atomic_reads_and_in_memory_writes_pass(source: str) -> None:
    assert direct_writes(source, "example.py") == []


def test_every_output_in_src_pipeline_is_written_through_pipeline_atomic() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        name = path.relative_to(SRC).as_posix()
        if name != "atomic.py":
            found += direct_writes(path.read_text(encoding="utf-8"), name)
    assert found == [], "write these through pipeline.atomic:\n" + "\n".join(found)
