"""Real public detection sets to develop against, and their figures at fixed epochs.

  prepare NAME --source MIRROR_OR_FOLDER [--out DIR]
      lays a fetched set out as a real export is laid out (Pascal VOC: Annotations/,
      JPEGImages/, ImageSets/Main/{train,val,test}.txt; COCO: one folder per split with its
      _annotations.coco.json), reading a bare git mirror at HEAD or an ordinary folder, then
      loads it through pipeline.data as a user's data set is loaded and prints its object sizes.
  measure NAME [--data DIR] [--epochs N] [--precision fp32|bf16] [--image-size PX] --record PATH
          [key=value ...]
      trains as the README's "Your own data" says (a user file with format, paths and
      image_size, layered over config/presets/photographs.yaml and five-minutes-cpu.yaml) but
      for a fixed number of epochs
      without a time budget, evaluates best.pth, and writes a JSON record of the figures, the
      training time, the machine, the load, the commit and the exact commands. Trailing
      key=value settings (seed=1, data.augment.scale_min=0.6667) are layered last, over the
      user file; the record keeps them and the resolved settings, so a variant or a seed is
      rerun from its record.

The sets' files stay out of the repository (licences, size): they are prepared under
resources/real/NAME (git-ignored) unless --out names another folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import harness
import numpy as np
import yaml
from real_layouts import (
    Source,
    lay_out_coco_per_split,
    lay_out_voc,
    published_split,
    seeded_split,
)

from pipeline import atomic, timing
from pipeline.cli import configure_logging
from pipeline.config import load_config, merge, parse_overrides, validate
from pipeline.data import has_test_split, load_split, load_splits
from pipeline.data.sources import SplitAnnotations
from pipeline.environment import machine
from pipeline.errors import ConfigError, DataError
from pipeline.runs import flatten
from pipeline.setting_groups import accuracy_settings

NAME = "real_sets"
RECORD_FORMAT = "benchmarks.real_set/1"
PREPARED = harness.REPO / "resources" / "real"
PRESETS = tuple(
    harness.REPO / "config" / "presets" / name
    for name in ("photographs.yaml", "five-minutes-cpu.yaml")
)
RECORDS = harness.REPO / "benchmarks" / "records" / "real"
BASE_CONFIG = harness.REPO / "config" / "config.yaml"  # under the presets: commands run at REPO
# settings measure sets from its own options: a trailing key=value may not set them too
OWN_SETTINGS = {
    "train.epochs": "--epochs",
    "train.time_budget_s": "none: measure trains for fixed epochs, without a budget",
    "precision": "--precision",
    "data.image_size": "--image-size",
}
SMALLEST_AT_INPUT_PX = 8  # README, "Choosing data.image_size"


# ---- the sets --------------------------------------------------------------------------
@dataclass(frozen=True)
class RealSet:
    name: str
    origin: str  # where to fetch it
    data: Callable[[Path], dict[str, Any]]  # the data section of a user's config for a layout
    lay_out: Callable[[Source, Path, int], None]
    image_size: int  # by the README's rule; docs/_incoming-realdata.md says why
    epochs: int  # one fp32 run within about 15 minutes on the shared 2-core development VM


def voc_data(root: Path) -> dict[str, Any]:
    return {"format": "voc", "root": str(root)}


def coco_per_split_data(root: Path) -> dict[str, Any]:
    return {
        "format": "coco",
        **{
            f"{split}_annotations": str(root / folder / "_annotations.coco.json")
            for split, folder in (("train", "train"), ("val", "valid"), ("test", "test"))
        },
    }


def _raccoon(source: Source, out: Path, seed: int) -> None:
    ids = sorted(name[len("annotations/") : -len(".xml")] for name in source.under("annotations"))
    lay_out_voc(source, out, "annotations", ("images",), seeded_split(ids, seed, 0.15, 0.15))


def _rsod(source: Source, out: Path, seed: int) -> None:
    folders = ("JPEGImages-trainval", "JPEGImages-test")
    lay_out_voc(source, out, "Annotations", folders, published_split(source, seed))


def _eggs(source: Source, out: Path, seed: int) -> None:
    lay_out_coco_per_split(source, out, ("train", "valid", "test"))


SETS = {
    s.name: s
    for s in (
        RealSet("raccoon", "github:datitran/raccoon_dataset", voc_data, _raccoon, 128, 80),
        RealSet("rsod", "github:linklist2/RSOD", voc_data, _rsod, 416, 4),
        RealSet(
            "eggs",
            "github:KisirinyaSirajje/egg_fertile_infertile_detection",
            coco_per_split_data,
            _eggs,
            64,
            15,
        ),
    )
}


def user_data(real: RealSet, root: Path, image_size: int | None = None) -> dict[str, Any]:
    """What a user's own config file says about this set: format, paths, image_size (the
    set's own unless another is given)."""
    size = real.image_size if image_size is None else image_size
    return {"data": {**real.data(root.resolve()), "image_size": size}}


# ---- prepare ---------------------------------------------------------------------------
def size_summary(splits: list[SplitAnnotations]) -> list[str]:
    """Objects' shorter sides as shares of their image's longer side, and what the README's
    image_size rule makes of them (the smallest object at about 8 px at the input)."""
    shares: dict[str, list[float]] = {}
    for split in splits:
        for record in split.records:
            sides = np.minimum(*(record.boxes[:, 2:] - record.boxes[:, :2]).T)
            for label, side in zip(record.labels, sides, strict=True):
                name = split.class_names[label]
                shares.setdefault(name, []).append(side / max(record.width, record.height))
    lines = [
        "class: objects; shorter side as % of the image's longer side: min / 5% / median / max"
    ]
    for name, values in shares.items():
        low, p5, median, high = np.percentile(values, [0, 5, 50, 100]) * 100
        lines.append(f"  {name}: {len(values)}; {low:.1f} / {p5:.1f} / {median:.1f} / {high:.1f}")
    every = np.concatenate([np.asarray(v) for v in shares.values()])
    for what, share in (("smallest object", every.min()), ("5% smallest", np.percentile(every, 5))):
        size = 32 * int(np.ceil(SMALLEST_AT_INPUT_PX / share / 32))
        lines.append(f"{SMALLEST_AT_INPUT_PX} px at the input for the {what}: image_size {size}")
    return lines


def prepare(real: RealSet, source_path: Path, out: Path, seed: int) -> None:
    if out.exists() and any(out.iterdir()):
        raise DataError(f"--out {out} exists and is not empty: remove it or name another folder.")
    partial = out.with_name(out.name + ".part")
    shutil.rmtree(partial, ignore_errors=True)
    source = Source(source_path)
    try:
        real.lay_out(source, partial, seed)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        source.close()
    if out.exists():
        out.rmdir()
    partial.rename(out)
    config = validate(merge(load_config(), user_data(real, out)), f"the {real.name} set")
    splits = list(load_splits(config))  # as training loads them, the log saying what each holds
    if has_test_split(config):
        splits.append(load_split(config, "test", splits[0].class_names))
    print(f"prepared {real.name} in {out}")
    print("\n".join(size_summary(splits)))


# ---- measure ---------------------------------------------------------------------------
PER_CLASS = ("name", "num_gt", "ap50", "ap50_interval", "ap", "ap_interval", "tp", "fp", "fn")


def figures(evaluation: dict[str, Any]) -> dict[str, Any]:
    """AP@.5 (macro over classes) and per class, AP@[.5:.95], and F1 at the configured score
    threshold and at the threshold chosen on validation, with their 95% intervals."""
    metrics, point = evaluation["metrics"], evaluation["operating_point"]
    return {
        "split": evaluation["metrics_split"],
        "num_images": metrics["num_images"],
        "num_ground_truth": metrics["num_ground_truth"],
        "ap50": metrics["ap50"],
        "ap50_interval": metrics["ap50_interval"],
        "ap": metrics["ap"],
        "ap_interval": metrics["ap_interval"],
        "ap75": metrics["ap75"],
        "per_class": [{key: found[key] for key in PER_CLASS} for found in metrics["per_class"]],
        "at_score_threshold": {
            "threshold": metrics["score_threshold"],
            **{key: metrics[key] for key in ("f1", "f1_interval", "precision", "recall")},
        },
        "at_operating_point": {
            key: point.get(key)
            for key in ("threshold", "picked_on", "f1", "f1_interval", "precision", "recall")
        },
    }


def commands(
    real: RealSet,
    data: Path,
    epochs: int,
    precision: str,
    work: Path,
    threads: str = "auto",
    image_size: int | None = None,
    overrides: Sequence[str] = (),
) -> list[list[str]]:
    """The README's "Your own data" commands at fixed epochs, `overrides` last; writes the
    user's config file."""
    user_file, run = work / f"{real.name}.yaml", work / "run"
    work.mkdir(parents=True, exist_ok=True)
    user_file.write_text(yaml.safe_dump(user_data(real, data, image_size)), encoding="utf-8")
    python = [sys.executable, "-m", "pipeline", "--cpu-threads", threads]
    return [
        [
            *python,
            "train",
            *("--configfile", *map(str, PRESETS), str(user_file)),
            *("--out", str(run)),
            *(f"train.epochs={epochs}", "train.time_budget_s=null", f"precision={precision}"),
            *overrides,
        ],
        [
            *python,
            "evaluate",
            *("--checkpoint", str(run / "best.pth")),
            *("--out", str(work / "eval.json"), "--predictions", str(work / "predictions.json")),
        ],
    ]


def resolved_config(train: list[str]) -> dict[str, Any]:
    """The config the training command resolves (config/config.yaml, the presets, the user's
    file, then its settings), validated: a bad setting stops measure before it trains."""
    files = train[train.index("--configfile") + 1 : train.index("--out")]
    settings = train[train.index("--out") + 2 :]
    return load_config([BASE_CONFIG, *files], settings)


def check_overrides(overrides: Sequence[str]) -> None:
    """Settings measure's own options set (epochs, precision, image size) are refused: the
    record's fields and file name say what those options gave."""
    for key in (item.split("=", 1)[0] for item in flatten(parse_overrides(overrides))):
        for own, option in OWN_SETTINGS.items():
            if key == own or key.startswith(own + ".") or own.startswith(key + "."):
                raise ConfigError(
                    f"Setting {key} is measure's own ({option}): give it that way, not as "
                    "key=value."
                )


def measure(
    real: RealSet,
    data: Path,
    epochs: int,
    precision: str,
    work: Path,
    threads: str,
    image_size: int | None = None,
    overrides: Sequence[str] = (),
) -> dict[str, Any]:
    check_overrides(overrides)
    train, evaluate = commands(real, data, epochs, precision, work, threads, image_size, overrides)
    settings = accuracy_settings(resolved_config(train))
    user = user_data(real, data, image_size)
    log = work / "commands.log"
    conditions = timing.RunConditions()
    harness.run_logged(train, log)
    loaded = conditions.finish()
    harness.run_logged(evaluate, log)
    summary = json.loads((work / "run" / "train_summary.json").read_text(encoding="utf-8"))
    evaluation = json.loads((work / "eval.json").read_text(encoding="utf-8"))
    return {
        "format": RECORD_FORMAT,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "set": real.name,
        "origin": real.origin,
        "user_config": user,
        "overrides": list(overrides),
        "settings": settings,
        "epochs": epochs,
        "precision": summary["precision"],
        "image_size": user["data"]["image_size"],
        "batch_size": summary["batch_size"],
        "figures": figures(evaluation),
        "training": {
            key: summary[key]
            for key in (
                "epochs",
                "steps",
                "wall_time_s",
                "train_time_s",
                "median_step_time_s",
                "best_epoch",
            )
        },
        "machine": machine(),
        "niceness": os.nice(0),
        "conditions": loaded,
        "commit": harness.git("rev-parse", "HEAD"),
        "src_tree": harness.git("rev-parse", "HEAD:src"),  # the code measured, whatever else moved
        "src_modified": bool(harness.git("status", "--porcelain", "--", "src")),
        "commands": [" ".join(command) for command in (train, evaluate)],
        "work": str(work),
    }


# ---- table -----------------------------------------------------------------------------
def _class_ap50(row: dict[str, Any]) -> str:
    """A class's AP@.5, or why it has none: no object of it in the evaluated split."""
    return "n/a (no objects)" if row["ap50"] is None else f"{row['ap50']:.3f}"


def _with_interval(value: float, found: dict[str, Any] | None) -> str:
    return f"{value:.3f} ({found['low']:.3f}-{found['high']:.3f})" if found else f"{value:.3f}"


def table(records: list[dict[str, Any]]) -> str:
    """A Markdown table of records, generated so that no figure is copied by hand.

    Rows of one set and training settings follow each other oldest first, so a change reads
    as the row after the one before it.
    """
    rows = []
    order = sorted(
        records,
        key=lambda r: (
            r["set"],
            r["image_size"],
            r["epochs"],
            r["precision"],
            r["created"],
        ),
    )
    for record in order:
        found, training = record["figures"], record["training"]
        fixed, chosen = found["at_score_threshold"], found["at_operating_point"]
        overrides = "".join(f", {item}" for item in record.get("overrides", ()))
        rows.append(
            [
                record["set"],
                f"{record['precision']}, {record['epochs']} epochs, {record['image_size']} px"
                f"{overrides}",
                _with_interval(found["ap50"], found["ap50_interval"]),
                " / ".join(f"{c['name']} {_class_ap50(c)}" for c in found["per_class"]),
                _with_interval(found["ap"], found["ap_interval"]),
                f"{_with_interval(fixed['f1'], fixed['f1_interval'])} at {fixed['threshold']:.2f}",
                f"{_with_interval(chosen['f1'], chosen['f1_interval'])} at {chosen['threshold']:.2f}",
                f"{training['wall_time_s'] / 60:.0f} min ({record['machine']['cpu_model']}, "
                f"{record['commit'][:7]})",
            ]
        )
    headers = [
        "set",
        "training",
        f"{records[0]['figures']['split'] if records else 'test'} AP@.5 (95%)",
        "AP@.5 per class",
        "AP@[.5:.95]",
        "F1 at the configured threshold",
        "F1 at validation's best-F1 threshold",
        "wall time (machine, commit)",
    ]
    lines = [headers, ["---"] * len(headers), *rows]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


# ---- command line ----------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python benchmarks/{NAME}.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    ready = commands.add_parser("prepare", help="lay a fetched set out as its export would be")
    ready.add_argument("name", choices=sorted(SETS))
    ready.add_argument("--source", type=Path, required=True, help="bare git mirror or folder")
    ready.add_argument("--out", type=Path, help="default: resources/real/NAME")
    ready.add_argument("--seed", type=int, default=0, help="seed of the splits made here")
    run = commands.add_parser("measure", help="train at fixed epochs, evaluate, write a record")
    run.add_argument("name", choices=sorted(SETS))
    run.add_argument("--data", type=Path, help="the prepared set (default: resources/real/NAME)")
    run.add_argument("--epochs", type=int, help="default: the set's fixed epochs")
    run.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    run.add_argument(
        "--image-size",
        type=int,
        help="data.image_size (default: the set's own, by the README's rule)",
    )
    run.add_argument("--record", type=Path, required=True, metavar="PATH.json")
    run.add_argument(
        "--cpu-threads",
        default="auto",
        help="torch CPU threads of both commands (auto, as the README: every usable CPU; on a "
        "machine shared with other work, 1 spends no time waiting for a descheduled thread)",
    )
    run.add_argument(
        "--work", type=Path, help="run folder, eval and predictions (default: benchmarks/out/...)"
    )
    run.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="settings layered last, over the user file (seed=1, data.augment.scale_min=0.6667)",
    )
    show = commands.add_parser("table", help="a Markdown table of records")
    show.add_argument(
        "records", nargs="*", type=Path, help="default: benchmarks/records/real/*.json"
    )
    # argparse gives a trailing positional after options nothing (its nargs="*" is taken,
    # empty, with NAME): settings after the options come back unknown and are kept in order
    args, rest = parser.parse_known_args(argv)
    if rest and (args.command != "measure" or any("=" not in s or s.startswith("-") for s in rest)):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "measure":
        args.overrides = [*args.overrides, *rest]
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    configure_logging(None)  # the loaders' lines: what each split holds, what was dropped
    if args.command == "table":
        paths = args.records or sorted(RECORDS.glob("*.json"))
        print(table([json.loads(path.read_text(encoding="utf-8")) for path in paths]))
        return 0
    real = SETS[args.name]
    if args.command == "prepare":
        prepare(real, args.source, args.out or PREPARED / real.name, args.seed)
        return 0
    data = args.data or PREPARED / real.name
    if not data.is_dir():
        raise DataError(f"--data {data} does not exist: run 'prepare {real.name}' first.")
    epochs = args.epochs or real.epochs
    work = args.work or harness.OUT_DIR / "real" / f"{real.name}-{args.precision}-{epochs}ep"
    record = measure(
        real,
        data,
        epochs,
        args.precision,
        work,
        args.cpu_threads,
        args.image_size,
        args.overrides,
    )
    harness.warn_if_loaded(
        record["conditions"],
        f"training {real.name}",
        "its wall time is longer than alone; the figures, at fixed epochs, do not depend on it.",
    )
    atomic.write_json(args.record, record)
    found = record["figures"]
    print(
        f"{real.name} {record['precision']} {epochs} epochs in "
        f"{record['training']['wall_time_s']:.0f} s: AP@.5 {found['ap50']:.3f}, "
        f"AP@[.5:.95] {found['ap']:.3f}, F1 {found['at_score_threshold']['f1']:.3f} at "
        f"{found['at_score_threshold']['threshold']:.2f}, "
        f"{found['at_operating_point']['f1']:.3f} at {found['at_operating_point']['threshold']:.2f} "
        f"(chosen on validation); record {args.record}"
    )
    return 0


if __name__ == "__main__":
    harness.run(main)
