"""fp16/bf16 numerics against fp32, for the benchmarks: loss, gradients and outputs of one
training forward and backward on the same weights and batch, after a short stretch of real
fp32 training (a fresh detector's box head outputs exactly zero in every precision)."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from pipeline import device as dev
from pipeline.engine.step import TrainStep, build_optimizer
from pipeline.models.loss import DetectionLoss

# Relative loss difference against fp32 above which a precision's numerics are not acceptable.
ACCEPTABLE_LOSS_REL_DIFF = 0.02
# Cosine similarity of all gradients against fp32's below which they point elsewhere.
ACCEPTABLE_GRAD_COSINE = 0.99


def _flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().reshape(-1)
            for p in model.parameters()
        ]
    )


def _loss_and_grads(
    model: torch.nn.Module,
    loss_fn: DetectionLoss,
    images: torch.Tensor,
    targets: list[dict],
    device: torch.device,
    precision: str,
) -> tuple[float, torch.Tensor, dict[str, torch.Tensor]]:
    """One training forward and backward; fp16 backward is loss-scaled as GradScaler would."""
    scale = 2.0**16 if precision == "fp16" else 1.0
    for _ in range(24):  # GradScaler's back-off, without a scaler's state
        model.zero_grad(set_to_none=True)
        with dev.autocast(device, precision):
            outputs = model(images)
        loss = loss_fn(outputs, targets)["total"]
        (loss * scale).backward()
        grads = _flat_grads(model) / scale
        if scale == 1.0 or torch.isfinite(grads).all():
            break
        scale /= 2
    return loss.item(), grads, {key: value.detach().float() for key, value in outputs.items()}


class NumericsReference:
    """The fp32 side of the numerics check, trained once per model and read by every precision.

    A freshly initialised detector says little: its box head outputs exactly zero in every
    precision. So a copy first trains `numerics_steps` fp32 steps on the batch; its weights
    then give one fp32 training forward and backward (the reference), and each precision's
    comparison starts again from those same weights.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        images: torch.Tensor,
        targets: list[dict],
        device: torch.device,
        settings: dict[str, Any],
        layout: torch.memory_format,
    ) -> None:
        self.images, self.targets, self.device = images, targets, device
        self.steps = settings["numerics_steps"]
        self.model = copy.deepcopy(model)
        self.loss_fn = DetectionLoss.for_model(self.model, settings["train"]["box_weight"])
        optimizer = build_optimizer(self.model.parameters(), settings["train"])
        step = TrainStep(
            self.model,
            self.loss_fn,
            optimizer,
            device,
            "fp32",
            grad_clip=settings["train"]["grad_clip"],
            memory_format=layout,
        )
        self.model.train()
        for _ in range(self.steps):
            step(images, targets)
        self.weights = copy.deepcopy(self.model.state_dict())
        self.loss, self.grads, self.outputs = _loss_and_grads(
            self.model, self.loss_fn, images, targets, device, "fp32"
        )

    def compare(self, precision: str) -> dict[str, Any]:
        """Loss, gradients and outputs under autocast in `precision` against the fp32 reference."""
        self.model.load_state_dict(self.weights)  # undo the batch-norm statistics of a pass
        candidate_loss, candidate_grads, candidate = _loss_and_grads(
            self.model, self.loss_fn, self.images, self.targets, self.device, precision
        )
        return _numerics_record(
            self.loss,
            self.grads,
            self.outputs,
            candidate_loss,
            candidate_grads,
            candidate,
            self.steps,
        )


def compare_numerics(
    model: torch.nn.Module,
    images: torch.Tensor,
    targets: list[dict],
    device: torch.device,
    precision: str,
    settings: dict[str, Any],
    layout: torch.memory_format,
) -> dict[str, Any]:
    """Loss, gradients and outputs under autocast against fp32, after a short real training."""
    reference = NumericsReference(model, images, targets, device, settings, layout)
    return reference.compare(precision)


def _numerics_record(
    reference_loss: float,
    reference_grads: torch.Tensor,
    reference: dict[str, torch.Tensor],
    candidate_loss: float,
    candidate_grads: torch.Tensor,
    candidate: dict[str, torch.Tensor],
    trained_steps: int,
) -> dict[str, Any]:
    outputs = {key: _max_diffs(reference[key], candidate[key]) for key in reference}
    finite = (
        math.isfinite(candidate_loss)
        and bool(torch.isfinite(candidate_grads).all())
        and all(bool(torch.isfinite(candidate[key]).all()) for key in candidate)
    )
    loss_abs = abs(candidate_loss - reference_loss)
    loss_rel = loss_abs / abs(reference_loss) if reference_loss else math.inf
    norm = reference_grads.norm().item()
    cosine = (
        torch.nn.functional.cosine_similarity(reference_grads, candidate_grads, dim=0).item()
        if finite
        else math.nan
    )
    grad_rel = (candidate_grads - reference_grads).norm().item() / norm if norm else math.inf
    problems = []
    if not finite:
        problems.append("the loss, an output or a gradient was not finite")
    if not loss_rel <= ACCEPTABLE_LOSS_REL_DIFF:
        problems.append(f"the loss is {loss_rel:.1%} off fp32's")
    if finite and not cosine >= ACCEPTABLE_GRAD_COSINE:
        problems.append(f"the gradients point elsewhere (cosine {cosine:.3f} with fp32's)")
    return {
        "reference": "fp32",
        "trained_steps": trained_steps,
        "loss_fp32": reference_loss,
        "loss": candidate_loss,
        "loss_abs_diff": loss_abs,
        "loss_rel_diff": loss_rel,
        "grad_cosine": cosine,
        "grad_rel_diff": grad_rel,
        "output_max_abs_diff": max(a for a, _ in outputs.values()),
        "output_max_rel_diff": max(r for _, r in outputs.values()),
        "outputs": {key: {"max_abs_diff": a, "max_rel_diff": r} for key, (a, r) in outputs.items()},
        "finite": finite,
        "acceptable": not problems,
        "problem": "; ".join(problems) or None,
        "acceptable_rule": (
            f"finite, relative loss difference <= {ACCEPTABLE_LOSS_REL_DIFF} and gradient cosine "
            f">= {ACCEPTABLE_GRAD_COSINE}, after {trained_steps} fp32 training steps"
        ),
    }


def _max_diffs(reference: torch.Tensor, candidate: torch.Tensor) -> tuple[float, float]:
    """Largest absolute difference, and the same relative to the largest fp32 magnitude."""
    diff = (candidate - reference).abs().max().item()
    scale = reference.abs().max().item()
    if diff == 0:
        return 0.0, 0.0
    return diff, diff / scale if scale > 0 else math.inf
