"""What the report concludes from the measurements: plain functions on frames and records.

Which training setting to recommend, whether each backend's shipped AMP default holds on this
machine, which timings to trust less, and how runs compare. Nothing here knows about HTML;
the sentences returned are the verdicts themselves, shown as text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from pipeline.errors import PipelineError
from pipeline.report.formatting import (
    backend_label,
    fmt_float,
    fmt_ratio,
    fmt_rel,
    fmt_speed,
    number,
    setting_label,
)
from pipeline.report.load import PRECISIONS, RunResults
from pipeline.runs import parse_run

# A speed-up within this fraction of 1 is noise, not a reason to change a default.
SPEEDUP_TOLERANCE = 0.05
# Where neither the evaluation nor the config says which detections to draw.
DEFAULT_SCORE_THRESHOLD = 0.3


# ---- the recommended training setting ----------------------------------------------------


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
    others: pd.DataFrame  # measured, safe or not, and no faster than `best`
    cpu_fp32_ms: float | None
    faster_off_policy: pd.DataFrame  # safe and faster, but the AMP policy never trains with it

    @property
    def speedup_vs_cpu_fp32(self) -> float | None:
        if self.best is None or self.cpu_fp32_ms is None:
            return None
        return self.cpu_fp32_ms / self.best["median_ms"]

    @property
    def is_cpu_fp32(self) -> bool:
        """Whether the choice is the CPU fp32 baseline itself."""
        return (
            self.best is not None
            and self.best["backend"] == "cpu"
            and self.best["precision"] == "fp32"
        )


def amp_allowed(env: dict[str, Any] | None, backend: Any) -> bool:
    """Whether training can use AMP on `backend` (env.json's amp_supported; unknown: yes)."""
    entry = ((env or {}).get("backends") or {}).get(backend)
    return not isinstance(entry, dict) or bool(entry.get("amp_supported", True))


def trainable(row: pd.Series, env: dict[str, Any] | None) -> bool:
    """A setting the trainer can run: fp32 anywhere, autocast only where AMP is allowed."""
    return row["precision"] == "fp32" or amp_allowed(env, row["backend"])


def choose_setting(frame: pd.DataFrame, model: str, env: dict[str, Any] | None = None) -> Choice:
    """The fastest training setting of `model` with acceptable numerics that the trainer runs."""
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
    """Why a reduced-precision record's numerics do not count as acceptable."""
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


def answer_cautions(best: pd.Series, frame: pd.DataFrame) -> list[tuple[str, list[str]]]:
    """(setting, flags) of the records the answer rests on: the choice and the CPU fp32 baseline."""
    baseline = frame[
        (frame["model"] == best["model"])
        & (frame["mode"] == "train")
        & (frame["backend"] == "cpu")
        & (frame["precision"] == "fp32")
        & (frame["status"] == "ok")
    ]
    rows = [best, *(row for index, row in baseline.iterrows() if index != best.name)]
    flagged = [
        (setting_label(row["backend"], row["precision"]), flags_of(row["record"])) for row in rows
    ]
    return [(setting, flags) for setting, flags in flagged if flags]


def speed_verdict(speedup: Any) -> str | None:
    """'faster' or 'slower' when a speed-up is beyond the noise tolerance, else None."""
    value = number(speedup)
    if value is None:
        return None
    if value > 1 + SPEEDUP_TOLERANCE:
        return "faster"
    return "slower" if value < 1 - SPEEDUP_TOLERANCE else None


# ---- the AMP policy ------------------------------------------------------------------------


def default_precision(
    env: dict[str, Any], backend: Any, config: dict[str, Any] | None
) -> str | None:
    """What amp=auto trains with on `backend`, by the policy env.json recorded."""
    entry = (env.get("backends") or {}).get(backend)
    if not isinstance(entry, dict) or not isinstance(entry.get("resolved_amp"), dict):
        return None
    amp_dtype = (config or {}).get("amp_dtype") or "fp16"
    return amp_dtype if entry["resolved_amp"].get("auto") else "fp32"


def policy_rows(frame: pd.DataFrame, backend: str, model: str | None) -> pd.DataFrame:
    """Training records of `backend` for `model` (or for its first model when that is absent)."""
    rows = frame[(frame["backend"] == backend) & (frame["mode"] == "train")]
    if model is not None and model in set(rows["model"]):
        return rows[rows["model"] == model]
    return rows[rows["model"] == rows["model"].iloc[0]] if not rows.empty else rows


def precision_records(rows: pd.DataFrame) -> dict[str, pd.Series | None]:
    """Each precision's record among `rows` (policy_rows), None where it was not run."""
    return {
        precision: (
            match.iloc[0] if not (match := rows[rows["precision"] == precision]).empty else None
        )
        for precision in PRECISIONS
    }


def fastest_safe_precision(rows: pd.DataFrame) -> str | None:
    safe = rows[rows["safe"] & rows["median_ms"].notna()].sort_values("median_ms")
    return safe.iloc[0]["precision"] if not safe.empty else None


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


# ---- runs and their accuracy ---------------------------------------------------------------


def run_scores(run: RunResults) -> dict[str, float | None]:
    """Best F1 and AP@.5: from the evaluation where it ran, else the last validation of training."""
    if run.evaluation:
        metrics = run.evaluation["metrics"]
        return {"best_f1": number(metrics.get("best_f1")), "ap50": number(metrics.get("ap50"))}
    final = (run.summary or {}).get("final_val") or {}
    return {"best_f1": number(final.get("best_f1")), "ap50": number(final.get("ap50"))}


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


def swept_values(name: str) -> dict[str, Any]:
    """The settings a run's name carries beyond device and precision (a sweep's values)."""
    try:
        return dict(parse_run(name).sweep)
    except PipelineError:
        return {}


def score_threshold(run: RunResults, config: dict[str, Any] | None) -> float:
    """The score above which detections count: the evaluation's, else the config's."""
    from_eval = number(((run.evaluation or {}).get("metrics") or {}).get("score_threshold"))
    if from_eval is not None:
        return from_eval
    from_config = number(((config or {}).get("eval") or {}).get("score_threshold"))
    return from_config if from_config is not None else DEFAULT_SCORE_THRESHOLD
