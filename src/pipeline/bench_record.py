"""What a benchmark record holds (format `schemas/bench.schema.yaml`): the settings taken from
the config, the configuration timed, and the record filled from a warm-up and its timed steps
or marked skipped (with the reason, where the backend cannot run it). The timing itself is
`pipeline.bench`'s."""

from __future__ import annotations

import logging
import platform
from datetime import UTC, datetime
from typing import Any

import torch

from pipeline import device as dev
from pipeline import stats, timing
from pipeline.environment import cpu_model
from pipeline.measured import BENCH_FORMAT as FORMAT
from pipeline.runs import benchmarked_models

log = logging.getLogger("pipeline")

# Keys of `bench` that, where set (not null), override what the training config says.
OVERRIDES = ("batch_size", "image_size", "channels_last", "num_classes")


def settings_from_config(config: dict[str, Any], num_classes: int) -> dict[str, Any]:
    """What to time and how: training's configuration, with the set `bench.*` keys on top."""
    bench, train = config["bench"], config["train"]
    derived = {
        "models": benchmarked_models(config),
        "batch_size": train["batch_size"],
        "image_size": config["data"]["image_size"],
        "channels_last": train["channels_last"],
        "num_classes": num_classes,
    }
    overridden = [key for key in OVERRIDES if bench.get(key) is not None]
    return {
        **derived,
        **{key: bench[key] for key in overridden},
        "overridden": overridden,
        "model_options": config["model"],
        "train": train,
        "deterministic": config["deterministic"],
        "compile": bench["compile"],
        "warmup_steps": bench["warmup_steps"],
        "warmup_budget_s": bench["warmup_budget_s"],
        "steps": bench["steps"],
        "time_budget_s": bench["time_budget_s"],
        "numerics_steps": bench["numerics_steps"],
        "instances": bench["instances"],
    }


def configuration(model_name: str, settings: dict[str, Any]) -> dict[str, Any]:
    """What a record timed, beside it: the step training will take, or what overrode it."""
    options = settings["model_options"]
    return {
        "source": (
            "training config with bench." + ", bench.".join(settings["overridden"])
            if settings["overridden"]
            else "training config"
        ),
        "overridden": settings["overridden"],
        "model": {**options, "name": model_name},
        "num_classes": settings["num_classes"],
        "batch_size": settings["batch_size"],
        "image_size": settings["image_size"],
        "channels_last": settings["channels_last"],
        "grad_clip": settings["train"]["grad_clip"],
        "optimizer": settings["train"]["optimizer"],
        "deterministic": settings["deterministic"],
        "compile": settings["compile"],
    }


def _native(device: torch.device) -> dict[str, bool] | None:
    if device.type != "cpu":
        return None
    return {p: dev.cpu_native_precision(p).native for p in ("bf16", "fp16")}


def base_record(
    device: torch.device, precision: str, mode: str, model_name: str, settings: dict[str, Any]
) -> dict[str, Any]:
    """An ok record of one combination before anything is timed; `skipped` and `finish` fill
    it in."""
    return {
        "format": FORMAT,
        "status": "ok",
        "reason": None,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "backend": device.type,
        "device": str(device),
        "device_description": dev.describe_device(device),
        "precision": precision,
        "mode": mode,
        "model": model_name,
        "parameters": None,
        "batch_size": settings["batch_size"],
        "image_size": settings["image_size"],
        "channels_last": settings["channels_last"],
        "compile": settings["compile"],
        "configuration": configuration(model_name, settings),
        "settings": {
            **timing.torch_settings(),
            "warmup_steps": settings["warmup_steps"],
            "warmup_budget_s": settings["warmup_budget_s"],
            "max_steps": settings["steps"],
            "time_budget_s": settings["time_budget_s"],
            "instances": settings["instances"],
        },
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu_model": cpu_model(),
            "cpu_native": _native(device),
        },
        "timing": None,
        "throughput_images_per_s": None,
        "numerics": None,
        "memory": None,
        "host_peak_rss_mb": None,
        "conditions": None,
    }


# What torch says when a backend cannot run an op in a dtype, or the batch does not fit.
_CANNOT_RUN = (
    "not implemented for",
    "not supported",
    "unsupported",
    "does not support",
    "out of memory",
)


def cannot_run_reason(error: BaseException) -> str | None:
    """The reason to record a combination as skipped, or None when the error is a real bug."""
    first = (str(error).strip().splitlines() or [""])[0]
    if isinstance(error, torch.OutOfMemoryError) or any(p in first.lower() for p in _CANNOT_RUN):
        return f"{type(error).__name__}: {first}"
    return None


def skipped(record: dict[str, Any], reason: str, level: int = logging.WARNING) -> None:
    """Mark a record skipped with its reason, and log it (at `level`: an unsupported precision
    is expected, an op that fails is worth a warning)."""
    record.update(status="skipped", reason=reason, numerics=None)
    where = " ".join(str(record[key]) for key in ("model", "device", "precision", "mode"))
    log.log(level, "%s: skipped (%s)", where, reason)


def combined_warmups(warmups: list[dict[str, Any]]) -> dict[str, Any]:
    """The warm-ups of a precision's model instances (`timing.warm_up`'s details) as the one
    a record states: steps and seconds summed, settled only where every one settled, ended
    early where one did (the first reason)."""
    return {
        "warmup_steps": sum(w["warmup_steps"] for w in warmups),
        "warmup_s": sum(w["warmup_s"] for w in warmups),
        "warmup_settled": all(w["warmup_settled"] for w in warmups),
        "warmup_ended_early": next(
            (w["warmup_ended_early"] for w in warmups if w["warmup_ended_early"]), None
        ),
    }


def finish(
    record: dict[str, Any],
    warmups: list[dict[str, Any]],
    conditions: timing.RunConditions,
    timed: timing.Timed,
    *,
    schedule_id: str,
    max_steps: int,
    block_steps: int,
) -> None:
    """Fill an ok record from the warm-ups of its model instances (`timing.warm_up`'s
    details), the conditions since the first began, and its share of the interleaved
    schedule (in blocks of `block_steps`)."""
    samples = timed.samples
    summary = stats.summarize(samples)
    warmup = combined_warmups(warmups)
    details = timing.step_details(
        warmup,
        total_s=warmup["warmup_s"] + timed.spent_s,
        count=len(samples),
        max_steps=max_steps,
        stopped_early=timed.stopped_early,
    )
    record.update(
        timing={
            **summary,
            **details,
            "samples_ms": [s * 1000 for s in samples],
            "rounds": list(timed.rounds),
            "instances": list(timed.instances),
            "instances_timed": len(set(timed.instances)),
            "schedule_id": schedule_id,
            "block_steps": block_steps,
        },
        throughput_images_per_s=record["batch_size"] / (summary["median_ms"] / 1000),
        conditions=conditions.finish(),
    )
    flags = stats.quality_words(summary)
    flags += [
        f"{what}: {details[key]}"
        for what, key in (
            ("warm-up ended early", "warmup_ended_early"),
            ("stopped early", "stopped_early"),
        )
        if details[key]
    ]
    instances = len(set(timed.instances))
    log.info(
        "%s %s %s %s: median %.1f ms (IQR %.1f, n=%d in %d rounds of %d model instance%s after "
        "%d warm-up steps%s%s), %.0f img/s%s",
        record["model"],
        record["device"],
        record["precision"],
        record["mode"],
        summary["median_ms"],
        summary["iqr_ms"],
        summary["count"],
        len(set(timed.rounds)),
        instances,
        "" if instances == 1 else "s",
        details["warmup_steps"],
        "" if details["warmup_settled"] else ", not settled",
        ", budget-limited" if details["budget_limited"] else "",
        record["throughput_images_per_s"],
        "; " + "; ".join(flags) if flags else "",
    )
