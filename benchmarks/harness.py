"""What the benchmark scripts share: side-by-side alternation, run conditions, output.

A ratio is only meaningful when both sides are measured in one run, interleaved, so that
drift (thermal, frequency, other work) hits both alike; `alternate` does exactly that.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from pipeline import atomic, stats, timing
from pipeline import device as dev
from pipeline.environment import cpu_model
from pipeline.errors import PipelineError

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "benchmarks" / "out"
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
    return result


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


def timed(step: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call, with the device synchronized on both sides of it."""
    dev.synchronize(device)
    start = time.perf_counter()
    step()
    dev.synchronize(device)
    return time.perf_counter() - start


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
    names = list(sides)
    blocks = []
    for index in range(rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            samples = [timed(sides[name], device) for _ in range(block)]
            blocks.append({"round": index, "side": name, "skip": skip, "samples_s": samples})
    return blocks


def warm_up(sides: dict[str, Callable[[], object]], device: torch.device, steps: int) -> None:
    for step in sides.values():
        for _ in range(steps):
            step()
        dev.synchronize(device)


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
    if not conditions["high_load"]:
        return
    share = conditions["foreign_cpu_share"]
    detail = (
        f"other processes used {share:.0%} of all CPU time"
        if share is not None
        else f"1-minute load average {conditions['load_1m_start']} -> {conditions['load_1m_end']}"
    )
    print(
        f"WARNING: other work shared the machine during {what} ({detail}): {consequence}",
        flush=True,
    )


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


def verdict(label: str, ratio: float, target: float) -> tuple[bool, str]:
    passed = ratio <= target
    return passed, f"{label}: {ratio:.3f}   target <= {target:.2f}   {'PASS' if passed else 'FAIL'}"


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


def run(main: Callable[[list[str]], int]) -> None:
    """Exit with main's status; an error the user can fix prints one line and exits 2."""
    try:
        status = main(sys.argv[1:])
    except PipelineError as error:
        print(f"error: {error}", file=sys.stderr)
        status = 2
    sys.exit(status)


def finish(path: Path, record: dict[str, Any], passed: bool, check: bool) -> int:
    """Write the record; the exit status says PASS/FAIL only when --check asked for it."""
    atomic.write_json(path, {**record, "passed": passed})
    print(f"raw samples: {path}")
    return 1 if check and not passed else 0
