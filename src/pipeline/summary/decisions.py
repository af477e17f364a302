"""What the measurements say: plain functions on frames and records, called once, by
summary/build.py, whose summary the report and `compare` show.

Which training setting to recommend, whether precision=auto's static choice on each backend
holds on this machine, and which timings to trust less (whether accuracy held: summary/accuracy.py).
Nothing here knows about HTML; the sentences returned are the verdicts themselves, shown as text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from pipeline.measured import PrecisionChoice, choose_precision
from pipeline.report.formatting import (
    backend_label,
    fmt_float,
    fmt_rel,
    number,
    setting_label,
)
from pipeline.stats import Speedup, quality_words, speedup_between
from pipeline.summary.load import PRECISIONS

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


def refusals(env: dict[str, Any] | None, backend: str) -> dict[str, str | None]:
    """Why precision=measured may not train in each reduced precision on `backend` (env.json)."""
    entry = ((env or {}).get("backends") or {}).get(backend)
    recorded = entry.get("measured_refused") if isinstance(entry, dict) else None
    if isinstance(recorded, dict):
        return recorded
    if backend == "cpu":  # an env.json from before the check: assume what the policy assumes
        unknown = "env.json does not say whether this CPU has native support"
        return {"bf16": unknown, "fp16": unknown}
    return {"bf16": None, "fp16": None}


def measured_choice(
    frame: pd.DataFrame, backend: str, model: str, env: dict[str, Any] | None
) -> PrecisionChoice | None:
    """What precision=measured would train `model` in on `backend`, from the same records."""
    rows = frame[
        (frame["backend"] == backend) & (frame["mode"] == "train") & (frame["model"] == model)
    ]
    if rows.empty:
        return None
    records = [(row["record"], row["file"]) for _, row in rows.iterrows()]
    return choose_precision(records, backend, model, refusals(env, backend))


def speed_between(reference: pd.Series, candidate: pd.Series) -> Speedup | None:
    """How much faster `candidate` ran than `reference`, with the interval (None without samples)."""
    if not reference["samples_s"] or not candidate["samples_s"]:
        return None
    return speedup_between(reference["record"]["timing"], candidate["record"]["timing"])


@dataclass
class Choice:
    """The fastest setting precision=measured trains `model` with, and what was faster but not chosen."""

    model: str
    best: pd.Series | None
    faster_unsafe: pd.DataFrame  # faster, numerics not acceptable
    others: pd.DataFrame  # measured, and no faster than `best`
    cpu_fp32: pd.Series | None
    faster_refused: list[tuple[pd.Series, str]]  # faster, acceptable, yet not what measured picks
    per_backend: dict[str, PrecisionChoice] = field(default_factory=dict)

    @property
    def speedup_vs_cpu_fp32(self) -> Speedup | None:
        if self.best is None or self.cpu_fp32 is None:
            return None
        return speed_between(self.cpu_fp32, self.best)

    @property
    def is_cpu_fp32(self) -> bool:
        """Whether the choice is the CPU fp32 baseline itself."""
        return (
            self.best is not None
            and self.best["backend"] == "cpu"
            and self.best["precision"] == "fp32"
        )


def choose_setting(frame: pd.DataFrame, model: str, env: dict[str, Any] | None = None) -> Choice:
    """The fastest of what precision=measured would train with on each backend (pipeline.measured).

    Within a backend a reduced precision must beat fp32 with its whole interval beyond the
    tolerance, have acceptable numerics, and be one the device layer lets measured mode use;
    across backends the fastest of those choices wins.
    """
    rows = frame[
        (frame["mode"] == "train")
        & (frame["status"] == "ok")
        & (frame["model"] == model)
        & frame["median_ms"].notna()
    ]
    per_backend = {
        backend: chosen
        for backend in dict.fromkeys(rows["backend"])
        if (chosen := measured_choice(frame, backend, model, env)) is not None
    }
    picked = []
    for backend, chosen in per_backend.items():
        match = rows[(rows["backend"] == backend) & (rows["precision"] == chosen.precision)]
        if not match.empty and match.iloc[0]["safe"]:
            picked.append(match.iloc[0])
    cpu = rows[(rows["backend"] == "cpu") & (rows["precision"] == "fp32")]
    cpu_fp32 = cpu.iloc[0] if not cpu.empty else None
    if not picked:
        return Choice(model, None, rows[~rows["safe"]], rows, cpu_fp32, [], per_backend)
    best = min(picked, key=lambda row: row["median_ms"])
    faster = rows["median_ms"] < best["median_ms"]
    faster_unsafe = rows[(~rows["safe"]) & faster].sort_values("median_ms")
    refused = []
    for _, row in rows[rows["safe"] & faster].sort_values("median_ms").iterrows():
        candidates = per_backend[row["backend"]].candidates
        reason = next((c.reason for c in candidates if c.precision == row["precision"]), None)
        refused.append((row, reason or "not what precision=measured chose on its backend"))
    others = rows.drop(index=best.name)
    others = others[others["median_ms"] >= best["median_ms"]]
    return Choice(model, best, faster_unsafe, others, cpu_fp32, refused, per_backend)


def numerics_problem(record: dict[str, Any]) -> str:
    """Why a reduced-precision record's numerics do not count as acceptable."""
    numerics = record.get("numerics")
    if not numerics:
        return "its numerics against fp32 were not measured"
    if numerics.get("problem"):
        return str(numerics["problem"])
    if not numerics.get("finite", True):
        return "it produced non-finite outputs or loss"
    return f"its loss differs from fp32 by {fmt_rel(numerics.get('loss_rel_diff'))} relative (rule: {numerics.get('acceptable_rule', 'n/a')})"


def flags_of(record: dict[str, Any], env: dict[str, Any] | None = None) -> list[str]:
    """Reasons to trust a timing less: drift, noise, a cut-short run or warm-up, a busy
    machine, TF32 in 'fp32', a configuration other than training's, or another CPU or GPU
    than env.json describes."""
    timing = record.get("timing") or {}
    flags = quality_words(timing) + [
        flag for flag in (other_cpu_flag(record, env), other_gpu_flag(record, env)) if flag
    ]
    if timing.get("warmup_ended_early"):
        flags.append(
            f"warm-up ended after {timing.get('warmup_steps')} steps, before the step time "
            f"settled: {timing['warmup_ended_early']}"
        )
    elif timing.get("warmup_settled") is False:
        flags.append(
            f"warm-up ended by its time budget after {timing.get('warmup_steps')} steps, "
            "before the step time settled"
        )
    steps = (record.get("settings") or {}).get("max_steps")
    if timing.get("stopped_early"):
        flags.append(
            f"stopped early: {timing.get('count')} of {steps} steps; {timing['stopped_early']}"
        )
    if timing.get("budget_limited"):
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
    overridden = (record.get("configuration") or {}).get("overridden")
    if overridden:
        flags.append(
            "timed with bench." + ", bench.".join(overridden) + " set, not what training runs"
        )
    return flags


def other_cpu_flag(record: dict[str, Any], env: dict[str, Any] | None) -> str | None:
    """Where the record was timed on another CPU model, or one computing bf16 or fp16 natively
    where env.json's does not (or the reverse): the jobs of one run landed on different node
    types of a cluster, and the summary names its machine by env.json alone."""
    timed = record.get("environment") or {}
    if not env or not timed:
        return None
    described = (env.get("platform") or {}).get("cpu_model")
    native = {
        precision: found.get("native")
        for precision, found in (env.get("cpu_native") or {}).items()
        if isinstance(found, dict)
    }
    timed_native = timed.get("cpu_native") or {}
    differs = [
        precision
        for precision, is_native in timed_native.items()
        if precision in native and bool(is_native) != bool(native[precision])
    ]
    if timed.get("cpu_model") in (None, described) and not differs:
        return None

    def cpu(model: Any, natives: dict[str, Any]) -> str:
        natively = ", ".join(
            f"{precision} {'native' if natives[precision] else 'not native'}"
            for precision in differs
        )
        return f"{model or 'n/a'}{f' ({natively})' if natively else ''}"

    return (
        f"timed on another CPU than the environment check described: "
        f"{cpu(timed.get('cpu_model'), timed_native)}, not {cpu(described, native)}; pin one "
        "node type for the whole run (docs/cluster.md)"
    )


def other_gpu_flag(record: dict[str, Any], env: dict[str, Any] | None) -> str | None:
    """Where a CUDA record's device is none of the GPUs env.json lists: the benchmark job
    landed on another GPU model than the environment check (a partition of mixed GPUs)."""
    names = [
        device.get("name")
        for device in ((env or {}).get("cuda") or {}).get("devices") or []
        if device.get("name")
    ]
    described = record.get("device_description") or ""
    if record.get("backend") != "cuda" or not names or any(name in described for name in names):
        return None
    return (
        f"timed on another GPU than the environment check described: {described}, not "
        f"{' + '.join(dict.fromkeys(names))}; pin one GPU model for the whole run "
        "(cluster.gpu_model, docs/cluster.md)"
    )


def answer_cautions(
    best: pd.Series, frame: pd.DataFrame, env: dict[str, Any] | None = None
) -> list[tuple[str, list[str]]]:
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
        (setting_label(row["backend"], row["precision"]), flags_of(row["record"], env))
        for row in rows
    ]
    return [(setting, flags) for setting, flags in flagged if flags]


def speed_verdict(speed: Speedup | None) -> str | None:
    """'faster' or 'slower' where the whole interval is beyond the tolerance, else None."""
    if speed is None or speed.verdict not in ("faster", "slower"):
        return None
    return speed.verdict


# ---- precision=auto, the static policy ---------------------------------------------------


def default_precision(env: dict[str, Any], backend: Any) -> str | None:
    """What precision=auto trains with on `backend`, by the policy env.json recorded."""
    entry = (env.get("backends") or {}).get(backend)
    if not isinstance(entry, dict) or not isinstance(entry.get("precisions"), dict):
        return None
    return entry["precisions"].get("auto")


# The shipped config trains with precision=measured: what the benchmarks chose on the backend
# device=auto picks. precision=auto, the static policy, is what env.json says auto resolves to.
SHIPPED_PRECISION = "measured"


def shipped_default(choice: Choice, env: dict[str, Any] | None) -> dict[str, str] | None:
    """What the shipped defaults (device=auto, precision=measured) train with here: the
    measured choice on device=auto's backend; None without env.json or its benchmarks."""
    backend = (env or {}).get("auto")
    chosen = choice.per_backend.get(backend) if backend else None
    return None if chosen is None else {"backend": backend, "precision": chosen.precision}


def static_default(env: dict[str, Any] | None) -> dict[str, str] | None:
    """What device=auto, precision=auto (the static policy) trains with here; None without env.json."""
    if not env:
        return None
    precision = default_precision(env, env.get("auto"))
    return None if precision is None else {"backend": env.get("auto"), "precision": precision}


def training_row(
    frame: pd.DataFrame, setting: dict[str, str] | None, model: str
) -> pd.Series | None:
    """The successful training record of a {backend, precision} setting, if it was measured."""
    if setting is None:
        return None
    match = frame[
        (frame["backend"] == setting["backend"])
        & (frame["precision"] == setting["precision"])
        & (frame["mode"] == "train")
        & (frame["model"] == model)
        & (frame["status"] == "ok")
    ]
    return match.iloc[0] if not match.empty else None


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


def amp_verdict(
    frame: pd.DataFrame,
    backend: str,
    default: str | None,
    model: str | None,
    env: dict[str, Any] | None,
) -> str:
    """One line: what precision=auto (the static policy) trains in, what was measured, and what
    precision=measured, the shipped default, trains in instead."""
    label = backend_label(backend)
    rows = policy_rows(frame, backend, model)
    if default is None:
        return f"{label}: env.json records no precision=auto policy."
    policy = f"precision=auto trains in {default}"
    ok = rows[(rows["status"] == "ok") & rows["median_ms"].notna()]
    if ok.empty or "fp32" not in set(ok["precision"]):
        return (
            f"{label}: {policy}; no fp32 training benchmark ran on this backend, so "
            "precision=measured has nothing to check it against."
        )
    chosen = measured_choice(frame, backend, str(ok.iloc[0]["model"]), env)
    times = {row["precision"]: row for _, row in ok.iterrows()}
    measured = "precision=measured, the shipped default,"
    if chosen.precision == default:
        return f"{label}: {policy}; {compare_text(times)}: {measured} trains in {default} too, so the two agree."
    instead = f"{measured} trains in {chosen.precision} here"
    if default not in times:
        return f"{label}: {policy}, but {default} was not measured (skipped or not run); {instead} ({chosen.reason})."
    default_row = times[default]
    if not default_row["safe"]:
        return f"{label}: {policy}, but {default} failed the numerics check ({numerics_problem(default_row['record'])}); {instead} ({chosen.reason})."
    gain = speed_between(default_row, times[chosen.precision])
    versus = f"{gain.text} than {default}" if gain is not None else chosen.reason
    return f"{label}: {policy}; {compare_text(times)}: {instead}, {versus}."


def compare_text(times: dict[str, pd.Series]) -> str:
    """How each measured reduced precision compares with fp32, with its interval."""
    reference = times["fp32"]
    others = []
    for precision, row in times.items():
        if precision == "fp32":
            continue
        speed = speed_between(reference, row)
        text = speed.text if speed is not None else "not comparable"
        others.append(f"{precision} {text}" + ("" if row["safe"] else " (numerics not acceptable)"))
    return "; ".join(others) if others else "only fp32 was measured"


# ---- accuracy: did the reduced precision hold up? -----------------------------------------
