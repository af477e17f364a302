"""The training loop: one pass from config to checkpoints, readable in one sitting.

Device from `resolve_device`, AMP from `resolve_amp`; fp16 runs through a GradScaler,
gradients are clipped after unscaling. Each epoch ends with `last.pth` (and `best.pth`
when the monitored metric improves), written atomically; `resume()` continues from
`last.pth` exactly where it left off, including the RNG streams.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline import atomic
from pipeline import device as dev
from pipeline.data import load_splits
from pipeline.data.dataset import loader_for
from pipeline.engine import checkpoint
from pipeline.engine.evaluator import Evaluator, size_bucket_text
from pipeline.engine.trackers import open_trackers
from pipeline.errors import CheckpointError, TrainingError
from pipeline.models import (
    build_from_config,
    check_input_size,
    input_multiple,
    memory_format,
    parameter_count,
)
from pipeline.models.loss import DetectionLoss

log = logging.getLogger("pipeline")
# What must match for `--resume` to continue a run rather than start another one.
RESUME_KEYS = ("seed", "deterministic", "data", "model", "train")


def build_optimizer(params, train: dict[str, Any]) -> torch.optim.Optimizer:
    if train["optimizer"] == "sgd":
        return torch.optim.SGD(
            params,
            lr=train["lr"],
            momentum=train["momentum"],
            nesterov=True,
            weight_decay=train["weight_decay"],
        )
    return torch.optim.AdamW(params, lr=train["lr"], weight_decay=train["weight_decay"])


def lr_factor(step: int, train: dict[str, Any], steps_per_epoch: int) -> float:
    """Linear warm-up, then cosine to zero, step decay, or constant; per optimizer step."""
    total = train["epochs"] * steps_per_epoch
    warmup = min(int(train["warmup_epochs"] * steps_per_epoch), total - 1)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if train["scheduler"] == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    if train["scheduler"] == "step":
        return train["gamma"] ** (step // (train["step_size"] * steps_per_epoch))
    return 1.0


def build_scheduler(optimizer: torch.optim.Optimizer, train: dict[str, Any], steps_per_epoch: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, train, steps_per_epoch)
    )


def _format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s"


class Trainer:
    """Trains one run into `run_dir`; `fit()` returns the summary it also writes."""

    def __init__(
        self, config: dict[str, Any], run_dir: str | Path, requested_device: str | None = None
    ) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.requested_device = requested_device or config["device"]
        self.device = dev.resolve_device(self.requested_device)
        self.amp = dev.resolve_amp(config["amp"], self.device)
        if config["amp"] is True and not self.amp:
            log.warning(
                "AMP was asked for, but %s does not support it (autocast there is far slower than fp32, "
                "so it is off by policy): training in fp32 instead.",
                self.device,
            )
        self.precision = dev.training_precision(config["amp"], config["amp_dtype"], self.device)
        reason = dev.autocast_unsupported_reason(self.device, self.precision)
        if reason:
            raise TrainingError(
                f"Cannot train in {self.precision} on {self.device}: {reason}. Set amp=false or amp_dtype to another precision."
            )
        self.train_cfg = config["train"]
        self._seed_everything()

        check_input_size(
            config["model"]["name"], config["data"]["image_size"], input_multiple(config["model"])
        )
        train_split, val_split = load_splits(config)
        self.class_names = train_split.class_names
        pin = dev.pin_memory_supported(self.device)
        self.train_loader = loader_for(train_split, config, train=True, pin_memory=pin)
        self.val_loader = loader_for(val_split, config, train=False, pin_memory=pin)
        self.steps_per_epoch = len(self.train_loader)

        self.memory_format = memory_format(self.train_cfg["channels_last"])
        self.model = build_from_config(config["model"], len(self.class_names)).to(
            self.device, memory_format=self.memory_format
        )
        self.loss_fn = DetectionLoss(self.model, self.train_cfg["box_weight"])
        self.optimizer = build_optimizer(self.model.parameters(), self.train_cfg)
        self.scheduler = build_scheduler(self.optimizer, self.train_cfg, self.steps_per_epoch)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        self.evaluator = Evaluator.from_config(config, self.class_names)
        self.memory = dev.PeakMemory(self.device)
        self.epoch = 0  # epochs completed
        self.global_step = 0
        self.nonfinite_run = 0  # consecutive non-finite losses, across epoch boundaries
        self.best_metric = -math.inf
        self.best_epoch: int | None = None
        self.epoch_rows: list[dict[str, Any]] = []
        self.step_times: list[float] = []
        self.elapsed_before = 0.0  # wall time of earlier sessions of a resumed run

    # ---- setup -------------------------------------------------------------------------
    def _seed_everything(self) -> None:
        seed = self.config["seed"]
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        if self.config["deterministic"]:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
        elif self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True

    @property
    def paths(self) -> dict[str, Path]:
        names = ("last.pth", "best.pth", "metrics.jsonl", "train_summary.json", "config.json")
        return {name.split(".")[0]: self.run_dir / name for name in names}

    def _autocast(self):
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(
            device_type=self.device.type, dtype=dev.autocast_dtype(self.precision)
        )

    # ---- checkpoints -------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": self.epoch,
            "global_step": self.global_step,
            "best_metric": self.best_metric,
            "best_epoch": self.best_epoch,
            "config": self.config,
            "class_names": self.class_names,
            "precision": self.precision,
            "rng": checkpoint.rng_state(),
            "elapsed_s": self.elapsed_before + time.perf_counter() - self._session_start,
        }

    def resume(self, required: bool) -> bool:
        """Continue from last.pth; with `required=False`, start afresh if it is absent or from another config."""
        path = self.paths["last"]
        if not path.exists():
            if required:
                raise CheckpointError(
                    f"Cannot resume: {path} does not exist (nothing was trained into {self.run_dir} yet)."
                )
            return False
        # On the CPU: RNG states must stay CPU tensors; the model and optimizer copy theirs over.
        state = checkpoint.load(path, map_location="cpu")
        changed = [key for key in RESUME_KEYS if state["config"].get(key) != self.config.get(key)]
        if state["class_names"] != self.class_names:
            changed.append("class names")
        if changed:
            message = f"{path} was trained with different settings ({', '.join(changed)})"
            if required:
                raise CheckpointError(
                    f"Cannot resume: {message}. Use another --out folder, or the same settings."
                )
            log.warning("%s: starting a new run instead of resuming.", message)
            return False
        if state["epoch"] >= self.train_cfg["epochs"] and not required:
            # a rerun of a finished run was asked for (by Snakemake, say, after a code change)
            log.info("%s holds a finished run: training again from the start.", path)
            return False
        checkpoint.load_weights(self.model, state, path)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.epoch, self.global_step = state["epoch"], state["global_step"]
        self.best_metric, self.best_epoch = state["best_metric"], state["best_epoch"]
        self.elapsed_before = state["elapsed_s"]
        checkpoint.restore_rng_state(state["rng"])
        self._truncate_metrics()
        log.info("resumed from %s after epoch %d (step %d)", path, self.epoch, self.global_step)
        return True

    def _truncate_metrics(self) -> None:
        """Drop metric rows of the epoch that was interrupted; it is about to run again."""
        path = self.paths["metrics"]
        if not path.exists():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by the kill
            if row["epoch"] <= self.epoch:
                kept.append(line)
                if row["type"] == "epoch":
                    self.epoch_rows.append(row)
                else:
                    self.step_times.append(row["step_time_s"])
        atomic.write_text(path, "".join(line + "\n" for line in kept))

    # ---- loop --------------------------------------------------------------------------
    def _write_row(self, row: dict[str, Any]) -> None:
        with open(self.paths["metrics"], "a", encoding="utf-8") as handle:
            handle.write(json.dumps(atomic.jsonable(row)) + "\n")
        self.trackers.log(row, self.global_step)

    def _train_step(
        self, images: torch.Tensor, targets: list[dict[str, Any]]
    ) -> dict[str, float] | None:
        images = images.to(self.device, non_blocking=True).contiguous(
            memory_format=self.memory_format
        )
        with self._autocast():
            outputs = self.model(images)
        losses = self.loss_fn(outputs, targets)
        total = losses["total"]
        value = total.item()
        if not math.isfinite(value):  # skip the update: one bad batch must not poison the weights
            return None
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(total).backward()
        if self.train_cfg["grad_clip"]:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.train_cfg["grad_clip"])
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.memory.update()
        return {"loss": value, "heatmap": losses["heatmap"].item(), "box": losses["box"].item()}

    def _train_epoch(self) -> dict[str, Any]:
        epoch = self.epoch + 1
        self.model.train()
        self.memory.reset()
        self.train_loader.sampler.set_epoch(epoch)
        batch_size, total_epochs = self.train_cfg["batch_size"], self.train_cfg["epochs"]
        interval = self.train_cfg["log_interval"]
        sums = {"loss": 0.0, "heatmap": 0.0, "box": 0.0}
        finite_steps = 0
        dev.synchronize(self.device)
        start = mark = time.perf_counter()
        for index, (images, targets) in enumerate(self.train_loader, start=1):
            result = self._train_step(images, targets)
            self.global_step += 1
            if result is None:
                self.nonfinite_run += 1
                if self.nonfinite_run >= self.train_cfg["max_nonfinite_steps"]:
                    raise TrainingError(
                        f"Training stopped in epoch {epoch}, step {self.global_step}: the loss was not finite for "
                        f"{self.nonfinite_run} consecutive steps, so the run is diverging. Lower train.lr (now "
                        f"{self.train_cfg['lr']}), keep train.grad_clip on, or use amp=false. The last "
                        + (
                            f"checkpoint, written after epoch {self.epoch}, is {self.paths['last']}."
                            if self.paths["last"].exists()
                            else "checkpoint is not written yet."
                        )
                    )
                continue
            self.nonfinite_run = 0
            finite_steps += 1
            for key in sums:
                sums[key] += result[key]
            if index % interval == 0 or index == self.steps_per_epoch:
                dev.synchronize(self.device)
                now = time.perf_counter()
                steps = index % interval or interval
                step_time = (now - mark) / steps
                mark = now
                self.step_times.append(step_time)
                remaining = (
                    (total_epochs - epoch) * self.steps_per_epoch + self.steps_per_epoch - index
                )
                lr = self.optimizer.param_groups[0]["lr"]
                self._write_row(
                    {
                        "type": "step",
                        "epoch": epoch,
                        "step": self.global_step,
                        **result,
                        "lr": lr,
                        "step_time_s": step_time,
                        "images_per_s": batch_size / step_time,
                        "memory": self.memory.as_dict(),
                    }
                )
                log.info(
                    "epoch %d/%d step %d/%d loss %.3f (heatmap %.3f box %.3f) lr %.2e %.0f ms/step %.0f img/s ETA %s",
                    epoch,
                    total_epochs,
                    index,
                    self.steps_per_epoch,
                    result["loss"],
                    result["heatmap"],
                    result["box"],
                    lr,
                    step_time * 1000,
                    batch_size / step_time,
                    _format_duration(remaining * step_time),
                )
        dev.synchronize(self.device)
        seconds = time.perf_counter() - start
        # an epoch without a finite loss has no mean loss (null in metrics.jsonl), not 0
        means = {
            key: value / finite_steps if finite_steps else math.nan for key, value in sums.items()
        }
        return {
            "epoch": epoch,
            "train_loss": means["loss"],
            "train_heatmap": means["heatmap"],
            "train_box": means["box"],
            "epoch_time_s": seconds,
            "images_per_s": self.steps_per_epoch * batch_size / seconds,
        }

    def _should_validate(self, epoch: int) -> bool:
        return epoch % self.train_cfg["val_interval"] == 0 or epoch == self.train_cfg["epochs"]

    def fit(self) -> dict[str, Any]:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._remove_stale_temp_files()
        atomic.write_json(self.paths["config"], self.config)
        if self.epoch == 0:
            self.paths["metrics"].unlink(missing_ok=True)
        self._session_start = time.perf_counter()
        self.trackers = open_trackers(self.train_cfg, self.run_dir, self.config)
        log.info(
            "training %s (%d parameters, %d classes) on %s, %s, %d epochs x %d steps of %d images",
            self.config["model"]["name"],
            parameter_count(self.model),
            len(self.class_names),
            dev.describe_device(self.device),
            "AMP " + self.precision if self.amp else "fp32",
            self.train_cfg["epochs"],
            self.steps_per_epoch,
            self.train_cfg["batch_size"],
        )
        try:
            while self.epoch < self.train_cfg["epochs"]:
                row = self._train_epoch()
                self.epoch = row["epoch"]
                row.update(
                    type="epoch",
                    step=self.global_step,
                    lr=self.optimizer.param_groups[0]["lr"],
                    memory=self.memory.as_dict(),
                    host_peak_rss_mb=dev.host_peak_rss_mb(),
                    val=None,
                )
                if self._should_validate(self.epoch):
                    row["val"] = self._validate()
                self._write_row(row)
                self.epoch_rows.append(row)
                checkpoint.save(self.paths["last"], self._state())
        finally:
            self.trackers.close()
        summary = self._summary()
        atomic.write_json(self.paths["train_summary"], summary)
        return summary

    def _remove_stale_temp_files(self) -> None:
        """A SIGKILL during an atomic write leaves its `.<name>.<random>.tmp` file behind."""
        for stale in sorted(self.run_dir.glob(".*.tmp")):
            if stale.is_file():
                stale.unlink(missing_ok=True)
                log.info("removed %s, left behind by an interrupted write", stale)

    def _validate(self) -> dict[str, Any]:
        metrics, _ = self.evaluator.evaluate(
            self.model, self.val_loader, self.device, self.precision
        )
        value = metrics[self.train_cfg["monitor"]]
        val = {
            key: metrics[key]
            for key in (
                "f1",
                "precision",
                "recall",
                "best_f1",
                "ap",
                "ap50",
                "ap75",
                "size_buckets",
            )
        }
        log.info(
            "epoch %d validation: F1 %.3f (P %.3f R %.3f), best F1 %.3f, AP@.5 %.3f, AP %.3f; "
            "AP@.5 by size %s",
            self.epoch,
            val["f1"],
            val["precision"],
            val["recall"],
            val["best_f1"],
            val["ap50"],
            val["ap"],
            size_bucket_text(val["size_buckets"]),
        )
        if value > self.best_metric:
            self.best_metric, self.best_epoch = value, self.epoch
            checkpoint.save(self.paths["best"], self._state())
            log.info("new best %s %.4f: %s", self.train_cfg["monitor"], value, self.paths["best"])
        return val

    def _summary(self) -> dict[str, Any]:
        epochs = self.epoch_rows
        final = next((row["val"] for row in reversed(epochs) if row.get("val")), None)
        session = time.perf_counter() - self._session_start
        return {
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "requested_device": self.requested_device,
            "device": str(self.device),
            "backend": self.device.type,
            "device_description": dev.describe_device(self.device),
            "amp": self.amp,
            "precision": self.precision,
            "model": self.config["model"]["name"],
            "parameters": parameter_count(self.model),
            "class_names": self.class_names,
            "epochs": self.epoch,
            "steps": self.global_step,
            "batch_size": self.train_cfg["batch_size"],
            "wall_time_s": self.elapsed_before + session,
            "resumed_after_s": self.elapsed_before,
            "train_time_s": sum(row["epoch_time_s"] for row in epochs),
            "epoch_times_s": [row["epoch_time_s"] for row in epochs],
            "median_step_time_s": statistics.median(self.step_times) if self.step_times else None,
            "images_per_s": statistics.median(row["images_per_s"] for row in epochs)
            if epochs
            else None,
            "peak_memory": max(
                (row["memory"] for row in epochs),
                key=lambda m: m["peak_mb"],
                default=self.memory.as_dict(),
            ),
            "host_peak_rss_mb": max(
                [dev.host_peak_rss_mb()] + [row["host_peak_rss_mb"] for row in epochs]
            ),
            "monitor": self.train_cfg["monitor"],
            "best_metric": self.best_metric if self.best_epoch is not None else None,
            "best_epoch": self.best_epoch,
            "final_val": final,
            "paths": {key: str(path) for key, path in self.paths.items()},
        }
