"""View models of the sections drawn from the benchmark records: the answer, the benchmark
table and the AMP policy check. The decisions come from decisions.py; this shapes them for the
templates (sections/answer, benchmarks and amp-policy.html.j2). A view of None means there is
nothing to show yet: the template says which step to run."""

from __future__ import annotations

import copy
import json
import shlex
from typing import Any

import pandas as pd
import yaml

from pipeline import runs
from pipeline.report import charts, decisions
from pipeline.report.formatting import number, setting_label
from pipeline.report.load import PRECISIONS, Results
from pipeline.stats import Speedup


def answer_view(
    results: Results, config: dict[str, Any] | None, invocation: dict[str, Any] | None = None
) -> dict[str, Any]:
    frame, env = results.bench, results.env
    checks = decisions.accuracy_checks(results.runs)
    synthetic_data = ((config or {}).get("data") or {}).get("format") == "synthetic"
    view: dict[str, Any] = {
        "model": decisions.answer_model(frame, config),
        "best": None,
        "shipped_default": shipped_default(env, config),
        "runs": [{"name": run.name, **decisions.run_scores(run)} for run in results.runs],
        "accuracy": [accuracy_view(check, synthetic_data, invocation) for check in checks],
        "tolerance_points": 100 * decisions.ACCURACY_TOLERANCE,
        "synthetic_data": synthetic_data,
    }
    if view["model"] is None:
        return view
    choice = decisions.choose_setting(frame, view["model"], env)
    if choice.best is None:
        return view
    best = choice.best
    record = best["record"]
    setting = setting_label(best["backend"], best["precision"])
    default = shipped_default_row(frame, env, config, view["model"])
    differs = default is None or default.name != best.name
    view.update(
        best={
            "setting": setting,
            "model": best["model"],
            "batch_size": record.get("batch_size"),
            "image_size": record.get("image_size"),
            "device": record.get("device_description"),
            "median_ms": best["median_ms"],
            "iqr_ms": best["iqr_ms"],
            "count": len(best["samples_s"]),
        },
        vs_cpu_fp32=choice.speedup_vs_cpu_fp32,
        is_cpu_fp32=choice.is_cpu_fp32,
        unsafe=[
            {
                "setting": setting_label(row["backend"], row["precision"]),
                "speed": decisions.speed_between(best, row),
                "problem": decisions.numerics_problem(row["record"]),
            }
            for _, row in choice.faster_unsafe.iterrows()
        ],
        slower=[
            {
                "setting": setting_label(row["backend"], row["precision"]),
                "speed": decisions.speed_between(best, row),
            }
            for _, row in choice.others.iterrows()
        ],
        refused=[
            {"setting": setting_label(row["backend"], row["precision"]), "reason": reason}
            for row, reason in choice.faster_refused
        ],
        cautions=decisions.answer_cautions(best, frame),
        differs_from_default=differs and view["shipped_default"] is not None,
        vs_default=decisions.speed_between(default, best) if default is not None else None,
        command=measured_command(best["backend"], env, "amp=measured", invocation=invocation),
        train_command=measured_train_command(best["backend"], env, invocation),
        accuracy_command=None
        if best["precision"] == "fp32"
        or any(check.precision == best["precision"] for check in checks)
        else measured_command(
            best["backend"], env, "'sweep={precision: [fp32, measured]}'", invocation=invocation
        ),
    )
    return view


def shipped_default_row(
    frame: pd.DataFrame, env: dict[str, Any] | None, config: dict[str, Any] | None, model: str
) -> pd.Series | None:
    """The training record of what device=auto, amp=auto trains with here, if it was measured."""
    if not env:
        return None
    backend = env.get("auto")
    precision = decisions.default_precision(env, backend, config)
    match = frame[
        (frame["backend"] == backend)
        & (frame["precision"] == precision)
        & (frame["mode"] == "train")
        & (frame["model"] == model)
        & (frame["status"] == "ok")
    ]
    return match.iloc[0] if not match.empty else None


def measured_command(
    backend: str,
    env: dict[str, Any] | None,
    *settings: str,
    invocation: dict[str, Any] | None = None,
) -> str:
    """The workflow command that trains with `settings` on `backend`, and reports it: with the
    --configfile files and --config settings the workflow was called with (`invocation`), so it
    trains on the user's data and settings, `settings` and the device replacing theirs."""
    ours = ([] if env and env.get("auto") == backend else [f"device={backend}"]) + list(settings)
    return workflow_command(ours, invocation)


def workflow_command(settings: list[str], invocation: dict[str, Any] | None = None) -> str:
    """The workflow command that builds the report with the --configfile files and --config
    settings it was called with (`invocation`), `settings` (`key=value`) replacing theirs."""
    replaced = {setting.strip("'").split("=", 1)[0] for setting in settings}
    invocation = invocation or {}
    words = ["snakemake --cores 1 results/report.html"]
    if invocation.get("configfiles"):
        words += ["--configfile", *(shlex.quote(str(path)) for path in invocation["configfiles"])]
    theirs = [
        shlex.quote(f"{key}={cli_value(value)}")
        for key, value in (invocation.get("config") or {}).items()
        if key not in replaced
    ]
    return " ".join([*words, "--config", *theirs, *settings])


def measured_train_command(
    backend: str, env: dict[str, Any] | None, invocation: dict[str, Any] | None = None
) -> str:
    """`python -m pipeline train --amp measured` with the workflow's config files and settings."""
    invocation = invocation or {}
    words = ["python -m pipeline train"]
    words += [f"--config {shlex.quote(str(path))}" for path in invocation.get("configfiles") or []]
    if not (env and env.get("auto") == backend):
        words.append(f"--device {backend}")
    words.append("--amp measured")
    settings = {
        key: value
        for key, value in (invocation.get("config") or {}).items()
        if key not in ("amp", "device", "sweep")
    }
    return " ".join([*words, *(shlex.quote(item) for item in runs.flatten(settings))])


def cli_value(value: Any) -> str:
    """A --config value as Snakemake reads it back (YAML): plain where it reads back the same,
    else JSON (which YAML reads too)."""
    if isinstance(value, str):
        try:
            if yaml.safe_load(value) == value:
                return value
        except yaml.YAMLError:
            pass
    return json.dumps(value)


def larger_test_split_command(images: int, invocation: dict[str, Any] | None) -> str:
    """The workflow command that evaluates every run on a synthetic test split of `images`
    (only the test split is made again, and nothing retrains), keeping the caller's data keys."""
    theirs = ((invocation or {}).get("config") or {}).get("data")
    data = copy.deepcopy(theirs) if isinstance(theirs, dict) else {}
    synthetic = data.get("synthetic")
    data["synthetic"] = {**(synthetic if isinstance(synthetic, dict) else {}), "num_test": images}
    return workflow_command([shlex.quote(f"data={json.dumps(data)}")], invocation)


def change_view(change: Any) -> dict[str, Any] | None:
    """A paired change (stats.PairedChange) in points, for the template."""
    if change is None:
        return None
    return {
        "points": 100 * change.change,
        "low": 100 * change.low,
        "high": 100 * change.high,
        "images": change.images,
        "confidence": change.confidence,
        "verdict": change.verdict,
    }


def accuracy_view(
    check: decisions.AccuracyCheck,
    synthetic_data: bool = False,
    invocation: dict[str, Any] | None = None,
) -> dict[str, Any]:
    undecided = [
        change
        for change in (check.f1_change, check.ap50_change)
        if change is not None and change.verdict == "undecided"
    ]
    # the larger test split must settle every undecided change
    needs = [change.images_to_settle() for change in undecided] if synthetic_data else []
    settle = max(needs) if needs and None not in needs else None
    return {
        "reduced": check.reduced,
        "reference": check.reference,
        "precision": check.precision,
        "f1": check.f1,
        "reference_f1": check.reference_f1,
        "ap50": check.ap50,
        "reference_ap50": check.reference_ap50,
        "drops": {name: None if drop is None else 100 * drop for name, drop in check.drops.items()},
        "verdict": check.verdict,
        "f1_change": change_view(check.f1_change),
        "ap50_change": change_view(check.ap50_change),
        "why_unpaired": check.why_unpaired,
        "split": check.split,
        "settle": None
        if settle is None
        else {"images": settle, "command": larger_test_split_command(settle, invocation)},
    }


def shipped_default(env: dict[str, Any] | None, config: dict[str, Any] | None) -> str | None:
    """The setting device=auto, amp=auto trains with here, so a reader sees whether to change anything."""
    if not env:
        return None
    backend = env.get("auto")
    precision = decisions.default_precision(env, backend, config)
    return None if precision is None else setting_label(backend, precision)


def benchmarks_view(frame: pd.DataFrame) -> dict[str, Any] | None:
    if frame.empty:
        return None
    models = list(dict.fromkeys(frame["model"]))
    rows = [bench_row(row) for _, row in frame.iterrows()]
    return {
        "with_model": len(models) > 1,
        "model": models[0],
        "chart": charts.bench_chart(frame),
        "rows": rows,
        "partial_output_diff": any(
            output_rel_diff_is_partial(record.get("numerics")) for record in frame["record"]
        ),
        "skipped": int((frame["status"] == "skipped").sum()),
    }


def bench_row(row: pd.Series) -> dict[str, Any]:
    record = row["record"]
    view = {
        "model": row["model"],
        "backend": row["backend"],
        "precision": row["precision"],
        "mode": row["mode"],
        "skipped": row["status"] != "ok",
        "reason": row["reason"],
        "flags": [],
        "numerics": {},
    }
    if view["skipped"]:
        return view
    view.update(
        batch_size=record.get("batch_size"),
        image_size=record.get("image_size"),
        median_ms=row["median_ms"],
        iqr_ms=row["iqr_ms"],
        images_per_s=row["images_per_s"],
        speedups=[speedup(row["vs_backend_fp32"]), speedup(row["vs_cpu_fp32"])],
        warmup=(record.get("timing") or {}).get("warmup_steps"),
        memory=record.get("memory"),
        host_rss_mb=record.get("host_peak_rss_mb"),
        numerics=numerics_view(row["precision"], record.get("numerics")),
        flags=decisions.flags_of(record),
    )
    return view


def speedup(speed: Speedup | None) -> dict[str, Any]:
    return {
        "value": speed,
        "verdict": decisions.speed_verdict(speed),
        "text": None if speed is None else speed.text,
    }


def numerics_view(precision: str, numerics: dict[str, Any] | None) -> dict[str, Any]:
    """The numerics check of one record: the fp32 reference, not measured, or its figures."""
    if precision == "fp32":
        return {"kind": "reference"}
    if not numerics:
        return {"kind": "not measured"}
    return {
        "kind": "measured",
        "loss_rel_diff": numerics.get("loss_rel_diff"),
        "output": output_rel_diff(numerics),
        "acceptable": numerics.get("acceptable") is True,
        "rule": numerics.get("acceptable_rule"),
    }


def output_rel_diff(numerics: dict[str, Any]) -> dict[str, Any]:
    """The overall output difference; where an all-zero fp32 output left it undefined, the
    largest defined per-output one (`key` names that output, `undefined` the others)."""
    overall = number(numerics.get("output_max_rel_diff"))
    if overall is not None:
        return {"value": overall, "key": None, "undefined": []}
    outputs = numerics.get("outputs") or {}
    per_output = {
        key: number(value.get("max_rel_diff"))
        for key, value in outputs.items()
        if isinstance(value, dict)
    }
    defined = {key: value for key, value in per_output.items() if value is not None}
    if not defined:
        return {"value": None, "key": None, "undefined": sorted(per_output)}
    key = max(defined, key=lambda k: defined[k])
    undefined = sorted(key for key, value in per_output.items() if value is None)
    return {"value": defined[key], "key": key, "undefined": undefined}


def output_rel_diff_is_partial(numerics: Any) -> bool:
    """Whether the overall output difference is undefined but per-output ones were recorded."""
    return (
        isinstance(numerics, dict)
        and number(numerics.get("output_max_rel_diff")) is None
        and bool(numerics.get("outputs"))
    )


def amp_policy_view(results: Results, config: dict[str, Any] | None) -> dict[str, Any] | None:
    env, frame = results.env, results.bench
    if not env:
        return None
    model = decisions.answer_model(frame, config)
    rows, verdicts = [], []
    for backend in env.get("backends") or {}:
        if frame[frame["backend"] == backend].empty:
            continue
        default = decisions.default_precision(env, backend, config)
        verdicts.append(decisions.amp_verdict(frame, backend, default, model, env))
        records = decisions.policy_rows(frame, backend, model)
        by_precision = decisions.precision_records(records)
        reference = by_precision.get("fp32")
        chosen = (
            decisions.measured_choice(frame, backend, str(records.iloc[0]["model"]), env)
            if not records.empty
            else None
        )
        rows.append(
            {
                "backend": backend,
                "default": default,
                "records": [
                    {
                        "record": record,
                        "speed": None
                        if record is None or reference is None or precision == "fp32"
                        else decisions.speed_between(reference, record),
                    }
                    for precision, record in by_precision.items()
                ],
                "measured": None if chosen is None else chosen.precision,
                "measured_reason": None if chosen is None else chosen.reason,
            }
        )
    return {
        "verdicts": verdicts,
        "rows": rows,
        "precisions": PRECISIONS,
        "model": model,
        "amp": config.get("amp", "auto") if config else None,
    }
