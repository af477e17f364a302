"""Per-backend x precision x mode benchmarks, measured honestly.

Synchronized around every timed step on every backend, every sample kept, reported as
median and IQR with a noisy flag; bounded by a time budget so that 30x-slower CPU
autocast stays affordable; with the numerics of fp16/bf16 against fp32 on the same
weights and batch, peak memory with its `exact` flag, and the run's conditions.
The record format is `schemas/bench.schema.yaml`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import platform
from datetime import UTC, datetime
from typing import Any

import torch

from pipeline import device as dev
from pipeline import timing
from pipeline.environment import cpu_model
from pipeline.models import build_model, memory_format, parameter_count
from pipeline.models.loss import DetectionLoss

log = logging.getLogger("pipeline")
FORMAT = "pipeline.bench/1"
MODES = ("train", "infer")
NUM_CLASSES = 4
# Relative loss difference against fp32 above which a precision's numerics are not acceptable.
ACCEPTABLE_LOSS_REL_DIFF = 0.02


def synthetic_batch(
    batch_size: int, image_size: int, device: torch.device
) -> tuple[torch.Tensor, list[dict]]:
    """A fixed random batch already on the device: the data pipeline is not what is timed."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(
        0, 256, (batch_size, 3, image_size, image_size), dtype=torch.uint8, generator=generator
    )
    targets = []
    for _ in range(batch_size):
        corners = torch.rand(3, 2, generator=generator) * (image_size * 0.7)
        sizes = 8 + torch.rand(3, 2, generator=generator) * (image_size * 0.25)
        boxes = torch.cat([corners, corners + sizes], dim=1).to(device)
        labels = torch.randint(0, NUM_CLASSES, (3,), generator=generator).to(device)
        targets.append({"boxes": boxes, "labels": labels})
    return images.to(device), targets


def _autocast(device: torch.device, precision: str):
    dtype = dev.autocast_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _max_diffs(reference: torch.Tensor, candidate: torch.Tensor) -> tuple[float, float]:
    """Largest absolute difference, and the same relative to the largest fp32 magnitude."""
    diff = (candidate.float() - reference.float()).abs().max().item()
    scale = reference.float().abs().max().item()
    if diff == 0:
        return 0.0, 0.0
    return diff, diff / scale if scale > 0 else math.inf


def compare_numerics(
    model: torch.nn.Module,
    loss_fn: DetectionLoss,
    images: torch.Tensor,
    targets: list[dict],
    device: torch.device,
    precision: str,
) -> dict[str, Any]:
    """Loss and outputs under autocast against fp32, same weights and batch (eval mode: no BN updates)."""
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        reference = model(images)
        reference_loss = loss_fn(reference, targets)["total"].item()
        with _autocast(device, precision):
            candidate = model(images)
        candidate_loss = loss_fn(candidate, targets)["total"].item()
    model.train(was_training)
    outputs = {key: _max_diffs(reference[key], candidate[key]) for key in reference}
    finite = all(
        torch.isfinite(candidate[key].float()).all().item() for key in candidate
    ) and math.isfinite(candidate_loss)
    loss_abs = abs(candidate_loss - reference_loss)
    loss_rel = loss_abs / abs(reference_loss) if reference_loss else math.inf
    return {
        "reference": "fp32",
        "loss_fp32": reference_loss,
        "loss": candidate_loss,
        "loss_abs_diff": loss_abs,
        "loss_rel_diff": loss_rel,
        "output_max_abs_diff": max(a for a, _ in outputs.values()),
        "output_max_rel_diff": max(r for _, r in outputs.values()),
        "outputs": {key: {"max_abs_diff": a, "max_rel_diff": r} for key, (a, r) in outputs.items()},
        "finite": finite,
        "acceptable": finite and loss_rel <= ACCEPTABLE_LOSS_REL_DIFF,
        "acceptable_rule": f"finite and relative loss difference <= {ACCEPTABLE_LOSS_REL_DIFF}",
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


def _train_step(model, loss_fn, optimizer, scaler, images, targets, device, precision):
    def step() -> None:
        with _autocast(device, precision):
            outputs = model(images)
        loss = loss_fn(outputs, targets)["total"]
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    return step


def _infer_step(model, images, device, precision):
    def step() -> None:
        with torch.inference_mode(), _autocast(device, precision):
            model(images)

    return step


def _base_record(
    device: torch.device, precision: str, mode: str, model_name: str, settings: dict[str, Any]
) -> dict[str, Any]:
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
        "settings": {
            **timing.torch_settings(),
            "warmup_steps": settings["warmup_steps"],
            "max_steps": settings["steps"],
            "time_budget_s": settings["time_budget_s"],
        },
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu_model": cpu_model(),
        },
        "timing": None,
        "throughput_images_per_s": None,
        "numerics": None,
        "memory": None,
        "host_peak_rss_mb": None,
        "conditions": None,
    }


def run(
    device: torch.device, precision: str, mode: str, model_name: str, settings: dict[str, Any]
) -> dict[str, Any]:
    """One benchmark record; a combination the backend cannot run comes back as status 'skipped'."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    record = _base_record(device, precision, mode, model_name, settings)
    reason = dev.autocast_unsupported_reason(device, precision)
    if reason:
        record.update(status="skipped", reason=reason)
        log.info("%s %s %s %s: skipped (%s)", model_name, device, precision, mode, reason)
        return record

    torch.manual_seed(0)
    layout = memory_format(settings["channels_last"])
    model = build_model(model_name, NUM_CLASSES, "multilabel").to(device, memory_format=layout)
    record["parameters"] = parameter_count(model)
    loss_fn = DetectionLoss.for_model(model)
    images, targets = synthetic_batch(settings["batch_size"], settings["image_size"], device)
    images = images.contiguous(memory_format=layout)
    if precision != "fp32":
        record["numerics"] = compare_numerics(model, loss_fn, images, targets, device, precision)
    runnable = torch.compile(model) if settings["compile"] else model
    if mode == "train":
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        step = _train_step(runnable, loss_fn, optimizer, scaler, images, targets, device, precision)
    else:
        model.eval()
        step = _infer_step(runnable, images, device, precision)

    memory = dev.PeakMemory(device)
    conditions = timing.RunConditions()
    try:
        samples, details = timing.timed_runs(
            step,
            device,
            warmup=settings["warmup_steps"],
            max_steps=settings["steps"],
            budget_s=settings["time_budget_s"],
            memory=memory,
        )
    except (RuntimeError, NotImplementedError) as error:
        reason = cannot_run_reason(error)
        if reason is None:
            raise
        record.update(status="skipped", reason=reason)
        log.warning(
            "%s %s %s %s: skipped (%s)", model_name, device, precision, mode, record["reason"]
        )
        return record
    summary = timing.summarize(samples)
    record.update(
        timing={**summary, **details, "samples_ms": [s * 1000 for s in samples]},
        throughput_images_per_s=settings["batch_size"] / (summary["median_ms"] / 1000),
        memory=memory.as_dict(),
        host_peak_rss_mb=dev.host_peak_rss_mb(),
        conditions=conditions.finish(),
    )
    log.info(
        "%s %s %s %s: median %.1f ms (IQR %.1f, n=%d%s), %.0f img/s%s",
        model_name,
        device,
        precision,
        mode,
        summary["median_ms"],
        summary["iqr_ms"],
        summary["count"],
        ", budget-limited" if details["budget_limited"] else "",
        record["throughput_images_per_s"],
        ", NOISY" if summary["noisy"] else "",
    )
    return record
