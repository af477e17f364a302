"""The loss's target plan (`pipeline.models.targets.plan_targets`) against its definition."""

from __future__ import annotations

import numpy as np
import torch

from pipeline.models import targets as target_plan

CLASSES, STRIDE, H, W = 3, 4, 24, 40  # a map wider than high: x and y cannot be swapped unseen


def varied_batch() -> list[dict]:
    """Seeded random boxes and every edge case the windows' arithmetic meets: objects at and past
    the map's borders, boxes larger than the map, zero-size boxes, fractional corners, an image
    without objects, a crowded image, ignore regions in some images and not in others."""
    generator = torch.Generator().manual_seed(7)

    def random_boxes(count: int, largest: float) -> torch.Tensor:
        corner = torch.rand(count, 2, generator=generator) * torch.tensor([W, H]) * STRIDE
        extent = torch.rand(count, 2, generator=generator) * largest
        return torch.cat([corner - 8, corner - 8 + extent], 1)

    def labels(count: int) -> torch.Tensor:
        return torch.randint(0, CLASSES, (count,), generator=generator)

    edges = torch.tensor(
        [
            [0.0, 0.0, 3.0, 3.0],  # in the top left cell
            [156.0, 92.0, 160.0, 96.0],  # in the bottom right cell
            [-40.0, 30.0, 20.0, 50.0],  # centre left of the map
            [150.0, 90.0, 210.0, 130.0],  # centre right of and below the map
            [-50.0, -70.0, 300.0, 200.0],  # larger than the map
            [0.0, 0.0, 160.0, 96.0],  # the whole map
            [37.0, 41.0, 37.0, 41.0],  # zero size
            [80.0, 10.5, 80.0, 60.25],  # zero width
            [12.37, 5.5, 30.81, 9.25],  # fractional corners
        ]
    )
    crowded = random_boxes(60, 40)
    return [
        {"boxes": edges, "labels": labels(len(edges))},
        {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long)},
        {
            "boxes": crowded,
            "labels": labels(len(crowded)),
            "ignore_boxes": torch.tensor([[3.5, 7.0, 40.0, 33.25], [150.0, 0.0, 170.0, 9.0]]),
            "ignore_labels": torch.tensor([2, 0]),
        },
        {
            "boxes": random_boxes(5, 120),
            "labels": labels(5),
            "ignore_boxes": torch.zeros(0, 4),
            "ignore_labels": torch.zeros(0, dtype=torch.long),
        },
        {
            "boxes": random_boxes(3, 12),
            "labels": labels(3),
            "ignore_boxes": torch.tensor([[-9.0, 60.0, 4.0, 100.0]]),
            "ignore_labels": torch.tensor([1]),
        },
    ]


def per_object_plan(targets: list[dict]) -> dict[str, torch.Tensor]:
    """The plan by its definition, one object at a time over the whole map: each object's two
    Gaussians at every cell where they exceed their cut-offs (row by row, x fastest), and each
    ignore region's class cells whose [x s, x s + s) x [y s, y s + s) the region overlaps."""
    plan = {name: [] for name in ("heat_key", "heat_value", "box_key", "box_object", "box_value")}
    boxes, areas, ignore = [], [], []
    gaussians = (
        ("heat", target_plan.HEAT_ALPHA, target_plan.MIN_SIGMA, target_plan.HEAT_CUTOFF),
        ("box", target_plan.BOX_BETA, target_plan.MIN_BOX_SIGMA, target_plan.BOX_AREA_CUTOFF),
    )
    columns, rows = torch.arange(W, dtype=torch.float32), torch.arange(H, dtype=torch.float32)
    for image, target in enumerate(targets):
        for box, label in zip(target["boxes"], target["labels"], strict=True):
            wh = (box[2:] - box[:2]) / STRIDE
            x = ((box[0] + box[2]) / 2 / STRIDE).floor().clamp(0, W - 1)
            y = ((box[1] + box[3]) / 2 / STRIDE).floor().clamp(0, H - 1)
            plane = (image * CLASSES + int(label)) * H * W
            for name, spread, floor, cutoff in gaussians:
                sigma = (spread * wh / 6).clamp(min=floor)
                across = torch.exp(-((columns - x) ** 2) / (2 * sigma[0] ** 2))
                down = torch.exp(-((rows - y) ** 2) / (2 * sigma[1] ** 2))
                gaussian = (down[:, None] * across[None, :]).reshape(-1)
                cells = (gaussian > cutoff).nonzero().reshape(-1)
                plan[f"{name}_key"].append(plane + cells)
                plan[f"{name}_value"].append(gaussian[cells])
            plan["box_object"].append(torch.full_like(cells, len(boxes)))
            boxes.append(box)
            areas.append((wh[0] * wh[1]).clamp(min=target_plan.EPS))
        regions = zip(target.get("ignore_boxes", []), target.get("ignore_labels", []), strict=True)
        for (x1, y1, x2, y2), label in regions:
            plane = (image * CLASSES + int(label)) * H * W
            ignore += [
                plane + cy * W + cx
                for cy in range(H)
                for cx in range(W)
                if cx * STRIDE < x2 and (cx + 1) * STRIDE > x1
                if cy * STRIDE < y2 and (cy + 1) * STRIDE > y1
            ]
    return {
        **{name: torch.cat(parts) for name, parts in plan.items()},
        "boxes": torch.stack(boxes),
        "area": torch.stack(areas),
        "ignore_key": torch.tensor(ignore, dtype=torch.long),
    }


def test_the_plan_draws_every_objects_gaussians_and_ignore_regions_as_their_definition() -> None:
    """Cells, objects, boxes and areas exactly; the Gaussians to torch's exp (whose last bit
    depends on the CPU and on an entry's position in its array)."""
    targets = varied_batch()
    plan = target_plan.plan_targets(targets, CLASSES, STRIDE, H, W)
    expected = per_object_plan(targets)
    assert plan.shape == (len(targets), CLASSES, H, W)
    for name in ("boxes", "area", "heat_key", "box_key", "box_object", "ignore_key"):
        assert getattr(plan, name).dtype == expected[name].dtype, name
        assert torch.equal(getattr(plan, name), expected[name]), name
    for name in ("heat_value", "box_value"):
        assert getattr(plan, name).dtype == torch.float32
        torch.testing.assert_close(getattr(plan, name), expected[name], rtol=1e-6, atol=0)
    assert len(expected["ignore_key"]) and len(expected["box_key"]) < len(expected["heat_key"])


def test_a_batch_without_ignore_regions_plans_none() -> None:
    targets = [{k: v for k, v in t.items() if "ignore" not in k} for t in varied_batch()]
    targets[3]["ignore_boxes"] = torch.zeros(0, 4)  # present but empty
    targets[3]["ignore_labels"] = torch.zeros(0, dtype=torch.long)
    assert target_plan.plan_targets(targets, CLASSES, STRIDE, H, W).ignore_key is None


def test_targets_as_lists_or_other_dtypes_plan_as_the_loaders_tensors() -> None:
    """The per-image conversion (lists, float64 arrays, int32 labels, flat boxes) and the joined
    one of the loader's tensors give the same plan, bit for bit."""
    targets = varied_batch()
    converted = [
        {
            "boxes": target["boxes"].double().numpy().reshape(-1),
            "labels": target["labels"].int().tolist(),
            **(
                {
                    "ignore_boxes": target["ignore_boxes"].tolist(),
                    "ignore_labels": np.asarray(target["ignore_labels"], dtype=np.int32),
                }
                if "ignore_boxes" in target
                else {}
            ),
        }
        for target in targets
    ]
    plan = target_plan.plan_targets(targets, CLASSES, STRIDE, H, W)
    again = target_plan.plan_targets(converted, CLASSES, STRIDE, H, W)
    for name in ("boxes", "area", "heat_key", "heat_value", "box_key", "box_object", "box_value"):
        a, b = getattr(plan, name), getattr(again, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert torch.equal(plan.ignore_key, again.ignore_key)


def test_an_empty_batch_plans_nothing() -> None:
    plan = target_plan.plan_targets([], CLASSES, STRIDE, H, W)
    assert plan.shape == (0, CLASSES, H, W)
    assert len(plan.boxes) == len(plan.heat_key) == len(plan.box_key) == 0
    assert plan.ignore_key is None
