"""Fitting a run's learning-rate schedule to a time budget (`train.time_budget_s`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


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
