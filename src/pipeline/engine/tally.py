"""The training loop's per-epoch tallies of its steps, kept on the device."""

from __future__ import annotations

from typing import Any

import torch

from pipeline.engine.step import StepResult


class StepTally:
    """What the loop keeps of its steps, on the device, so that steps never wait for it.

    Loss sums and the count of finite steps per epoch, and the streak of consecutive
    non-finite losses across epochs; `read()` fetches all of it at once: the one host
    synchronisation of a log step.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.streak = torch.zeros((), device=device)
        self.new_epoch()

    def new_epoch(self) -> None:
        self.sums = torch.zeros(3, device=self.device)  # loss, heatmap, box over finite steps
        self.finite_steps = torch.zeros((), device=self.device)
        self.worst_streak = self.streak.clone()

    def add(self, result: StepResult) -> None:
        self.sums += torch.where(result.finite, result.losses, 0.0)
        self.finite_steps += result.finite
        self.streak = (self.streak + 1) * ~result.finite
        self.worst_streak = torch.maximum(self.worst_streak, self.streak)

    def read(self, result: StepResult) -> dict[str, Any]:
        """This step's losses and the tallies so far, in one synchronisation."""
        values = torch.cat(
            [
                result.losses,
                result.finite[None],
                self.worst_streak[None],
                self.sums,
                self.finite_steps[None],
            ]
        ).tolist()
        return {
            "loss": values[0],
            "heatmap": values[1],
            "box": values[2],
            "finite": bool(values[3]),
            "worst_streak": values[4],
            "sums": values[5:8],
            "finite_steps": values[8],
        }
