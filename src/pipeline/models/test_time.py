"""Test-time views beyond the flip test: the images resized by each of `eval.test_scales`, the
maps of every view brought to the frame of the images as given and averaged before decoding
once (CenterNet.forward's `scales`; the flip test's mirror and averaging are CenterNet's own).

A larger view gives small objects more stride-4 cells and one more estimate. The trained
detectors measured so far scored lower at another input size even with the images read at that
size, and AP@[.5:.95] fell with every scale set tried (benchmarks/test_scales.py,
records/test_scales/): off by default.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from pipeline.models.centernet import CenterNet

_TINY = torch.finfo(torch.float32).tiny  # floors a probability before its log


def scaled_side(side: int, scale: float, multiple: int) -> int:
    """An input side times a test scale, rounded to the nearest multiple of the backbone's
    total stride (at least one): the one rounding that the model and the config check share."""
    return max(multiple, math.floor(side * scale / multiple + 0.5) * multiple)


def resized(images: torch.Tensor, scale: float, multiple: int) -> torch.Tensor:
    """The images resized by `scale` (each side by `scaled_side`), bilinear (antialiased when
    shrunk), as floats in [0, 1]; the images themselves where the size is unchanged."""
    height, width = images.shape[-2:]
    size = (scaled_side(height, scale, multiple), scaled_side(width, scale, multiple))
    if size == (height, width):
        return images
    x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    shrink = size[0] < height or size[1] < width
    return F.interpolate(x, size=size, mode="bilinear", antialias=shrink).clamp(0.0, 1.0)


def in_frame(
    model: CenterNet, outputs: dict[str, torch.Tensor], height: int, width: int
) -> dict[str, torch.Tensor]:
    """The maps of a view of the images resized to another size, brought to the frame of
    inputs of `height` x `width`: every map sampled bilinearly at the centres of that
    frame's cells (the same points of the image), the heatmap and IoUs as probabilities
    (returned as the logits that give them back), each class's box with its offsets
    divided by the view's scale (its cells are that much smaller) and its log sizes less
    the log of the scale: where a view's cells all point at one centre, its offsets are
    linear across the cells and sampling keeps that centre exactly. The maps themselves
    where the view is the frame's size."""
    size = (height // model.stride, width // model.stride)
    view = outputs["box"].shape[-2:]
    if tuple(view) == size:
        return outputs
    scale_y, scale_x = view[0] / size[0], view[1] / size[1]

    def sampled(value: torch.Tensor) -> torch.Tensor:
        return F.interpolate(value, size=size, mode="bilinear", align_corners=False)

    box = sampled(outputs["box"].float())
    box[:, 0::4] /= scale_x
    box[:, 1::4] /= scale_y
    box[:, 2::4] -= math.log(scale_x)
    box[:, 3::4] -= math.log(scale_y)
    framed = {"box": box}
    for key, value in outputs.items():
        if key == "box":
            continue
        value = value.float()
        if key == "heatmap" and model.label_mode == "single":
            framed[key] = sampled(value.softmax(dim=1)).clamp(min=_TINY).log()
        else:  # sigmoid: log p - log (1 - p), each side sampled on its own
            yes = sampled(value.sigmoid()).clamp(min=_TINY).log()
            framed[key] = yes - sampled((-value).sigmoid()).clamp(min=_TINY).log()
    return framed


def scaled_views(
    model: CenterNet, images: torch.Tensor, flip_test: bool, scales: Sequence[float]
) -> dict[str, torch.Tensor]:
    """The maps of the images resized by each scale (and of their mirrors under the flip
    test), each in the images' own frame, averaged as the flip test averages its two views."""
    height, width = images.shape[-2:]
    views = []
    for scale in scales:
        view = resized(images, scale, model.backbone.total_stride)
        views.append(in_frame(model, model.maps(view), height, width))
        if flip_test:
            mirror = model.mirrored(model.maps(view.flip(-1)))
            views.append(in_frame(model, mirror, height, width))
    return model.averaged(views)


def inference_maps(
    model: nn.Module,
    images: torch.Tensor,
    flip_test: bool = False,
    test_scales: Sequence[float] = (1.0,),
) -> dict[str, torch.Tensor]:
    """The maps that evaluation, validation and prediction decode: the model's own call where
    neither `eval.flip_test` nor `eval.test_scales` asks for more views, so that every model
    with a `forward(images)` evaluates; the one place both settings reach the model."""
    if tuple(test_scales) == (1.0,):
        return model(images, flip_test=True) if flip_test else model(images)
    return model(images, flip_test=flip_test, scales=tuple(test_scales))
