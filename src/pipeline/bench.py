"""Benchmarks of the step that training will take, every precision x mode of a backend in one
schedule (fp32 first, so a precision its own samples show slower than fp32 stops early).

What is timed comes from the training config (model and its options, label mode, memory
format, batch and image size, gradient clipping, optimizer, kernel flags); the `bench.*`
keys override it where set, and every record says which configuration it timed and what was
overridden. Mode `train` times `engine.step.TrainStep`, the trainer's own step; mode `infer`
the forward pass under `inference_mode`, as evaluation and profiling run it without
`eval.flip_test` (one view): the model's inference form, BatchNorm folded into the convs
(`models.inference`). Each precision is timed on `bench.instances` freshly built models
(a new model can keep a faster or slower speed mode, and a CPU process one for all
its models: there each instance index is timed in a forked child), each warmed up until its
step time settles; the device is synchronized around every timed step; every sample is kept
and summarised with its spread and drift; a time budget bounds a much slower CPU autocast.
fp16/bf16 numerics are compared with fp32 (`pipeline.numerics`). The rounds, in this process
or in forked children, are `pipeline.bench_schedule`'s; the records are built by
`pipeline.bench_record`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pipeline import bench_record, bench_schedule, forked, timing
from pipeline import device as dev
from pipeline.bench_schedule import Ready
from pipeline.bench_stops import FRESH_REFERENCE_STEPS, FarBehind, slower_than
from pipeline.data.shapes import render_sample
from pipeline.data.synthetic import SyntheticSpec
from pipeline.engine.step import TrainStep, build_optimizer
from pipeline.models import build_from_config, memory_format, parameter_count
from pipeline.models.inference import for_inference
from pipeline.models.loss import DetectionLoss
from pipeline.numerics import NumericsReference

MODES = ("train", "infer")
log = logging.getLogger("pipeline")


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


def _infer_step(model: torch.nn.Module, images: torch.Tensor, device, precision: str):
    def step() -> None:
        with torch.inference_mode(), dev.autocast(device, precision):
            model(images)

    return step


def _step(model, images, targets, device, precision, mode, settings, layout):
    """The function timed: TrainStep as the trainer builds it, or the inference forward."""
    if mode == "infer":  # the inference form evaluation and the profile run
        inferred = for_inference(model)
        runnable = torch.compile(inferred) if settings["compile"] else inferred
        return _infer_step(runnable, images, device, precision)
    runnable = torch.compile(model) if settings["compile"] else model
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
    *,
    fork: bool = True,
) -> list[dict[str, Any]]:
    """Every model x precision x mode on one backend; one record each, fp32's first, then
    each other precision's, each with its modes in order. On a CPU where forking is safe
    (`forked.safe`: Linux), each model instance index in a child forked from this process,
    which must not have run torch compute yet (`bench_schedule.forked`); `fork=False` keeps
    them in this process, for a caller that has.

    For each model and mode, every precision gets `bench.instances` freshly built models
    (instance k from seed k, the first from the seed a process of its own would use), each
    with its own warm-up, fp32's first; then their timed blocks alternate in rounds
    (`bench_schedule`: order reversed every round, instance k of every precision in the same
    rounds), so that the speed-up is paired round by round and resampled over instance pairs
    (`stats.speedup_between`) and what the machine does meanwhile cancels out of it. The
    batch is rendered once per process that builds models (on a CPU, once in each child) and
    the numerics' fp32 reference trained once per model. A precision whose warm-up or timed
    steps already show it slower than fp32 stops there (`slower_than`), and its record says
    why.
    """
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
    shared = _Shared(device, settings)
    shared.fork = fork and device.type == "cpu" and FORK_CPU_INSTANCES and forked.safe()
    ordered = sorted(dict.fromkeys(precisions), key=lambda p: p != "fp32")
    records = []
    for model_name in models:
        shared.forget_numerics()
        by_mode = {
            mode: _run_interleaved(shared, ordered, mode, model_name)
            for mode in dict.fromkeys(modes)
        }
        records += [by_mode[mode][precision] for precision in ordered for mode in by_mode]
    return records


class _Shared:
    """What the combinations of one process share: the kernel flags and the rendered batch
    (made at the first combination that runs; on a CPU in each forked child, as the bench
    process computes nothing), and the numerics' fp32 reference of a model (on a CPU, the
    comparisons the first child made)."""

    def __init__(self, device: torch.device, settings: dict[str, Any]) -> None:
        self.device, self.settings = device, settings
        self.fork = False  # model instances in forked children (`bench_schedule.forked`)
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

    @property
    def compared(self) -> dict[str, dict[str, Any]]:
        """The precisions compared with the model's fp32 reference so far."""
        return self._compared

    def remember_numerics(self, compared: dict[str, dict[str, Any]]) -> None:
        """Comparisons made in a forked child, so that no later child makes them again."""
        self._compared.update(compared)

    def numerics(self, model: torch.nn.Module, precision: str) -> dict[str, Any]:
        """`precision` against fp32, the same for every mode (the check trains, whatever mode
        is timed); `model` (freshly built) starts the model's reference if none yet."""
        if precision in self._compared:
            return copy.deepcopy(self._compared[precision])
        if self._numerics is None:
            images, targets = self.batch()
            self._numerics = NumericsReference(
                model, images, targets, self.device, self.settings, self.layout
            )
        self._compared[precision] = self._numerics.compare(precision)
        return copy.deepcopy(self._compared[precision])


# CPU model instances are timed in forked children (`bench_fork`): a process often holds a
# precision in one speed mode for all its instances, and a forked child draws its own. Tests
# of the one-process schedule's bookkeeping in the test process turn it off.
FORK_CPU_INSTANCES = True


def _run_interleaved(
    shared: _Shared, precisions: list[str], mode: str, model_name: str
) -> dict[str, dict[str, Any]]:
    """The records of one model and mode: each precision built and warmed up in turn, then
    timed in interleaved rounds against the others.

    Each precision is timed on several freshly built model instances (`bench.instances`):
    a new model can settle into a faster or slower mode and keep it, which rounds of one
    instance never show. Instance k of every precision is built from seed k, so a pair
    differs only in precision; all precisions' first instances are built and warmed up
    before any second one, and their warm-ups alone give the records' memory figures. A
    precision whose warm-up steps show it far slower than fp32 at the same moment
    (`FarBehind`) gets no further instance: its first timed steps stop it. On a CPU each
    instance index is built, warmed up and timed in a child process of its own
    (`bench_schedule.forked`); on CUDA and MPS, which must not fork after their
    initialisation, all in this process.
    """

    def prepare(going: list[str], instances, records, ready) -> None:
        _prepare(shared, going, mode, model_name, instances, records, ready)

    if shared.fork:
        return bench_schedule.forked(shared, precisions, prepare, f"{model_name} {mode}")
    return bench_schedule.in_one_process(shared, precisions, prepare)


def _prepare(
    shared: _Shared,
    precisions: list[str],
    mode: str,
    model_name: str,
    instances: range | list[int],
    records: dict[str, dict[str, Any]],
    ready: dict[str, Ready],
) -> None:
    """Build and warm up model instances `instances` of every precision into `ready`; the
    first instance (0) also makes each precision's record into `records`."""
    device = shared.device
    held_mb = None  # device memory held before the first model: the batch, the reference
    for instance in instances:
        for precision in precisions:
            exclude_mb = None
            if instance == 0:
                record = bench_record.base_record(
                    device, precision, mode, model_name, shared.settings
                )
                records[precision] = record
                reason = dev.autocast_unsupported_reason(device, precision)
                if reason:
                    bench_record.skipped(record, reason, logging.INFO)
                    continue
                allocated = dev.memory_stats(device).get("allocated_mb", 0.0)
                held_mb = allocated if held_mb is None else held_mb
                exclude_mb = max(0.0, allocated - held_mb)
            elif precision not in ready or ready[precision].complete:
                continue
            try:
                _warm_up_instance(shared, records[precision], ready, instance, exclude_mb)
            except (RuntimeError, NotImplementedError) as error:
                reason = bench_record.cannot_run_reason(error)
                if reason is None:
                    raise
                if instance == 0:
                    bench_record.skipped(records[precision], reason)
                else:  # timed on the instances it has, as many as fit
                    ready[precision].complete = True
                    log.info(
                        "%s %s: no model instance %d (%s); timed over %d",
                        precision,
                        mode,
                        instance,
                        reason,
                        instance,
                    )


def _warm_up_instance(
    shared: _Shared,
    record: dict[str, Any],
    ready: dict[str, Ready],
    instance: int,
    exclude_mb: float | None,
) -> None:
    """Build model instance `instance` (seed `instance`) for the record's precision and warm
    its step up, into `ready`. The first instance's warm-up gives the record its device peak
    and host peak RSS (the same step as the timed ones, alone on the device: the other
    models wait, and the memory they hold, `exclude_mb`, is left out, as are the fp32 steps
    that judge it); later ones measure no memory."""
    device, settings, layout = shared.device, shared.settings, shared.layout
    precision, mode = record["precision"], record["mode"]
    images, targets = shared.batch()
    torch.manual_seed(instance)
    np.random.seed(instance)
    model_config = {**settings["model_options"], "name": record["model"]}
    model = build_from_config(model_config, settings["num_classes"])
    model = model.to(device, memory_format=layout)
    first = instance == 0
    memory = None
    if first:
        record["parameters"] = parameter_count(model)
        memory = dev.PeakMemory(device, exclude_mb=exclude_mb or 0.0)
        dev.reset_host_peak_rss()
        if precision != "fp32":
            record["numerics"] = shared.numerics(model, precision)
        conditions = timing.RunConditions()
    fp32 = ready.get("fp32")
    end_warmup = stop = judge = None
    if fp32 is not None and precision != "fp32":
        # built from the same seed (in a forked child, its only instance)
        fp32_step = fp32.steps[min(instance, len(fp32.steps) - 1)] if fp32.steps else None
        judge = FarBehind(
            fp32.warmups[0]["step_times"],
            None if fp32_step is None else lambda: _reference_steps_now(fp32_step, device, memory),
            None if first else ready[precision].warmups[0]["step_times"],
        )
        end_warmup, stop = slower_than(judge, fp32.timed, precision)
    step = _step(model, images, targets, device, precision, mode, settings, layout)
    warmed = timing.warm_up(
        step,
        device,
        warmup=settings["warmup_steps"],
        budget_s=settings["warmup_budget_s"],
        memory=memory,
        end_warmup=end_warmup,
    )
    if first:
        record.update(memory=memory.as_dict(), host_peak_rss_mb=memory.host_peak_rss_mb)
        ready[precision] = Ready([step], [warmed], conditions, stop, timing.Timed())
    else:
        ready[precision].steps.append(step)
        ready[precision].warmups.append(warmed)
        if ready[precision].stop is None:  # in a forked child, the first instance's was not sent
            ready[precision].stop = stop
    # Far slower than fp32 (the warm-up's own test, whether it or the budget ended the
    # warm-up, even after one step; fp32 steps again only where the machine changed): its
    # first timed steps stop it, so a further instance would only cost time.
    if judge is not None and judge(warmed["step_times"]):
        ready[precision].complete = True


def _reference_steps_now(
    step: Callable[[], Any], device: torch.device, memory: dev.PeakMemory | None
) -> list[float]:
    """FRESH_REFERENCE_STEPS of fp32's warm `step` now, for `FarBehind` alone: no record
    keeps them, and `memory` (the judged precision's, where it measures) leaves them out.
    No steps where it cannot run now: the judgement then rests on fp32's warm-up."""

    def run() -> list[float]:
        return [timing.timed_step(step, device) for _ in range(FRESH_REFERENCE_STEPS)]

    try:
        return memory.set_aside(run) if memory is not None else run()
    except (RuntimeError, NotImplementedError) as error:
        reason = bench_record.cannot_run_reason(error)
        if reason is None:
            raise
        log.info("fp32 could not step again to judge another precision by (%s)", reason)
        return []
