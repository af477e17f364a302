"""The results folder read into typed records and pandas frames, every file checked on the way:
what the summary is made of, and what the report draws its charts and examples from.

A file that is not what its stage writes stops the report with a ResultsFileError naming it;
a file that is simply not there yet is left out (the report says so where it would be shown).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd

from pipeline import measured
from pipeline.errors import DataError, PipelineError, ResultsFileError
from pipeline.report.formatting import number
from pipeline.runs import PRECISIONS
from pipeline.stats import Speedup, speedup_between

BACKENDS = ("cuda", "mps", "cpu")  # the order the report lists them in
MODES = ("train", "infer")
GIT_TIMEOUT_S = 5


@dataclass
class RunResults:
    """Everything one training run left under the results folder; any piece may be missing."""

    name: str
    summary: dict[str, Any] | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    metrics_note: str | None = None
    evaluation: dict[str, Any] | None = None
    predictions_path: Path | None = None
    profile: dict[str, Any] | None = None
    profile_dir: Path | None = None


@dataclass
class Results:
    root: Path
    env: dict[str, Any] | None
    bench_records: list[tuple[dict[str, Any], Path]]  # every benchmark record and its file
    runs: list[RunResults]
    job_stats: pd.DataFrame | None
    # every input file read, with the 'created' stamp its writer put in it (None where there is none)
    files: dict[Path, str | None]


# ---- files -----------------------------------------------------------------------------


def read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ResultsFileError(
            f"Cannot read {path}: {error}. Delete it and rerun the step that writes it."
        ) from error
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ResultsFileError(
            f"{path} is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno}): the step that "
            "writes it was probably interrupted or the file was edited. Delete it and rerun that step."
        ) from error


def read_json_object(path: Path, what: str, required: Iterable[str] = ()) -> dict[str, Any]:
    """A JSON object with the keys the report relies on; anything else names the file."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise ResultsFileError(
            f"{path} holds a JSON {type(data).__name__}, not the object a {what} file holds. Delete it and rerun the step that writes it."
        )
    missing = [key for key in required if key not in data]
    if missing:
        raise ResultsFileError(
            f"{path} is not a {what} file: it lacks {', '.join(missing)}. Delete it and rerun the step that writes it."
        )
    return data


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """Rows of a JSON-lines file; a cut-off last line (a run still writing) is skipped with a note."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ResultsFileError(f"Cannot read {path}: {error}.") from error
    lines = text.splitlines()
    rows, skipped = [], None
    for number_, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            if number_ == len(lines) and not text.endswith("\n"):
                skipped = f"{path.name}: its last line is incomplete (a run still writing, or killed) and was left out."
                continue
            raise ResultsFileError(
                f"{path} line {number_} is not valid JSON ({error.msg}). Delete the run folder and train it again."
            ) from error
        if not isinstance(row, dict) or "type" not in row:
            raise ResultsFileError(
                f"{path} line {number_} is not a metrics row (a JSON object with a 'type')."
            )
        rows.append(row)
    return rows, skipped


def read_bench_file(path: Path) -> list[dict[str, Any]]:
    """Records of one benchmark file, checked against the schema the bench step writes to."""
    try:
        return measured.read_bench_file(path)
    except DataError as error:
        raise ResultsFileError(f"{error} Delete it and rerun the benchmark.") from error


# ---- the results folder ------------------------------------------------------------------


def load_results(root: Path) -> Results:
    if not root.is_dir():
        what = "is a file, not a folder" if root.exists() else "does not exist"
        raise PipelineError(
            f"Results folder {root} {what}: run the workflow first (snakemake --cores 1), or pass "
            "--results DIR."
        )
    files: dict[Path, str | None] = {}
    env_path = root / "env.json"
    env = None
    if env_path.exists():
        env = read_json_object(env_path, "environment (env.json)", ("backends", "auto"))
        backends = env["backends"]
        if not isinstance(backends, dict) or not all(
            isinstance(e, dict) for e in backends.values()
        ):
            raise ResultsFileError(
                f"{env_path}: 'backends' must map each backend to an object. Rerun check-env."
            )
        files[env_path] = env.get("created")
    records = []
    for path in sorted((root / "bench").glob("*.json")):
        found = read_bench_file(path)
        records += [(record, path) for record in found]
        files[path] = found[0].get("created")
    runs = load_runs(root, files)
    return Results(root, env, records, runs, load_job_stats(root), files)


def run_names(root: Path) -> list[str]:
    names = {path.parent.name for path in root.glob("train/*/train_summary.json")}
    names |= {
        path.stem for path in root.glob("eval/*.json") if not path.stem.endswith("_predictions")
    }
    names |= {path.parent.name for path in root.glob("profile/*/profile.json")}
    return sorted(names, key=run_sort_key)


def run_sort_key(name: str) -> tuple[int, int, str]:
    """cuda runs before mps before cpu, fp32 before fp16 before bf16: the baseline reads first."""
    head = name.split("+")[0]
    backend = next((i for i, b in enumerate(BACKENDS) if head.startswith(b)), len(BACKENDS))
    precision = next(
        (i for i, p in enumerate(PRECISIONS) if head.endswith(f"-{p}")), len(PRECISIONS)
    )
    return backend, precision, name


def load_runs(root: Path, files: dict[Path, str | None]) -> list[RunResults]:
    runs = []
    for name in run_names(root):
        run = RunResults(name)
        train_dir = root / "train" / name
        if (train_dir / "train_summary.json").exists():
            run.summary = read_json_object(
                train_dir / "train_summary.json", "training summary", ("backend", "precision")
            )
            files[train_dir / "train_summary.json"] = None
        if (train_dir / "metrics.jsonl").exists():
            run.metrics, run.metrics_note = read_jsonl(train_dir / "metrics.jsonl")
            files[train_dir / "metrics.jsonl"] = None
        evaluation = root / "eval" / f"{name}.json"
        if evaluation.exists():
            run.evaluation = read_json_object(evaluation, "evaluation", ("metrics",))
            if not isinstance(run.evaluation["metrics"], dict):
                raise ResultsFileError(
                    f"{evaluation}: 'metrics' must be an object. Delete it and rerun the evaluation."
                )
            files[evaluation] = run.evaluation.get("created")
        predictions = root / "eval" / f"{name}_predictions.json"
        if predictions.exists():
            run.predictions_path = predictions
            files[predictions] = None
        profile_dir = root / "profile" / name
        if (profile_dir / "profile.json").exists():
            run.profile = read_json_object(profile_dir / "profile.json", "profile", ("latency",))
            if not isinstance(run.profile["latency"], list):
                raise ResultsFileError(
                    f"{profile_dir / 'profile.json'}: 'latency' must be a list. Delete it and rerun the profile."
                )
            run.profile_dir = profile_dir
            files[profile_dir / "profile.json"] = run.profile.get("created")
        runs.append(run)
    return runs


def load_job_stats(root: Path) -> pd.DataFrame | None:
    """Snakemake `benchmark:` files: one TSV per job, named after the rule and its wildcards."""
    folder = root / "job_stats"
    rows = []
    for path in sorted(folder.glob("**/*.tsv")):
        try:
            frame = pd.read_csv(path, sep="\t")
        except (OSError, ValueError, pd.errors.ParserError) as error:
            raise ResultsFileError(f"{path} is not a Snakemake benchmark TSV: {error}.") from error
        if frame.empty or "s" not in frame.columns:
            raise ResultsFileError(
                f"{path} is not a Snakemake benchmark TSV (no 's' column with the wall time)."
            )
        last = frame.iloc[-1]
        rows.append(
            {
                "job": path.relative_to(folder).with_suffix("").as_posix(),
                "wall_s": number(pd.to_numeric(last.get("s"), errors="coerce")),
                "max_rss_mb": number(pd.to_numeric(last.get("max_rss"), errors="coerce")),
                "cpu_time_s": number(pd.to_numeric(last.get("cpu_time"), errors="coerce")),
                "mean_load": number(pd.to_numeric(last.get("mean_load"), errors="coerce")),
            }
        )
    return pd.DataFrame(rows) if rows else None


# ---- benchmark records as a frame ----------------------------------------------------------


def bench_frame(records: list[tuple[dict[str, Any], Path]]) -> pd.DataFrame:
    """One row per record, with speed-ups (and their intervals) against the same backend's
    fp32 and against CPU fp32, of the same model and mode: what the summary's decisions work on."""
    columns = [
        "model",
        "backend",
        "precision",
        "mode",
        "status",
        "reason",
        "median_ms",
        "iqr_ms",
        "images_per_s",
        "safe",
        "samples_s",
        "record",
        "file",
    ]
    frame = pd.DataFrame([bench_row(record, path) for record, path in records], columns=columns)
    if frame.empty:
        return frame.assign(vs_backend_fp32=None, vs_cpu_fp32=None)
    fp32 = {
        (row["model"], row["mode"], row["backend"]): row["record"]["timing"]
        for _, row in frame.iterrows()
        if row["status"] == "ok" and row["precision"] == "fp32" and row["samples_s"]
    }

    def against(row: pd.Series, backend: str) -> Speedup | None:
        reference = fp32.get((row["model"], row["mode"], backend))
        if reference is None or not row["samples_s"]:
            return None
        return speedup_between(reference, row["record"]["timing"])  # paired where interleaved

    frame["vs_backend_fp32"] = [against(row, row["backend"]) for _, row in frame.iterrows()]
    frame["vs_cpu_fp32"] = [against(row, "cpu") for _, row in frame.iterrows()]
    order = {
        "model": lambda s: s,
        "mode": lambda s: s.map(lambda v: _rank(MODES, v)),
        "backend": lambda s: s.map(lambda v: _rank(BACKENDS, v)),
        "precision": lambda s: s.map(lambda v: _rank(PRECISIONS, v)),
    }
    return frame.sort_values(
        list(order), key=lambda s: order[s.name](s), kind="stable"
    ).reset_index(drop=True)


def _rank(order: tuple[str, ...], value: Any) -> int:
    return order.index(value) if value in order else len(order)


def bench_row(record: dict[str, Any], path: Path) -> dict[str, Any]:
    timing = record.get("timing") or {}
    numerics = record.get("numerics") or {}
    ok = record["status"] == "ok"
    return {
        "model": record["model"],
        "backend": record["backend"],
        "precision": record["precision"],
        "mode": record["mode"],
        "status": record["status"],
        "reason": record.get("reason"),
        "median_ms": number(timing.get("median_ms")) if ok else None,
        "iqr_ms": number(timing.get("iqr_ms")) if ok else None,
        "images_per_s": number(record.get("throughput_images_per_s")),
        # fp32 is the reference; autocast counts only when its numerics were checked and passed.
        "safe": ok and (record["precision"] == "fp32" or numerics.get("acceptable") is True),
        "samples_s": [ms / 1000 for ms in timing.get("samples_ms") or []] if ok else [],
        "record": record,
        "file": path,
    }


# ---- files read only where the report shows them ---------------------------------------


def read_predictions(path: Path) -> dict[str, Any]:
    predictions = read_json_object(path, "predictions", ("images", "class_names"))
    if not isinstance(predictions["images"], list) or not isinstance(
        predictions["class_names"], list
    ):
        raise ResultsFileError(
            f"{path}: 'images' and 'class_names' must be lists. Delete it and rerun the evaluation."
        )
    return predictions


def predicted_images(
    predictions: dict[str, Any], predictions_path: Path, limit: int
) -> tuple[list[tuple[dict[str, Any], Any]], list[str]]:
    """Up to `limit` (prediction, RGB image) pairs, and the image files that could not be read."""
    shown, missing = [], []
    for item in predictions["images"]:
        if len(shown) == limit:
            break
        if not isinstance(item, dict):
            continue
        image = open_image(item.get("file"), predictions_path)
        if image is None:
            missing.append(str(item.get("file")))
        else:
            shown.append((item, image))
    return shown, missing


def open_image(name: Any, predictions_path: Path):
    """The image as RGB, or None: relative paths are tried from here and from the results' parent."""
    from PIL import Image

    if not isinstance(name, str) or not name:
        return None
    path = Path(name)
    candidates = (
        [path]
        if path.is_absolute()
        else [Path.cwd() / path, predictions_path.parent.parent.parent / path]
    )
    for candidate in candidates:
        try:
            with Image.open(candidate) as image:
                return image.convert("RGB")
        except (OSError, ValueError):
            continue
    return None


def read_operators(run: RunResults) -> dict[str, Any] | None:
    """The profiler block of profile.json, or operators.json beside it."""
    profiler = (run.profile or {}).get("profiler")
    if isinstance(profiler, dict):
        return profiler
    path = (run.profile_dir or Path()) / "operators.json"
    return read_json_object(path, "operator profile") if path.exists() else None


def modified_time(path: Path) -> datetime | None:
    try:
        return datetime.fromtimestamp(path.stat().st_mtime, UTC)
    except OSError:
        return None


def git_state(folder: Path) -> dict[str, Any]:
    """The commit of the checkout holding the results and how many files differ from it
    (None each, as far as git cannot tell: not a git checkout, no commit, no git)."""
    commit = git_output(folder, "rev-parse", "HEAD")
    if commit is None:
        return {"id": None, "changed": None, "untracked": None}
    status = git_output(folder, "status", "--porcelain")
    if status is None:
        return {"id": commit.strip(), "changed": None, "untracked": None}
    lines = [line for line in status.splitlines() if line.strip()]
    untracked = sum(line.startswith("??") for line in lines)
    return {"id": commit.strip(), "changed": len(lines) - untracked, "untracked": untracked}


def git_output(folder: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(folder), *args],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None
