"""Training memory: peak resident memory of training on a 20,000-image synthetic set at 512 px.

Each row builds the Trainer in a fresh process from the default config, with data.image_size
512 on a generated synthetic set of --images training images (rendered at 128 px and
letterboxed up to 512 by the loader, as any image is), then runs --steps training steps
(`trainer.step` on the training DataLoader's batches, as `fit()` does, without validation or
checkpoints); 0 steps runs a whole epoch. A thread reads, every 0.2 s, the memory of the
process and of its DataLoader workers. The row's figure is the sum of each process's own peak
resident memory (VmHWM): an upper bound, since peaks need not coincide and a forked worker's
RSS counts the pages it shares with its parent again (the largest simultaneous RSS and PSS
sums seen are recorded beside it).

Rows: `auto` (the default data.cache: the split is cached only if its decoded images fit
data.cache_budget of the available memory, which the record notes), and `true` (forced
caching). The forced row may run on the first --true-images images only (a 20,000-image cache
at 512 px needs 15.7 GB); its figure for --images is then extrapolated: measured peak plus the
decoded bytes of the images left out (3 x 512 x 512 each), and labelled so.
Target, for the default (auto) row only: peak memory <= 4 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import harness

NAME = "training_memory"
TARGET_GB = 4.0
GB = 1e9
INPUT_SIZE = 512
SOURCE_SIZE = 128
NUM_VAL = 256  # the default validation split: its loader, and its cache, are part of training
DEFAULT_DATA_ROOT = harness.REPO / "resources" / "data" / "shapes-20k"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = harness.parser(NAME, __doc__)
    parser.add_argument("--images", type=int, default=20000, help="training images")
    parser.add_argument(
        "--steps",
        type=int,
        default=20,
        help="training steps per row (0: a whole epoch); the record says how many of an epoch's",
    )
    parser.add_argument(
        "--true-images",
        type=int,
        default=2000,
        help="images of the forced data.cache=true row (fewer than --images: extrapolated)",
    )
    parser.add_argument(
        "--data-root",
        type=Path,
        default=DEFAULT_DATA_ROOT,
        help="the generated set (made there, once, if it is missing)",
    )
    parser.add_argument("--cpu-threads", default="auto", help="torch CPU threads")
    parser.add_argument("--row", choices=("auto", "true"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    harness.check_positive(parser, args, "images", "true_images")
    if args.steps < 0:
        parser.error("--steps must be at least 0")
    args.true_images = min(args.true_images, args.images)
    return args


# ---- the data set --------------------------------------------------------------------------
def ensure_data(root: Path, images: int) -> None:
    """The synthetic set with `images` training images (rendered once, in every usable CPU)."""
    from pipeline.data.synthetic import SyntheticSpec, generate

    train = root / "instances_train.json"
    if train.is_file() and len(json.loads(train.read_text())["images"]) == images:
        return
    print(f"generating {images} + {NUM_VAL} synthetic images at {SOURCE_SIZE} px in {root}")
    started = time.perf_counter()
    generate(SyntheticSpec(num_train=images, num_val=NUM_VAL, num_test=0), root)
    print(f"generated in {time.perf_counter() - started:.0f} s", flush=True)


def subset_split(root: Path, images: int) -> str:
    """A training split of the first `images` images (the forced-cache row's), as a split name."""
    name = f"train_first{images}"
    path = root / f"instances_{name}.json"
    if not path.is_file():
        document = json.loads((root / "instances_train.json").read_text())
        document["images"] = document["images"][:images]
        kept = {image["id"] for image in document["images"]}
        document["annotations"] = [a for a in document["annotations"] if a["image_id"] in kept]
        path.write_text(json.dumps(document))
    return name


# ---- memory of a process tree --------------------------------------------------------------
def _status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _pss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


class PeakSampler:
    """Samples, in a thread, the memory of this process and its children (the loader's workers).

    `peak_kb`: the sum of each process's own peak RSS (VmHWM, exact per process, read while it
    lives), an upper bound of their largest simultaneous sum; `sampled_rss_kb` and
    `sampled_pss_kb`: the largest sums of RSS and of PSS seen at one sample."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s = interval_s
        self.hwm_kb: dict[int, int] = {}
        self.sampled_rss_kb = self.sampled_pss_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def peak_kb(self) -> int:
        return sum(self.hwm_kb.values())

    def sample(self) -> None:
        pids = [os.getpid(), *_children(os.getpid())]
        for pid in pids:
            self.hwm_kb[pid] = max(self.hwm_kb.get(pid, 0), _status_kb(pid, "VmHWM"))
        self.sampled_rss_kb = max(self.sampled_rss_kb, sum(_status_kb(p, "VmRSS") for p in pids))
        self.sampled_pss_kb = max(self.sampled_pss_kb, sum(_pss_kb(p) for p in pids))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> PeakSampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


# ---- one row, in its own process -----------------------------------------------------------
def measure_row(args: argparse.Namespace) -> dict[str, Any]:
    import logging

    import torch

    from pipeline import device as dev
    from pipeline.config import load_config
    from pipeline.engine.trainer import Trainer

    logging.basicConfig(level=logging.INFO, format="  %(message)s", stream=sys.stdout)
    dev.set_cpu_threads(args.cpu_threads)
    images = args.images if args.row == "auto" else args.true_images
    split = "train" if images == args.images else subset_split(args.data_root, images)
    config = load_config(
        None,
        [
            "device=cpu",
            f"data.root={args.data_root}",
            f"data.train_split={split}",
            f"data.image_size={INPUT_SIZE}",
            f"data.synthetic.num_train={args.images}",
            f"data.synthetic.num_val={NUM_VAL}",
            "data.synthetic.num_test=0",
            f"data.cache={args.row}",
        ],
    )
    with PeakSampler() as sampler, tempfile.TemporaryDirectory() as run_dir:
        started = time.perf_counter()
        trainer = Trainer(config, run_dir)
        built_s = time.perf_counter() - started
        loader = trainer.train_loader
        steps = args.steps or len(loader)
        trainer.model.train()
        started = time.perf_counter()
        done = 0
        rss_by_step: list[float] = []  # RSS sum after each step: does memory still grow?
        while done < steps:
            for batch_images, targets in loader:
                trainer.tally.add(trainer.step(batch_images, targets))
                done += 1
                pids = [os.getpid(), *_children(os.getpid())]
                rss_by_step.append(sum(_status_kb(p, "VmRSS") for p in pids) * 1024 / GB)
                if done == steps:
                    break
            loader.sampler.set_epoch(loader.sampler.epoch + 1)
        train_s = time.perf_counter() - started
        row = {
            "cache": args.row,
            "images": images,
            "cached": loader.dataset.cache_decision.cache,
            "decision": loader.dataset.cache_decision.reason,
            "val_cached": trainer.val_loader.dataset.cache_decision.cache,
            "num_workers": loader.num_workers,
            "batch_size": trainer.train_cfg["batch_size"],
            "precision": trainer.precision,
            "steps": done,
            "steps_per_epoch": len(loader),
            "build_s": built_s,
            "train_s": train_s,
            "rss_gb_by_step": rss_by_step,
            "torch_threads": torch.get_num_threads(),
        }
        del trainer, loader  # shuts the persistent workers down inside the sampled region
    row |= {
        "peak_rss_gb": sampler.peak_kb * 1024 / GB,
        "sampled_rss_gb": sampler.sampled_rss_kb * 1024 / GB,
        "sampled_pss_gb": sampler.sampled_pss_kb * 1024 / GB,
        "main_peak_rss_gb": sampler.hwm_kb[os.getpid()] * 1024 / GB,
        "workers_seen": len(sampler.hwm_kb) - 1,
    }
    return row


def run_row(args: argparse.Namespace, argv: list[str], row: str) -> dict[str, Any]:
    """One row in a fresh interpreter: the peak memory of one process is never another's."""
    print(f"row data.cache={row}:", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "row.json"
        command = [sys.executable, __file__, *argv, "--row", row, "--out", str(out), "--no-record"]
        subprocess.run(command, check=True)
        return json.loads(out.read_text())


def _cells(label: str, row: dict[str, Any]) -> list[object]:
    return [
        label,
        "yes" if row["cached"] else "no",
        row["num_workers"],
        f"{row['steps']}/{row['steps_per_epoch']}",
        f"{row['peak_rss_gb']:.2f}",
        f"{row['main_peak_rss_gb']:.2f}",
        f"{row['sampled_rss_gb']:.2f}",
        f"{row['sampled_pss_gb']:.2f}",
    ]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.row:
        from pipeline import atomic

        atomic.write_json(args.out, measure_row(args))
        return 0
    started = time.perf_counter()
    ensure_data(args.data_root, args.images)
    from pipeline import timing
    from pipeline.data.cache import available_memory, decoded_bytes

    memory = available_memory()
    conditions = timing.RunConditions()
    rows = {row: run_row(args, argv, row) for row in ("auto", "true")}
    conditions = conditions.finish()
    harness.warn_if_loaded(
        conditions, "the rows", "its times are not to be trusted (its memory figures are)."
    )
    auto, forced = rows["auto"], rows["true"]
    left_out = args.images - forced["images"]
    forced_full = forced["peak_rss_gb"] + decoded_bytes(left_out, INPUT_SIZE) / GB
    forced_label = f"data.cache=true, {args.images} images" + (
        f", EXTRAPOLATED from {forced['images']}" if left_out else ""
    )
    print(
        f"{NAME}: {args.images} training images at {INPUT_SIZE} px (rendered at {SOURCE_SIZE}), "
        f"default settings: batch {auto['batch_size']}, {auto['precision']}, "
        f"{auto['torch_threads']} torch threads"
    )
    print(f"auto decided: {auto['decision']}")
    table = [
        _cells(f"data.cache=auto (default), {auto['images']} images", auto),
        _cells(f"data.cache=true, {forced['images']} images", forced),
    ]
    if left_out:
        table.append([forced_label, "yes", "", "", f"{forced_full:.2f}", "", "", ""])
    headers = ("row", "cached", "workers", "steps", "peak RSS GB", "main", "sampled", "PSS")
    print(harness.table(headers, table))
    print(
        "peak RSS: the sum of each process's own peak (main + loader workers); sampled: the "
        "largest simultaneous RSS and PSS sums seen every 0.2 s"
    )
    note = " (forced: extrapolated)" if left_out else ""
    print(
        f"peak RSS, auto / forced true, {args.images} images: "
        f"{auto['peak_rss_gb']:.2f} / {forced_full:.2f} GB = {auto['peak_rss_gb'] / forced_full:.3f}"
        + note
    )
    partial = auto["steps"] < auto["steps_per_epoch"]
    trend = auto["rss_gb_by_step"]
    half = len(trend) // 2
    growth = max(trend[half:]) - max(trend[: half or 1])
    print(
        f"auto row, RSS sum after each step: {trend[0]:.2f} GB after the first, "
        f"{trend[-1]:.2f} GB after the last; largest of the second half minus the first: "
        f"{growth:+.3f} GB"
    )
    if partial:
        print(f"NOTE: {auto['steps']} of the epoch's {auto['steps_per_epoch']} steps (--steps)")
    passed, line = harness.verdict(
        "peak RSS GB, default (auto), workers included", auto["peak_rss_gb"], TARGET_GB
    )
    print(line)
    print(f"took {time.perf_counter() - started:.0f} s")

    flags = harness.condition_flags(conditions, "the rows")
    if partial:
        flags.append(
            f"stopped early: {auto['steps']} of an epoch's {auto['steps_per_epoch']} steps (--steps)"
        )
    if left_out:
        flags.append(
            f"forced data.cache=true measured at {forced['images']} images; its "
            f"{args.images}-image figure is extrapolated: plus the decoded bytes of the rest"
        )
    what = f"{args.images} images at {INPUT_SIZE} px, process + loader workers"
    figures = [
        harness.figure(
            "auto.peak_rss_gb",
            f"data.cache=auto (default): peak RSS, {what}",
            auto["peak_rss_gb"],
            "GB",
            target=("<=", TARGET_GB),
        ),
        harness.figure(
            "auto.sampled_pss_gb",
            "data.cache=auto: largest PSS sum sampled",
            auto["sampled_pss_gb"],
            "GB",
        ),
        harness.figure(
            "auto.cached", "data.cache=auto cached the training split", auto["cached"], "boolean"
        ),
        harness.figure(
            "auto.late_growth_gb",
            "data.cache=auto: largest RSS sum after a step of the second half minus the first",
            growth,
            "GB",
        ),
        harness.figure(
            "true.peak_rss_gb",
            f"data.cache=true: peak RSS, {forced['images']} images at {INPUT_SIZE} px (measured)",
            forced["peak_rss_gb"],
            "GB",
        ),
        harness.figure("true.full_peak_rss_gb", f"{forced_label}: peak RSS", forced_full, "GB"),
    ]
    settings = {
        "images": args.images,
        "input_size": INPUT_SIZE,
        "source_size": SOURCE_SIZE,
        "num_val": NUM_VAL,
        "steps": args.steps,
        "true_images": forced["images"],
        "available_memory_gb_at_start": (memory.available or 0) / GB,
        "rows": rows,
    }
    document = harness.record(NAME, figures, settings=settings, flags=flags)
    harness.write_record(args, document)
    return harness.finish(
        args.out, {"settings": settings, "conditions": conditions}, passed, args.check
    )


if __name__ == "__main__":
    harness.run(main)
