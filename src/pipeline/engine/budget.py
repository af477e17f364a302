"""A run's plan, its length in optimizer steps (which the learning-rate schedule spans), and
fitting that plan to a time budget (`train.time_budget_s`)."""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("pipeline")


@dataclass(frozen=True)
class BudgetTiming:
    used_s: float  # the run's wall time so far
    epoch_s: float  # a whole epoch's training
    validation_s: float  # one validation


def steps_within_budget(
    timing: BudgetTiming,
    *,
    budget_s: float,
    done_steps: int,
    steps_per_epoch: int,
    validated: bool,
    most_epochs: int,
    validates: Callable[[int, int], bool],
) -> int:
    """The most optimizer steps, from `done_steps` (whole epochs, the last of which has validated
    if `validated`) up to `most_epochs` epochs, that fit into `budget_s` with the validations
    still to come; the last epoch may stop part-way. `validates(epoch, last_epoch)` says
    whether an epoch validates in a run of that many epochs."""
    done_epochs = math.ceil(done_steps / steps_per_epoch)
    step_s = timing.epoch_s / steps_per_epoch
    pending = [] if validated else [done_epochs]
    fitting = done_steps
    for epochs in range(done_epochs + 1, most_epochs + 1):
        later = range(done_epochs + 1, epochs + 1)
        validations = sum(validates(epoch, epochs) for epoch in (*pending, *later))
        left_s = budget_s - timing.used_s - validations * timing.validation_s
        steps = min(epochs * steps_per_epoch, done_steps + math.floor(left_s / step_s))
        if steps > (epochs - 1) * steps_per_epoch:  # at least one step into this epoch
            fitting = steps
    return fitting


class TimeBudget:
    """The run's length in optimizer steps (its plan) and, with `train.time_budget_s`, the
    plan fitted to the budget after every epoch: the part of `engine.trainer.Trainer` that
    plans, mixed into it."""

    # what it reads of the Trainer (set in Trainer.__init__, the loop and resume)
    train_cfg: dict[str, Any]
    schedule: dict[str, Any]  # what the learning-rate schedule spans
    steps_per_epoch: int
    epoch: int
    global_step: int
    planned_steps: int
    logged_plan_steps: int | None
    elapsed_before: float
    _session_start: float
    timings: dict[str, list[float]]
    _should_validate: Callable[[int, int], bool]

    def _budget_timing(self) -> BudgetTiming:
        """What the budget's plan knows now: the run's seconds so far (all sessions), and the
        median time of an epoch's training and of a validation (0 before the first)."""
        return BudgetTiming(
            used_s=self.elapsed_before + time.perf_counter() - self._session_start,
            epoch_s=statistics.median(self.timings["epochs_s"]),
            validation_s=statistics.median(self.timings["validations_s"] or [0.0]),
        )

    def _plan(self, steps: int) -> None:
        """The run's length in optimizer steps: the learning-rate schedule spans them (ending at
        zero after the last), and the last epoch stops there, part-way through if need be."""
        self.planned_steps = steps
        self.schedule["epochs"] = steps / self.steps_per_epoch  # what lr_factor spans

    @property
    def planned_epochs(self) -> int:
        return math.ceil(self.planned_steps / self.steps_per_epoch)

    def _fit_schedule_to_budget(self, validated: bool) -> None:
        """With `train.time_budget_s`, after every epoch: plan as many steps as fit into what is
        left of the budget (at most `train.epochs`, never fewer than trained), from the median
        epoch and validation times so far, counting every validation still to come (each
        `val_interval` and the last); the last epoch may stop part-way. The learning-rate
        schedule spans the plan, so the run ends its cosine at zero instead of being cut off.
        The plan is logged after the first epoch, whenever it moves by a whole epoch from what
        was last logged, and when it ends the run; not at every small change.
        Planning again after each epoch corrects the first epoch's estimate (it runs slower
        than later ones) and follows a host that speeds up or slows down. A run that has
        trained its planned last epoch ends there, time left or not: its learning rate has
        annealed to zero and would restart."""
        if self.epoch >= self.planned_epochs:
            return
        budget, most = self.train_cfg["time_budget_s"], self.train_cfg["epochs"]
        timing = self._budget_timing()
        fitting = steps_within_budget(
            timing,
            budget_s=budget,
            done_steps=self.global_step,
            steps_per_epoch=self.steps_per_epoch,
            validated=validated,
            most_epochs=most,
            validates=self._should_validate,
        )
        moved = (
            self.logged_plan_steps is None
            or abs(fitting - self.logged_plan_steps) >= self.steps_per_epoch
            or fitting == self.global_step  # ends now
        )
        if moved:
            self.logged_plan_steps = fitting
            log.info(
                "time budget %.0f s: %.0f s used after epoch %d; an epoch takes %.1f s and a "
                "validation %.1f s, so %.1f of at most %d epochs fit (%d steps), and the "
                "learning-rate schedule spans them",
                budget,
                timing.used_s,
                self.epoch,
                timing.epoch_s,
                timing.validation_s,
                fitting / self.steps_per_epoch,
                most,
                fitting,
            )
        self._plan(fitting)
        if self.epoch == 1 and timing.used_s > budget:
            log.warning(
                "the first epoch alone took longer than train.time_budget_s=%s: training stops "
                "after it. Raise the budget, or lower data.image_size or train.batch_size.",
                budget,
            )
