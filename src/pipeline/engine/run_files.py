"""The files of a run's folder: their paths, what last.pth and best.pth hold, resuming from
last.pth, the metrics file's rows (kept and cut back on resume), and what an interrupted or
failed write leaves."""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeline import atomic
from pipeline.engine import checkpoint
from pipeline.engine.ema import WeightAverage
from pipeline.engine.trackers import Trackers
from pipeline.errors import CheckpointError
from pipeline.setting_groups import differing_keys, result_settings

log = logging.getLogger("pipeline")


class RunFolder:
    """The part of `engine.trainer.Trainer` that reads and writes its run folder's files, mixed
    into it."""

    # what it reads and sets of the Trainer (set in Trainer.__init__ and the loop)
    config: dict[str, Any]
    train_cfg: dict[str, Any]
    run_dir: Path
    class_names: list[str]
    precision: str
    steps_per_epoch: int
    model: torch.nn.Module
    evaluated_model: torch.nn.Module
    weight_average: WeightAverage | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    epoch: int
    global_step: int
    planned_steps: int
    _plan: Callable[[int], None]
    timings: dict[str, list[float]]
    best_metric: float
    best_epoch: int | None
    best_weights: dict[str, torch.Tensor] | None
    operating_point: dict[str, Any] | None
    epoch_rows: list[dict[str, Any]]
    step_times: list[float]
    elapsed_before: float
    _session_start: float
    trackers: Trackers

    @property
    def paths(self) -> dict[str, Path]:
        names = ("last.pth", "best.pth", "metrics.jsonl", "train_summary.json", "config.json")
        return {name.split(".")[0]: self.run_dir / name for name in names}

    def _state(self) -> dict[str, Any]:
        """last.pth: "model" holds the evaluated weights (what eval and profile load), and with
        train.ema the weights being trained are kept beside them for a resume."""
        average = self.weight_average
        return {
            "model": self.evaluated_model.state_dict(),
            "training_model": self.model.state_dict() if average else None,
            "ema_updates": average.updates if average else None,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": self.epoch,
            "planned_steps": self.planned_steps,
            "timings": self.timings,
            "global_step": self.global_step,
            "best_metric": self.best_metric,
            "best_epoch": self.best_epoch,
            "best_model": self.best_weights,
            "operating_point": self.operating_point,
            "config": self.config,
            "class_names": self.class_names,
            "precision": self.precision,
            "rng": checkpoint.rng_state(),
            "elapsed_s": self.elapsed_before + time.perf_counter() - self._session_start,
        }

    def _best_state(self) -> dict[str, Any]:
        """best.pth: the best epoch's weights and what evaluating them needs.

        last.pth carries the same weights, so a resume can write best.pth again: the
        workflow declares best.pth an output, and Snakemake deletes a job's outputs before
        it runs the job again, also a job that will resume from last.pth.
        """
        return {
            "model": self.best_weights,
            "epoch": self.best_epoch,
            "best_epoch": self.best_epoch,
            "best_metric": self.best_metric,
            "monitor": self.train_cfg["monitor"],
            "operating_point": self.operating_point,
            "config": self.config,
            "class_names": self.class_names,
            "precision": self.precision,
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
        # what must match for a resume to continue this run rather than mix two
        changed = differing_keys(result_settings(state["config"]), result_settings(self.config))
        if state["class_names"] != self.class_names:
            changed.append("class names")
        if state["precision"] != self.precision:
            changed.append(f"precision {state['precision']}, now {self.precision}")
        if changed:
            message = f"{path} was trained with different settings ({', '.join(changed)})"
            if required:
                raise CheckpointError(
                    f"Cannot resume: {message}. Use another --out folder, or the same settings."
                )
            log.warning("%s: starting a new run instead of resuming.", message)
            return False
        # checkpoints before 2026-12 hold the plan in epochs
        planned = state.get("planned_steps") or self.steps_per_epoch * state.get(
            "planned_epochs", self.train_cfg["epochs"]
        )
        if state["global_step"] >= planned and not required:
            # a rerun of a finished run was asked for (by Snakemake, say, after a code change)
            log.info("%s holds a finished run: training again from the start.", path)
            return False
        if not required and not checkpoint.weights_fit(self.model, state):
            log.warning(
                "%s holds weights of another architecture (an earlier version of %s): starting "
                "a new run instead of resuming.",
                path,
                self.config["model"]["name"],
            )
            return False
        checkpoint.load_weights(self.evaluated_model, state, path)
        if self.weight_average:
            self.weight_average.updates = state["ema_updates"]
            self.model.load_state_dict(state["training_model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.epoch, self.global_step = state["epoch"], state["global_step"]
        self._plan(planned)
        self.timings = state.get("timings", self.timings)  # absent in checkpoints before 2026-12
        self.best_metric, self.best_epoch = state["best_metric"], state["best_epoch"]
        self.best_weights = state.get("best_model")
        self.operating_point = state.get("operating_point")  # None in older runs
        self.elapsed_before = state["elapsed_s"]
        checkpoint.restore_rng_state(state["rng"])
        self._truncate_metrics()
        if self.best_weights is not None:  # the workflow may have deleted best.pth
            checkpoint.save(self.paths["best"], self._best_state())
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

    def _write_row(self, row: dict[str, Any]) -> None:
        line = json.dumps(atomic.jsonable(row))
        atomic.append_line(self.paths["metrics"], line, self._after_a_failed_write())
        self.trackers.log(row, self.global_step)

    def _after_a_failed_write(self) -> str:
        """What a failed write of a checkpoint or metrics row leaves to continue from."""
        last = self.paths["last"]
        if not last.exists():
            return "No epoch was checkpointed yet: training starts from the beginning again."
        return (
            f"{last} holds the last epoch saved, and metrics.jsonl its rows: add --resume (the "
            "workflow passes --resume-if-possible) to continue from there."
        )

    def _remove_unfinished_start(self, created: bool) -> None:
        """Bad data found before the first epoch ended leaves no folder holding only
        config.json and step rows: the folder goes if this run made it, else those files."""
        if created:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        else:
            for path in (self.paths["config"], self.paths["metrics"]):
                path.unlink(missing_ok=True)

    def _remove_stale_temp_files(self) -> None:
        """A SIGKILL during an atomic write leaves its `.<name>.<random>.tmp` file behind."""
        for stale in sorted(self.run_dir.glob(".*.tmp")):
            if stale.is_file():
                stale.unlink(missing_ok=True)
                log.info("removed %s, left behind by an interrupted write", stale)
