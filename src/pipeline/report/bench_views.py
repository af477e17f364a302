"""View models of the sections drawn from the summary's answer and benchmark records: the
answer, the benchmark table and the AMP policy check. The decisions are the summary's
(pipeline.summary); this shapes them for the templates (sections/answer, benchmarks and
amp-policy.html.j2) and adds the commands that repeat the workflow's call. A view of None means
there is nothing to show yet: the template says which step to run."""

from __future__ import annotations

import copy
import json
import shlex
from typing import Any

import yaml

from pipeline import runs
from pipeline.report import charts
from pipeline.report.formatting import setting_label
from pipeline.runs import PRECISIONS
from pipeline.stats import MIN_ROUNDS_TO_PAIR


def answer_view(
    summary: dict[str, Any], invocation: dict[str, Any] | None = None
) -> dict[str, Any]:
    answer, checks = summary["answer"], summary["accuracy_checks"]
    synthetic_data = summary["synthetic_data"] is True
    view: dict[str, Any] = {
        "model": answer["model"],
        "best": None,
        "shipped_default": label(answer["shipped_default"]),
        "runs": summary["runs"],
        "accuracy": [accuracy_view(check, synthetic_data, invocation) for check in checks],
        "tolerance_points": 100 * checks[0]["tolerance"] if checks else None,
        "synthetic_data": synthetic_data,
    }
    chosen = answer["chosen"]
    if chosen is None:
        return view
    backend, auto = chosen["backend"], (summary["machine"] or {}).get("auto")
    view.update(
        best={**chosen, "setting": label(chosen)},
        vs_cpu_fp32=chosen["vs_cpu_fp32"],
        is_cpu_fp32=chosen["is_cpu_fp32"],
        unsafe=[{**other, "setting": label(other)} for other in chosen["faster_unsafe"]],
        slower=[{**other, "setting": label(other)} for other in chosen["slower"]],
        refused=[{**other, "setting": label(other)} for other in chosen["faster_refused"]],
        cautions=[(caution["setting"], caution["flags"]) for caution in chosen["cautions"]],
        follows_default=chosen["is_shipped_default"] is True,
        differs_from_default=chosen["is_shipped_default"] is False,
        vs_default=chosen["vs_default"],
        static_default=label(answer.get("static_default")),
        vs_static_default=chosen.get("vs_static_default"),
        config_precision=answer.get("config_precision"),
        config_elsewhere=config_trains_elsewhere(answer, chosen, auto),
        command=measured_command(backend, auto, "precision=measured", invocation=invocation),
        train_command=measured_train_command(backend, auto, invocation),
        accuracy_command=None
        if chosen["accuracy_checked"]
        else measured_command(
            backend, auto, "'sweep={precision: [fp32, measured]}'", invocation=invocation
        ),
    )
    return view


def config_trains_elsewhere(
    answer: dict[str, Any], chosen: dict[str, Any], auto: str | None
) -> bool:
    """Whether the summarised config set a precision other than the shipped measured one that
    trains with something else than the answer on device=auto's backend."""
    precision = answer.get("config_precision")
    if precision in (None, "measured"):
        return False
    if precision == "auto":
        static = answer.get("static_default")
        precision = None if static is None else static["precision"]
    return (auto, precision) != (chosen["backend"], chosen["precision"])


def label(setting: dict[str, Any] | None) -> str | None:
    """'CPU bf16' for a summary's {backend, precision}; None for None."""
    return None if setting is None else setting_label(setting["backend"], setting["precision"])


def measured_command(
    backend: str,
    auto: str | None,
    *settings: str,
    invocation: dict[str, Any] | None = None,
) -> str:
    """The workflow command that trains with `settings` on `backend` (`auto`: what device=auto
    resolves to here), and reports it: with the --configfile files and --config settings the
    workflow was called with (`invocation`), so it trains on the user's data and settings,
    `settings` and the device replacing theirs."""
    ours = ([] if auto == backend else [f"device={backend}"]) + list(settings)
    return workflow_command(ours, invocation)


def workflow_command(
    settings: list[str],
    invocation: dict[str, Any] | None = None,
    start: str = "snakemake --cores 1 results/report.html",
) -> str:
    """The workflow command (`start`: by default the one that builds the report) with the
    --configfile files and --config settings it was called with (`invocation`), `settings`
    (`key=value`) replacing theirs: without them it would run on the shipped config, not the
    user's data, and rerun every stage whose settings differ."""
    replaced = {setting.strip("'").split("=", 1)[0] for setting in settings}
    invocation = invocation or {}
    words = [start]
    if invocation.get("configfiles"):
        words += ["--configfile", *(shlex.quote(str(path)) for path in invocation["configfiles"])]
    theirs = [
        shlex.quote(f"{key}={cli_value(value)}")
        for key, value in (invocation.get("config") or {}).items()
        if key not in replaced
    ]
    if theirs or settings:
        words += ["--config", *theirs, *settings]
    return " ".join(words)


def measured_train_command(
    backend: str, auto: str | None, invocation: dict[str, Any] | None = None
) -> str:
    """`python -m pipeline train --precision measured` with the workflow's config files and settings."""
    invocation = invocation or {}
    words = ["python -m pipeline train"]
    if invocation.get("configfiles"):
        words += ["--configfile", *(shlex.quote(str(path)) for path in invocation["configfiles"])]
    if auto != backend:
        words.append(f"--device {backend}")
    words.append("--precision measured")
    settings = {
        key: value
        for key, value in (invocation.get("config") or {}).items()
        if key not in ("precision", "device", "sweep")
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


def change_view(change: dict[str, Any] | None) -> dict[str, Any] | None:
    """A paired change of the summary in points, for the template."""
    if change is None:
        return None
    return {
        "points": 100 * change["change"],
        "low": 100 * change["low"],
        "high": 100 * change["high"],
        "images": change["images"],
        "confidence": change["confidence"],
        "verdict": change["verdict"],
    }


def accuracy_view(
    check: dict[str, Any], synthetic_data: bool = False, invocation: dict[str, Any] | None = None
) -> dict[str, Any]:
    """An accuracy check with its changes in points; on the built-in data, the command that
    makes a test split large enough to settle an undecided one."""
    settle = check["images_to_settle"] if synthetic_data else None
    return {
        **check,
        "drops": {
            name: None if drop is None else 100 * drop
            for name, drop in (("F1", check["f1_drop"]), ("AP@.5", check["ap50_drop"]))
        },
        "f1_change": change_view(check["f1_change"]),
        "ap50_change": change_view(check["ap50_change"]),
        "settle": None
        if settle is None
        else {"images": settle, "command": larger_test_split_command(settle, invocation)},
    }


def benchmarks_view(benchmarks: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not benchmarks:
        return None
    models = list(dict.fromkeys(entry["model"] for entry in benchmarks))
    return {
        "with_model": len(models) > 1,
        "model": models[0],
        "chart": charts.bench_chart(benchmarks),
        "rows": [bench_row(entry) for entry in benchmarks],
        "partial_output_diff": any(
            output_rel_diff_is_partial(entry["numerics"]) for entry in benchmarks
        ),
        "skipped": sum(entry["status"] == "skipped" for entry in benchmarks),
    }


def bench_row(entry: dict[str, Any]) -> dict[str, Any]:
    view = {**entry, "skipped": entry["status"] != "ok", "numerics": {}}
    if view["skipped"]:
        return view
    fp32 = entry["precision"] == "fp32"
    view.update(
        speedups=[
            REFERENCE_CELL if fp32 else speedup(entry["vs_backend_fp32"]),
            REFERENCE_CELL if fp32 and entry["backend"] == "cpu" else speedup(entry["vs_cpu_fp32"]),
        ],
        numerics=numerics_view(entry["precision"], entry["numerics"]),
    )
    return view


# The fp32 row of a backend is the reference its speed-ups are measured against (itself: 1x)
REFERENCE_CELL = {"value": None, "verdict": None, "text": None, "reference": True}


def speedup(speed: dict[str, Any] | None) -> dict[str, Any]:
    """A speed-up cell, marked only where the whole interval is beyond the tolerance."""
    verdict = None if speed is None else speed["verdict"]
    return {
        "value": speed,
        "verdict": verdict if verdict in ("faster", "slower") else None,
        "text": None if speed is None else f"{speed['text']}; {pairing_text(speed)}",
        "reference": False,
    }


def pairing_text(speed: dict[str, Any]) -> str:
    """How the interval was had: paired by interleaved rounds, or from two sets timed apart
    (records of the sequential bench, or of another process or backend)."""
    rounds = speed.get("paired_rounds")
    if rounds:
        return f"paired over {rounds} interleaved rounds"
    return (
        f"unpaired: not timed together in {MIN_ROUNDS_TO_PAIR} or more interleaved rounds, so "
        "the machine's drift between the two is in the interval"
    )


def numerics_view(precision: str, numerics: dict[str, Any] | None) -> dict[str, Any]:
    """The numerics check of one record: the fp32 reference, not measured, or its figures."""
    if precision == "fp32":
        return {"kind": "reference"}
    if not numerics:
        return {"kind": "not measured"}
    return {
        "kind": "measured",
        "loss_rel_diff": numerics["loss_rel_diff"],
        "output": output_rel_diff(numerics),
        "acceptable": numerics["acceptable"],
        "rule": numerics["rule"],
    }


def output_rel_diff(numerics: dict[str, Any]) -> dict[str, Any]:
    """The overall output difference; where an all-zero fp32 output left it undefined, the
    largest defined per-output one (`key` names that output, `undefined` the others)."""
    overall = numerics["output_max_rel_diff"]
    if overall is not None:
        return {"value": overall, "key": None, "undefined": []}
    per_output = numerics["outputs"]
    defined = {key: value for key, value in per_output.items() if value is not None}
    if not defined:
        return {"value": None, "key": None, "undefined": sorted(per_output)}
    key = max(defined, key=lambda k: defined[k])
    undefined = sorted(key for key, value in per_output.items() if value is None)
    return {"value": defined[key], "key": key, "undefined": undefined}


def output_rel_diff_is_partial(numerics: dict[str, Any] | None) -> bool:
    """Whether the overall output difference is undefined but per-output ones were recorded."""
    return (
        numerics is not None
        and numerics["output_max_rel_diff"] is None
        and bool(numerics["outputs"])
    )


def amp_policy_view(
    summary: dict[str, Any], config: dict[str, Any] | None
) -> dict[str, Any] | None:
    """Each backend's shipped default and what precision=measured does there (the summary's
    verdicts), with the training benchmark of each precision they rest on."""
    policies = summary["amp_policy"]
    if policies is None:
        return None
    rows = []
    for policy in policies:
        records = {
            precision: next(
                (
                    entry
                    for entry in summary["benchmarks"]
                    if (entry["model"], entry["backend"], entry["mode"], entry["precision"])
                    == (policy["model"], policy["backend"], "train", precision)
                ),
                None,
            )
            for precision in PRECISIONS
        }
        rows.append(
            {
                **policy,
                "records": [
                    {
                        "record": record,
                        "speed": None
                        if record is None or precision == "fp32"
                        else record["vs_backend_fp32"],
                    }
                    for precision, record in records.items()
                ],
            }
        )
    return {
        "verdicts": [policy["verdict"] for policy in policies],
        "rows": rows,
        "precisions": PRECISIONS,
        "model": summary["answer"]["model"],
        "precision": config.get("precision", "auto") if config else None,
    }
