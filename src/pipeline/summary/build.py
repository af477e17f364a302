"""results/summary.json: the results folder summed up once, with every decision in it.

The machine (from env.json: this step probes nothing), the commit, what the figures may be
compared by (a hash of the settings accuracy depends on, and of what the benchmarks timed),
the answer (and whether the shipped defaults follow it), precision=auto's verdicts, every
benchmark record's median, IQR and flags, the accuracy checks, and each trained run's time and
evaluation (trained_runs.py). The decisions come from decisions.py, here and nowhere else; the
report and `compare` show what this writes.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd

from pipeline import atomic
from pipeline.evaluation.image_bootstrap import PairedChange
from pipeline.report.formatting import number
from pipeline.setting_groups import accuracy_settings
from pipeline.stats import Speedup
from pipeline.summary import accuracy, annotations, decisions, trained_runs
from pipeline.summary.load import Results, bench_frame, git_state, load_results

FORMAT = "pipeline.summary/1"


def summarize(results_dir: str | Path, config: dict[str, Any] | None) -> dict[str, Any]:
    """The summary of the results folder; `config` is the workflow's resolved config (None:
    unknown, and then accuracy is compared with nothing)."""
    return summary_of(load_results(Path(results_dir)), config)


def write(summary: dict[str, Any], out: str | Path) -> Path:
    """Write a summary atomically (the test suite holds it to summary.schema.yaml)."""
    return atomic.write_json(out, summary)


def summary_of(results: Results, config: dict[str, Any] | None) -> dict[str, Any]:
    frame, env = bench_frame(results.bench_records), results.env
    model = decisions.answer_model(frame, config)
    checks = accuracy.accuracy_checks(results.runs)
    summary = {
        "format": FORMAT,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "results": str(results.root),
        "machine": machine(env),
        "commit": git_state(results.root),
        "comparison": {
            "accuracy": accuracy_basis(config),
            "speed": speed_basis(frame, model),
        },
        "synthetic_data": None
        if config is None
        else (config.get("data") or {}).get("format") == "synthetic",
        "answer": answer(frame, env, model, checks, config),
        "amp_policy": amp_policy(frame, env, model),
        "benchmarks": [benchmark(row, env) for _, row in frame.iterrows()],
        "accuracy_checks": [accuracy_check(check) for check in checks],
        "runs": [trained_runs.run_entry(run) for run in results.runs],
    }
    return atomic.jsonable(summary)  # numpy scalars as Python numbers, as a file holds them


# ---- what may be compared with what -------------------------------------------------------


def settings_hash(settings: Any) -> str:
    """A stable hash of settings: equal settings, equal hash, whatever the order of keys."""
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def accuracy_basis(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """The settings the accuracy figures depend on (setting_groups.accuracy_settings) and their
    hash; for a user's data set, with its annotation files' digests, which the hash takes in
    place of the files' paths (summary.annotations)."""
    if config is None:
        return None
    settings = accuracy_settings(config)
    digests = annotations.annotation_digests(config)
    if digests is None:
        return {"hash": settings_hash(settings), "settings": settings}
    return {
        "hash": settings_hash(annotations.identity(settings, digests)),
        "settings": settings,
        "annotations": digests,
    }


def speed_basis(frame: pd.DataFrame, model: str | None) -> dict[str, Any] | None:
    """What the answer model's training benchmarks timed (model, batch, image size, memory
    format) and its hash; None without a successful training benchmark."""
    if model is None:
        return None
    timed = frame[
        (frame["model"] == model) & (frame["mode"] == "train") & (frame["status"] == "ok")
    ]
    record = timed.iloc[0]["record"]
    timed_config = record.get("configuration") or {}
    settings = {
        "model": timed_config.get("model") or {"name": model},
        "batch_size": record.get("batch_size"),
        "image_size": record.get("image_size"),
        "channels_last": record.get("channels_last"),
    }
    return {"hash": settings_hash(settings), "settings": settings}


# ---- the machine -----------------------------------------------------------------------------


def machine(env: dict[str, Any] | None) -> dict[str, Any] | None:
    """The machine as env.json describes it; None without env.json."""
    if not env:
        return None
    platform = env.get("platform") or {}
    cuda = env.get("cuda") or {}
    return {
        "cpu_model": platform.get("cpu_model"),
        "cpu_count": platform.get("cpu_count"),
        "memory_gib": number(platform.get("memory_gib")),
        "torch_threads": platform.get("torch_threads"),
        "os": platform.get("os"),
        "architecture": platform.get("machine"),
        "cpu_native": {
            precision: {"native": bool(found.get("native")), "evidence": found.get("evidence")}
            for precision, found in (env.get("cpu_native") or {}).items()
            if isinstance(found, dict)
        },
        "gpus": [
            {
                "name": gpu.get("name"),
                "memory_gib": number(gpu.get("total_memory_gib")),
                "capability": gpu.get("capability"),
            }
            for gpu in cuda.get("devices") or []
            if isinstance(gpu, dict)
        ],
        "versions": {
            **(env.get("versions") or {}),
            "cuda": cuda.get("version"),
            "cudnn": None if cuda.get("cudnn") is None else str(cuda.get("cudnn")),
        },
        "backends": list(env.get("available") or []),
        "auto": env.get("auto"),
    }


# ---- the answer and the AMP policy ----------------------------------------------------------


def speed(value: Speedup | None) -> dict[str, Any] | None:
    """A speed-up as the summary keeps it: ratio, interval, verdict and the sentence (the
    method is the schema's to say, not every record's)."""
    if value is None:
        return None
    found = value.as_dict()
    del found["method"]
    return {**found, "text": value.text}


def setting(row: pd.Series) -> dict[str, str]:
    return {"backend": row["backend"], "precision": row["precision"]}


def answer(
    frame: pd.DataFrame,
    env: dict[str, Any] | None,
    model: str | None,
    checks: list[accuracy.AccuracyCheck],
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What to train with here and why nothing faster: `chosen` is None where no training
    benchmark ran (`model` None) or none had acceptable numerics. The shipped defaults
    (device=auto, precision=measured) follow the answer wherever it is on device=auto's backend;
    `config_precision` says whether the summarised runs' config kept that default."""
    static = decisions.static_default(env)
    found: dict[str, Any] = {
        "model": model,
        "shipped_default": None,
        "static_default": static,
        "config_precision": None if config is None else config.get("precision"),
        "chosen": None,
    }
    if model is None:
        return found
    choice = decisions.choose_setting(frame, model, env)
    shipped = decisions.shipped_default(choice, env)
    found["shipped_default"] = shipped
    best = choice.best
    if best is None:
        return found
    record = best["record"]
    default = decisions.training_row(frame, shipped, model)
    static_row = decisions.training_row(frame, static, model)
    found["chosen"] = {
        **setting(best),
        "model": best["model"],
        "batch_size": record.get("batch_size"),
        "image_size": record.get("image_size"),
        "device": record.get("device_description"),
        "median_ms": best["median_ms"],
        "iqr_ms": best["iqr_ms"],
        "count": len(best["samples_s"]),
        "vs_cpu_fp32": speed(choice.speedup_vs_cpu_fp32),
        "is_cpu_fp32": choice.is_cpu_fp32,
        "numerics": "reference" if best["precision"] == "fp32" else "acceptable",
        "is_shipped_default": None
        if shipped is None
        else default is not None and default.name == best.name,
        "vs_default": None if default is None else speed(decisions.speed_between(default, best)),
        "vs_static_default": None
        if static_row is None
        else speed(decisions.speed_between(static_row, best)),
        "faster_unsafe": [
            {
                **setting(row),
                "speed": speed(decisions.speed_between(best, row)),
                "problem": decisions.numerics_problem(row["record"]),
            }
            for _, row in choice.faster_unsafe.iterrows()
        ],
        "slower": [
            {**setting(row), "speed": speed(decisions.speed_between(best, row))}
            for _, row in choice.others.iterrows()
        ],
        "faster_refused": [
            {**setting(row), "reason": reason} for row, reason in choice.faster_refused
        ],
        "cautions": [
            {"setting": label, "flags": flags}
            for label, flags in decisions.answer_cautions(best, frame, env)
        ],
        "accuracy_checked": best["precision"] == "fp32"
        or any(check.precision == best["precision"] for check in checks),
    }
    return found


def amp_policy(
    frame: pd.DataFrame, env: dict[str, Any] | None, model: str | None
) -> list[dict[str, Any]] | None:
    """Each benchmarked backend's precision=auto (the static policy) against what
    precision=measured, the shipped default, does there; None without env.json (unknown)."""
    if not env:
        return None
    found = []
    for backend in env.get("backends") or {}:
        if frame[frame["backend"] == backend].empty:
            continue
        default = decisions.default_precision(env, backend)
        records = decisions.policy_rows(frame, backend, model)
        policy_model = None if records.empty else str(records.iloc[0]["model"])
        chosen = (
            None
            if policy_model is None
            else decisions.measured_choice(frame, backend, policy_model, env)
        )
        found.append(
            {
                "backend": backend,
                "model": policy_model,
                "default": default,
                "measured": None if chosen is None else chosen.precision,
                "measured_reason": None if chosen is None else chosen.reason,
                "verdict": decisions.amp_verdict(frame, backend, default, model, env),
            }
        )
    return found


# ---- benchmark records -----------------------------------------------------------------------


def benchmark(row: pd.Series, env: dict[str, Any] | None) -> dict[str, Any]:
    """One benchmark record: its figures and timed steps, the flags that make it less
    trustworthy, its numerics against fp32 and its speed-ups (against the same backend's fp32
    and against CPU fp32)."""
    record = row["record"]
    ok = row["status"] == "ok"
    timing = record.get("timing") or {}
    return {
        "model": row["model"],
        "backend": row["backend"],
        "precision": row["precision"],
        "mode": row["mode"],
        "status": row["status"],
        "reason": row["reason"],
        "file": Path(row["file"]).name,
        "batch_size": record.get("batch_size"),
        "image_size": record.get("image_size"),
        "channels_last": record.get("channels_last"),
        "median_ms": row["median_ms"],
        "iqr_ms": row["iqr_ms"],
        "count": len(row["samples_s"]),
        # as the record holds them: compare resamples them for speed-ups across machines
        "samples_ms": list(timing.get("samples_ms") or []) if ok else [],
        # each step's model instance: the independent units compare resamples
        **({"instances": list(timing["instances"])} if ok and "instances" in timing else {}),
        "warmup_steps": timing.get("warmup_steps") if ok else None,
        "images_per_s": row["images_per_s"],
        "memory": record.get("memory") if ok else None,
        "host_peak_rss_mb": number(record.get("host_peak_rss_mb")),
        "safe": bool(row["safe"]),
        "numerics": numerics(record),
        "flags": decisions.flags_of(record, env) if ok else [],
        "vs_backend_fp32": speed(row["vs_backend_fp32"]),
        "vs_cpu_fp32": speed(row["vs_cpu_fp32"]),
    }


def numerics(record: dict[str, Any]) -> dict[str, Any] | None:
    """A reduced precision's numerics against fp32; None for fp32 and where not measured."""
    found = record.get("numerics")
    if record.get("precision") == "fp32" or not isinstance(found, dict):
        return None
    acceptable = found.get("acceptable") is True
    return {
        "acceptable": acceptable,
        "problem": None if acceptable else decisions.numerics_problem(record),
        "loss_rel_diff": number(found.get("loss_rel_diff")),
        "output_max_rel_diff": number(found.get("output_max_rel_diff")),
        "outputs": {
            key: number(value.get("max_rel_diff"))
            for key, value in (found.get("outputs") or {}).items()
            if isinstance(value, dict)
        },
        "rule": found.get("acceptable_rule"),
    }


# ---- accuracy checks -------------------------------------------------------------------------


def change(value: PairedChange | None) -> dict[str, Any] | None:
    if value is None:
        return None
    return {
        "change": value.change,
        "low": value.low,
        "high": value.high,
        "verdict": value.verdict,
        "images": value.images,
        "tolerance": value.tolerance,
        "confidence": value.confidence,
    }


def accuracy_check(check: accuracy.AccuracyCheck) -> dict[str, Any]:
    """A reduced-precision run against its fp32 twin, with how many test images would settle
    an undecided change (were it to stay where it is; None: decided, or beyond reach)."""
    undecided = [
        found
        for found in (check.f1_change, check.ap50_change)
        if found is not None and found.verdict == "undecided"
    ]
    needs = [found.images_to_settle() for found in undecided]
    return {
        "reduced": check.reduced,
        "reference": check.reference,
        "precision": check.precision,
        "split": check.split,
        "f1": check.f1,
        "reference_f1": check.reference_f1,
        "ap50": check.ap50,
        "reference_ap50": check.reference_ap50,
        "f1_drop": check.drops["F1"],
        "ap50_drop": check.drops["AP@.5"],
        "verdict": check.verdict,
        "f1_change": change(check.f1_change),
        "ap50_change": change(check.ap50_change),
        "why_unpaired": check.why_unpaired,
        "images_to_settle": max(needs) if needs and None not in needs else None,
        "tolerance": accuracy.ACCURACY_TOLERANCE,
    }
