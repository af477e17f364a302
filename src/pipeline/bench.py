"""Benchmarks of the step that training will take, every precision x mode of a backend in one
process (fp32 first, so a precision its own samples show slower than fp32 stops early).

What is timed comes from the training config (model and its options, label mode, memory
format, batch and image size, gradient clipping, optimizer, kernel flags); the `bench.*` keys
override it where set, and every record says which configuration it timed and what was
overridden. Mode `train` times `engine.step.TrainStep`, the trainer's own step; mode `infer`
the forward pass under `inference_mode`, as evaluation and profiling run it. Warm-up runs
until the step time settles; the device is synchronized around every timed step; every
sample is kept and summarised with its spread and drift; a time budget bounds a much slower
CPU autocast. fp16/bf16 numerics are compared with fp32 (`pipeline.numerics`). The record
format is `schemas/bench.schema.yaml`.
"""

from __future__ import annotations

import copy
import logging
import platform
from datetime import UTC, datetime
from typing import Any

import numpy as np
import torch

from pipeline import device as dev
from pipeline import stats, timing
from pipeline.data.synthetic import SyntheticSpec, render_sample
from pipeline.engine.step import TrainStep, build_optimizer
from pipeline.environment import cpu_model
from pipeline.measured import BENCH_FORMAT as FORMAT
from pipeline.models import build_from_config, memory_format, parameter_count
from pipeline.models.loss import DetectionLoss
from pipeline.numerics import NumericsReference
from pipeline.runs import benchmarked_models

log = logging.getLogger("pipeline")
MODES = ("train", "infer")
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
    }


def rendered_batch(
    batch_size: int, image_size: int, num_classes: int, device: torch.device
) -> tuple[torch.Tensor, list[dict]]:
    """A fixed batch of rendered shapes already on the device: the data pipeline is not timed.

    Real objects (not noise) so that the numerics stretch trains on a detection problem.
    """
    spec = SyntheticSpec(
        image_size=image_size,
        min_objects=1,
        min_object_size=max(4.0, image_size / 16),
        max_object_size=image_size * 3 / 8,
        seed=0,
    )
    images, targets = [], []
    for index in range(batch_size):
        pixels, objects = render_sample(spec, "train", index)
        images.append(torch.from_numpy(pixels).permute(2, 0, 1))
        boxes = torch.tensor([obj["box"] for obj in objects], dtype=torch.float32).reshape(-1, 4)
        labels = torch.tensor([obj["label"] % num_classes for obj in objects], dtype=torch.long)
        targets.append({"boxes": boxes, "labels": labels})  # on the host, as the loss reads them
    return torch.stack(images).to(device), targets


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


def _infer_step(model: torch.nn.Module, images: torch.Tensor, device, precision: str):
    def step() -> None:
        with torch.inference_mode(), dev.autocast(device, precision):
            model(images)

    return step


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
        "configuration": configuration(model_name, settings),
        "settings": {
            **timing.torch_settings(),
            "warmup_steps": settings["warmup_steps"],
            "warmup_budget_s": settings["warmup_budget_s"],
            "max_steps": settings["steps"],
            "time_budget_s": settings["time_budget_s"],
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


def _step(model, images, targets, device, precision, mode, settings, layout):
    """The function timed: TrainStep as the trainer builds it, or the inference forward."""
    runnable = torch.compile(model) if settings["compile"] else model
    if mode == "infer":
        model.eval()
        return _infer_step(runnable, images, device, precision)
    model.train()
    train = settings["train"]
    # The scheduler's step (microseconds of Python) is left out: it would tie the benchmark to
    # train.epochs and the schedule, which change no timing.
    train_step = TrainStep(
        runnable,
        DetectionLoss.for_model(model, train["box_weight"]),
        build_optimizer(model.parameters(), train),
        device,
        precision,
        grad_clip=train["grad_clip"],
        memory_format=layout,
    )
    return lambda: train_step(images, targets)


def run(
    device: torch.device, precision: str, mode: str, model_name: str, settings: dict[str, Any]
) -> dict[str, Any]:
    """One benchmark record; a combination the backend cannot run comes back as status 'skipped'."""
    (record,) = run_backend(device, [precision], [mode], [model_name], settings)
    return record


def run_backend(
    device: torch.device,
    precisions: list[str],
    modes: list[str],
    models: list[str],
    settings: dict[str, Any],
) -> list[dict[str, Any]]:
    """Every model x precision x mode on one backend, timed one after another in this
    process, fp32 first for each model; one record each, in that order.

    The batch is rendered once and the numerics' fp32 reference trained once per model; each
    combination still times a freshly built model (the seed a process of its own would use).
    A precision whose warm-up or timed steps already show it slower than fp32 in the same mode
    stops there (`slower_than`), and its record says why.
    """
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
    shared = _Shared(device, settings)
    records = []
    for model_name in models:
        shared.forget_numerics()
        fp32_samples: dict[str, list[float]] = {}
        for precision in sorted(dict.fromkeys(precisions), key=lambda p: p != "fp32"):
            for mode in dict.fromkeys(modes):
                reference = fp32_samples.get(mode) if precision != "fp32" else None
                record = _run_one(shared, precision, mode, model_name, reference)
                if precision == "fp32" and record["status"] == "ok":
                    fp32_samples[mode] = [ms / 1000 for ms in record["timing"]["samples_ms"]]
                records.append(record)
    return records


# A new model's first steps run slower than its settled ones (oneDNN builds its primitives,
# the allocator grows), by well under this factor: a precision whose fastest warm-up step is
# further behind fp32's median than this cannot catch up by settling.
SETTLING_GAIN_LIMIT = 3.0


def slower_than(
    reference_s: list[float], precision: str
) -> tuple[timing.StopRule, timing.StopRule]:
    """The rules that end a precision's warm-up and timing once its own steps show that it is
    slower than fp32 (`reference_s`: fp32's timed steps, same backend, model and mode).

    Timing stops only on `stats.speedup`'s own verdict 'slower' (the whole interval below 1
    by more than the tolerance) after the fewest steps a claim needs: the verdict the choice
    reads from the same samples, so a precision that could still be chosen is never stopped.
    The warm-up only loses its wait for settling: the timed steps still decide.
    """
    reference_median = float(np.median(reference_s))

    def end_warmup(step_times: list[float]) -> str | None:
        fastest = min(step_times)
        if fastest <= SETTLING_GAIN_LIMIT * reference_median:
            return None
        return (
            f"its fastest warm-up step took {fastest * 1000:.1f} ms, more than "
            f"{SETTLING_GAIN_LIMIT:g}x fp32's median step ({reference_median * 1000:.1f} ms): "
            "more than settling gains"
        )

    def stop(samples: list[float]) -> str | None:
        if len(samples) < stats.MIN_SAMPLES_FOR_A_CLAIM:
            return None
        if np.median(samples) <= reference_median * (1 + stats.SPEEDUP_TOLERANCE):
            return None  # not even its median is behind: spare the bootstrap
        speed = stats.speedup(reference_s, samples)
        if speed.verdict != "slower":
            return None
        return (
            f"after {len(samples)} timed steps, {precision} is {speed.text} against fp32, "
            "so it cannot be the faster precision"
        )

    return end_warmup, stop


class _Shared:
    """What the combinations of one process share: the kernel flags and the rendered batch
    (made at the first combination that runs), and the numerics' fp32 reference of a model."""

    def __init__(self, device: torch.device, settings: dict[str, Any]) -> None:
        self.device, self.settings = device, settings
        self.layout = memory_format(settings["channels_last"])
        self._batch: tuple[torch.Tensor, list[dict]] | None = None
        self._numerics: NumericsReference | None = None
        self._compared: dict[str, dict[str, Any]] = {}

    def batch(self) -> tuple[torch.Tensor, list[dict]]:
        if self._batch is None:
            dev.set_kernel_flags(self.device, self.settings["deterministic"])
            images, targets = rendered_batch(
                self.settings["batch_size"],
                self.settings["image_size"],
                self.settings["num_classes"],
                self.device,
            )
            self._batch = images.contiguous(memory_format=self.layout), targets
        return self._batch

    def forget_numerics(self) -> None:
        self._numerics = None
        self._compared = {}

    def numerics(self, model: torch.nn.Module, precision: str) -> dict[str, Any]:
        """`precision` against fp32, the same for every mode (the check trains, whatever mode
        is timed); `model` (freshly built) starts the model's reference if none yet."""
        if self._numerics is None:
            images, targets = self.batch()
            self._numerics = NumericsReference(
                model, images, targets, self.device, self.settings, self.layout
            )
        if precision not in self._compared:
            self._compared[precision] = self._numerics.compare(precision)
        return copy.deepcopy(self._compared[precision])


def _run_one(
    shared: _Shared,
    precision: str,
    mode: str,
    model_name: str,
    fp32_samples: list[float] | None = None,
) -> dict[str, Any]:
    device, settings, layout = shared.device, shared.settings, shared.layout
    record = _base_record(device, precision, mode, model_name, settings)
    reason = dev.autocast_unsupported_reason(device, precision)
    if reason:
        record.update(status="skipped", reason=reason)
        log.info("%s %s %s %s: skipped (%s)", model_name, device, precision, mode, reason)
        return record

    images, targets = shared.batch()
    torch.manual_seed(0)
    np.random.seed(0)
    model_config = {**settings["model_options"], "name": model_name}
    model = build_from_config(model_config, settings["num_classes"])
    model = model.to(device, memory_format=layout)
    record["parameters"] = parameter_count(model)
    end_warmup, stop = slower_than(fp32_samples, precision) if fp32_samples else (None, None)
    memory = dev.PeakMemory(device)
    dev.reset_host_peak_rss()
    try:
        if precision != "fp32":
            record["numerics"] = shared.numerics(model, precision)
        step = _step(model, images, targets, device, precision, mode, settings, layout)
        conditions = timing.RunConditions()
        samples, details = timing.timed_runs(
            step,
            device,
            warmup=settings["warmup_steps"],
            max_steps=settings["steps"],
            budget_s=settings["time_budget_s"],
            warmup_budget_s=settings["warmup_budget_s"],
            memory=memory,
            end_warmup=end_warmup,
            stop=stop,
        )
    except (RuntimeError, NotImplementedError) as error:
        reason = cannot_run_reason(error)
        if reason is None:
            raise
        record.update(status="skipped", reason=reason, numerics=None)
        log.warning(
            "%s %s %s %s: skipped (%s)", model_name, device, precision, mode, record["reason"]
        )
        return record
    summary = stats.summarize(samples)
    record.update(
        timing={**summary, **details, "samples_ms": [s * 1000 for s in samples]},
        throughput_images_per_s=settings["batch_size"] / (summary["median_ms"] / 1000),
        memory=memory.as_dict(),
        host_peak_rss_mb=dev.host_peak_rss_mb(),
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
    log.info(
        "%s %s %s %s: median %.1f ms (IQR %.1f, n=%d after %d warm-up steps%s%s), %.0f img/s%s",
        model_name,
        device,
        precision,
        mode,
        summary["median_ms"],
        summary["iqr_ms"],
        summary["count"],
        details["warmup_steps"],
        "" if details["warmup_settled"] else ", not settled",
        ", budget-limited" if details["budget_limited"] else "",
        record["throughput_images_per_s"],
        "; " + "; ".join(flags) if flags else "",
    )
    return record
