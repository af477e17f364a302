"""The detection loss's targets, drawn in a window of cells around each object, so that their
memory and time follow the objects' area instead of objects x map.

A Gaussian is drawn only where it exceeds a cut-off: `HEAT_CUTOFF` for the heatmap target
(below it the focal loss's negative weight, (1 - target)^4, is 1 to within 4 * HEAT_CUTOFF),
`BOX_AREA_CUTOFF` for the cells where boxes are regressed (the area's definition). Since a
Gaussian is the product of a row and a column profile of at most 1, it exceeds the cut-off only
where each profile does: within a rectangle of sigma * sqrt(2 ln(1 / cut-off)) cells on each
side of the centre. Within it the values are those of the whole map's Gaussian.

The windows' sizes depend on the boxes, so they are planned on the host, where the loader
gives the targets: reading a box there costs nothing, where on an accelerator it would make the
host wait for the device. The plan is a few flat arrays (one entry per drawn cell) that travel
to the device pinned and without waiting (`TargetPlan.to`); targets found on a device are copied
to the host first, and that copy waits.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pipeline import device as dev

HEAT_ALPHA = 0.54  # Gaussian spread of the heatmap target, as a fraction of the box size
BOX_BETA = 0.54  # same for the area where boxes are regressed
HEAT_CUTOFF = 1e-6  # the heatmap target is zero where the Gaussian is at most this
BOX_AREA_CUTOFF = 0.05  # a cell regresses an object's box where its Gaussian exceeds this
MIN_SIGMA = 1.5  # cells, heatmap targets
MIN_BOX_SIGMA = 1.1  # cells, the area where boxes are regressed
TIE = 1e-6  # Gaussians this close at a cell are a tie
EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class TargetPlan:
    """A batch's targets as the loss reads them. Keys index the [B, C, h, w] maps, flattened."""

    shape: tuple[int, int, int, int]  # B, C, h, w
    boxes: torch.Tensor  # float32 [M, 4]: every object of the batch, xyxy input pixels
    area: torch.Tensor  # float32 [M]: in cells
    heat_key: torch.Tensor  # int64 [E]: cells (of the object's class) of heatmap Gaussians
    heat_value: torch.Tensor  # float32 [E]: the Gaussian there (> HEAT_CUTOFF)
    box_key: torch.Tensor  # int64 [F]: cells (of the object's class) where boxes are regressed
    box_object: torch.Tensor  # int64 [F]: the object, an index into `boxes`
    box_value: torch.Tensor  # float32 [F]: its Gaussian there (> BOX_AREA_CUTOFF)
    ignore_key: torch.Tensor | None  # int64 [I]: cells an ignore region of that class overlaps

    def to(self, device: torch.device) -> TargetPlan:
        """On `device`, queued behind the work already there (pinned: no wait for the device)."""
        pin = dev.pin_memory_supported(device)

        def move(value: Any) -> Any:
            if not isinstance(value, torch.Tensor) or value.device == device:
                return value
            return (value.pin_memory() if pin else value).to(device, non_blocking=True)

        return dataclasses.replace(
            self, **{f.name: move(getattr(self, f.name)) for f in dataclasses.fields(self)}
        )

    def heatmap(self) -> torch.Tensor:
        """[B, C, h, w]: at each cell, the highest Gaussian among the objects of that class."""
        target = self.heat_value.new_zeros(math.prod(self.shape))
        return target.scatter_reduce_(0, self.heat_key, self.heat_value, "amax").view(self.shape)

    def ignored(self) -> torch.Tensor | None:
        """[B, C, h, w] bool: cells an ignore region of that class overlaps (None: no region)."""
        if self.ignore_key is None:
            return None
        mask = torch.zeros(math.prod(self.shape), dtype=torch.bool, device=self.heat_key.device)
        return mask.index_fill_(0, self.ignore_key, True).view(self.shape)

    def box_owners(self) -> torch.Tensor:
        """[F] bool: the entries whose object regresses that (class, cell).

        Among the objects of the class, the one whose Gaussian is highest at the cell, ties
        going to the smaller one (then the first), so that every object's own centre cell (where
        decoding reads its box, in its class's channels) regresses that object. Box channels are
        per class, so an object of another class never takes the cell: a small object at a large
        one's centre leaves the large one's class channels to it. TTFNet gives each cell to the
        smallest object whose area covers it, which hands a large object's centre cell to any
        small object near it.
        """
        key, obj, value = self.box_key, self.box_object, self.box_value
        cells, count = math.prod(self.shape), len(self.boxes)
        highest = value.new_zeros(cells).scatter_reduce_(0, key, value, "amax")
        candidate = value >= highest[key] - TIE
        area = torch.where(candidate, self.area[obj], math.inf)
        smallest = value.new_full((cells,), math.inf).scatter_reduce_(0, key, area, "amin")
        rank = torch.where(candidate & (area <= smallest[key]), obj, count)
        first = key.new_full((cells,), count).scatter_reduce_(0, key, rank, "amin")
        return first[key] == obj


# The plan's index work (counts, ranges, gathers, keys) is numpy: a numpy call on these arrays
# costs a fraction of a torch op's dispatch on the host, and the plan makes many. The values
# (float32) are computed by torch with the same operations on the same arrays as ever: exp's
# last bit differs between libraries and CPUs, and in torch even with an entry's position in
# its array (a vector body and a scalar tail run different kernels).
def _enumerate(count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(item, index within the item) of each of `count[item]` entries per item, in order."""
    item = np.repeat(np.arange(len(count), dtype=np.int64), count)
    return item, np.arange(len(item), dtype=np.int64) - (np.cumsum(count) - count)[item]


def _windows(
    x0: np.ndarray, y0: np.ndarray, x1: np.ndarray, y1: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(item, x, y) of every cell of each item's window [x0, x1] x [y0, y1] (inclusive)."""
    across = np.maximum(x1 - x0 + 1, 0)
    item, cell = _enumerate(across * np.maximum(y1 - y0 + 1, 0))
    across = across[item]
    return item, x0[item] + cell % across, y0[item] + cell // across


# The Gaussians drawn for each object, the heatmap target's and the area where boxes are
# regressed, [Gaussian, 1, 1]: their spreads (a fraction of the box size), floors of sigma
# (cells), and sqrt(2 ln(1 / cut-off)), the distance in sigmas within which each may exceed its
# cut-off. float32: torch multiplies a float32 tensor by a Python number as float32 too.
_SPREAD = torch.tensor([HEAT_ALPHA, BOX_BETA], dtype=torch.float32).view(2, 1, 1)
_FLOOR = torch.tensor([MIN_SIGMA, MIN_BOX_SIGMA], dtype=torch.float32).view(2, 1, 1)
_CUTOFF = (HEAT_CUTOFF, BOX_AREA_CUTOFF)
_REACH = torch.tensor(
    [math.sqrt(2 * math.log(1 / cutoff)) for cutoff in _CUTOFF], dtype=torch.float32
).view(2, 1, 1)


def _drawn(
    centre: torch.Tensor, wh: torch.Tensor, plane: np.ndarray, h: int, w: int
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per Gaussian (heatmap, box area), (object, key, Gaussian) where each object's Gaussian
    exceeds its cut-off; a key is the cell y * w + x in the object's class map (at `plane`).

    A Gaussian exceeds its cut-off only within sigma * `_REACH` cells of the centre: its window,
    whose cells run row by row, x fastest. Each value is the whole map's Gaussian there: the
    product of the object's column profile at x and row profile at y, each computed once per
    column and row (the same operations on the same numbers as per cell, so the same values)
    instead of once per cell. The profiles of both Gaussians, both axes and every object lie
    end to end in one array, and so do the windows' rows, so that each step is one call.
    """
    objects = len(centre)
    sigma = (_SPREAD * wh / 6).clamp(min=_FLOOR)  # [Gaussian, object, axis]
    reach = (sigma * _REACH).ceil().long().numpy()
    cell = centre.long().numpy()
    # one profile per [Gaussian, axis, object]: a Gaussian's columns of each object, its rows
    low = np.maximum(cell - reach, 0).transpose(0, 2, 1)
    high = np.minimum(cell + reach, (w - 1, h - 1)).transpose(0, 2, 1)
    count = np.maximum(high - low + 1, 0)
    item, step = _enumerate(count.reshape(-1))
    first = np.cumsum(count) - count.reshape(-1)  # where each profile starts
    at = low.reshape(-1)[item] + step  # the column's x or the row's y
    mean = np.broadcast_to(centre.numpy().T, low.shape).reshape(-1)[item]
    deviation = sigma.transpose(1, 2).reshape(-1).numpy()[item]
    exponent = -((torch.from_numpy(at).float() - torch.from_numpy(mean)) ** 2) / (
        2 * torch.from_numpy(deviation) ** 2
    )
    # exp of each Gaussian's columns, and of its rows, apart (see the note above `_enumerate`)
    parts = exponent.split(count.sum(2).reshape(-1).tolist())
    profile = torch.cat([part.exp() for part in parts]).numpy()

    # the windows' rows [Gaussian, object, y]; each holds its column profile's cells, x fastest
    rows = np.flatnonzero(item % max(2 * objects, 1) >= objects)  # their profile entries
    columns = item[rows] - objects  # the item of each row's column profile
    row_obj = item[rows] % max(objects, 1)
    row, dx = _enumerate(count.reshape(-1)[columns])  # each window cell's row and x - x0
    down = torch.from_numpy(profile[rows][row])
    value = (down * torch.from_numpy(profile[first[columns][row] + dx])).numpy()
    x0 = low.reshape(-1)[columns]
    key = (plane[row_obj] + at[rows] * w + x0)[row] + dx
    obj = row_obj[row]
    # the rows of each Gaussian are those of its items, [2 g objects, 2 (g + 1) objects)
    bounds = np.searchsorted(item[rows], 2 * objects * np.arange(len(_CUTOFF) + 1))
    ends = np.searchsorted(row, bounds)  # the cells of those rows
    drawn = []
    for (begin, end), cutoff in zip(itertools.pairwise(ends), _CUTOFF, strict=True):
        keep = np.flatnonzero(value[begin:end] > np.float32(cutoff)) + begin
        drawn.append((obj[keep], key[keep], value[keep]))
    return drawn


def _joined(
    targets: Sequence[dict[str, Any]], key: str, dtype: torch.dtype, width: int = 0
) -> tuple[torch.Tensor, list[int]]:
    """(the images' values of `key` joined on the host as `dtype`, each image's count).

    Where every image holds a host tensor of `dtype` and shape (as the loader gives them), they
    are joined in one call: checking them costs less than converting each.
    """
    shape = (-1, width) if width else (-1,)
    values = [target.get(key) for target in targets]
    if values and all(
        type(value) is torch.Tensor
        and value.dtype is dtype
        and value.is_cpu
        and value.dim() == len(shape)
        and (not width or value.shape[1] == width)
        for value in values
    ):
        return torch.cat(values).detach(), [value.shape[0] for value in values]
    parts = []
    for value in values:
        value = torch.zeros(0) if value is None else torch.as_tensor(value)
        parts.append(value.detach().to("cpu", dtype).reshape(shape))
    joined = torch.cat(parts) if parts else torch.zeros(0, dtype=dtype).reshape(shape)
    return joined, [len(part) for part in parts]


def plan_targets(
    targets: Sequence[dict[str, Any]], num_classes: int, stride: int, h: int, w: int
) -> TargetPlan:
    """The plan of a batch's targets (`boxes`, `labels`, optional `ignore_boxes` and
    `ignore_labels` per image) for [B, C, h, w] maps at `stride`, on the host."""
    boxes, counts = _joined(targets, "boxes", torch.float32, 4)
    labels = _joined(targets, "labels", torch.long)[0].numpy()
    image = np.repeat(np.arange(len(targets), dtype=np.int64), counts)
    wh = (boxes[:, 2:] - boxes[:, :2]) / stride  # cells
    centre = ((boxes[:, :2] + boxes[:, 2:]) / 2 / stride).floor()
    centre = torch.stack([centre[:, 0].clamp(0, w - 1), centre[:, 1].clamp(0, h - 1)], dim=-1)
    plane = (image * num_classes + labels) * (h * w)  # where each object's class map starts
    (_, heat_key, heat_value), (box_obj, box_key, box_value) = _drawn(centre, wh, plane, h, w)
    return TargetPlan(
        shape=(len(targets), num_classes, h, w),
        boxes=boxes,
        area=(wh[:, 0] * wh[:, 1]).clamp(min=EPS),
        heat_key=torch.from_numpy(heat_key),
        heat_value=torch.from_numpy(heat_value),
        box_key=torch.from_numpy(box_key),
        box_object=torch.from_numpy(box_obj),
        box_value=torch.from_numpy(box_value),
        ignore_key=_ignore_key(targets, num_classes, stride, h, w),
    )


def _ignore_key(targets, num_classes: int, stride: int, h: int, w: int) -> torch.Tensor | None:
    """Cells (of the region's class) that an ignore region overlaps; None without regions."""
    labels = _joined(targets, "ignore_labels", torch.long)[0].numpy()
    if not len(labels):
        return None
    regions, counts = _joined(targets, "ignore_boxes", torch.float32, 4)
    image = np.repeat(np.arange(len(targets), dtype=np.int64), counts)
    # a margin of a cell each side, then the exact test: the cell [x s, x s + s) overlaps
    low = (regions[:, :2] / stride).clamp(-1, max(h, w)).floor().long().numpy() - 1
    high = (regions[:, 2:] / stride).clamp(-1, max(h, w)).ceil().long().numpy()
    item, x, y = _windows(
        np.maximum(low[:, 0], 0), np.maximum(low[:, 1], 0),
        np.minimum(high[:, 0], w - 1), np.minimum(high[:, 1], h - 1),
    )  # fmt: skip
    left, top = torch.from_numpy(x).float() * stride, torch.from_numpy(y).float() * stride
    region = torch.from_numpy(regions.numpy()[item])
    inside = (left < region[:, 2]) & (left + stride > region[:, 0])
    inside &= (top < region[:, 3]) & (top + stride > region[:, 1])
    plane = (image[item] * num_classes + labels[item]) * (h * w)
    return torch.from_numpy((plane + y * w + x)[inside.numpy()])
