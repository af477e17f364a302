"""DetectionLoss: the same values as before, no model inside, no host syncs, bounded memory."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline.device import cpu_tensor_peak_bytes
from pipeline.models import build_model
from pipeline.models import targets as target_plan
from pipeline.models.centernet import STRIDE
from pipeline.models.loss import DetectionLoss, giou_loss

pytestmark = pytest.mark.usefixtures("torch_flags_threads_and_logger")


def wave(shape: tuple[int, ...], rate: float, phase: float) -> torch.Tensor:
    """Deterministic values without an RNG, so the literals below hold on any torch."""
    n = torch.arange(math.prod(shape), dtype=torch.float32)
    return torch.sin(n * rate + phase).reshape(shape)


def fixed_outputs(
    batch: int, heat_channels: int, cells: int, classes: int
) -> dict[str, torch.Tensor]:
    """Every class's box channels hold the same values, so the loss equals that of one box
    per cell (what PINNED was measured with) and summing the box gradient over classes gives
    that loss's gradient."""
    heatmap = 3.0 * wave((batch, heat_channels, cells, cells), 0.37, 0.5) - 1.0
    box = 0.6 * wave((batch, 1, 4, cells, cells), 0.23, 1.3)
    box = box.expand(-1, classes, -1, -1, -1).reshape(batch, 4 * classes, cells, cells)
    return {"heatmap": heatmap.requires_grad_(), "box": box.clone().requires_grad_()}


def fixed_targets(objects: tuple[int, ...], classes: int, size: int) -> list[dict]:
    """Boxes of 3 to size/2 px spread over the image, overlapping where there are many."""
    targets = []
    for i, count in enumerate(objects):
        boxes = []
        for j in range(count):
            w, h = 3 + (13 * j + 7 * i) % (size // 2), 3 + (5 * j + 11 * i) % (size // 2)
            x1, y1 = (17 * i + 29 * j) % (size - w), (11 * i + 37 * j) % (size - h)
            boxes.append([float(x1), float(y1), float(x1 + w), float(y1 + h)])
        labels = [(i + 2 * j) % classes for j in range(count)]
        targets.append(
            {
                "boxes": torch.tensor(boxes).reshape(-1, 4),
                "labels": torch.tensor(labels, dtype=torch.long),
            }
        )
    return targets


def probe(grad: torch.Tensor) -> torch.Tensor:
    """A fixed projection of a gradient: sensitive to its direction, not only its size."""
    return (grad * wave(tuple(grad.shape), 0.11, math.pi / 2)).sum()


def loss_for(label_mode: str, classes: int) -> DetectionLoss:
    return DetectionLoss(classes, label_mode, STRIDE, box_weight=2.0)


# (label mode, classes, image size, objects per image) -> (total, heatmap, box,
# sum |d total/d heatmap|, probe(d heatmap), sum |d total/d box|, probe(d box)). The heatmap
# terms are as the loss gave them before it was made sync-free (commit 7447b17: model inside,
# one_hot product, boolean-mask indexing, torchvision's GIoU loss); the total and box terms as
# it gives them since each (class, cell) regresses the object of that class with the highest
# Gaussian (`TargetPlan.box_owners`; with one class per overlap, the values of the per-cell owner before it)
# and the box area's floor is MIN_BOX_SIGMA. The box gradient is summed over the classes' box
# channels: each class's channels learn that class's objects only (checked below).
PINNED = [
    (
        ("multilabel", 3, 64, (3, 0, 5)),
        (113.67976379394531, 111.37027740478516, 1.1547367572784424, 94.43255615234375,
         0.5697574019432068, 0.8063508868217468, 0.06388634443283081),
    ),
    (
        ("single", 4, 64, (2, 6)),
        (16.873092651367188, 14.651681900024414, 1.1107052564620972, 30.830862045288086,
         -0.7520946264266968, 0.7334617376327515, -0.016720015555620193),
    ),
    (
        ("single", 2, 32, (0, 0)),
        (129.07901000976562, 129.07901000976562, -0.0, 142.431884765625,
         -1.1360304355621338, 0.0, 0.0),
    ),
    (
        ("multilabel", 5, 96, (12,)),
        (91.28947448730469, 89.14031982421875, 1.0745768547058105, 75.78677368164062,
         0.29201629757881165, 0.5382134318351746, 0.01754637435078621),
    ),
    (
        ("single", 3, 128, (1, 4, 0, 9)),
        (310.5044250488281, 308.4060363769531, 1.049209475517273, 379.46929931640625,
         -0.04971253126859665, 0.39303845167160034, -0.09596973657608032),
    ),
]  # fmt: skip


@pytest.mark.parametrize(("case", "expected"), PINNED, ids=[str(c) for c, _ in PINNED])
def test_values_and_gradients_match_the_pinned_ones(case, expected) -> None:
    label_mode, classes, size, objects = case
    heat_channels = classes + (label_mode == "single")
    outputs = fixed_outputs(len(objects), heat_channels, size // STRIDE, classes)
    losses = loss_for(label_mode, classes)(outputs, fixed_targets(objects, classes, size))
    losses["total"].backward()
    heat_grad = outputs["heatmap"].grad
    box_grad = outputs["box"].grad.unflatten(1, (classes, 4)).sum(dim=1)
    got = (
        losses["total"].item(),
        losses["heatmap"].item(),
        losses["box"].item(),
        heat_grad.abs().sum().item(),
        probe(heat_grad).item(),
        box_grad.abs().sum().item(),
        probe(box_grad).item(),
    )
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)


def owner_map(boxes: list[list[float]], labels: list[int], classes: int) -> torch.Tensor:
    """[class, h, w]: the object whose box each (class, cell) of a 128-px image regresses (-1:
    none)."""
    targets = [{"boxes": torch.tensor(boxes), "labels": torch.tensor(labels)}]
    plan = DetectionLoss(classes, "single").plan(targets, 32, 32)
    owners = torch.full((classes * 32 * 32,), -1)
    owns = plan.box_owners()
    owners[plan.box_key[owns]] = plan.box_object[owns]
    return owners.view(classes, 32, 32)


def test_each_object_regresses_its_own_centre_cell_also_beside_a_smaller_one() -> None:
    """A 96-px object with a 10-px one of the same class 4 px from its centre (inside its box,
    as a cell inside a tissue): decoding reads each box at its object's centre cell, so that
    cell must regress that object. The smallest-covering-object rule gave the large centre to
    the small object."""
    large, small = [18.0, 18.0, 114.0, 114.0], [65.0, 61.0, 75.0, 71.0]  # centre cells 16, 17
    plan = DetectionLoss(2, "single").plan(
        [{"boxes": torch.tensor([small]), "labels": torch.tensor([1])}], 32, 32
    )
    assert (plan.box_key == 1 * 32 * 32 + 16 * 32 + 16).any()  # its area covers the large centre
    owners = owner_map([large, small], [1, 1], 2)
    assert owners[1, 16, 16] == 0 and owners[1, 16, 17] == 1 and owners[1, 0, 0] == -1
    assert (owners[0] == -1).all()  # class 0 has no object
    # equal Gaussians (both at the floor of MIN_BOX_SIGMA) go to the smaller object, then the first
    four, six = [64.0, 64.0, 68.0, 68.0], [63.0, 63.0, 69.0, 69.0]
    assert owner_map([six, four], [0, 0], 1)[0, 16, 16] == 1
    assert owner_map([four, four], [0, 0], 1)[0, 16, 16] == 0


def box_gradient(classes: int, boxes: list[list[float]], labels: list[int]) -> torch.Tensor:
    """d (box loss) / d (box map), [class, 4, h, w], for one image of 32x32 cells."""
    outputs = fixed_outputs(1, classes + 1, 32, classes)
    targets = [{"boxes": torch.tensor(boxes), "labels": torch.tensor(labels)}]
    losses = loss_for("single", classes)(outputs, targets)
    (losses["total"] - losses["heatmap"]).backward()
    return outputs["box"].grad.unflatten(1, (classes, 4))[0]


def test_a_cells_box_channels_of_each_class_learn_only_that_class_objects() -> None:
    """A large object of class 2 and a small one of class 0 a cell from its centre: class 2's
    box channels learn exactly what they learn from the large object alone, class 0's what they
    learn from the small one alone (the loss averages over objects: half as much with two), and
    class 1's nothing. Before, each cell went to one of the two, whatever their classes."""
    classes = 3
    large, small = [16.0, 16.0, 112.0, 112.0], [66.0, 61.0, 76.0, 71.0]  # centre cells 16 and 17
    both = box_gradient(classes, [large, small], [2, 0])
    alone_large = box_gradient(classes, [large], [2])
    alone_small = box_gradient(classes, [small], [0])
    assert not both[1].any()
    torch.testing.assert_close(2 * both[2], alone_large[2])
    torch.testing.assert_close(2 * both[0], alone_small[0])
    assert both[2, :, 16, 16].abs().sum() > 0 and both[0, :, 16, 17].abs().sum() > 0


def test_a_large_object_keeps_its_centre_cell_when_a_small_one_of_another_class_shares_it() -> None:
    """A 64-px object of class 0 and an 8-px object of class 1 with the same centre: decoding
    reads class 0's box at that cell from class 0's channels, so they must be trained there on
    the 64-px box (the cell went to the smaller object, and class 0's channels learnt nothing)."""
    classes = 2
    large, small = [32.0, 32.0, 96.0, 96.0], [60.0, 60.0, 68.0, 68.0]  # both centred on cell 16
    both = box_gradient(classes, [large, small], [0, 1])
    alone_large = box_gradient(classes, [large], [0])
    assert both[0, :, 16, 16].abs().sum() > 0
    torch.testing.assert_close(2 * both[0, :, 16, 16], alone_large[0, :, 16, 16])
    assert both[1, :, 16, 16].abs().sum() > 0  # the small one keeps its own centre


def heatmap_gradient(label_mode: str, ignore: list[tuple[list[float], int]]) -> torch.Tensor:
    """d (loss) / d (heatmap logits), [channel, h, w], of one 64-px image (16x16 cells) with an
    object of class 0 centred on cell (3, 3) and the given ignore regions."""
    outputs = fixed_outputs(1, 2 + (label_mode == "single"), 16, 2)
    target = {"boxes": torch.tensor([[8.0, 8.0, 20.0, 20.0]]), "labels": torch.tensor([0])}
    target["ignore_boxes"] = torch.tensor([box for box, _ in ignore]).reshape(-1, 4)
    target["ignore_labels"] = torch.tensor([label for _, label in ignore], dtype=torch.long)
    loss_for(label_mode, 2)(outputs, [target])["total"].backward()
    return outputs["heatmap"].grad[0]


@pytest.mark.parametrize("label_mode", ["multilabel", "single"])
def test_an_ignore_region_takes_no_part_in_its_classes_negatives(label_mode: str) -> None:
    """A crowd region of class 0 over the cells 0 to 7 (32 px), holding the object's centre:
    class 0's scores there are not punished (multilabel: no gradient at all), the object's centre
    still trains as a positive, and every cell outside the region trains as without it."""
    plain = heatmap_gradient(label_mode, [])
    crowd = heatmap_gradient(label_mode, [([0.0, 0.0, 32.0, 32.0], 0)])
    inside = torch.zeros(16, 16, dtype=torch.bool)
    inside[:8, :8] = True
    torch.testing.assert_close(crowd[:, ~inside], plain[:, ~inside], rtol=0, atol=0)
    torch.testing.assert_close(crowd[:, 3, 3], plain[:, 3, 3], rtol=0, atol=0)  # the positive
    inside[3, 3] = False
    if label_mode == "multilabel":
        assert not crowd[0, inside].any() and plain[0, inside].abs().min() > 0
        torch.testing.assert_close(crowd[1], plain[1], rtol=0, atol=0)
    else:  # softmax ties the classes of a cell: every channel there changes, and only there
        assert (crowd[:, inside] != plain[:, inside]).all()


def test_an_ignore_region_of_another_class_changes_nothing_for_this_one() -> None:
    plain = heatmap_gradient("multilabel", [])
    other = heatmap_gradient("multilabel", [([0.0, 0.0, 32.0, 32.0], 1)])
    torch.testing.assert_close(other[0], plain[0], rtol=0, atol=0)
    assert not other[1, :8, :8].any()


def test_a_region_overlapping_part_of_a_cell_ignores_that_cell() -> None:
    """A region of 2x2 px inside cell (5, 9) holds no cell's centre; the cell it overlaps is
    ignored all the same (an object that small is centred there), and no other."""
    plain = heatmap_gradient("multilabel", [])
    small = heatmap_gradient("multilabel", [([37.0, 21.0, 39.0, 23.0], 0)])
    changed = (small != plain).any(dim=0).nonzero().tolist()
    assert changed == [[5, 9]] and not small[0, 5, 9]


def test_giou_loss_matches_torchvision_on_overlapping_touching_and_disjoint_boxes() -> None:
    from torchvision.ops import generalized_box_iou_loss

    first = torch.tensor([[0.0, 0, 10, 10], [0, 0, 10, 10], [0, 0, 4, 4], [2, 3, 9, 12]])
    second = torch.tensor([[5.0, 5, 15, 15], [10, 0, 20, 10], [6, 6, 9, 9], [2, 3, 9, 12]])
    torch.testing.assert_close(giou_loss(first, second), generalized_box_iou_loss(first, second))


# ---- what the loss holds -----------------------------------------------------------------


@pytest.mark.parametrize("label_mode", ["multilabel", "single"])
def test_the_loss_holds_no_model_parameters_or_state(label_mode: str) -> None:
    model = build_model("tiny_conv", 3, label_mode, width=8)
    loss = DetectionLoss.for_model(model, box_weight=1.5)
    assert list(loss.parameters()) == [] and list(loss.buffers()) == []
    assert loss.state_dict() == {} and list(loss.children()) == []
    assert (loss.num_classes, loss.label_mode, loss.stride, loss.box_weight) == (
        3,
        label_mode,
        model.stride,
        1.5,
    )


def test_an_unknown_label_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="label_mode must be one of"):
        DetectionLoss(3, "softmax")


# ---- host synchronisation --------------------------------------------------------------------

# Ops that make the host wait for the device: reading a value (item, bool, comparisons that
# return a Python bool) or sizing a result by the data (nonzero, masked_select, unique).
_SYNCING_OPS = {
    "_local_scalar_dense",
    "is_nonzero",
    "equal",
    "nonzero",
    "masked_select",
    "_unique",
    "_unique2",
    "unique_consecutive",
    "unique_dim",
}


class OpRecorder(TorchDispatchMode):
    """Every ATen op that runs, with what it was given and what it produced: the syncing ops,
    and each tensor produced with more than `larger_than` elements."""

    def __init__(self, larger_than: float = math.inf) -> None:
        super().__init__()
        self.syncing: list[str] = []
        self.larger_than = larger_than
        self.large: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if name in _SYNCING_OPS:
            self.syncing.append(func.__name__)
        if name.startswith(("index", "_index_put")) and any(
            _is_mask(index) for index in _flat(args[1:])
        ):
            self.syncing.append(f"{func.__name__} with a boolean mask")
        result = func(*args, **kwargs)
        for tensor in _flat(result):
            if isinstance(tensor, torch.Tensor) and tensor.numel() > self.larger_than:
                self.large.append((func.__name__, tuple(tensor.shape)))
        return result


def _flat(value):
    if isinstance(value, list | tuple):
        for item in value:
            yield from _flat(item)
    else:
        yield value


def _is_mask(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype in (torch.bool, torch.uint8)


def record_ops(run: Callable[[], None], larger_than: float = math.inf) -> OpRecorder:
    recorder = OpRecorder(larger_than)
    with recorder:
        run()
    return recorder


@pytest.mark.parametrize("label_mode", ["multilabel", "single"])
@pytest.mark.parametrize("objects", [(3, 0, 5), (0, 0)], ids=["some-empty", "all-empty"])
def test_forward_and_backward_never_make_the_host_wait_for_the_device(
    label_mode: str, objects: tuple[int, ...]
) -> None:
    outputs = fixed_outputs(len(objects), 3 + (label_mode == "single"), 16, 3)
    targets = fixed_targets(objects, 3, 64)
    targets[0]["ignore_boxes"] = torch.tensor([[4.0, 6.0, 30.0, 20.0]])  # a crowd region
    targets[0]["ignore_labels"] = torch.tensor([2])
    loss = loss_for(label_mode, 3)
    # what depends on the boxes' values is planned on the host, where the loader gives them
    plan = loss.plan(targets, 16, 16)

    def step() -> None:
        loss(outputs, plan)["total"].backward()

    recorder = record_ops(step)
    assert recorder.syncing == []
    assert outputs["box"].grad is not None  # the box head stays in the graph, also without objects
    assert all(t.device.type == "cpu" for t in (plan.boxes, plan.heat_key, plan.ignore_key))


def test_given_targets_or_their_plan_the_loss_is_the_same() -> None:
    outputs = fixed_outputs(3, 4, 16, 3)
    targets = fixed_targets((3, 0, 5), 3, 64)
    loss = loss_for("single", 3)
    by_targets, by_plan = loss(outputs, targets), loss(outputs, loss.plan(targets, 16, 16))
    assert all(torch.equal(by_targets[key], by_plan[key]) for key in by_targets)
    with pytest.raises(ValueError, match="planned for maps of"):
        loss(outputs, loss.plan(targets, 8, 8))


def test_the_sync_recorder_sees_item_and_boolean_mask_indexing() -> None:
    """The check above is only as good as its recorder: it must catch the usual culprits."""
    values = torch.arange(6.0)

    def culprits() -> None:
        mask = values > 2
        values[mask].sum()
        _ = values.sum().item()
        if mask.any():
            pass

    syncing = record_ops(culprits).syncing
    assert any("boolean mask" in op for op in syncing)
    assert any(op.startswith("_local_scalar_dense") for op in syncing)
    assert len(syncing) >= 3


# ---- windows -------------------------------------------------------------------------------


def dense_gaussians(boxes: torch.Tensor, spread: float, min_sigma: float, cells: int):
    """[N, h, w]: each object's Gaussian over the whole map, as the loss drew them before it drew
    windows (a row and a column profile multiplied out)."""
    wh = (boxes[:, 2:] - boxes[:, :2]) / STRIDE
    centre = ((boxes[:, :2] + boxes[:, 2:]) / 2 / STRIDE).floor().clamp(0, cells - 1)
    sigma = (spread * wh / 6).clamp(min=min_sigma)
    grid = torch.arange(cells, dtype=torch.float32)
    across = torch.exp(-((grid - centre[:, 0, None]) ** 2) / (2 * sigma[:, 0, None] ** 2))
    down = torch.exp(-((grid - centre[:, 1, None]) ** 2) / (2 * sigma[:, 1, None] ** 2))
    return down[:, :, None] * across[:, None, :]


def test_windowed_targets_equal_the_whole_maps_gaussians_above_their_cut_offs() -> None:
    """Objects from 3 px to most of the image, some cut by its edges, in 3 classes: the heatmap
    target is the dense one wherever that exceeds HEAT_CUTOFF (zero elsewhere), and boxes are
    regressed at exactly the cells where an object's dense Gaussian exceeds BOX_AREA_CUTOFF."""
    cells, classes = 48, 3
    (target,) = fixed_targets((40,), classes, cells * STRIDE)
    target["boxes"][0] = torch.tensor([-30.0, 100.0, 150.0, 210.0])  # past the left edge
    target["boxes"][1] = torch.tensor([0.0, 0.0, 192.0, 192.0])  # the whole image
    boxes, labels = target["boxes"], target["labels"]
    plan = DetectionLoss(classes, "single").plan([target], cells, cells)

    heat = dense_gaussians(boxes, target_plan.HEAT_ALPHA, target_plan.MIN_SIGMA, cells)
    dense = torch.stack(
        [torch.where((labels == c)[:, None, None], heat, 0.0).amax(0) for c in range(classes)]
    )
    expected = torch.where(dense > target_plan.HEAT_CUTOFF, dense, 0.0)
    torch.testing.assert_close(plan.heatmap()[0], expected, rtol=1e-6, atol=0)
    assert (expected > 0).sum() < expected.numel()  # the cut-off cut something

    area = dense_gaussians(boxes, target_plan.BOX_BETA, target_plan.MIN_BOX_SIGMA, cells)
    above = area > target_plan.BOX_AREA_CUTOFF  # [N, h, w]
    drawn = torch.zeros_like(above)
    cell = plan.box_key % (cells * cells)
    drawn[plan.box_object, cell // cells, cell % cells] = True
    assert torch.equal(drawn, above)
    value = area[plan.box_object, cell // cells, cell % cells]
    torch.testing.assert_close(plan.box_value, value, rtol=1e-6, atol=0)
    assert torch.equal(plan.box_key // (cells * cells), labels[plan.box_object])


def test_the_loss_draws_in_memory_that_follows_the_objects_area_not_objects_x_map() -> None:
    """1024 px, 300 objects of 8 to 40 px per image, batch 16 (dense microscopy, a retail shelf):
    the loss's forward and backward stay under 1 GB of torch memory. The Gaussians over the whole
    map for every object were 16 x 300 x 256 x 256 floats: 1.2 GiB each, several of them."""
    classes = 3
    outputs, targets = crowded_batch(16, classes, 1024, 300, smallest=8)
    for tensor in outputs.values():
        tensor.requires_grad_()
    loss = DetectionLoss(classes, "single")
    peak = cpu_tensor_peak_bytes(lambda: loss(outputs, targets)["total"].backward())
    gradients = sum(tensor.numel() * 4 for tensor in outputs.values())
    assert gradients < peak < 2**30, f"peak {peak / 2**20:.0f} MiB"


# ---- memory --------------------------------------------------------------------------------

# The scale issue 11 names: 80 classes at 512 px, 60 objects per image, batch 16.
SCALE = {"batch": 16, "classes": 80, "size": 512, "objects": 60}


def crowded_batch(batch: int, classes: int, size: int, objects: int, smallest: float = 4):
    """Random outputs and `objects` boxes per image of `smallest` to 40 px, seeded."""
    cells = size // STRIDE
    generator = torch.Generator().manual_seed(0)
    outputs = {
        "heatmap": torch.randn(batch, classes + 1, cells, cells, generator=generator),
        "box": torch.randn(batch, 4 * classes, cells, cells, generator=generator),
    }
    targets = []
    for _ in range(batch):
        corner = torch.rand(objects, 2, generator=generator) * (size - 40)
        extent = smallest + torch.rand(objects, 2, generator=generator) * (40 - smallest)
        labels = torch.randint(0, classes, (objects,), generator=generator)
        targets.append({"boxes": torch.cat([corner, corner + extent], 1), "labels": labels})
    return outputs, targets


def dense_sizes(batch: int, classes: int, size: int, objects: int) -> tuple[int, int, int]:
    """Elements of the heatmap logits [B, C+1, h, w], of the boxes [B, 4C, h, w] (their
    gradients are as large) and of one Gaussian per object [B, N, h, w]."""
    cells = (size // STRIDE) ** 2
    return batch * (classes + 1) * cells, batch * 4 * classes * cells, batch * objects * cells


def test_only_tensors_of_the_boxes_size_outgrow_the_heatmap_and_the_objects_gaussians() -> None:
    """The heatmap target once came from a [B, N, C, h, w] product of objects and classes."""
    scale = {**SCALE, "batch": 2}  # per image as at full scale; two images keep it quick
    outputs, targets = crowded_batch(**scale)
    for tensor in outputs.values():
        tensor.requires_grad_()
    heat, _, objects = dense_sizes(**scale)
    loss = DetectionLoss(scale["classes"], "single")
    recorder = record_ops(
        lambda: loss(outputs, targets)["total"].backward(), larger_than=max(heat, objects)
    )
    box_size = outputs["box"].numel()
    assert recorder.large, "the recorder saw no tensor the size of the boxes' gradient"
    assert all(math.prod(shape) <= box_size for _, shape in recorder.large), recorder.large


_PEAK_SCRIPT = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from test_loss import SCALE, crowded_batch
from pipeline.device import host_peak_rss_mb
from pipeline.models.loss import DetectionLoss
torch.set_num_threads(1)
outputs, targets = crowded_batch(**SCALE)
for tensor in outputs.values():
    tensor.requires_grad_()
before = host_peak_rss_mb()
DetectionLoss(SCALE["classes"], "single")(outputs, targets)["total"].backward()
print(json.dumps({"rise_mb": host_peak_rss_mb() - before}))
"""


@pytest.mark.slow
def test_peak_memory_at_80_classes_512_px_60_objects_batch_16_stays_within_dense_sizes(
    request: pytest.FixtureRequest,
) -> None:
    """Measured in a fresh process (peak RSS): a few tensors of the dense sizes and the boxes'
    gradient, where the objects x classes product alone was 4.7 GiB."""
    heat, boxes, objects = dense_sizes(**SCALE)
    bound_mb = (16 * (heat + objects) + boxes) * 4 / 2**20
    product_mb = heat / (SCALE["classes"] + 1) * SCALE["classes"] * SCALE["objects"] * 4 / 2**20
    assert bound_mb < product_mb  # the bound leaves no room for the product
    result = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(request.path.parent)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rise_mb = json.loads(result.stdout.splitlines()[-1])["rise_mb"]
    assert 0 < rise_mb < bound_mb, f"peak rose by {rise_mb:.0f} MB (bound {bound_mb:.0f} MB)"


def _plan_digest(plan: target_plan.TargetPlan) -> str:
    """The plan's cells and objects bit for bit, its Gaussians and areas to 1e-5: torch's exp
    differs by CPU (AVX2, AVX-512) in the last bit."""
    digest = hashlib.sha256(str(plan.shape).encode())
    for name in ("boxes", "area", "heat_key", "heat_value", "box_key", "box_object", "box_value"):
        value = getattr(plan, name).numpy()
        digest.update(f"{name} {value.dtype} {value.shape}".encode())
        digest.update((value.round(5) if value.dtype.kind == "f" else value).tobytes())
    if plan.ignore_key is not None:
        digest.update(plan.ignore_key.numpy().tobytes())
    return digest.hexdigest()


def _varied_targets() -> list[dict]:
    """Objects from 3 px to the whole image, some past its edges, fractional corners, and
    ignore regions: every branch of the window arithmetic."""
    targets = fixed_targets((9, 0, 23, 4), 3, 128)
    targets[0]["boxes"][0] = torch.tensor([-30.0, 100.0, 150.0, 210.0])
    targets[0]["boxes"][1] = torch.tensor([0.0, 0.0, 128.0, 128.0])
    targets[2]["boxes"][:5] += torch.tensor([0.37, 0.5, 0.81, 0.25])
    targets[3]["boxes"][3] = torch.tensor([120.5, 121.0, 128.0, 127.75])
    targets[3]["ignore_boxes"] = torch.tensor([[3.5, 7.0, 40.0, 33.25], [100.0, 0.0, 128.0, 9.0]])
    targets[3]["ignore_labels"] = torch.tensor([2, 0])
    return targets


# Written from plan_targets as it was before its windows were drawn from per-object profiles
# (main at ff74fe1): what the loss trains on.
PINNED_PLAN = "e43d8fe5dbad2d623e25f39b6ba84b763060a6cec036cf95ab1d54e92f45297b"


def test_the_target_plan_is_what_it_always_was() -> None:
    plan = DetectionLoss(3, "single").plan(_varied_targets(), 32, 32)
    assert _plan_digest(plan) == PINNED_PLAN


def ideal_box_map(plan: target_plan.TargetPlan) -> torch.Tensor:
    """The box map [B, 4C, h, w] that regresses, at every (class, cell) an object owns, that
    object's box exactly (the map the box loss is minimised by); other cells hold zeros."""
    batch, classes, h, w = plan.shape
    owns = plan.box_owners()
    key, box = plan.box_key[owns], plan.boxes[plan.box_object[owns]]
    plane, cell = key // (h * w), key % (h * w)
    image, label, row, col = plane // classes, plane % classes, cell // w, cell % w
    values = torch.stack(
        [
            (box[:, 0] + box[:, 2]) / 2 / STRIDE - col - 0.5,
            (box[:, 1] + box[:, 3]) / 2 / STRIDE - row - 0.5,
            ((box[:, 2] - box[:, 0]) / STRIDE).log(),
            ((box[:, 3] - box[:, 1]) / STRIDE).log(),
        ],
        dim=1,
    )
    regression = torch.zeros(batch, classes, 4, h, w)
    regression[image[:, None], label[:, None], torch.arange(4), row[:, None], col[:, None]] = values
    return regression.view(batch, 4 * classes, h, w)


def test_targets_and_decoding_agree_the_box_the_loss_is_minimised_by_decodes_to_its_object() -> (
    None
):
    """A size bias between what the loss trains and what decoding reads would cap AP@[.5:.95]
    whatever the model learns: the map with zero box loss must decode, at each object's
    heatmap peak, to exactly that object's box, for objects of 3 to 100 px side by side."""
    from torchvision.ops import box_iou

    classes, size = 2, 128
    h = w = size // STRIDE
    generator = torch.Generator().manual_seed(0)
    sides = torch.exp(torch.empty(40, 2).uniform_(math.log(3), math.log(100), generator=generator))
    centres = torch.rand(40, 2, generator=generator) * size
    boxes = torch.cat([centres - sides / 2, centres + sides / 2], 1).clamp(0, size)
    boxes = boxes[((boxes[:, 2:] - boxes[:, :2]) > 2).all(1)]
    labels = torch.randint(0, classes, (len(boxes),), generator=generator)
    targets = [
        {"boxes": boxes[i::8], "labels": labels[i::8]} for i in range(8)
    ]  # about 5 objects an image, overlapping in places
    loss = loss_for("multilabel", classes)
    plan = loss.plan(targets, h, w)
    regression = ideal_box_map(plan)
    heatmap = torch.logit(plan.heatmap().clamp(1e-6, 1 - 1e-6))
    outputs = {"heatmap": heatmap, "box": regression}
    assert loss(outputs, plan)["box"].item() == pytest.approx(0.0, abs=1e-5)
    model = build_model("tiny_conv", classes, "multilabel", width=8)
    for found, target in zip(model.decode(outputs, 100, centre_window=1), targets, strict=True):
        for label in range(classes):
            mine = target["labels"] == label
            peaks = found["boxes"][(found["labels"] == label) & (found["scores"] > 0.99)]
            if mine.any():  # every object's best match among its class's peaks is itself
                best = box_iou(target["boxes"][mine], peaks).max(dim=1).values
                assert best.min().item() > 1 - 1e-4
