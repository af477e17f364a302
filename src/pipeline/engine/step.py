"""One optimisation step exactly as training takes it: the trainer runs it, the benchmark times it.

Forward under the run's autocast, the loss (given the targets on the host), backward through a
GradScaler for fp16, gradients clipped after unscaling, optimizer and scheduler step. The step
never waits for the device: a non-finite loss is skipped on the device itself (fused optimizers
take a `found_inf` flag, the contract GradScaler uses with them), so the host can queue the next
step while an accelerator still works on this one. Where the optimizer has no fused kernel for
the device, the step falls back to reading that flag: one host synchronisation per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from pipeline import device as dev


def build_optimizer(params, train: dict[str, Any]) -> torch.optim.Optimizer:
    """The configured optimizer, fused where torch has a fused kernel for the parameters' device."""
    params = list(params)
    for fused in (True, False):
        options = {"fused": True} if fused else {}
        try:
            if train["optimizer"] == "sgd":
                sgd = torch.optim.SGD(
                    params,
                    lr=train["lr"],
                    momentum=train["momentum"],
                    nesterov=train["momentum"] > 0,  # torch refuses Nesterov without momentum
                    weight_decay=train["weight_decay"],
                    **options,
                )
                if fused and train["momentum"]:
                    # Fused SGD makes its momentum buffers with torch.empty_like on the first
                    # step and fills them only if that step is not skipped (found_inf): a
                    # skipped first step would leave the next reading uninitialised memory.
                    # A zero buffer updates exactly as a first step does (dampening is 0).
                    for param in params:
                        sgd.state[param]["momentum_buffer"] = torch.zeros_like(param)
                return sgd
            return torch.optim.AdamW(
                params, lr=train["lr"], weight_decay=train["weight_decay"], **options
            )
        except RuntimeError:
            if not fused:
                raise
    raise AssertionError("unreachable")


def lr_factor(step: int, train: dict[str, Any], steps_per_epoch: int) -> float:
    """Linear warm-up, then cosine to zero, step decay, or constant; per optimizer step.
    `train["epochs"]` may be fractional: a time budget's plan may end part-way into an epoch."""
    total = round(train["epochs"] * steps_per_epoch)
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


@dataclass(frozen=True)
class StepResult:
    """What a step leaves on the device; reading it is the caller's (one) synchronisation."""

    losses: torch.Tensor  # float32 [3]: total, heatmap, box (detached)
    finite: torch.Tensor  # bool scalar: the loss was finite (else the update was skipped)


class TrainStep:
    """Callable `(images, targets) -> StepResult`: one training step of the run's precision."""

    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        precision: str,
        *,
        grad_clip: float | None,
        memory_format: torch.memory_format,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    ) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.device = device
        self.precision = precision
        self.grad_clip = grad_clip
        self.memory_format = memory_format
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        self.skips_on_device = bool(optimizer.defaults.get("fused"))

    def __call__(self, images: torch.Tensor, targets: list[dict[str, Any]]) -> StepResult:
        images = images.to(self.device, non_blocking=True).contiguous(
            memory_format=self.memory_format
        )
        # the targets stay on the host: the loss plans its windows from the boxes there and
        # queues only that plan's arrays to the device (reading boxes on a device would wait)
        with dev.autocast(self.device, self.precision):
            outputs = self.model(images)
        losses = self.loss_fn(outputs, targets)
        total = losses["total"]
        values = torch.stack([total.detach(), losses["heatmap"], losses["box"]]).float()
        finite = torch.isfinite(values[0])
        # Without a fused kernel nothing can skip the update on the device: look (one sync).
        # A GradScaler finds the non-finite gradients that such a loss leaves by itself.
        if not (self.skips_on_device or self.scaler.is_enabled()) and not bool(finite):
            return StepResult(values, finite)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(total).backward()
        if self.grad_clip:
            self.scaler.unscale_(self.optimizer)
            # a model may clip groups of its parameters apart (CenterNet: its IoU branch)
            groups = getattr(self.model, "clip_groups", lambda: [self.model.parameters()])()
            for group in groups:
                torch.nn.utils.clip_grad_norm_(group, self.grad_clip)
        if self.skips_on_device and not self.scaler.is_enabled():
            self.optimizer.found_inf = (~finite).float()  # the fused kernel skips on 1
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
        else:
            self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.scheduler is not None:
            self.scheduler.step()
        return StepResult(values, finite)
