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
import math
from collections.abc import Sequence
from typing import Any

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


# On the host, gathers are index_select and masks are taken by their indices: torch's indexing
# with a tensor (aten::index) costs many times as much per call on a CPU, for the same values.
def _at(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values[index] along the first dimension."""
    return values.index_select(0, index)


def _where(mask: torch.Tensor) -> torch.Tensor:
    """The indices of a 1-D mask's true entries, in order (so that `_at(v, _where(m))` is v[m])."""
    return mask.nonzero().squeeze(1)


def _windows(
    x0: torch.Tensor, y0: torch.Tensor, x1: torch.Tensor, y1: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(item, x, y) of every cell of each item's window [x0, x1] x [y0, y1] (inclusive), host."""
    across = (x1 - x0 + 1).clamp(min=0)
    count = across * (y1 - y0 + 1).clamp(min=0)
    item = torch.repeat_interleave(torch.arange(len(count)), count)
    local = torch.arange(len(item)) - _at(count.cumsum(0) - count, item)
    across = _at(across, item)
    return item, _at(x0, item) + local % across, _at(y0, item) + local // across


def _ranges(low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(item, value) of every integer in each item's range [low, high] (inclusive), in order."""
    count = (high - low + 1).clamp(min=0)
    item = torch.repeat_interleave(torch.arange(len(count)), count)
    return item, _at(low, item) + torch.arange(len(item)) - _at(count.cumsum(0) - count, item)


def _reach(sigma: torch.Tensor, cutoff: float) -> torch.Tensor:
    """Whole cells from the centre within which a Gaussian of `sigma` may exceed `cutoff`."""
    return (sigma * math.sqrt(2 * math.log(1 / cutoff))).ceil().long()


def _drawn(
    centre: torch.Tensor, wh: torch.Tensor, spread: float, min_sigma: float, cutoff: float, h, w
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(object, flat cell y * w + x, Gaussian) where each object's Gaussian exceeds `cutoff`.

    The cells are those of `_windows` in its order (each object's window row by row), and each
    value is the whole map's Gaussian there: the product of the object's column profile at x
    and row profile at y, each computed once per column and row (the same operations on the
    same numbers as per cell, so the same values) instead of once per cell.
    """
    sigma = (spread * wh / 6).clamp(min=min_sigma)
    reach = _reach(sigma, cutoff)
    low = centre.long() - reach
    high = centre.long() + reach
    x0, x1 = low[:, 0].clamp(min=0), high[:, 0].clamp(max=w - 1)
    column_obj, x = _ranges(x0, x1)
    row_obj, y = _ranges(low[:, 1].clamp(min=0), high[:, 1].clamp(max=h - 1))
    across = torch.exp(
        -((x.float() - _at(centre[:, 0], column_obj)) ** 2)
        / (2 * _at(sigma[:, 0], column_obj) ** 2)
    )
    down = torch.exp(
        -((y.float() - _at(centre[:, 1], row_obj)) ** 2) / (2 * _at(sigma[:, 1], row_obj) ** 2)
    )
    # each row of a window holds its object's width of cells, x running fastest
    width = (x1 - x0 + 1).clamp(min=0)
    row_width = _at(width, row_obj)
    row, column = _ranges(torch.zeros_like(row_width), row_width - 1)
    column += _at(_at(width.cumsum(0) - width, row_obj), row)  # the object's first column
    value = _at(down, row) * _at(across, column)
    keep = _where(value > cutoff)
    row, column = _at(row, keep), _at(column, keep)
    return _at(row_obj, row), _at(y, row) * w + _at(x, column), _at(value, keep)


def _host(targets: Sequence[dict[str, Any]], key: str, dtype: torch.dtype, width: int = 0):
    parts = []
    for target in targets:
        value = target.get(key)
        value = torch.zeros(0) if value is None else torch.as_tensor(value)
        value = value.detach().to("cpu", dtype)
        parts.append(value.reshape(-1, width) if width else value.reshape(-1))
    return parts


def plan_targets(
    targets: Sequence[dict[str, Any]], num_classes: int, stride: int, h: int, w: int
) -> TargetPlan:
    """The plan of a batch's targets (`boxes`, `labels`, optional `ignore_boxes` and
    `ignore_labels` per image) for [B, C, h, w] maps at `stride`, on the host."""
    boxes_list = _host(targets, "boxes", torch.float32, 4)
    labels_list = _host(targets, "labels", torch.long)
    image = torch.repeat_interleave(
        torch.arange(len(targets)), torch.tensor([len(b) for b in boxes_list], dtype=torch.long)
    )
    boxes = torch.cat(boxes_list) if boxes_list else torch.zeros(0, 4)
    labels = torch.cat(labels_list) if labels_list else torch.zeros(0, dtype=torch.long)
    wh = (boxes[:, 2:] - boxes[:, :2]) / stride  # cells
    centre = ((boxes[:, :2] + boxes[:, 2:]) / 2 / stride).floor()
    centre = torch.stack([centre[:, 0].clamp(0, w - 1), centre[:, 1].clamp(0, h - 1)], dim=-1)
    plane = (image * num_classes + labels) * (h * w)  # where each object's class map starts

    heat_obj, heat_cell, heat_value = _drawn(centre, wh, HEAT_ALPHA, MIN_SIGMA, HEAT_CUTOFF, h, w)
    box_obj, box_cell, box_value = _drawn(
        centre, wh, BOX_BETA, MIN_BOX_SIGMA, BOX_AREA_CUTOFF, h, w
    )
    return TargetPlan(
        shape=(len(targets), num_classes, h, w),
        boxes=boxes,
        area=(wh[:, 0] * wh[:, 1]).clamp(min=EPS),
        heat_key=_at(plane, heat_obj) + heat_cell,
        heat_value=heat_value,
        box_key=_at(plane, box_obj) + box_cell,
        box_object=box_obj,
        box_value=box_value,
        ignore_key=_ignore_key(targets, num_classes, stride, h, w),
    )


def _ignore_key(targets, num_classes: int, stride: int, h: int, w: int) -> torch.Tensor | None:
    """Cells (of the region's class) that an ignore region overlaps; None without regions."""
    regions_list = _host(targets, "ignore_boxes", torch.float32, 4)
    labels_list = _host(targets, "ignore_labels", torch.long)
    if not any(len(labels) for labels in labels_list):
        return None
    image = torch.repeat_interleave(
        torch.arange(len(targets)), torch.tensor([len(r) for r in regions_list], dtype=torch.long)
    )
    regions, labels = torch.cat(regions_list), torch.cat(labels_list)
    # a margin of a cell each side, then the exact test: the cell [x s, x s + s) overlaps
    low = (regions[:, :2] / stride).clamp(-1, max(h, w)).floor().long() - 1
    high = (regions[:, 2:] / stride).clamp(-1, max(h, w)).ceil().long()
    item, x, y = _windows(
        low[:, 0].clamp(min=0), low[:, 1].clamp(min=0),
        high[:, 0].clamp(max=w - 1), high[:, 1].clamp(max=h - 1),
    )  # fmt: skip
    left, top = x.float() * stride, y.float() * stride
    region = _at(regions, item)
    inside = (left < region[:, 2]) & (left + stride > region[:, 0])
    inside &= (top < region[:, 3]) & (top + stride > region[:, 1])
    plane = (_at(image, item) * num_classes + _at(labels, item)) * (h * w)
    return _at(plane + y * w + x, _where(inside))
