"""The detection loss: penalty-reduced focal loss on the class heatmap, GIoU on boxes.

Boxes are supervised at every cell of a Gaussian area around each object's centre,
weighted by that Gaussian (TTFNet), which gives the box branch many more training
signals per image than the centre cell alone. Every object weighs the same in the box
loss (TTFNet's log-area weight favoured large objects; small ones are the hard ones here).

Gaussians are at least `MIN_SIGMA` cells wide. With CenterNet's size-proportional
spread, an 8 px object at stride 4 gets a one-cell target, so the cells beside its
centre are punished as hard negatives although the centre's cell is a coin toss between
them; the model answers with low scores for small objects. On the synthetic set,
raising the floor from ~0 to 1.5 cells lifted recall of objects under 12 px from 0.36 to
0.83 at the same training budget.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torchvision.ops import generalized_box_iou_loss

from pipeline.models.centernet import CenterNet

_HEAT_ALPHA = 0.54  # Gaussian spread of the heatmap target, as a fraction of the box size
_BOX_BETA = 0.54  # same for the area where boxes are regressed
MIN_SIGMA = 1.5  # cells
_EPS = 1e-6


def _gaussians(
    centres: torch.Tensor,
    sizes: torch.Tensor,
    spread: float,
    h: int,
    w: int,
) -> torch.Tensor:
    """[..., h, w] Gaussians peaking at 1 on each object's centre cell; sizes in cells."""
    sigma = (spread * sizes / 6).clamp(min=MIN_SIGMA)
    ys = torch.arange(h, device=centres.device, dtype=centres.dtype)
    xs = torch.arange(w, device=centres.device, dtype=centres.dtype)
    dx = xs.view(1, 1, 1, w) - centres[..., 0, None, None]
    dy = ys.view(1, 1, h, 1) - centres[..., 1, None, None]
    return torch.exp(
        -(dx**2) / (2 * sigma[..., 0, None, None] ** 2)
        - dy**2 / (2 * sigma[..., 1, None, None] ** 2)
    )


class DetectionLoss(nn.Module):
    """Returns {'total', 'heatmap', 'box'}; call with the model's outputs and the batch's targets."""

    def __init__(self, model: CenterNet, box_weight: float = 2.0) -> None:
        super().__init__()
        self.model = model
        self.label_mode = model.label_mode  # the loss must read the heatmap as the model decodes it
        self.box_weight = box_weight

    def forward(
        self, outputs: dict[str, torch.Tensor], targets: list[dict[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        logits = outputs["heatmap"].float()
        batch, _, h, w = logits.shape
        stride = self.model.stride
        device = logits.device
        boxes = pad_sequence(
            [t["boxes"].to(device, torch.float32) for t in targets], batch_first=True
        )
        labels = pad_sequence(
            [t["labels"].to(device) for t in targets], batch_first=True, padding_value=-1
        )
        if boxes.numel() == 0:
            boxes = torch.zeros(batch, 0, 4, device=device)
            labels = torch.zeros(batch, 0, dtype=torch.long, device=device)
        valid = labels >= 0  # [B, N]
        wh = (boxes[..., 2:] - boxes[..., :2]) / stride  # cells
        centre = ((boxes[..., :2] + boxes[..., 2:]) / 2 / stride).floor().clamp(min=0)
        centre = torch.minimum(centre, torch.tensor([w - 1.0, h - 1.0], device=device))

        heat_target = self._heatmap_target(
            centre, wh, labels, valid, (batch, self.model.num_classes, h, w)
        )
        heat_loss = self._focal_loss(logits, heat_target)
        box_loss = self._box_loss(outputs, boxes, centre, wh, valid, h, w)
        total = heat_loss + self.box_weight * box_loss
        return {"total": total, "heatmap": heat_loss.detach(), "box": box_loss.detach()}

    @staticmethod
    def _heatmap_target(centre, wh, labels, valid, shape) -> torch.Tensor:
        _, classes, h, w = shape
        gauss = _gaussians(centre, wh, _HEAT_ALPHA, h, w) * valid[..., None, None]  # [B, N, h, w]
        one_hot = (
            F.one_hot(labels.clamp(min=0), classes).to(gauss.dtype) * valid[..., None]
        )  # [B, N, C]
        # the max over objects of each class: one Gaussian per (object, class) slot
        per_class = gauss[:, :, None] * one_hot[..., None, None]  # [B, N, C, h, w]
        if per_class.shape[1] == 0:
            return torch.zeros(shape, device=centre.device)
        return per_class.amax(dim=1)

    def _focal_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.label_mode == "multilabel":
            log_p, log_not_p = F.logsigmoid(logits), F.logsigmoid(-logits)
        else:
            log_probs = logits.log_softmax(dim=1)[:, : target.shape[1]]
            log_p = log_probs
            log_not_p = torch.log1p(-log_probs.exp().clamp(max=1 - _EPS))
        p = log_p.exp()
        positive = target >= 1 - _EPS
        pos_loss = -(log_p * (1 - p) ** 2)[positive].sum()
        neg_loss = -(log_not_p * p**2 * (1 - target) ** 4)[~positive].sum()
        return (pos_loss + neg_loss) / positive.sum().clamp(min=1)

    def _box_loss(self, outputs, boxes, centre, wh, valid, h, w) -> torch.Tensor:
        batch, count = valid.shape
        if count == 0 or not valid.any():
            return outputs["box"].sum() * 0.0
        gauss = _gaussians(centre, wh, _BOX_BETA, h, w) * valid[..., None, None]  # [B, N, h, w]
        area = (wh[..., 0] * wh[..., 1]).clamp(min=_EPS)
        # each cell regresses the smallest object whose area covers it
        key = torch.where(gauss > 0.05, area[..., None, None], torch.full_like(gauss, math.inf))
        best, owner = key.min(dim=1)  # [B, h, w]
        assigned = torch.isfinite(best)
        if not assigned.any():
            return outputs["box"].sum() * 0.0
        owner_gauss = gauss.gather(1, owner[:, None]).squeeze(1)
        # each object weighs 1 in all; its cells share that by their Gaussian
        norm = torch.zeros_like(area).scatter_add_(
            1, owner.view(batch, -1), (owner_gauss * assigned).view(batch, -1)
        )
        weight = owner_gauss / norm.gather(1, owner.view(batch, -1)).view(batch, h, w).clamp(
            min=_EPS
        )
        target_boxes = boxes.gather(1, owner.view(batch, -1, 1).expand(-1, -1, 4)).view(
            batch, h, w, 4
        )
        predicted = self.model.boxes(outputs).permute(0, 2, 3, 1)  # [B, h, w, 4]
        losses = generalized_box_iou_loss(
            predicted[assigned], target_boxes[assigned], reduction="none"
        )
        weights = weight[assigned]
        return (losses * weights).sum() / weights.sum().clamp(min=_EPS)
