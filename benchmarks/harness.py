"""What the benchmark scripts share: side-by-side alternation, run conditions, output, records.

A ratio is only meaningful when both sides are measured in one run, interleaved, so that
drift (thermal, frequency, other work) hits both alike; `alternate` does exactly that.
Every script also writes one small record of its figures with the machine, the commit and
the command (`write_record`), which the tables in docs/ are generated from.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from pipeline import atomic, formats, stats, timing
from pipeline import cli as pipeline_cli
from pipeline import device as dev
from pipeline.config import load_config
from pipeline.engine.trainer import Trainer
from pipeline.environment import cpu_model, machine, machine_id
from pipeline.errors import PipelineError

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "benchmarks" / "out"
RECORDS_DIR = REPO / "benchmarks" / "records"
RECORD_FORMAT = "pipeline.benchmark_record/1"
DEFAULT_DATA_ROOT = REPO / "resources" / "data" / "shapes"


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """Options every script takes; the result is a figure, the exit status only with --check."""
    result = argparse.ArgumentParser(
        prog=f"python benchmarks/{name}.py",
        description=(doc or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    result.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when the target is missed (without it the exit status is 0 either way)",
    )
    result.add_argument(
        "--out",
        type=Path,
        default=OUT_DIR / f"{name}.json",
        help="JSON file with every raw sample",
    )
    add_record_options(result)
    return result


def add_record_options(result: argparse.ArgumentParser) -> None:
    """--record PATH (default: benchmarks/records/<script>/<machine>-<date>-<commit>.json) and --no-record."""
    result.add_argument(
        "--record",
        type=Path,
        help="JSON record of the figures, the machine, the commit and the command "
        "(default: benchmarks/records/<script>/<machine>-<date>-<commit>.json)",
    )
    result.add_argument(
        "--no-record", action="store_true", help="write no record (a quick look, say)"
    )


def add_torch_options(result: argparse.ArgumentParser) -> None:
    result.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto")
    result.add_argument(
        "--cpu-threads",
        default="auto",
        help="torch CPU threads (auto: every CPU this process may use, as the pipeline does)",
    )
    result.add_argument("--seed", type=int, default=0, help="torch seed and config seed")


def add_alternation_options(
    result: argparse.ArgumentParser, *, warmup: int, block: int, rounds: int
) -> None:
    result.add_argument("--warmup", type=int, default=warmup, help="untimed steps of each side")
    result.add_argument("--block", type=int, default=block, help="N: steps per block")
    result.add_argument(
        "--rounds", type=int, default=rounds, help="R: rounds, each one block of every side"
    )


def add_batches_and_data_options(result: argparse.ArgumentParser, settings_help: str) -> None:
    """K batches held in memory, the generated data set, and config overrides for the Trainer."""
    result.add_argument(
        "--batches", type=int, default=16, help="K: batches taken once from the loader, reused"
    )
    result.add_argument(
        "--data-root", default=str(DEFAULT_DATA_ROOT), help="the generated data set"
    )
    result.add_argument("settings", nargs="*", metavar="key=value", help=settings_help)


def check_positive(result: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) < 1:
            result.error(
                f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
            )


def setup_torch(args: argparse.Namespace) -> torch.device:
    """Threads as the pipeline sets them, the seed, and the device (an absent one is an error)."""
    dev.set_cpu_threads(args.cpu_threads)
    torch.manual_seed(args.seed)
    return dev.resolve_device(args.device)


def trainer_config(
    args: argparse.Namespace, device: torch.device, *settings: str
) -> dict[str, Any]:
    """The shipped config with the script's device, seed, data set and key=value settings, then
    `settings` (a side's or a row's own) on top."""
    return load_config(
        None,
        [
            f"device={device}",
            f"seed={args.seed}",
            f"data.root={args.data_root}",
            *args.settings,
            *settings,
        ],
    )


def stepping_trainer(config: dict[str, Any]) -> Trainer:
    """A Trainer whose steps a script calls itself, its model in training mode: fit() is never
    called, so nothing is written to the run folder, which goes at once."""
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(config, run_dir)
    trainer.model.train()
    return trainer


def alternate(
    sides: dict[str, Callable[[], object]],
    device: torch.device,
    *,
    rounds: int,
    block: int,
    skip: int = 0,
) -> list[dict[str, Any]]:
    """`rounds` rounds of one block of `block` timed steps per side, in ABBA order.

    Reversing the order every round keeps a linear drift from favouring the side that
    always runs first. The first `skip` steps of every block are timed and kept, but not
    counted (see `counted`): they can carry the other side's after-effects.
    """
    blocks = []
    for index in range(rounds):
        for name in timing.balanced_order(list(sides), index):
            samples = [timing.timed_step(sides[name], device) for _ in range(block)]
            blocks.append({"round": index, "side": name, "skip": skip, "samples_s": samples})
    return blocks


def warm_up(sides: dict[str, Callable[[], object]], device: torch.device, steps: int) -> None:
    for step in sides.values():
        for _ in range(steps):
            step()
        dev.synchronize(device)


def measure(
    sides: dict[str, Callable[[], object]],
    device: torch.device,
    *,
    warmup: int,
    rounds: int,
    block: int,
    skip: int = 0,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`warm_up` every side, then `alternate` them; returns the blocks and the run conditions
    (`timing.RunConditions`) of the timed rounds alone, taken as soon as they end."""
    warm_up(sides, device, warmup)
    conditions = timing.RunConditions()
    blocks = alternate(sides, device, rounds=rounds, block=block, skip=skip)
    return blocks, conditions.finish()


def measure_trainer_steps(
    name: str,
    trainer: Trainer,
    sides: dict[str, Callable[[], object]],
    args: argparse.Namespace,
    batches: int,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Say what is timed (side A's Trainer, the threads, the K batches held in memory, the
    rounds), then `measure` the sides with the script's --warmup/--rounds/--block, warning
    when other work shared the machine."""
    print(
        f"{name}: {trainer.config['model']['name']} on {dev.describe_device(trainer.device)} in "
        f"{trainer.precision}, batch {trainer.train_cfg['batch_size']} at "
        f"{trainer.config['data']['image_size']} px, {torch.get_num_threads()} torch threads; "
        f"K={batches} batches in memory, warm-up {args.warmup}, {args.rounds} rounds x "
        f"{args.block} steps per side (ABBA)",
        flush=True,
    )
    blocks, conditions = measure(
        sides, trainer.device, warmup=args.warmup, rounds=args.rounds, block=args.block
    )
    warn_if_loaded(conditions, "the measurement")
    return blocks, conditions


def counted(blocks: Sequence[dict[str, Any]], side: str) -> list[float]:
    """The counted samples of one side, in the order they were taken."""
    return [s for b in blocks if b["side"] == side for s in b["samples_s"][b["skip"] :]]


def median_s(samples: Sequence[float]) -> float:
    return stats.summarize(list(samples))["median_ms"] / 1000


def round_ratios(blocks: Sequence[dict[str, Any]], a: str, b: str) -> list[float]:
    """Median of A over median of B within each round: how much the ratio moves round to round."""
    rounds = sorted({block["round"] for block in blocks})
    ratios = []
    for index in rounds:
        these = [block for block in blocks if block["round"] == index]
        ratios.append(median_s(counted(these, a)) / median_s(counted(these, b)))
    return ratios


# ---- run conditions --------------------------------------------------------------------
def warn_if_loaded(
    conditions: dict[str, Any],
    what: str,
    consequence: str = "the figures below are not to be trusted; rerun on an idle machine.",
) -> None:
    for flag in condition_flags(conditions, what):
        print(f"WARNING: {flag}: {consequence}", flush=True)


def condition_flags(conditions: dict[str, Any], what: str) -> list[str]:
    """Words for a record (and the warning) when other work shared the machine."""
    if not conditions["high_load"]:
        return []
    share = conditions["foreign_cpu_share"]
    detail = (
        f"other processes used {share:.0%} of all CPU time"
        if share is not None
        else f"1-minute load average {conditions['load_1m_start']} -> {conditions['load_1m_end']}"
    )
    return [f"other work shared the machine during {what} ({detail})"]


# ---- output ----------------------------------------------------------------------------
def environment(device: torch.device | None) -> dict[str, Any]:
    """Where and how this script ran; without a device, the measuring was done elsewhere."""
    return {
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_model": cpu_model(),
        "device": str(device) if device is not None else None,
        "device_description": dev.describe_device(device) if device is not None else None,
        **(timing.torch_settings() if device is not None else {}),
    }


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns right-aligned, the first left-aligned; floats (ratios) to three places."""
    cells = [[str(h) for h in headers], *[[_cell(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value: object) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def ms(value: float) -> str:
    """Milliseconds to a width that keeps GPU-sized and CPU-sized steps readable."""
    return f"{value:.2f}" if abs(value) < 100 else f"{value:.1f}"


def print_sides(
    result: dict[str, dict[str, Any]], blocks: Sequence[dict[str, Any]], note: str = ""
) -> tuple[float, list[float]]:
    """Print sides A and B and the per-round A/B ratios; return median A / median B and them."""
    ratio = result["A"]["summary"]["median_ms"] / result["B"]["summary"]["median_ms"]
    per_round = round_ratios(blocks, "A", "B")
    print(table(SIDE_HEADERS, [side_row(k, v) for k, v in result.items()]))
    print(
        f"{note}per-round A/B: min {min(per_round):.3f}, median {statistics.median(per_round):.3f}, "
        f"max {max(per_round):.3f}"
    )
    return ratio, per_round


def verdict(
    label: str, ratio: float, target: float, *, interval: tuple[float, float] | None = None
) -> tuple[bool, str]:
    """PASS or FAIL by the point figure; with its `interval` (at stats.CONFIDENCE) the line
    shows it, and says so where it crosses the target: another run may well read otherwise."""
    passed = ratio <= target
    shown = f"{ratio:.3f}"
    if interval is not None:
        shown += f" ({stats.CONFIDENCE:.0%} interval {interval[0]:.3f}-{interval[1]:.3f})"
    line = f"{label}: {shown}   target <= {target:.2f}   {'PASS' if passed else 'FAIL'}"
    if interval is not None and interval[0] <= target <= interval[1]:
        line += " (the interval crosses the target: not settled by this run)"
    return passed, line


def side_summary(label: str, samples: Sequence[float]) -> dict[str, Any]:
    return {"label": label, "summary": stats.summarize(list(samples))}


def side_row(name: str, side: dict[str, Any]) -> list[object]:
    s = side["summary"]
    return [
        f"{name}  {side['label']}",
        ms(s["median_ms"]),
        ms(s["iqr_ms"]),
        ms(s["p10_ms"]),
        ms(s["p90_ms"]),
        s["count"],
        "yes" if s["noisy"] else "no",
    ]


SIDE_HEADERS = ("side", "median ms", "IQR ms", "p10 ms", "p90 ms", "n", "noisy")


def run_logged(command: list[str], log: Path) -> None:
    """Run a command from the repository root, its output appended to `log`; failing, the
    error names the command and ends with the last lines of its output."""
    with log.open("a", encoding="utf-8") as out:
        done = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = "\n".join(log.read_text(encoding="utf-8").splitlines()[-12:])
        raise PipelineError(
            f"{' '.join(command)} exited {done.returncode}; the end of its output ({log}):\n{tail}"
        )


def evaluate_in_process(argv: list[str], out: Path) -> tuple[dict[str, Any], float]:
    """`python -m pipeline ARGV` (an `evaluate` writing its eval JSON to `out`) in this process:
    that JSON and the command's wall seconds."""
    start = time.perf_counter()
    if pipeline_cli.main(argv) != 0:
        raise SystemExit(f"python -m pipeline {' '.join(argv)} failed")
    seconds = time.perf_counter() - start
    return json.loads(out.read_text(encoding="utf-8")), seconds


def run(main: Callable[[list[str]], int]) -> None:
    """Exit with main's status; an error the user can fix prints one line and exits 2."""
    try:
        status = main(sys.argv[1:])
    except PipelineError as error:
        print(f"error: {error}", file=sys.stderr)
        status = 2
    sys.exit(status)


def finish(path: Path, record: dict[str, Any], passed: bool, check: bool) -> int:
    """Write the raw samples; the exit status says PASS/FAIL only when --check asked for it."""
    atomic.write_json(path, {**record, "passed": passed})
    print(f"raw samples: {path}")
    return 1 if check and not passed else 0


# ---- records ---------------------------------------------------------------------------
def figure(
    key: str,
    label: str,
    value: float | bool | None,
    unit: str,
    *,
    target: tuple[str, float | bool] | None = None,
    interval: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """One figure of a record; `target` is (op, bound) with op one of <=, >=, ==."""
    passed = None
    if target is not None:
        op, bound = target
        passed = value is not None and bool(
            value <= bound if op == "<=" else value >= bound if op == ">=" else value == bound
        )
    return {
        "key": key,
        "label": label,
        "value": value,
        "unit": unit,
        "interval": None if interval is None else {"low": interval[0], "high": interval[1]},
        "target": None if target is None else {"op": target[0], "value": target[1]},
        "passed": passed,
    }


def side_figures(sides: dict[str, dict[str, Any]], prefix: str = "") -> list[dict[str, Any]]:
    """Each side's median step time, as `side_summary` holds it."""
    return [
        figure(
            f"{prefix}{name.lower()}.median_ms",
            f"median step time, {side['label']}",
            side["summary"]["median_ms"],
            "ms",
        )
        for name, side in sides.items()
    ]


def noisy_flags(sides: dict[str, dict[str, Any]], what: str = "") -> list[str]:
    """Words for a record for each side whose spread is above the noisy threshold."""
    return [
        f"{what}{side['label']} noisy: IQR {side['summary']['iqr_ratio']:.0%} of its median"
        for side in sides.values()
        if side["summary"]["noisy"]
    ]


def commit() -> dict[str, Any] | None:
    """The checked-out commit and whether tracked files differ from it; None outside git."""
    try:
        sha = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return None
    return {"sha": sha, "dirty": dirty}


def git(*args: str) -> str:
    done = subprocess.run(
        ["git", *args], cwd=REPO, capture_output=True, text=True, check=True, timeout=30
    )
    return done.stdout.strip()


def command_line(argv: Sequence[str]) -> str:
    """The command as run from the repository root, with the project's Python as `python`."""
    script = Path(argv[0]).resolve()
    shown = script.relative_to(REPO) if script.is_relative_to(REPO) else script
    return shlex.join(["python", str(shown), *argv[1:]])


def record(
    name: str,
    figures: list[dict[str, Any]],
    *,
    settings: dict[str, Any],
    flags: Sequence[str] = (),
    argv: Sequence[str] | None = None,
) -> dict[str, Any]:
    """One record (benchmark_record.schema.yaml) of what this run measured, and where."""
    targeted = [f["passed"] for f in figures if f["passed"] is not None]
    return {
        "format": RECORD_FORMAT,
        "benchmark": name,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": command_line(sys.argv if argv is None else argv),
        "commit": commit(),
        "machine": machine(),
        "settings": settings,
        "figures": figures,
        "passed": all(targeted) if targeted else None,
        "flags": list(flags),
    }


def default_record_path(document: dict[str, Any]) -> Path:
    """benchmarks/records/<script>/<machine id>-<date>-<commit>.json: one per machine, day and
    commit, so that measuring two commits in a day keeps both (-dirty where tracked files
    differ from the commit; no commit part outside git)."""
    name = f"{machine_id(document['machine'])}-{document['created'][:10]}"
    found = document.get("commit")
    if found:
        name += f"-{found['sha'][:7]}" + ("-dirty" if found["dirty"] else "")
    return RECORDS_DIR / document["benchmark"] / f"{name}.json"


def write_record(args: argparse.Namespace, document: dict[str, Any]) -> Path | None:
    """Check the record against its schema and write it where --record says (unless --no-record)."""
    if args.no_record:
        return None
    problem = formats.problem(document, "benchmark_record")
    if problem:  # a bug in the script, never a figure to commit
        raise RuntimeError(f"The {document['benchmark']} record {problem}")
    path = args.record or default_record_path(document)
    atomic.write_json(path, document)
    print(f"record: {path}")
    return path
