"""The training loop: one pass from config to checkpoints, readable in one sitting.

Device from `resolve_device`, precision from the AMP policy or, with `precision: measured`, from the
benchmarks' choice; each step is `engine.step.TrainStep` (the step the benchmark times). The
loop reads the device only at log intervals, so the host queues steps ahead of an
accelerator. Each epoch ends with `last.pth` (and `best.pth` when the monitored metric
improves), written atomically; `resume()` continues from `last.pth` exactly where it left
off, including the RNG streams. The run folder's files and `resume()` are
`engine.run_files.RunFolder`'s, the run's plan and its time budget `engine.budget.TimeBudget`'s:
`Trainer` mixes both in.
"""

from __future__ import annotations

import logging
import math
import random
import statistics
import time
from datetime import UTC, datetime
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline import atomic
from pipeline import device as dev
from pipeline.data import load_splits
from pipeline.data.dataset import loader_for
from pipeline.engine import checkpoint
from pipeline.engine.budget import TimeBudget
from pipeline.engine.ema import WeightAverage
from pipeline.engine.run_files import RunFolder
from pipeline.engine.step import StepResult, TrainStep, build_optimizer, build_scheduler
from pipeline.engine.tally import StepTally
from pipeline.engine.trackers import open_trackers
from pipeline.errors import DataError, TrainingError
from pipeline.evaluation.coco import size_bucket_text
from pipeline.evaluation.loop import Evaluator
from pipeline.measured import PrecisionChoice, unmeasured_choice
from pipeline.models import build_from_config, check_input_size, memory_format, parameter_count
from pipeline.models.inference import for_inference
from pipeline.models.loss import DetectionLoss

log = logging.getLogger("pipeline")
SUMMARY_FORMAT = "pipeline.train_summary/1"  # schemas/train_summary.schema.yaml


def _format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s"


class Trainer(RunFolder, TimeBudget):
    """Trains one run into `run_dir`; `fit()` returns the summary it also writes."""

    def __init__(
        self,
        config: dict[str, Any],
        run_dir: str | Path,
        requested_device: str | None = None,
        precision_choice: PrecisionChoice | None = None,
    ) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.requested_device = requested_device or config["device"]
        self.device = dev.resolve_device(self.requested_device)
        if config["precision"] == "measured" and precision_choice is None:
            # the shipped default with nothing measured (a first train outside the workflow)
            auto = dev.training_precision("auto", self.device)
            precision_choice = unmeasured_choice(self.device.type, config["model"]["name"], auto)
            log.warning("%s", precision_choice.reason)
        self.precision_choice = precision_choice
        measured = precision_choice.precision if precision_choice else None
        self.precision = dev.run_precision(config["precision"], self.device, measured)
        self.amp = self.precision != "fp32"
        if config["precision"] in ("fp16", "bf16") and not self.amp:
            log.warning(
                "AMP was asked for, but %s does not support it in %s (%s): training in fp32 instead.",
                self.device,
                config["precision"],
                dev.measured_precision_refused_reason(self.device, config["precision"])
                or "autocast there is off by policy",
            )
        dev.require_precision(self.device, self.precision, "training")
        self.train_cfg = config["train"]
        self._seed_everything()

        check_input_size(config["model"], config["data"]["image_size"])
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
        self.weight_average = WeightAverage(self.model) if self.train_cfg["ema"] else None
        self.loss_fn = DetectionLoss.for_model(self.model, self.train_cfg["box_weight"])
        self.optimizer = build_optimizer(self.model.parameters(), self.train_cfg)
        # What the learning-rate schedule spans (its "epochs" may be fractional); set by _plan.
        self.schedule = dict(self.train_cfg)
        self.scheduler = build_scheduler(self.optimizer, self.schedule, self.steps_per_epoch)
        self._plan(self.train_cfg["epochs"] * self.steps_per_epoch)
        self.step = TrainStep(
            self.model,
            self.loss_fn,
            self.optimizer,
            self.device,
            self.precision,
            grad_clip=self.train_cfg["grad_clip"],
            memory_format=self.memory_format,
            scheduler=self.scheduler,
        )
        self.scaler = self.step.scaler
        self.evaluator = Evaluator.from_config(config, self.class_names)
        self.memory = dev.PeakMemory(self.device)
        self.epoch = 0  # epochs completed
        self.global_step = 0
        self.tally = StepTally(self.device)
        self.best_metric = -math.inf
        self.best_epoch: int | None = None
        self.best_weights: dict[str, torch.Tensor] | None = None  # a CPU copy, kept in last.pth
        # the best epoch's best-F1 score threshold on validation, saved with its weights
        self.operating_point: dict[str, Any] | None = None
        self.epoch_rows: list[dict[str, Any]] = []
        self.step_times: list[float] = []
        self.elapsed_before = 0.0  # wall time of earlier sessions of a resumed run
        # what a time budget plans from: every epoch's training and every validation, in seconds
        self.timings: dict[str, list[float]] = {"epochs_s": [], "validations_s": []}
        self.logged_plan_steps: int | None = None  # the budget's plan as last logged

    # ---- setup -------------------------------------------------------------------------
    def _seed_everything(self) -> None:
        seed = self.config["seed"]
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        dev.set_kernel_flags(self.device, self.config["deterministic"])

    @property
    def evaluated_model(self) -> torch.nn.Module:
        """What is validated and saved as the run's model: the weight average, where on."""
        return self.weight_average.module if self.weight_average else self.model

    # ---- loop --------------------------------------------------------------------------
    def _stop_if_diverging(self, epoch: int, streak: float) -> None:
        limit = self.train_cfg["max_nonfinite_steps"]
        if streak < limit:
            return
        raise TrainingError(
            f"Training stopped in epoch {epoch}, step {self.global_step}: the loss was not finite for "
            f"{int(streak)} consecutive steps, so the run is diverging. Lower train.lr (now "
            f"{self.train_cfg['lr']}), keep train.grad_clip on, or use precision=fp32. The last "
            + (
                f"checkpoint, written after epoch {self.epoch}, is {self.paths['last']}."
                if self.paths["last"].exists()
                else "checkpoint is not written yet."
            )
        )

    def _train_epoch(self) -> dict[str, Any]:
        """One epoch; the device is read (one synchronisation) only at log steps."""
        epoch = self.epoch + 1
        self.model.train()
        self.memory.reset()
        self.train_loader.sampler.set_epoch(epoch)
        self.tally.new_epoch()
        batch_size, total_epochs = self.train_cfg["batch_size"], self.planned_epochs
        # all of the epoch's batches, or fewer where the plan ends part-way into it
        steps = min(self.steps_per_epoch, self.planned_steps - self.global_step)
        interval = self.train_cfg["log_interval"]
        dev.synchronize(self.device)
        start = mark = time.perf_counter()
        for index, (images, targets) in enumerate(islice(self.train_loader, steps), start=1):
            result = self.train_step(images, targets)
            if index % interval and index != steps:
                continue
            read = self.tally.read(result)
            now = time.perf_counter()
            self._stop_if_diverging(epoch, read["worst_streak"])
            step_time = (now - mark) / (index % interval or interval)
            mark = now
            self.step_times.append(step_time)
            if not read["finite"]:  # a skipped step has no figures to log
                continue
            remaining = self.planned_steps - self.global_step
            lr = self.optimizer.param_groups[0]["lr"]
            self._write_row(
                {
                    "type": "step",
                    "epoch": epoch,
                    "step": self.global_step,
                    "loss": read["loss"],
                    "heatmap": read["heatmap"],
                    "box": read["box"],
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
                steps,
                read["loss"],
                read["heatmap"],
                read["box"],
                lr,
                step_time * 1000,
                batch_size / step_time,
                _format_duration(remaining * step_time),
            )
        seconds = time.perf_counter() - start
        # the epoch's last step was a log step: `read` holds its totals
        count = read["finite_steps"]
        # an epoch without a finite loss has no mean loss (null in metrics.jsonl), not 0
        means = [value / count if count else math.nan for value in read["sums"]]
        return {
            "epoch": epoch,
            "train_loss": means[0],
            "train_heatmap": means[1],
            "train_box": means[2],
            "epoch_time_s": seconds,
            "images_per_s": steps * batch_size / seconds,
        }

    def train_step(self, images: torch.Tensor, targets: list[dict[str, Any]]) -> StepResult:
        """One optimizer step and what every step keeps up to date (benchmarks/trainer_overhead.py
        times this against a bare PyTorch loop); nothing here reads the device."""
        result = self.step(images, targets)
        if self.weight_average:
            self.weight_average.update()
        self.global_step += 1
        self.memory.update()
        self.tally.add(result)
        return result

    def _should_validate(self, epoch: int, last_epoch: int | None = None) -> bool:
        """Every `val_interval` epochs and the last (of the schedule, or `last_epoch`)."""
        last = self.planned_epochs if last_epoch is None else last_epoch
        return epoch % self.train_cfg["val_interval"] == 0 or epoch == last

    def fit(self) -> dict[str, Any]:
        created, fresh = not self.run_dir.exists(), self.epoch == 0
        atomic.make_folder(self.run_dir)
        self._remove_stale_temp_files()
        atomic.write_json(self.paths["config"], self.config)
        if self.epoch == 0:
            self.paths["metrics"].unlink(missing_ok=True)
        self._session_start = time.perf_counter()
        self.trackers = open_trackers(self.train_cfg, self.run_dir, self.config)
        bad_start = False
        log.info(
            "training %s (%d parameters, %d classes) on %s, %s, %d epochs x %d steps of %d images",
            self.config["model"]["name"],
            parameter_count(self.model),
            len(self.class_names),
            dev.describe_device(self.device),
            "AMP " + self.precision if self.amp else "fp32",
            self.planned_epochs,
            self.steps_per_epoch,
            self.train_cfg["batch_size"],
        )
        try:
            while self.epoch < self.planned_epochs:
                epoch_started = time.perf_counter()
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
                self.timings["epochs_s"].append(time.perf_counter() - epoch_started)
                budgeted = self.train_cfg["time_budget_s"] is not None
                if budgeted and self.epoch == 1:  # the budget's plan needs a validation's time
                    row["val"] = self._timed_validation()
                if budgeted:
                    self._fit_schedule_to_budget(validated=row["val"] is not None)
                if row["val"] is None and self._should_validate(self.epoch):
                    row["val"] = self._timed_validation()
                self._write_row(row)
                self.epoch_rows.append(row)
                checkpoint.save(self.paths["last"], self._state(), self._after_a_failed_write())
        except DataError:  # found while decoding (data.cache=false)
            bad_start = fresh and not self.epoch_rows
            raise
        finally:
            self.trackers.close()
            if bad_start:
                self._remove_unfinished_start(created)
        summary = self._summary()
        atomic.write_json(self.paths["train_summary"], summary)
        return summary

    def _timed_validation(self) -> dict[str, Any]:
        started = time.perf_counter()
        val = self._validate()
        self.timings["validations_s"].append(time.perf_counter() - started)
        return val

    def _validate(self) -> dict[str, Any]:
        metrics, _ = self.evaluator.evaluate(
            for_inference(self.evaluated_model), self.val_loader, self.device, self.precision
        )
        value = metrics[self.train_cfg["monitor"]]
        val = {
            key: metrics[key]
            for key in (
                "f1",
                "score_threshold",
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
            "epoch %d validation: F1 %.3f at score %.2f (P %.3f R %.3f), best F1 %.3f at %.2f, "
            "AP@.5 %.3f, AP %.3f; AP@.5 by size %s",
            self.epoch,
            val["f1"],
            val["score_threshold"],
            val["precision"],
            val["recall"],
            val["best_f1"],
            metrics["best_f1_threshold"],
            val["ap50"],
            val["ap"],
            size_bucket_text(val["size_buckets"]),
        )
        if value > self.best_metric:
            self.best_metric, self.best_epoch = value, self.epoch
            self.operating_point = checkpoint.operating_point(metrics)
            self.best_weights = {
                key: tensor.detach().to("cpu", copy=True)
                for key, tensor in self.evaluated_model.state_dict().items()
            }
            checkpoint.save(self.paths["best"], self._best_state(), self._after_a_failed_write())
            log.info("new best %s %.4f: %s", self.train_cfg["monitor"], value, self.paths["best"])
        return val

    def _summary(self) -> dict[str, Any]:
        epochs = self.epoch_rows
        final = next((row["val"] for row in reversed(epochs) if row.get("val")), None)
        session = time.perf_counter() - self._session_start
        return {
            "format": SUMMARY_FORMAT,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "requested_device": self.requested_device,
            "device": str(self.device),
            "backend": self.device.type,
            "device_description": dev.describe_device(self.device),
            "amp": self.amp,
            "precision": self.precision,
            "precision_choice": self.precision_choice.as_dict() if self.precision_choice else None,
            "model": self.config["model"]["name"],
            "parameters": parameter_count(self.model),
            "class_names": self.class_names,
            "epochs": self.epoch,
            "time_budget_s": self.train_cfg["time_budget_s"],  # None: epochs = train.epochs
            "ema": self.weight_average is not None,
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
