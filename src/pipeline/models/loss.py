"""The detection loss: penalty-reduced focal loss on the class heatmap, GIoU on boxes, and
with the model's IoU branch (`model.iou_score`) BCE of its prediction against the IoU of each
cell's decoded box with its object.

Boxes are supervised at every cell of a Gaussian area around each object's centre,
weighted by that Gaussian (TTFNet), which gives the box branch many more training
signals per image than the centre cell alone. Every object weighs the same in the box
loss (TTFNet's log-area weight favoured large objects; small ones are the hard ones here),
and where areas of one class overlap, a cell regresses, in that class's box channels, the
object of that class whose Gaussian is highest there (`TargetPlan.box_owners`): box channels
are per class, so objects of other classes at that cell train their own channels. Targets are
drawn in windows around each object (`pipeline.models.targets`).

Gaussians are at least `MIN_SIGMA` cells wide. With CenterNet's size-proportional
spread, an 8 px object at stride 4 gets a one-cell target, so the cells beside its
centre are punished as hard negatives although the centre's cell is a coin toss between
them; the model answers with low scores for small objects. On the synthetic set,
raising the floor from ~0 to 1.5 cells lifted recall of objects under 12 px from 0.36 to
0.83 at the same training budget. The area where boxes are regressed has a floor of its own,
`MIN_BOX_SIGMA`, narrower: with 1.5 cells a 4-px object's box was also regressed from cells 15
px away, and the boxes read at its peak came out too large and off centre. Measured with one
training run per value: 1.1 cells lifted the default set's validation F1 from 0.936 to 0.942
and AP@.5 from 0.964 to 0.972; 0.8 did more for the multi-scale preset's small objects but
cost the default set F1 (0.927).

The IoU branch is trained at the (class, cell) pairs where boxes are regressed, with the box
loss's weights, against the IoU of the box decoded there with the object that owns it
(detached: the branch learns to judge the box, not to move it), as IoU-aware RetinaNet trains
its IoU head on positives only. Elsewhere its prediction is left free: decoding multiplies it
into the heatmap's score, which is low there.

Ignore regions (COCO crowd regions, VOC difficult objects: the targets' `ignore_boxes` and
`ignore_labels`) take no part in the heatmap's negative term for their class: the objects in
them were not counted one by one, and evaluation ignores detections there, so a score there is
neither right nor wrong. Their positive term and the box loss see only the counted objects.

On the device everything is computed with masks as weights: no `.item()`, no boolean-mask
indexing, no branch on a tensor's value. Each of those makes the host wait for the
device (to read a value or to size a result), which would stall every training step on
a GPU. Only shapes, known on the host, choose a path. What depends on the boxes' values (the
windows' sizes) is planned on the host before the device sees it (`plan_targets`): give the
loss the targets as the loader gives them, on the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.centernet import LABEL_MODES, STRIDE, CenterNet, _xyxy
from pipeline.models.targets import EPS, TargetPlan, plan_targets

_GIOU_EPS = 1e-7  # as torchvision.ops.generalized_box_iou_loss
IOU_LOSS_WEIGHT = 1.0  # the IoU branch's BCE beside the focal loss (IoU-aware RetinaNet's)


def _union_and_iou(
    predicted: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(union, IoU) of paired xyxy boxes [..., 4], elementwise, without a boolean mask."""
    px1, py1, px2, py2 = predicted.unbind(-1)
    tx1, ty1, tx2, ty2 = target.unbind(-1)
    overlap_w = (torch.minimum(px2, tx2) - torch.maximum(px1, tx1)).clamp(min=0)
    overlap_h = (torch.minimum(py2, ty2) - torch.maximum(py1, ty1)).clamp(min=0)
    intersection = overlap_w * overlap_h
    union = (px2 - px1) * (py2 - py1) + (tx2 - tx1) * (ty2 - ty1) - intersection
    return union, intersection / (union + _GIOU_EPS)


def paired_iou(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """IoU of paired xyxy boxes [..., 4], elementwise (torchvision.ops.box_iou's diagonal)."""
    return _union_and_iou(predicted, target)[1]


def giou_loss(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """1 - GIoU of paired xyxy boxes [..., 4], elementwise.

    The maths of torchvision.ops.generalized_box_iou_loss, whose intersection is computed
    through a boolean mask (`x[mask]`): that indexing waits for the device to count the
    mask. Clamping the overlap at zero gives the same values without the wait.
    """
    px1, py1, px2, py2 = predicted.unbind(-1)
    tx1, ty1, tx2, ty2 = target.unbind(-1)
    union, iou = _union_and_iou(predicted, target)
    enclosing = (torch.maximum(px2, tx2) - torch.minimum(px1, tx1)) * (
        torch.maximum(py2, ty2) - torch.minimum(py1, ty1)
    )
    return 1 - iou + (enclosing - union) / (enclosing + _GIOU_EPS)


class DetectionLoss(nn.Module):
    """Returns {'total', 'heatmap', 'box'} (and 'iou' where the outputs hold the IoU branch's
    'iou'); call with the model's outputs and the batch's targets (a list of per-image dicts on
    the host, or their `TargetPlan`).

    It holds no model, parameters or state: only what it must agree on with the model
    (class count, label mode, stride), so that it reads the heatmap and boxes as the model
    decodes them. `for_model` takes those from a model.
    """

    def __init__(
        self,
        num_classes: int,
        label_mode: str,
        stride: int = STRIDE,
        box_weight: float = 2.0,
    ) -> None:
        super().__init__()
        if label_mode not in LABEL_MODES:
            raise ValueError(f"label_mode must be one of {LABEL_MODES}, got {label_mode!r}")
        self.num_classes = num_classes
        self.label_mode = label_mode
        self.stride = stride
        self.box_weight = box_weight

    @classmethod
    def for_model(cls, model: CenterNet, box_weight: float = 2.0) -> DetectionLoss:
        return cls(model.num_classes, model.label_mode, model.stride, box_weight)

    def plan(self, targets: list[dict[str, torch.Tensor]], h: int, w: int) -> TargetPlan:
        """The targets' plan for maps of h x w cells (host work; see `pipeline.models.targets`)."""
        return plan_targets(targets, self.num_classes, self.stride, h, w)

    def forward(
        self,
        outputs: dict[str, torch.Tensor],
        targets: list[dict[str, torch.Tensor]] | TargetPlan,
    ) -> dict[str, torch.Tensor]:
        logits = outputs["heatmap"].float()
        batch, _, h, w = logits.shape
        plan = targets if isinstance(targets, TargetPlan) else self.plan(targets, h, w)
        if plan.shape != (batch, self.num_classes, h, w):
            raise ValueError(
                f"the targets were planned for maps of {plan.shape}, the outputs are "
                f"{(batch, self.num_classes, h, w)}"
            )
        plan = plan.to(logits.device)
        heat_loss = self._focal_loss(logits, plan.heatmap(), plan.ignored())
        box_loss, iou_loss = self._box_loss(outputs["box"], plan, outputs.get("iou"))
        total = heat_loss + self.box_weight * box_loss
        losses = {"heatmap": heat_loss.detach(), "box": box_loss.detach()}
        if iou_loss is not None:
            total = total + IOU_LOSS_WEIGHT * iou_loss
            losses["iou"] = iou_loss.detach()
        return {"total": total, **losses}

    def _focal_loss(
        self, logits: torch.Tensor, target: torch.Tensor, ignored: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.label_mode == "multilabel":
            log_p, log_not_p = F.logsigmoid(logits), F.logsigmoid(-logits)
        else:
            log_probs = logits.log_softmax(dim=1)[:, : target.shape[1]]
            log_p = log_probs
            log_not_p = torch.log1p(-log_probs.exp().clamp(max=1 - EPS))
        p = log_p.exp()
        positive = target >= 1 - EPS
        pos_loss = torch.where(positive, log_p * (1 - p) ** 2, 0.0).sum()
        negative = ~positive if ignored is None else ~(positive | ignored)
        neg_loss = torch.where(negative, log_not_p * p**2 * (1 - target) ** 4, 0.0).sum()
        return -(pos_loss + neg_loss) / positive.sum().clamp(min=1)

    def _box_loss(
        self, regression: torch.Tensor, plan: TargetPlan, iou_logits: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """GIoU at every (class, cell) an object owns, read from that class's box channels, and
        (given the IoU branch's logits) the branch's BCE against the IoU of the box decoded
        there with that object, with the same weights."""
        _, classes, h, w = plan.shape
        obj, value = plan.box_object, plan.box_value
        owns = plan.box_owners()
        # each object weighs 1 in all; its (class, cell) pairs share that by their Gaussian
        norm = torch.zeros_like(plan.area).scatter_add_(0, obj, torch.where(owns, value, 0.0))
        weight = torch.where(owns, value / norm[obj].clamp(min=EPS), 0.0)
        plane, cell = plan.box_key // (h * w), plan.box_key % (h * w)
        image, label = plane // classes, plane % classes
        row, col = cell // w, cell % w
        coords = torch.arange(4, device=regression.device)
        # class c's box channels (4c to 4c+3) at the cell
        values = regression[image[:, None], label[:, None] * 4 + coords, row[:, None], col[:, None]]
        predicted = _xyxy(values, col.float(), row.float(), self.stride)
        objects = plan.boxes[obj]
        total_weight = weight.sum().clamp(min=EPS)
        losses = torch.where(owns, giou_loss(predicted, objects) * weight, 0.0)
        if iou_logits is None:
            return losses.sum() / total_weight, None
        logits = iou_logits[image, label, row, col].float()
        quality = paired_iou(predicted.detach(), objects).clamp(0, 1)
        bce = F.binary_cross_entropy_with_logits(logits, quality, reduction="none")
        iou_loss = torch.where(owns, bce * weight, 0.0).sum() / total_weight
        return losses.sum() / total_weight, iou_loss
