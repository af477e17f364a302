"""The comparison report: one self-contained HTML page that says which backend and precision
to train with on this machine, with every benchmark, run, evaluation and profile behind it.

No torch here: the report must start fast and run where no accelerator (or no torch) is.
Every string that comes from a file goes through `esc()`; plots are inline PNGs; nothing
is fetched from the network, so the page opens offline and prints as it shows.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import numbers
import os
import subprocess
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pandas as pd
import yaml
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter

from pipeline import atomic
from pipeline.errors import PipelineError
from pipeline.runs import parse_run

BACKENDS = ("cuda", "mps", "cpu")
PRECISIONS = ("fp32", "fp16", "bf16")
MODES = ("train", "infer")
BACKEND_LABELS = {"cuda": "CUDA", "mps": "MPS", "cpu": "CPU"}
PRECISION_COLORS = {"fp32": "#4c72b0", "fp16": "#dd8452", "bf16": "#55a868"}
RUN_COLORS = (
    "#4c72b0",
    "#dd8452",
    "#55a868",
    "#c44e52",
    "#8172b3",
    "#937860",
    "#da8bc3",
    "#8c8c8c",
    "#ccb974",
    "#64b5cd",
)
SECTIONS = {
    "answer": "Answer",
    "environment": "Environment",
    "benchmarks": "Benchmarks",
    "amp-policy": "AMP policy",
    "training": "Training",
    "evaluation": "Evaluation",
    "profile": "Inference profile",
    "provenance": "Provenance",
}
# A speed-up within this fraction of 1 is noise, not a reason to change a default.
SPEEDUP_TOLERANCE = 0.05
# Bars spanning more than this ratio get a log axis, or the fast ones vanish.
LOG_SCALE_SPREAD = 10.0
MAX_GRID_IMAGES = 8
MAX_DRAWN_DETECTIONS = 25
TOP_OPERATORS = 10
GIT_TIMEOUT_S = 5
PNG_DPI = 144
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BENCH_SCHEMA = Path(__file__).parent / "schemas" / "bench.schema.yaml"
REPRODUCE = (
    ("everything, then this report", "snakemake --cores 1 results/report.html"),
    ("only this report, from the results already there", "snakemake report -R report"),
)


class ResultsFileError(PipelineError):
    """A file under the results folder is unreadable or not in the format its stage writes."""


# ---- safe HTML -------------------------------------------------------------------------


class Html(str):
    """Markup built by this module: `esc()` passes it through, every other string is escaped."""


def esc(value: Any) -> Html:
    if isinstance(value, Html):
        return value
    return Html(html.escape("" if value is None else str(value), quote=True))


def _attributes(attrs: dict[str, Any]) -> str:
    parts = []
    for key, value in attrs.items():
        if value is None or value is False:
            continue
        name = key.rstrip("_").replace("_", "-")
        parts.append(f' {name}="{html.escape(str(value), quote=True)}"')
    return "".join(parts)


def tag(name: str, *children: Any, **attrs: Any) -> Html:
    """An element whose text children are escaped; `class_=` sets the class attribute."""
    inner = "".join(esc(child) for child in children if child is not None)
    return Html(f"<{name}{_attributes(attrs)}>{inner}</{name}>")


def void_tag(name: str, **attrs: Any) -> Html:
    return Html(f"<{name}{_attributes(attrs)}>")


def join(parts: Iterable[Any], separator: str = "") -> Html:
    return Html(esc(separator).join(esc(part) for part in parts))


def note(*children: Any, kind: str = "info") -> Html:
    """A boxed remark: missing pieces and caveats are stated, never silently left out."""
    return tag("p", *children, class_=f"note note-{kind}")


@dataclass
class Cell:
    content: Any
    class_: str | None = None
    colspan: int | None = None
    title: str | None = None


def num(content: Any, title: str | None = None, class_: str = "") -> Cell:
    return Cell(content, f"num {class_}".strip(), title=title)


@dataclass
class Row:
    """A table row with an optional full-width line under it (flags that would not fit a column)."""

    cells: list[Any]
    sub: Any = None


def table(headers: list[Any], rows: list[list[Any] | Row], caption: Any = None) -> Html:
    """A table in a scrolling wrapper, so wide ones stay readable on a laptop screen.

    Each row is its own <tbody>, so a row and its sub-line share one zebra stripe.
    """
    head = tag("thead", tag("tr", *(tag("th", header, scope="col") for header in headers)))
    bodies = [_row(row if isinstance(row, Row) else Row(row), len(headers)) for row in rows]
    parts = [tag("caption", caption) if caption is not None else None, head, *bodies]
    return tag("div", tag("table", *parts), class_="table-wrap")


def _row(row: Row, width: int) -> Html:
    main = tag("tr", *(_cell(value) for value in row.cells), class_="has-sub" if row.sub else None)
    if not row.sub:
        return tag("tbody", main)
    return tag("tbody", main, tag("tr", tag("td", row.sub, colspan=width), class_="sub"))


def _cell(value: Any) -> Html:
    if isinstance(value, Cell):
        return tag(
            "td",
            value.content,
            class_=value.class_ or None,
            colspan=value.colspan,
            title=value.title,
        )
    return tag("td", value)


def definition_list(items: Iterable[tuple[Any, Any]]) -> Html:
    return tag("dl", *(Html(tag("dt", key) + tag("dd", value)) for key, value in items))


# ---- numbers ---------------------------------------------------------------------------


def number(value: Any) -> float | None:
    """A finite float, or None for null, NaN, infinity and anything that is not a number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value) if math.isfinite(value) else None


def fmt_ms(value: Any) -> str:
    value = number(value)
    if value is None:
        return "n/a"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def fmt_float(value: Any, digits: int = 3) -> str:
    value = number(value)
    return "n/a" if value is None else f"{value:.{digits}f}"


def fmt_rel(value: Any) -> str:
    """Relative differences span decades: scientific notation keeps small ones readable."""
    value = number(value)
    return "n/a" if value is None else f"{value:.2e}"


def fmt_ratio(value: Any) -> str:
    value = number(value)
    if value is None:
        return "n/a"
    return f"{value:.1f}×" if value >= 10 else f"{value:.2f}×"


def fmt_speed(ratio: float | None, reference: str) -> str:
    """'1.40× faster than fp32' or '9.4× slower than fp32', whichever reads naturally."""
    if ratio is None:
        return f"not comparable with {reference}"
    if ratio >= 1:
        return f"{fmt_ratio(ratio)} faster than {reference}"
    return f"{fmt_ratio(1 / ratio)} slower than {reference}"


def fmt_mb(value: Any) -> str:
    value = number(value)
    if value is None:
        return "n/a"
    return f"{value / 1024:.2f} GB" if value >= 10240 else f"{value:.0f} MB"


def fmt_seconds(value: Any) -> str:
    value = number(value)
    if value is None:
        return "n/a"
    if value < 60:
        return f"{value:.1f} s"
    minutes, seconds = divmod(round(value), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{seconds:02d}s"


def fmt_time(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def yes_no(value: Any) -> str:
    return "yes" if value else "no"


def backend_label(backend: Any) -> str:
    return BACKEND_LABELS.get(str(backend), str(backend).upper())


def setting_label(backend: Any, precision: Any) -> str:
    return f"{backend_label(backend)} {precision}"


def memory_text(memory: Any, host_rss_mb: Any, backend: Any) -> str:
    """Peak memory as a table shows it: exact, a marked lower bound, or host RSS on the CPU."""
    memory = memory if isinstance(memory, dict) else {}
    if backend == "cpu":
        return f"host RSS {fmt_mb(host_rss_mb)}" if number(host_rss_mb) is not None else "n/a (CPU)"
    peak = number(memory.get("peak_mb"))
    if peak is None:
        return "n/a"
    if memory.get("exact") is False:
        return f"≥ {fmt_mb(peak)} (sampled lower bound)"
    return f"{fmt_mb(peak)} ({memory.get('label') or 'exact'})"


def device_memory_text(memory: Any, backend: Any) -> str:
    """Device memory where host RSS has its own column: the CPU has no device memory."""
    return "n/a (CPU)" if backend == "cpu" else memory_text(memory, None, backend)


def mpl_text(text: Any) -> str:
    """Matplotlib reads '$...$' as math: a '$' in a run or class name must stay a dollar."""
    return str(text).replace("$", r"\$")


# ---- reading the results folder --------------------------------------------------------


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


@cache
def bench_schema() -> dict[str, Any]:
    return yaml.safe_load(BENCH_SCHEMA.read_text(encoding="utf-8"))


def read_bench_file(path: Path) -> list[dict[str, Any]]:
    """Records of one benchmark file, checked against the schema the bench step writes to."""
    data = read_json(path)
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(bench_schema()).iter_errors(data)
    )
    if error is not None:
        where = "/".join(str(part) for part in error.absolute_path) or "(top level)"
        raise ResultsFileError(
            f"{path} is not a benchmark file in format pipeline.bench/1: at {where}, {error.message}. "
            "Delete it and rerun the benchmark."
        )
    return data["records"]


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
    bench: pd.DataFrame
    runs: list[RunResults]
    job_stats: pd.DataFrame | None
    # every input file read, with the 'created' stamp its writer put in it (None where there is none)
    files: dict[Path, str | None]


def load_results(root: Path) -> Results:
    if not root.is_dir():
        raise PipelineError(
            f"Results folder {root} does not exist: run the workflow first (snakemake --cores 1), or pass --results DIR."
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
    return Results(root, env, bench_frame(records), runs, load_job_stats(root), files)


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


# ---- benchmark table and the choice it supports ------------------------------------------


def bench_frame(records: list[tuple[dict[str, Any], Path]]) -> pd.DataFrame:
    """One row per record, with speed-ups against the same backend's fp32 and against CPU fp32."""
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
        "record",
        "file",
    ]
    rows = [bench_row(record, path) for record, path in records]
    frame = pd.DataFrame(rows, columns=columns)
    ok = frame[frame["status"] == "ok"]
    fp32 = ok[ok["precision"] == "fp32"]
    same = fp32[["model", "mode", "backend", "median_ms"]].drop_duplicates(
        ["model", "mode", "backend"]
    )
    cpu = fp32[fp32["backend"] == "cpu"][["model", "mode", "median_ms"]].drop_duplicates(
        ["model", "mode"]
    )
    frame = frame.merge(
        same.rename(columns={"median_ms": "backend_fp32_ms"}),
        on=["model", "mode", "backend"],
        how="left",
    )
    frame = frame.merge(
        cpu.rename(columns={"median_ms": "cpu_fp32_ms"}), on=["model", "mode"], how="left"
    )
    frame["vs_backend_fp32"] = frame["backend_fp32_ms"] / frame["median_ms"]
    frame["vs_cpu_fp32"] = frame["cpu_fp32_ms"] / frame["median_ms"]
    order = {
        "model": lambda s: s,
        "mode": lambda s: s.map(lambda v: _rank(MODES, v)),
        "backend": lambda s: s.map(lambda v: _rank(BACKENDS, v)),
        "precision": lambda s: s.map(lambda v: _rank(PRECISIONS, v)),
    }
    if frame.empty:
        return frame
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
        "record": record,
        "file": path,
    }


def answer_model(frame: pd.DataFrame, config: dict[str, Any] | None) -> str | None:
    """The config's model where it was benchmarked in mode train, else the first one that was."""
    trained = frame[(frame["mode"] == "train") & (frame["status"] == "ok")]
    if trained.empty:
        return None
    present = set(trained["model"])
    model_section = (config or {}).get("model")
    wanted = model_section.get("name") if isinstance(model_section, dict) else None
    if wanted in present:
        return wanted
    listed = ((config or {}).get("bench") or {}).get("models") or []
    return next((model for model in listed if model in present), str(trained["model"].iloc[0]))


@dataclass
class Choice:
    """The fastest safe training setting for one model, and what was faster but unsafe."""

    model: str
    best: pd.Series | None
    faster_unsafe: pd.DataFrame
    others: pd.DataFrame
    cpu_fp32_ms: float | None
    faster_off_policy: pd.DataFrame  # safe and faster, but the AMP policy never trains with it


def amp_allowed(env: dict[str, Any] | None, backend: Any) -> bool:
    """Whether training can use AMP on `backend` (env.json's amp_supported; unknown: yes)."""
    entry = ((env or {}).get("backends") or {}).get(backend)
    return not isinstance(entry, dict) or bool(entry.get("amp_supported", True))


def trainable(row: pd.Series, env: dict[str, Any] | None) -> bool:
    """A setting the trainer can run: fp32 anywhere, autocast only where AMP is allowed."""
    return row["precision"] == "fp32" or amp_allowed(env, row["backend"])


def choose_setting(frame: pd.DataFrame, model: str, env: dict[str, Any] | None = None) -> Choice:
    rows = frame[
        (frame["mode"] == "train")
        & (frame["status"] == "ok")
        & (frame["model"] == model)
        & frame["median_ms"].notna()
    ]
    allowed = (
        rows.apply(lambda row: trainable(row, env), axis=1).astype(bool)
        if not rows.empty
        else rows["safe"]
    )
    safe = rows[rows["safe"] & allowed].sort_values("median_ms", kind="stable")
    best = safe.iloc[0] if not safe.empty else None
    if best is None:
        return Choice(model, None, rows[~rows["safe"]], rows, None, rows.iloc[0:0])
    faster = rows["median_ms"] < best["median_ms"]
    faster_unsafe = rows[(~rows["safe"]) & faster].sort_values("median_ms")
    faster_off_policy = rows[rows["safe"] & ~allowed & faster].sort_values("median_ms")
    others = rows.drop(index=best.name)
    others = others[others["median_ms"] >= best["median_ms"]]
    return Choice(
        model, best, faster_unsafe, others, number(best["cpu_fp32_ms"]), faster_off_policy
    )


def numerics_problem(record: dict[str, Any]) -> str:
    numerics = record.get("numerics")
    if not numerics:
        return "its numerics against fp32 were not measured"
    if not numerics.get("finite", True):
        return "it produced non-finite outputs or loss"
    return f"its loss differs from fp32 by {fmt_rel(numerics.get('loss_rel_diff'))} relative (rule: {numerics.get('acceptable_rule', 'n/a')})"


def flags_of(record: dict[str, Any]) -> list[str]:
    """Reasons to trust a timing less: noise, a cut-short run, a busy machine, TF32 in 'fp32'."""
    flags = []
    timing = record.get("timing") or {}
    if timing.get("noisy"):
        flags.append(
            f"noisy: IQR {fmt_float(100 * (number(timing.get('iqr_ratio')) or 0), 0)}% of median"
        )
    if timing.get("budget_limited"):
        steps = (record.get("settings") or {}).get("max_steps")
        flags.append(f"budget-limited: {timing.get('count')} of {steps} steps")
    conditions = record.get("conditions") or {}
    if conditions.get("high_load"):
        share = number(conditions.get("foreign_cpu_share"))
        others = f", others used {share:.0%} CPU" if share is not None else ""
        flags.append(
            f"high load: {fmt_float(conditions.get('load_1m_start'), 1)} on {conditions.get('cpu_count')} cores{others}"
        )
    settings = record.get("settings") or {}
    if record.get("backend") == "cuda" and record.get("precision") == "fp32":
        tf32 = [
            name
            for name, key in (("matmul", "tf32_matmul"), ("cuDNN", "tf32_cudnn"))
            if settings.get(key)
        ]
        if tf32:
            flags.append(f"TF32 allowed: {', '.join(tf32)}")
    return flags


# ---- figures ---------------------------------------------------------------------------


def figure_html(figure: Figure, alt: str, caption: Any = None, palette: bool = False) -> Html:
    """The figure as a base64 PNG in an <img>, shown at its design size (96 px per inch).

    `palette=True` reduces photos to 256 colours: noisy images barely compress otherwise,
    and eight of them would make the report megabytes long.
    """
    FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=PNG_DPI, bbox_inches="tight", facecolor="white")
    png = buffer.getvalue()
    if palette:
        from PIL import Image

        reduced = io.BytesIO()
        Image.open(io.BytesIO(png)).convert("RGB").quantize(256).save(
            reduced, format="PNG", optimize=True
        )
        png = reduced.getvalue()
    return png_html(png, alt, caption)


def png_html(png: bytes, alt: str, caption: Any = None) -> Html:
    width_px = int.from_bytes(png[16:20], "big") * 96 // PNG_DPI
    source = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
    image = void_tag(
        "img",
        src=source,
        alt=alt,
        width=width_px,
        style=f"max-width:100%;height:auto;width:{width_px}px",
    )
    return tag("figure", image, tag("figcaption", caption) if caption is not None else None)


def plain_log_labels(axis) -> None:
    """'30' rather than '3×10¹' on a log axis; minor ticks labelled only when under a decade is shown."""
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    axis.set_major_formatter(plain)
    low, high = axis.get_view_interval()
    axis.set_minor_formatter(plain if low > 0 and high / low < 10 else NullFormatter())


def run_colors(runs: list[RunResults]) -> dict[str, str]:
    return {run.name: RUN_COLORS[index % len(RUN_COLORS)] for index, run in enumerate(runs)}


def bench_chart(frame: pd.DataFrame) -> Html | None:
    """Median ms per precision, grouped by model/backend/mode, with IQR error bars."""
    ok = frame[(frame["status"] == "ok") & frame["median_ms"].notna()]
    if ok.empty:
        return None
    groups = list(dict.fromkeys(zip(frame["model"], frame["backend"], frame["mode"], strict=True)))
    medians = ok["median_ms"]
    log_scale = medians.max() / max(medians.min(), 1e-9) > LOG_SCALE_SPREAD
    figure = Figure(figsize=(max(6.0, 1.25 * len(groups) + 2), 3.8))
    axes = figure.add_subplot()
    width = 0.8 / len(PRECISIONS)
    for offset, precision in enumerate(PRECISIONS):
        xs, ys, errors = [], [], [[], []]
        for index, (model, backend, mode) in enumerate(groups):
            x = index + (offset - 1) * width
            match = frame[
                (frame["model"] == model)
                & (frame["backend"] == backend)
                & (frame["mode"] == mode)
                & (frame["precision"] == precision)
            ]
            if match.empty:
                continue
            row = match.iloc[0]
            if row["status"] != "ok" or pd.isna(row["median_ms"]):
                axes.text(
                    x,
                    0.02,
                    "skipped",
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    color="#777",
                    transform=axes.get_xaxis_transform(),
                )
                continue
            half = (number(row["iqr_ms"]) or 0.0) / 2
            xs.append(x)
            ys.append(row["median_ms"])
            errors[0].append(min(half, row["median_ms"] * 0.9) if log_scale else half)
            errors[1].append(half)
        if xs:
            axes.bar(
                xs,
                ys,
                width,
                yerr=errors,
                capsize=3,
                label=precision,
                color=PRECISION_COLORS[precision],
                error_kw={"elinewidth": 1},
            )
    axes.set_xticks(
        range(len(groups)),
        [mpl_text(f"{model}\n{backend_label(backend)} {mode}") for model, backend, mode in groups],
        fontsize=8,
    )
    if log_scale:
        axes.set_yscale("log")
        plain_log_labels(axes.yaxis)
    axes.set_ylabel("median ms per step" + (" (log scale)" if log_scale else ""))
    axes.grid(axis="y", alpha=0.3)
    axes.legend(title="precision", fontsize=8, title_fontsize=8)
    axes.set_title("Step time per precision (error bars: IQR)", fontsize=10)
    return figure_html(
        figure, "Bar chart of median milliseconds per step for each backend, mode and precision"
    )


def training_chart(runs: list[RunResults], colors: dict[str, str]) -> Html | None:
    """Loss per step and validation F1 / AP@.5 per epoch, one colour per run."""
    with_rows = [run for run in runs if run.metrics]
    if not with_rows:
        return None
    figure = Figure(figsize=(10, 3.6))
    loss_axes, val_axes = figure.subplots(1, 2)
    any_val = False
    for run in with_rows:
        steps = [
            (row.get("step"), number(row.get("loss")))
            for row in run.metrics
            if row.get("type") == "step"
        ]
        steps = [(s, v) for s, v in steps if number(s) is not None and v is not None]
        if steps:
            loss_axes.plot(
                *zip(*steps, strict=True),
                color=colors[run.name],
                label=mpl_text(run.name),
                linewidth=1.3,
            )
        vals = [
            (row.get("epoch"), row["val"])
            for row in run.metrics
            if row.get("type") == "epoch" and isinstance(row.get("val"), dict)
        ]
        for key, style in (("f1", "-"), ("ap50", "--")):
            points = [
                (epoch, number(val.get(key)))
                for epoch, val in vals
                if number(val.get(key)) is not None
            ]
            if points:
                any_val = True
                val_axes.plot(
                    *zip(*points, strict=True),
                    style,
                    marker="o",
                    markersize=3,
                    color=colors[run.name],
                    label=mpl_text(f"{run.name} {'F1' if key == 'f1' else 'AP@.5'}"),
                )
    loss_axes.set(xlabel="step", ylabel="training loss", title="Loss")
    for axes in (loss_axes, val_axes):
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    val_axes.set(
        xlabel="epoch",
        ylabel="score",
        title="Validation F1 (solid) and AP@.5 (dashed)",
        ylim=(-0.02, 1.02),
    )
    for axes in (loss_axes, val_axes):
        axes.grid(alpha=0.3)
        axes.title.set_fontsize(10)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=7)
    if not any_val:
        val_axes.text(
            0.5,
            0.5,
            "no validation rows yet",
            ha="center",
            va="center",
            transform=val_axes.transAxes,
            color="#777",
        )
    figure.tight_layout()
    return figure_html(
        figure, "Training loss per step and validation F1 and AP@.5 per epoch for each run"
    )


def latency_chart(runs: list[RunResults], colors: dict[str, str]) -> Html | None:
    """p50/p90/p99 latency against batch size, one colour per run, log-log."""
    profiled = [run for run in runs if run.profile and run.profile["latency"]]
    if not profiled:
        return None
    figure = Figure(figsize=(7, 3.8))
    axes = figure.add_subplot()
    batches: set[int] = set()
    for run in profiled:
        rows = sorted(
            (row for row in run.profile["latency"] if isinstance(row, dict)),
            key=lambda row: number(row.get("batch_size")) or 0,
        )
        for key, style in (("p50_ms", "-"), ("p90_ms", "--"), ("p99_ms", ":")):
            points = [
                (row.get("batch_size"), number((row.get("wall") or {}).get(key))) for row in rows
            ]
            points = [(b, v) for b, v in points if number(b) is not None and v is not None]
            if points:
                batches.update(int(b) for b, _ in points)
                axes.plot(
                    *zip(*points, strict=True),
                    style,
                    marker="o",
                    markersize=3,
                    color=colors[run.name],
                    label=mpl_text(f"{run.name} {key[:3]}"),
                )
    if not batches:
        return None
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    plain_log_labels(axes.yaxis)
    axes.set_xticks(sorted(batches), [str(b) for b in sorted(batches)])
    axes.set(
        xlabel="batch size",
        ylabel="latency ms (log scale)",
        title="Inference latency: p50 (solid), p90 (dashed), p99 (dotted)",
    )
    axes.title.set_fontsize(10)
    axes.grid(alpha=0.3, which="both")
    axes.legend(fontsize=7)
    return figure_html(
        figure, "Inference latency percentiles against batch size for each profiled run"
    )


# ---- section: answer -------------------------------------------------------------------


def answer_section(results: Results, config: dict[str, Any] | None) -> Html:
    body = [answer_block(results.bench, config, results.env)]
    default = shipped_default_line(results, config)
    if default:
        body.append(tag("p", default))
    body.append(trained_runs_line(results.runs))
    return section("answer", *body)


def answer_block(
    frame: pd.DataFrame, config: dict[str, Any] | None, env: dict[str, Any] | None = None
) -> Html:
    model = answer_model(frame, config)
    if model is None:
        return note(
            "No successful training benchmark yet, so there is no answer: run ",
            tag("code", "snakemake --cores 1 bench"),
            " (skipped records say why a combination could not run).",
            kind="warn",
        )
    choice = choose_setting(frame, model, env)
    if choice.best is None:
        return note(
            f"No {model} training benchmark with acceptable numerics: every measured setting failed the numerics check, so none can be recommended.",
            kind="warn",
        )
    best = choice.best
    headline = f"On this machine, train with {setting_label(best['backend'], best['precision'])}"
    parts = [
        tag(
            "p",
            tag("strong", headline),
            f": {choice_speed_text(choice)}, numerics acceptable.",
            class_="answer",
        )
    ]
    parts.append(tag("p", basis_text(best)))
    parts.append(unsafe_text(choice))
    parts.append(off_policy_text(choice))
    caution = caution_text(best, frame)
    if caution:
        parts.append(note(caution, kind="warn"))
    return tag("div", *parts, class_="answer-box")


def choice_speed_text(choice: Choice) -> str:
    best = choice.best
    if choice.cpu_fp32_ms is None:
        return "no CPU fp32 benchmark of this model to compare with"
    if best["backend"] == "cpu" and best["precision"] == "fp32":
        return "it is the CPU fp32 baseline itself (1.00×)"
    return f"{fmt_ratio(choice.cpu_fp32_ms / best['median_ms'])} faster than CPU fp32"


def basis_text(best: pd.Series) -> str:
    record = best["record"]
    return (
        f"Measured on model {best['model']}, training steps of batch {record.get('batch_size')} at "
        f"{record.get('image_size')}×{record.get('image_size')} pixels on {record.get('device_description')}: "
        f"median {fmt_ms(best['median_ms'])} ms per step (IQR {fmt_ms(best['iqr_ms'])} ms)."
    )


def unsafe_text(choice: Choice) -> Html | None:
    """Why nothing faster is recommended: each faster setting failed the numerics check."""
    best = choice.best
    if choice.faster_unsafe.empty:
        slower = [
            f"{setting_label(r['backend'], r['precision'])} {fmt_ratio(r['median_ms'] / best['median_ms'])} slower"
            for _, r in choice.others.iterrows()
        ]
        if not slower:
            return None
        lead = "Every other" if choice.faster_off_policy.empty else "Every other allowed"
        return tag("p", f"{lead} measured training setting is slower: ", "; ".join(slower), ".")
    reasons = [
        f"{setting_label(r['backend'], r['precision'])} is {fmt_ratio(best['median_ms'] / r['median_ms'])} faster, but {numerics_problem(r['record'])}"
        for _, r in choice.faster_unsafe.iterrows()
    ]
    return note("No faster choice is safe: ", "; ".join(reasons), ".", kind="warn")


def off_policy_text(choice: Choice) -> Html | None:
    """Faster, numerically fine settings the AMP policy rules out: a finding, not a choice."""
    if choice.faster_off_policy.empty:
        return None
    found = [
        f"{setting_label(r['backend'], r['precision'])} measured {fmt_ratio(choice.best['median_ms'] / r['median_ms'])} faster with acceptable numerics"
        for _, r in choice.faster_off_policy.iterrows()
    ]
    return note(
        "; ".join(found),
        ", but the device layer never trains with AMP there (amp_supported is false: the policy "
        "assumes a CPU without bf16 hardware, where autocast is 14 to 31 times slower). On this "
        "machine the measurement contradicts that policy; see the AMP policy section.",
        kind="warn",
    )


def caution_text(best: pd.Series, frame: pd.DataFrame) -> str | None:
    """Flags on the records the answer rests on (the choice and the CPU fp32 baseline)."""
    baseline = frame[
        (frame["model"] == best["model"])
        & (frame["mode"] == "train")
        & (frame["backend"] == "cpu")
        & (frame["precision"] == "fp32")
        & (frame["status"] == "ok")
    ]
    flagged = []
    for row in [best, *(row for index, row in baseline.iterrows() if index != best.name)]:
        flags = flags_of(row["record"])
        if flags:
            flagged.append(f"{setting_label(row['backend'], row['precision'])}: {', '.join(flags)}")
    if not flagged:
        return None
    return (
        "Treat these timings with care, and rerun the benchmarks on an idle machine to confirm: "
        + "; ".join(flagged)
        + "."
    )


def shipped_default_line(results: Results, config: dict[str, Any] | None) -> str | None:
    """What device=auto, amp=auto trains with here, so a reader sees whether to change anything."""
    env = results.env
    if not env:
        return None
    backend = env.get("auto")
    precision = default_precision(env, backend, config)
    if precision is None:
        return None
    return f"The shipped defaults (device=auto, amp=auto) train with {setting_label(backend, precision)} here; the AMP policy section checks that against the measurements."


def trained_runs_line(runs: list[RunResults]) -> Html:
    if not runs:
        return note(
            "Trained runs: none yet (no results/train, results/eval or results/profile outputs)."
        )
    items = []
    for run in runs:
        scores = run_scores(run)
        items.append(
            f"{run.name}: best F1 {fmt_float(scores['best_f1'])}, AP@.5 {fmt_float(scores['ap50'])}"
        )
    return tag("p", tag("strong", "Trained runs: "), "; ".join(items), ".")


def run_scores(run: RunResults) -> dict[str, float | None]:
    """Best F1 and AP@.5: from the evaluation where it ran, else the last validation of training."""
    if run.evaluation:
        metrics = run.evaluation["metrics"]
        return {"best_f1": number(metrics.get("best_f1")), "ap50": number(metrics.get("ap50"))}
    final = (run.summary or {}).get("final_val") or {}
    return {"best_f1": number(final.get("best_f1")), "ap50": number(final.get("ap50"))}


# ---- section: environment ----------------------------------------------------------------


def environment_section(env: dict[str, Any] | None) -> Html:
    if not env:
        return section(
            "environment",
            note(
                "No env.json under the results folder: run ",
                tag("code", "python -m pipeline check-env --output results/env.json"),
                ".",
                kind="warn",
            ),
        )
    rows = []
    for name, entry in (env.get("backends") or {}).items():
        entry = entry if isinstance(entry, dict) else {}
        available = bool(entry.get("available"))
        detail = (
            entry.get("description")
            if available
            else f"missing: {entry.get('reason') or 'no reason recorded'}"
        )
        rows.append(
            [
                backend_label(name),
                Cell("yes" if available else "no", "good" if available else "bad"),
                "on" if entry.get("amp_default") else "off",
                "yes" if entry.get("amp_supported") else "no",
                detail,
            ]
        )
    platform = env.get("platform") or {}
    versions = env.get("versions") or {}
    facts = [
        ("auto chose", backend_label(env.get("auto"))),
        (
            "CPU",
            f"{platform.get('cpu_model', 'n/a')}, {platform.get('cpu_count', 'n/a')} cores; torch uses {platform.get('torch_threads', 'n/a')} threads",
        ),
        ("OS", platform.get("os", "n/a")),
        (
            "versions",
            ", ".join(f"{key} {value}" for key, value in versions.items() if value) or "n/a",
        ),
    ]
    facts += gpu_facts(env)
    return section(
        "environment",
        table(
            [
                "Backend",
                "Available",
                "AMP default",
                "AMP supported",
                "Device, or why it is missing",
            ],
            rows,
        ),
        definition_list(facts),
    )


def gpu_facts(env: dict[str, Any]) -> list[tuple[str, str]]:
    facts = []
    cuda = env.get("cuda") or {}
    for gpu in cuda.get("devices") or []:
        facts.append(
            (
                f"cuda:{gpu.get('index')}",
                f"{gpu.get('name')}, {gpu.get('total_memory_gib')} GiB, compute capability {gpu.get('capability')}, {gpu.get('multiprocessors')} SMs",
            )
        )
    if cuda.get("built"):
        visible = cuda.get("visible_devices_env")
        facts.append(
            (
                "CUDA build",
                f"torch built for CUDA {cuda.get('version')}, cuDNN {cuda.get('cudnn') or 'n/a'}; CUDA_VISIBLE_DEVICES {'unset' if visible is None else repr(visible)}",
            )
        )
    mps = env.get("mps") or {}
    if mps.get("built") or mps.get("macos"):
        facts.append(
            (
                "MPS",
                f"built: {yes_no(mps.get('built'))}, available: {yes_no(mps.get('available'))}, macOS {mps.get('macos') or 'n/a'}",
            )
        )
    return facts


# ---- section: benchmarks -----------------------------------------------------------------


def benchmarks_section(frame: pd.DataFrame) -> Html:
    if frame.empty:
        return section(
            "benchmarks",
            note(
                "No benchmark records under results/bench yet: run ",
                tag("code", "snakemake --cores 1 bench"),
                ".",
                kind="warn",
            ),
        )
    models = list(dict.fromkeys(frame["model"]))
    with_model = len(models) > 1
    headers = [
        "Backend",
        "Precision",
        "Mode",
        "Batch",
        "Median ms/step (IQR)",
        "Images/s",
        "Speed-up vs backend fp32",
        "Speed-up vs CPU fp32",
        "Peak memory",
        "Loss rel. diff",
        "Output max rel. diff",
        "Numerics OK",
    ]
    headers = ["Model", *headers] if with_model else headers
    rows = [bench_table_row(row, len(headers), with_model) for _, row in frame.iterrows()]
    skipped = int((frame["status"] == "skipped").sum())
    model_text = "" if with_model else f" Model: {models[0]}."
    parts = [
        tag(
            "p",
            "Medians over the timed steps after warm-up, with the interquartile range (IQR); a speed-up above 1× is faster than the reference. Numerics compare the autocast loss and outputs with fp32 on the same weights and batch."
            + model_text,
        ),
        bench_chart(frame),
        table(headers, rows),
    ]
    if any(
        output_rel_diff_is_partial(row["record"].get("numerics")) for _, row in frame.iterrows()
    ):
        parts.append(
            note(
                "* The overall output max rel. diff is undefined (recorded as null) because an fp32 output is all zero; the figure shown is the largest per-output one that is defined."
            )
        )
    if skipped:
        parts.append(
            note(
                f"{skipped} combination(s) were skipped: the backend cannot run them (the row gives the reason)."
            )
        )
    return section("benchmarks", *parts)


def bench_table_row(row: pd.Series, width: int, with_model: bool) -> Row:
    record = row["record"]
    head = [backend_label(row["backend"]), row["precision"], row["mode"]]
    head = [row["model"], *head] if with_model else head
    if row["status"] != "ok":
        return Row(
            [
                *head,
                Cell(
                    f"skipped: {row['reason'] or 'no reason recorded'}",
                    "skipped",
                    colspan=width - len(head),
                ),
            ]
        )
    numerics = record.get("numerics")
    flags = flags_of(record)
    cells = [
        *head,
        Cell(f"{record.get('batch_size')} × {record.get('image_size')}²", "nowrap"),
        num(
            Html(
                esc(fmt_ms(row["median_ms"]))
                + tag("span", f" ({fmt_ms(row['iqr_ms'])})", class_="muted")
            )
        ),
        num(fmt_float(row["images_per_s"], 1)),
        speed_cell(row["vs_backend_fp32"]),
        speed_cell(row["vs_cpu_fp32"]),
        Cell(
            memory_text(record.get("memory"), record.get("host_peak_rss_mb"), row["backend"]),
            "memory",
        ),
        *numerics_cells(row["precision"], numerics),
    ]
    return Row(
        cells,
        Html(tag("span", "flags: ", class_="flag-label") + esc("; ".join(flags)))
        if flags
        else None,
    )


def speed_cell(value: Any) -> Cell:
    value = number(value)
    if value is None:
        return num("n/a")
    kind = (
        "good" if value > 1 + SPEEDUP_TOLERANCE else "bad" if value < 1 - SPEEDUP_TOLERANCE else ""
    )
    return num(fmt_ratio(value), class_=kind)


def numerics_cells(precision: str, numerics: dict[str, Any] | None) -> list[Any]:
    if precision == "fp32":
        return [num("reference"), num("reference"), Cell("yes (reference)", "good")]
    if not numerics:
        return [num("n/a"), num("n/a"), Cell("not measured", "bad")]
    acceptable = numerics.get("acceptable") is True
    return [
        num(fmt_rel(numerics.get("loss_rel_diff"))),
        output_rel_diff_cell(numerics),
        Cell(
            "yes" if acceptable else "no",
            "good" if acceptable else "bad",
            title=numerics.get("acceptable_rule"),
        ),
    ]


def output_rel_diff_is_partial(numerics: Any) -> bool:
    return (
        isinstance(numerics, dict)
        and number(numerics.get("output_max_rel_diff")) is None
        and bool(numerics.get("outputs"))
    )


def output_rel_diff_cell(numerics: dict[str, Any]) -> Cell:
    """The overall figure, or the largest defined per-output one when an all-zero fp32 output made it undefined."""
    overall = number(numerics.get("output_max_rel_diff"))
    if overall is not None:
        return num(fmt_rel(overall))
    outputs = numerics.get("outputs") or {}
    defined = {
        key: number(value.get("max_rel_diff"))
        for key, value in outputs.items()
        if isinstance(value, dict)
    }
    undefined = sorted(key for key, value in defined.items() if value is None)
    defined = {key: value for key, value in defined.items() if value is not None}
    if not defined:
        return num("n/a", title="relative difference undefined: the fp32 outputs are all zero")
    key = max(defined, key=lambda k: defined[k])
    title = f"largest over outputs with a defined relative difference ({key}); undefined for {', '.join(undefined)} (fp32 output all zero)"
    return num(f"{fmt_rel(defined[key])}*", title=title)


# ---- section: AMP policy -----------------------------------------------------------------


def default_precision(
    env: dict[str, Any], backend: Any, config: dict[str, Any] | None
) -> str | None:
    """What amp=auto trains with on `backend`, by the policy env.json recorded."""
    entry = (env.get("backends") or {}).get(backend)
    if not isinstance(entry, dict) or not isinstance(entry.get("resolved_amp"), dict):
        return None
    amp_dtype = (config or {}).get("amp_dtype") or "fp16"
    return amp_dtype if entry["resolved_amp"].get("auto") else "fp32"


def amp_policy_section(results: Results, config: dict[str, Any] | None) -> Html:
    env, frame = results.env, results.bench
    if not env:
        return section(
            "amp-policy", note("No env.json, so the shipped AMP defaults are unknown.", kind="warn")
        )
    model = answer_model(frame, config)
    rows, verdicts = [], []
    for backend in env.get("backends") or {}:
        records = frame[frame["backend"] == backend]
        if records.empty:
            continue
        default = default_precision(env, backend, config)
        verdict = amp_verdict(frame, backend, default, model, amp_allowed(env, backend))
        verdicts.append(tag("li", verdict))
        rows.append(amp_policy_row(frame, backend, default, model))
    if not rows:
        return section("amp-policy", note("No benchmark records for any backend in env.json yet."))
    parts = [tag("ul", *verdicts, class_="verdicts")]
    parts.append(
        table(
            [
                "Backend",
                "Shipped default (amp=auto)",
                *(f"{p} train ms/step" for p in PRECISIONS),
                "Fastest with acceptable numerics",
            ],
            rows,
        )
    )
    parts.append(
        tag(
            "p",
            f"Measured on training steps of {model or 'n/a'}. The shipped default is what amp=auto resolves to on each backend (env.json); "
            + (
                f"your config sets amp={config_text(config.get('amp', 'auto'))}."
                if config
                else "no config was given to compare with."
            ),
            class_="small",
        )
    )
    return section("amp-policy", *parts)


def config_text(value: Any) -> str:
    """A config value as the user writes it: true/false rather than Python's True/False."""
    return json.dumps(value) if isinstance(value, bool) else str(value)


def policy_rows(frame: pd.DataFrame, backend: str, model: str | None) -> pd.DataFrame:
    rows = frame[(frame["backend"] == backend) & (frame["mode"] == "train")]
    if model is not None and model in set(rows["model"]):
        return rows[rows["model"] == model]
    return rows[rows["model"] == rows["model"].iloc[0]] if not rows.empty else rows


def amp_policy_row(
    frame: pd.DataFrame, backend: str, default: str | None, model: str | None
) -> list[Any]:
    rows = policy_rows(frame, backend, model)
    cells = []
    for precision in PRECISIONS:
        match = rows[rows["precision"] == precision]
        if match.empty:
            cells.append(num("not run"))
        elif match.iloc[0]["status"] != "ok":
            cells.append(num("skipped", title=match.iloc[0]["reason"]))
        else:
            row = match.iloc[0]
            cells.append(
                num(
                    f"{fmt_ms(row['median_ms'])}{'' if row['safe'] else ' (numerics not acceptable)'}"
                )
            )
    safe = rows[rows["safe"] & rows["median_ms"].notna()].sort_values("median_ms")
    fastest = safe.iloc[0]["precision"] if not safe.empty else "none"
    shipped = (
        "n/a"
        if default is None
        else ("AMP off: fp32" if default == "fp32" else f"AMP on: {default}")
    )
    return [backend_label(backend), shipped, *cells, fastest]


def amp_verdict(
    frame: pd.DataFrame,
    backend: str,
    default: str | None,
    model: str | None,
    allowed: bool = True,
) -> str:
    """One line: does the measurement confirm the shipped default, or suggest another setting?"""
    label = backend_label(backend)
    rows = policy_rows(frame, backend, model)
    if default is None:
        return f"{label}: no AMP policy recorded in env.json."
    policy = "AMP off by default" if default == "fp32" else f"AMP on ({default}) by default"
    ok = rows[(rows["status"] == "ok") & rows["median_ms"].notna()]
    if ok.empty:
        return (
            f"{label}: {policy}; no training benchmark ran on this backend, so it is unconfirmed."
        )
    times = {row["precision"]: row for _, row in ok.iterrows()}
    safe = ok[ok["safe"]].sort_values("median_ms")
    if safe.empty:
        return f"{label}: {policy}; no precision passed the numerics check, so nothing can be recommended."
    best = safe.iloc[0]
    if default not in times:
        return f"{label}: {policy}; {default} was not measured (skipped or not run), and {best['precision']} is the fastest with acceptable numerics: {suggestion(best['precision'])}."
    default_row = times[default]
    if not default_row["safe"]:
        return f"{label}: {policy}, but {default} failed the numerics check ({numerics_problem(default_row['record'])}): {suggestion(best['precision'])}."
    if best["precision"] == default:
        return f"{label}: {policy}; {compare_text(times, default)}: default confirmed."
    gain = default_row["median_ms"] / best["median_ms"]
    if gain <= 1 + SPEEDUP_TOLERANCE:
        return f"{label}: {policy}; {compare_text(times, default)}: within {SPEEDUP_TOLERANCE:.0%} of the fastest, so the default is confirmed."
    if not allowed and best["precision"] != "fp32":
        return (
            f"{label}: AMP off by policy (amp_supported is false, so amp=true trains in fp32 too); "
            f"{best['precision']} measured {fmt_ratio(gain)} faster than {default} with acceptable "
            "numerics: default not confirmed on this machine (the policy assumes no bf16 hardware)."
        )
    return f"{label}: {policy}; {best['precision']} measured {fmt_ratio(gain)} faster than {default} with acceptable numerics: {suggestion(best['precision'])}."


def compare_text(times: dict[str, pd.Series], default: str) -> str:
    """How each other measured precision compares with the default one."""
    reference = times[default]
    others = [
        f"{precision} measured {fmt_speed(reference['median_ms'] / row['median_ms'], default)}"
        + ("" if row["safe"] else " (numerics not acceptable)")
        for precision, row in times.items()
        if precision != default
    ]
    return "; ".join(others) if others else f"only {default} was measured"


def suggestion(precision: str) -> str:
    if precision == "fp32":
        return "consider amp=false"
    return f"consider amp=true amp_dtype={precision}"


# ---- section: training -------------------------------------------------------------------


def training_section(runs: list[RunResults], colors: dict[str, str]) -> Html:
    trained = [run for run in runs if run.summary or run.metrics]
    if not trained:
        return section(
            "training",
            note(
                "No training runs under results/train yet: run ",
                tag("code", "snakemake --cores 1 train"),
                ".",
                kind="warn",
            ),
        )
    parts: list[Any] = [
        training_chart(trained, colors) or note("No metrics.jsonl rows to plot yet.")
    ]
    parts.append(
        table(
            [
                "Run",
                "Device",
                "Precision",
                "Epochs",
                "Wall time",
                "Images/s",
                "Peak device memory",
                "Host RSS",
                "Best F1 (epoch)",
            ],
            [training_row(run) for run in trained],
        )
    )
    for run in trained:
        if run.metrics_note:
            parts.append(note(f"{run.name}: {run.metrics_note}"))
        if not run.summary:
            parts.append(
                note(
                    f"{run.name}: no train_summary.json (training still running, or it stopped early)."
                )
            )
    if len(trained) > 1:
        parts.extend(run_comparison(trained, colors))
    return section("training", *parts)


def swept_values(name: str) -> dict[str, Any]:
    """The settings a run's name carries beyond device and precision (a sweep's values)."""
    try:
        return dict(parse_run(name).sweep)
    except PipelineError:
        return {}


def run_comparison(runs: list[RunResults], colors: dict[str, str]) -> list[Html]:
    """Runs side by side: what differs between them, and accuracy against training time."""
    keys = sorted({key for run in runs for key in swept_values(run.name)})
    rows = []
    for run in runs:
        values, scores = swept_values(run.name), run_scores(run)
        summary = run.summary or {}
        rows.append(
            [
                run.name,
                *(num(esc(values.get(key, "—"))) for key in keys),
                f"{summary.get('backend', 'n/a')} {summary.get('precision', '')}".strip(),
                num(fmt_seconds(summary.get("wall_time_s"))),
                num(fmt_float(scores["best_f1"])),
                num(fmt_float(scores["ap50"])),
            ]
        )
    parts = [
        tag("h3", "Runs compared"),
        table(["Run", *keys, "Backend, precision", "Wall time", "Best F1", "AP@.5"], rows),
    ]
    chart = accuracy_time_chart(runs, colors)
    if chart:
        parts.append(chart)
    return parts


def accuracy_time_chart(runs: list[RunResults], colors: dict[str, str]) -> Html | None:
    """Each run as a point: training wall time against AP@.5 (circles) and best F1 (squares)."""
    points = [
        (run, number((run.summary or {}).get("wall_time_s")), run_scores(run)) for run in runs
    ]
    points = [(run, wall, scores) for run, wall, scores in points if wall is not None]
    if not points:
        return None
    figure = Figure(figsize=(6.4, 3.6))
    axes = figure.subplots()
    for run, wall, scores in points:
        for key, marker in (("ap50", "o"), ("best_f1", "s")):
            if scores[key] is not None:
                axes.scatter(wall, scores[key], marker=marker, color=colors[run.name], s=36)
        axes.annotate(
            mpl_text(run.name),
            (wall, scores["ap50"] or scores["best_f1"] or 0),
            fontsize=7,
            xytext=(4, 4),
            textcoords="offset points",
        )
    axes.set(
        xlabel="training wall time (s)",
        ylabel="score",
        title="Accuracy against training time",
        ylim=(-0.02, 1.02),
    )
    axes.title.set_fontsize(10)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    return figure_html(
        figure, "Training wall time against AP@.5 (circles) and best F1 (squares) for each run"
    )


def training_row(run: RunResults) -> list[Any]:
    summary = run.summary or {}
    best, epoch = best_f1(run)
    amp = "AMP " if summary.get("amp") else ""
    wall = summary.get("wall_time_s")
    return [
        run.name,
        summary.get("device_description", "n/a"),
        f"{amp}{summary.get('precision', 'n/a')}",
        num(summary.get("epochs", "n/a")),
        num(fmt_seconds(wall)),
        num(fmt_float(summary.get("images_per_s"), 1)),
        device_memory_text(summary.get("peak_memory"), summary.get("backend")),
        num(fmt_mb(summary.get("host_peak_rss_mb"))),
        num(f"{fmt_float(best)} ({epoch})" if best is not None else "n/a"),
    ]


def best_f1(run: RunResults) -> tuple[float | None, Any]:
    """Highest validation F1 and its epoch, from the metrics rows (the summary monitors any metric)."""
    points = [
        (number(row["val"].get("f1")), row.get("epoch"))
        for row in run.metrics
        if row.get("type") == "epoch" and isinstance(row.get("val"), dict)
    ]
    points = [(value, epoch) for value, epoch in points if value is not None]
    if points:
        return max(points, key=lambda point: point[0])
    summary = run.summary or {}
    if summary.get("monitor") == "f1" and number(summary.get("best_metric")) is not None:
        return number(summary["best_metric"]), summary.get("best_epoch")
    return None, None


# ---- section: evaluation -----------------------------------------------------------------


def evaluation_section(runs: list[RunResults], config: dict[str, Any] | None) -> Html:
    evaluated = [run for run in runs if run.evaluation]
    if not evaluated:
        return section(
            "evaluation",
            note(
                "No evaluation results under results/eval yet: run ",
                tag("code", "snakemake --cores 1 evaluate"),
                ".",
                kind="warn",
            ),
        )
    headers = [
        "Run",
        "Checkpoint epoch",
        "Score threshold",
        "Precision",
        "Recall",
        "F1",
        "Best F1 (threshold)",
        "AP@.5",
        "AP@[.5:.95]",
        "AP@.75",
        "Images",
        "Ground truth",
        "Detections",
    ]
    parts = [
        tag(
            "p",
            "Precision, recall and F1 are micro-averaged over classes at IoU ≥ 0.5 and the score threshold; best F1 is at the threshold that maximises it. AP follows COCO (AP@[.5:.95] averages IoU 0.5 to 0.95).",
        ),
        table(headers, [evaluation_row(run) for run in evaluated]),
        tag("h3", "Average precision per class"),
        per_class_table(evaluated),
        tag("h3", "Validation images"),
        prediction_grid(runs, config),
    ]
    return section("evaluation", *parts)


def evaluation_row(run: RunResults) -> list[Any]:
    evaluation = run.evaluation or {}
    metrics = evaluation["metrics"]
    micro = metrics.get("micro") if isinstance(metrics.get("micro"), dict) else metrics
    best = metrics.get("best") if isinstance(metrics.get("best"), dict) else {}
    threshold = best.get("threshold", metrics.get("best_f1_threshold"))
    return [
        run.name,
        num(evaluation.get("checkpoint_epoch", "n/a")),
        num(fmt_float(metrics.get("score_threshold"), 2)),
        num(fmt_float(micro.get("precision"))),
        num(fmt_float(micro.get("recall"))),
        num(fmt_float(micro.get("f1"))),
        num(f"{fmt_float(metrics.get('best_f1'))} ({fmt_float(threshold, 2)})"),
        num(fmt_float(metrics.get("ap50"))),
        num(fmt_float(metrics.get("ap"))),
        num(fmt_float(metrics.get("ap75"))),
        num(metrics.get("num_images", "n/a")),
        num(metrics.get("num_ground_truth", "n/a")),
        num(metrics.get("num_detections", "n/a")),
    ]


def per_class_table(runs: list[RunResults]) -> Html:
    per_run = {run.name: class_rows(run) for run in runs}
    classes = list(dict.fromkeys(name for rows in per_run.values() for name in rows))
    if not classes:
        return note("The evaluation files hold no per-class results.")
    headers = ["Class", "Ground truth"] + [Html(f"{esc(name)}<br>AP@.5 / AP") for name in per_run]
    rows = []
    for name in classes:
        num_gt = next(
            (rows_[name].get("num_gt") for rows_ in per_run.values() if name in rows_), "n/a"
        )
        cells = [
            num(
                f"{fmt_float(r[name].get('ap50'))} / {fmt_float(r[name].get('ap'))}"
                if name in r
                else "n/a"
            )
            for r in per_run.values()
        ]
        rows.append([name, num(num_gt), *cells])
    return table(headers, rows)


def class_rows(run: RunResults) -> dict[str, dict[str, Any]]:
    rows = (run.evaluation or {})["metrics"].get("per_class") or []
    return {str(row.get("name")): row for row in rows if isinstance(row, dict)}


def prediction_grid(runs: list[RunResults], config: dict[str, Any] | None) -> Html:
    run = next((run for run in runs if run.predictions_path), None)
    if run is None:
        return note(
            "No predictions file (results/eval/<run>_predictions.json), so no images to show."
        )
    predictions = read_json_object(run.predictions_path, "predictions", ("images", "class_names"))
    if not isinstance(predictions["images"], list) or not isinstance(
        predictions["class_names"], list
    ):
        raise ResultsFileError(
            f"{run.predictions_path}: 'images' and 'class_names' must be lists. Delete it and rerun the evaluation."
        )
    threshold = score_threshold(run, config)
    shown, missing = [], []
    for item in predictions["images"]:
        if len(shown) == MAX_GRID_IMAGES:
            break
        if not isinstance(item, dict):
            continue
        image = open_image(item.get("file"), run.predictions_path)
        if image is None:
            missing.append(str(item.get("file")))
        else:
            shown.append((item, image))
    parts = []
    if shown:
        caption = f"{run.name}: ground truth in green, detections with score ≥ {threshold:.2f} in red (at most {MAX_DRAWN_DETECTIONS} per image)."
        parts.append(
            figure_html(
                draw_predictions(shown, predictions["class_names"], threshold),
                f"Validation images of {run.name} with ground-truth and detected boxes",
                caption,
                palette=True,
            )
        )
    if missing:
        listed = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        parts.append(
            note(
                f"{len(missing)} image file(s) named in {run.predictions_path.name} could not be read and are left out: {listed}.",
                kind="warn",
            )
        )
    if not parts:
        parts.append(note(f"{run.predictions_path.name} lists no images."))
    return join(parts)


def score_threshold(run: RunResults, config: dict[str, Any] | None) -> float:
    from_eval = number(((run.evaluation or {}).get("metrics") or {}).get("score_threshold"))
    if from_eval is not None:
        return from_eval
    from_config = number(((config or {}).get("eval") or {}).get("score_threshold"))
    return from_config if from_config is not None else 0.3


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


def draw_predictions(
    shown: list[tuple[dict[str, Any], Any]], class_names: list[Any], threshold: float
) -> Figure:
    columns = min(4, len(shown))
    rows = math.ceil(len(shown) / columns)
    figure = Figure(figsize=(2.6 * columns, 2.6 * rows))
    for index, (item, image) in enumerate(shown):
        axes = figure.add_subplot(rows, columns, index + 1)
        axes.imshow(image, interpolation="nearest")
        axes.set_axis_off()
        draw_boxes(axes, item.get("ground_truth") or {}, class_names, None, "#1a9641")
        drawn = draw_boxes(axes, item.get("detections") or {}, class_names, threshold, "#d7191c")
        axes.set_title(
            mpl_text(f"{Path(str(item.get('file'))).name}: {drawn} detection(s)"), fontsize=7
        )
    figure.tight_layout()
    return figure


def draw_boxes(
    axes, group: dict[str, Any], class_names: list[Any], threshold: float | None, color: str
) -> int:
    """Boxes of one kind; with a threshold, only detections above it, labelled 'class score'."""
    boxes = group.get("boxes") or []
    labels = group.get("labels") or []
    scores = group.get("scores") or [None] * len(boxes)
    items = list(zip(boxes, labels, scores, strict=False))
    if threshold is not None:
        items = [item for item in items if number(item[2]) is not None and item[2] >= threshold]
        items = sorted(items, key=lambda item: -item[2])[:MAX_DRAWN_DETECTIONS]
    for box, label, score in items:
        if not isinstance(box, list) or len(box) != 4 or any(number(v) is None for v in box):
            continue
        x0, y0, x1, y1 = box
        axes.add_patch(
            Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, edgecolor=color, linewidth=1.2)
        )
        if threshold is not None:
            name = (
                class_names[label]
                if isinstance(label, int) and 0 <= label < len(class_names)
                else f"class {label}"
            )
            # Labels of boxes in the right half end at the box's right edge, so they stay inside.
            right_half = x0 > sum(axes.get_xlim()) / 2
            axes.text(
                x1 if right_half else x0,
                y0,
                mpl_text(f"{name} {score:.2f}"),
                fontsize=5.5,
                color="white",
                ha="right" if right_half else "left",
                va="bottom",
                clip_on=True,
                bbox={"facecolor": color, "edgecolor": "none", "pad": 0.6, "alpha": 0.85},
            )
    return len(items)


# ---- section: profile --------------------------------------------------------------------


def profile_section(runs: list[RunResults], colors: dict[str, str], out: Path) -> Html:
    profiled = [run for run in runs if run.profile]
    if not profiled:
        return section(
            "profile",
            note(
                "No inference profile under results/profile yet: run ",
                tag("code", "snakemake --cores 1 profile"),
                ".",
                kind="warn",
            ),
        )
    headers = [
        "Run",
        "Device",
        "Precision",
        "Batch",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "Images/s",
        "Peak memory",
        "Flags",
    ]
    rows = [
        latency_row(run, row)
        for run in profiled
        for row in run.profile["latency"]
        if isinstance(row, dict)
    ]
    parts: list[Any] = [latency_chart(profiled, colors), table(headers, rows)]
    for run in profiled:
        parts.append(operators_block(run, out))
    return section("profile", *parts)


def latency_row(run: RunResults, row: dict[str, Any]) -> list[Any]:
    profile = run.profile or {}
    wall = row.get("wall") or {}
    flags = [
        flag
        for flag, on in (
            ("noisy", wall.get("noisy")),
            ("budget-limited", wall.get("budget_limited")),
        )
        if on
    ]
    return [
        run.name,
        profile.get("device_description", "n/a"),
        profile.get("precision", "n/a"),
        num(row.get("batch_size", "n/a")),
        num(fmt_ms(wall.get("p50_ms"))),
        num(fmt_ms(wall.get("p90_ms"))),
        num(fmt_ms(wall.get("p99_ms"))),
        num(fmt_float(row.get("throughput_images_per_s"), 1)),
        device_memory_text(row.get("memory"), profile.get("backend")),
        ", ".join(flags),
    ]


def operators_of(run: RunResults) -> dict[str, Any] | None:
    """The profiler block of profile.json, or operators.json beside it."""
    profiler = (run.profile or {}).get("profiler")
    if isinstance(profiler, dict):
        return profiler
    path = (run.profile_dir or Path()) / "operators.json"
    return read_json_object(path, "operator profile") if path.exists() else None


def operators_block(run: RunResults, out: Path) -> Html:
    profiler = operators_of(run)
    heading = tag("h3", f"Top operators: {run.name}")
    if not profiler:
        return join([heading, note(f"{run.name}: no operator profile recorded.")])
    rows = [
        [
            op.get("name"),
            num(op.get("calls", "n/a")),
            num(fmt_float(op.get("self_cpu_ms"))),
            num(fmt_float(op.get("self_device_ms"))),
            num(f"{100 * (number(op.get('share')) or 0):.1f}%"),
        ]
        for op in (profiler.get("top_operators") or [])[:TOP_OPERATORS]
        if isinstance(op, dict)
    ]
    intro = f"Batch {profiler.get('batch_size')}, {profiler.get('steps')} forward pass(es), sorted by {profiler.get('sorted_by')}; activities: {', '.join(map(str, profiler.get('activities') or []))}."
    parts = [
        heading,
        tag("p", intro),
        table(["Operator", "Calls", "Self CPU ms", "Self device ms", "Share"], rows)
        if rows
        else note("No operators recorded."),
    ]
    parts.append(trace_link(run, profiler, out))
    if profiler.get("note"):
        parts.append(note(profiler["note"], kind="warn"))
    return join(parts)


def trace_link(run: RunResults, profiler: dict[str, Any], out: Path) -> Html:
    """A link relative to the report, so the results folder can move with the report in it."""
    trace = (run.profile_dir or Path()) / Path(str(profiler.get("trace") or "trace.json")).name
    if not trace.exists():
        return note(f"{run.name}: the trace file {trace.name} is missing.")
    relative = Path(os.path.relpath(trace.resolve(), out.resolve().parent)).as_posix()
    link = tag("a", relative, href=urllib.parse.quote(relative))
    return tag(
        "p", "Chrome trace: ", link, " (open it in Perfetto or chrome://tracing).", class_="small"
    )


# ---- section: provenance -----------------------------------------------------------------


def provenance_section(
    results: Results, config: dict[str, Any] | None, generated: datetime
) -> Html:
    parts: list[Any] = [
        definition_list([*git_facts(results.root), ("report generated", fmt_time(generated))])
    ]
    parts.append(tag("h3", "Resolved configuration"))
    if config:
        parts.append(
            tag(
                "pre",
                yaml.safe_dump(
                    config, sort_keys=False, allow_unicode=True, default_flow_style=False
                ),
                class_="config",
            )
        )
    else:
        parts.append(
            note(
                "No configuration was given (--config-json or --config); each run's own config is in results/train/<run>/config.json."
            )
        )
    parts.append(tag("h3", "Input files"))
    parts.append(files_table(results))
    parts.append(tag("h3", "Snakemake job statistics"))
    parts.append(job_stats_table(results.job_stats))
    parts.append(tag("h3", "Reproduce"))
    parts.append(
        tag("ul", *(tag("li", f"{what}: ", tag("code", command)) for what, command in REPRODUCE))
    )
    return section("provenance", *parts)


def git_facts(folder: Path) -> list[tuple[str, str]]:
    commit = git_output(folder, "rev-parse", "HEAD")
    if commit is None:
        return [("git commit", "unknown (not a git checkout, or no commit yet)")]
    status = git_output(folder, "status", "--porcelain")
    if status is None:
        state = "unknown"
    else:
        lines = [line for line in status.splitlines() if line.strip()]
        untracked = sum(line.startswith("??") for line in lines)
        changed = len(lines) - untracked
        state = (
            "clean" if not lines else f"dirty: {changed} changed and {untracked} untracked file(s)"
        )
    return [("git commit", commit.strip()), ("working tree", state)]


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


def files_table(results: Results) -> Html:
    rows = [
        [path.relative_to(results.root).as_posix(), created or "n/a", file_time(path)]
        for path, created in results.files.items()
    ]
    return table(["File (under the results folder)", "Recorded as created", "Last modified"], rows)


def file_time(path: Path) -> str:
    try:
        return fmt_time(datetime.fromtimestamp(path.stat().st_mtime, UTC))
    except OSError:
        return "n/a"


def job_stats_table(stats: pd.DataFrame | None) -> Html:
    if stats is None:
        return note("No Snakemake job statistics (results/job_stats/**/*.tsv) yet.")
    rows = [
        [
            row["job"],
            num(fmt_float(row["wall_s"], 2)),
            num(fmt_float(row["max_rss_mb"], 0)),
            num(fmt_float(row["cpu_time_s"], 2)),
            num(fmt_float(row["mean_load"], 1)),
        ]
        for _, row in stats.iterrows()
    ]
    return table(
        ["Job (rule/wildcards)", "Wall s", "Max RSS MB", "CPU time s", "Mean load %"], rows
    )


# ---- the page --------------------------------------------------------------------------


def section(id_: str, *body: Any) -> Html:
    return tag("section", tag("h2", SECTIONS[id_]), *body, id=id_)


def build(results_dir: str | Path, out: str | Path, config: dict[str, Any] | None = None) -> Path:
    """Read every result under `results_dir` and write the report to `out` atomically."""
    results = load_results(Path(results_dir))
    out = Path(out)
    return atomic.write_text(out, render(results, config, out, datetime.now(UTC)))


def render(results: Results, config: dict[str, Any] | None, out: Path, generated: datetime) -> str:
    colors = run_colors(results.runs)
    sections = [
        answer_section(results, config),
        environment_section(results.env),
        benchmarks_section(results.bench),
        amp_policy_section(results, config),
        training_section(results.runs, colors),
        evaluation_section(results.runs, config),
        profile_section(results.runs, colors, out),
        provenance_section(results, config, generated),
    ]
    return page(sections, results.root, generated)


def page(sections: list[Html], root: Path, generated: datetime) -> str:
    nav = tag(
        "nav",
        tag("ul", *(tag("li", tag("a", title, href=f"#{id_}")) for id_, title in SECTIONS.items())),
    )
    header = tag(
        "header",
        tag("h1", "Which backend and precision to train with"),
        tag("p", f"Results folder {root} · generated {fmt_time(generated)}", class_="small"),
    )
    body = tag("body", header, nav, tag("main", *sections))
    head = Html(
        '<head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>Training backend report</title><style>{CSS}</style></head>"
    )
    return f'<!DOCTYPE html>\n<html lang="en">{head}{body}</html>\n'


CSS = """
:root { --fg: #1d2125; --muted: #5f6b76; --line: #d6dbe0; --zebra: #f5f7f9; --good: #1a7f37; --bad: #b42318;
        --accent: #2456a6; --warn-bg: #fff8e5; --warn-line: #e0a800; --info-bg: #eef4fb; --info-line: #7aa3d6; }
* { box-sizing: border-box; }
body { margin: 0 auto; max-width: 1180px; padding: 0 24px 48px; color: var(--fg); background: #fff;
       font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", Arial, sans-serif; }
header h1 { font-size: 1.6rem; margin: 24px 0 4px; }
nav ul { list-style: none; display: flex; flex-wrap: wrap; gap: 4px 16px; padding: 8px 0; margin: 0 0 8px;
         border-bottom: 1px solid var(--line); }
nav a { color: var(--accent); text-decoration: none; }
nav a:hover { text-decoration: underline; }
section { margin-top: 28px; }
h2 { font-size: 1.3rem; border-bottom: 2px solid var(--line); padding-bottom: 4px; margin-bottom: 12px; }
h3 { font-size: 1.05rem; margin: 20px 0 8px; }
.small { color: var(--muted); font-size: 0.88rem; }
.muted { color: var(--muted); }
.answer-box { border: 2px solid var(--accent); border-radius: 8px; padding: 12px 16px; background: #f7faff; }
.answer { font-size: 1.2rem; margin: 0 0 6px; }
.note { border-left: 4px solid var(--info-line); background: var(--info-bg); padding: 6px 10px; margin: 8px 0; }
.note-warn { border-left-color: var(--warn-line); background: var(--warn-bg); }
.table-wrap { overflow-x: auto; margin: 8px 0 12px; }
table { border-collapse: collapse; font-size: 0.84rem; min-width: 40%; }
th, td { border: 1px solid var(--line); padding: 4px 8px; vertical-align: top; text-align: left; }
th { background: #eef1f4; font-weight: 600; }
tbody:nth-of-type(even) { background: var(--zebra); }
tr.has-sub td { border-bottom: none; }
tr.sub td { border-top: none; padding-top: 0; font-size: 0.8rem; color: var(--muted); }
.flag-label { font-weight: 600; color: #9a6700; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.good, .good { color: var(--good); font-weight: 600; }
td.bad, .bad { color: var(--bad); font-weight: 600; }
td.nowrap { white-space: nowrap; }
td.memory { min-width: 9.5em; }
td.skipped { color: var(--muted); font-style: italic; }
tr:not(.sub) td:first-child { white-space: nowrap; }
dl { display: grid; grid-template-columns: max-content 1fr; gap: 2px 16px; margin: 8px 0; }
dt { font-weight: 600; color: var(--muted); }
dd { margin: 0; overflow-wrap: anywhere; }
figure { margin: 12px 0; }
figcaption { color: var(--muted); font-size: 0.85rem; }
img { display: block; }
pre.config { background: var(--zebra); border: 1px solid var(--line); padding: 8px 12px; font-size: 0.8rem;
             max-height: 480px; overflow: auto; white-space: pre-wrap; }
code { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 0.9em;
       background: var(--zebra); padding: 0 3px; border-radius: 3px; }
ul.verdicts li { margin: 4px 0; }
@media print {
  @page { margin: 12mm; }
  body { max-width: none; padding: 0; font-size: 10pt; }
  nav { display: none; }
  a { color: inherit; text-decoration: none; }
  h2, h3 { break-after: avoid; }
  table, figure, .answer-box, .note, dl { break-inside: avoid; }
  .table-wrap { overflow: visible; }
  table { font-size: 7.5pt; }
  tr.sub td { font-size: 7pt; }
  pre.config { max-height: none; overflow: visible; }
  tbody, th, .answer-box, .note { -webkit-print-color-adjust: exact; print-color-adjust: exact; }
}
"""
