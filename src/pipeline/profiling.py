"""Inference profile of a trained model: latency per batch size and a torch.profiler trace.

Latency is wall time around a synchronized forward pass as evaluation and predict run it: the
model's inference form (BatchNorm folded into the convs, `models.inference`) and, with the flip
test, the images and their mirrors; p50/p90/p99 after a warm-up that lasts until the latency
settles, plus GPU-side event time where the backend has events. `torch.profiler` has no MPS activity:
on MPS its operator table shows CPU-side dispatch only, and the output says so.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from pipeline import atomic, stats, timing
from pipeline import device as dev
from pipeline.models.inference import for_inference

log = logging.getLogger("pipeline")
FORMAT = "pipeline.profile/1"
MPS_NOTE = (
    "torch.profiler has no MPS activity: the operator table shows CPU-side dispatch only, not GPU "
    "kernel time. GPU-side latency comes from torch.mps.Event timing where available; for kernel "
    "detail use torch.mps.profiler with Instruments, or PYTORCH_MPS_LOG_PROFILE_INFO."
)
TOP_OPERATORS = 25
# Device types whose events are kernels in torch's operator table (profiler_util._build_table).
_DEVICE_SIDE = frozenset({DeviceType.CUDA, DeviceType.PrivateUse1, DeviceType.MTIA, DeviceType.XPU})


def _forward(
    model: torch.nn.Module,
    images: torch.Tensor,
    device: torch.device,
    precision: str,
    flip_test: bool,
):
    """One forward pass as evaluation and predict run it (`flip_test`: the images and their
    mirrors, eval.flip_test)."""

    def run() -> None:
        with torch.inference_mode(), dev.autocast(device, precision):
            model(images, flip_test=flip_test)

    return run


def latency(
    model: torch.nn.Module,
    device: torch.device,
    precision: str,
    image_size: int,
    batch_size: int,
    settings: dict[str, Any],
    memory_format: torch.memory_format,
) -> dict[str, Any]:
    """Latency statistics of one batch size; device-event time alongside wall time."""
    images = torch.randint(
        0, 256, (batch_size, 3, image_size, image_size), dtype=torch.uint8, device=device
    )
    images = images.contiguous(memory_format=memory_format)
    forward = _forward(model, images, device, precision, settings["flip_test"])
    timer = dev.DeviceTimer(device)
    gpu_ms: list[float] = []

    def timed() -> None:
        timer.start()
        forward()
        measured = timer.stop_ms()
        if measured is not None:
            gpu_ms.append(measured)

    memory = dev.PeakMemory(device)
    samples, details = timing.timed_runs(
        timed,
        device,
        warmup=settings["warmup"],
        max_steps=settings["repeats"],
        budget_s=settings["time_budget_s"],
        memory=memory,
    )
    summary = stats.summarize(samples)
    gpu = stats.summarize([ms / 1000 for ms in gpu_ms[-len(samples) :]]) if gpu_ms else None
    return {
        "batch_size": batch_size,
        "wall": {**summary, **details, "samples_ms": [s * 1000 for s in samples]},
        "device_events": gpu,
        "throughput_images_per_s": batch_size / (summary["median_ms"] / 1000),
        "memory": memory.as_dict(),
    }


def _is_kernel(event: Any) -> bool:
    """A device-side event (a kernel, a memcpy), as torch's own table counts them."""
    return event.device_type in _DEVICE_SIDE and not getattr(event, "is_user_annotation", False)


def operator_rows(events: Iterable[Any], key: str) -> list[dict[str, Any]]:
    """Rows of `prof.key_averages()` sorted by `key`, each with its share of the total time.

    With CUDA activity the events hold operator rows (CPU-side, charged the device time of
    the kernels they launched) and kernel rows (the kernels themselves), so a sum over all
    rows counts every kernel twice. The device total sums kernel rows only, and the CPU total
    every row's self CPU time, as torch.autograd.profiler_util's table does: shares then
    match the percentages torch prints.
    """
    rows = []
    totals = {"self_cpu_ms": 0.0, "self_device_ms": 0.0}
    for event in events:
        device_self = getattr(event, "self_device_time_total", None) or getattr(
            event, "self_cuda_time_total", 0
        )
        kernel = _is_kernel(event)
        row = {
            "name": event.key,
            "kind": "kernel" if kernel else "operator",
            "calls": event.count,
            "self_cpu_ms": event.self_cpu_time_total / 1000,
            "cpu_total_ms": event.cpu_time_total / 1000,
            "self_device_ms": (device_self or 0) / 1000,
        }
        totals["self_cpu_ms"] += row["self_cpu_ms"]
        if kernel:
            totals["self_device_ms"] += row["self_device_ms"]
        rows.append(row)
    rows.sort(key=lambda row: row[key], reverse=True)
    total = totals[key] or 1.0
    for row in rows:
        row["share"] = row[key] / total
    return rows


def _quiet_kineto_without_gpus() -> None:
    """Where a CUDA build of torch finds no GPU, the profiler's Kineto logs `ERROR: ...
    gpuGetDeviceCount failed` at every profile: harmless, yet it reads as a failure in the
    profile's log. Its log level (read as a profile starts) is raised past errors there alone,
    never over a KINETO_LOG_LEVEL of the user's."""
    if dev.cuda_build_without_gpu():
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")


def operator_profile(
    model: torch.nn.Module,
    device: torch.device,
    precision: str,
    image_size: int,
    batch_size: int,
    steps: int,
    trace_path: Path,
    memory_format: torch.memory_format,
    flip_test: bool = False,
) -> dict[str, Any]:
    """Top operators by self time over `steps` forward passes, and a Chrome trace file."""
    images = torch.randint(
        0, 256, (batch_size, 3, image_size, image_size), dtype=torch.uint8, device=device
    )
    images = images.contiguous(memory_format=memory_format)
    forward = _forward(model, images, device, precision, flip_test)
    forward()  # warm-up outside the trace
    dev.synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _quiet_kineto_without_gpus()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            forward()
        dev.synchronize(device)
    atomic.write_with(trace_path, lambda tmp: prof.export_chrome_trace(str(tmp)))
    key = "self_device_ms" if device.type == "cuda" else "self_cpu_ms"
    rows = operator_rows(prof.key_averages(), key)
    return {
        "activities": [a.name for a in activities],
        "batch_size": batch_size,
        "steps": steps,
        "sorted_by": key,
        "top_operators": rows[:TOP_OPERATORS],
        "trace": trace_path.name,
        "note": MPS_NOTE if device.type == "mps" else None,
    }


def run(
    model: torch.nn.Module,
    device: torch.device,
    precision: str,
    image_size: int,
    settings: dict[str, Any],
    out_dir: Path,
    memory_format: torch.memory_format,
) -> dict[str, Any]:
    """Profile into `out_dir`: profile.json (latency + operators), operators.json, trace.json.

    `model` is profiled in its inference form (`for_inference`), the one evaluation runs."""
    model = for_inference(model)
    rows = []
    for batch_size in settings["batch_sizes"]:
        row = latency(model, device, precision, image_size, batch_size, settings, memory_format)
        rows.append(row)
        log.info(
            "batch %d: p50 %.2f ms, p90 %.2f, p99 %.2f, %.0f img/s",
            batch_size,
            row["wall"]["p50_ms"],
            row["wall"]["p90_ms"],
            row["wall"]["p99_ms"],
            row["throughput_images_per_s"],
        )
    trace_batch = sorted(settings["batch_sizes"])[len(settings["batch_sizes"]) // 2]
    operators = operator_profile(
        model,
        device,
        precision,
        image_size,
        trace_batch,
        settings["trace_steps"],
        out_dir / "trace.json",
        memory_format,
        settings["flip_test"],
    )
    atomic.write_json(out_dir / "operators.json", operators)
    if operators["note"]:
        log.warning("%s", operators["note"])
    return {"latency": rows, "profiler": operators}
