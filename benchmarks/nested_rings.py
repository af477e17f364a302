"""How the detector handles large rings with a small object in their hole (multi-scale preset).

Reads an `eval --predictions` file of the multi-scale preset's test split and prints, for the
large rings (over 64 px, the size buckets' rule) with a small object (under 20 px) within 10 px
of their centre and for the other large rings: how many are found (a ring detection at score
>= 0.4, the default threshold, with IoU >= 0.5) and the mean IoU of the best ring detection;
and the medium-sized ring detections (score >= 0.3) that match no ring, with how many of them
lie inside a ring's box. Those are what the medium bucket's rings lose to: a dot in a ring's
hole led the box head to give the ring its hole's box. Many more objects than the medium
bucket's handful of rings, so a change shows here before it shows in that bucket's AP.

    python -m pipeline eval --checkpoint RUN/best.pth --out RUN.json --predictions RUN_pred.json
    .venv/bin/python benchmarks/nested_rings.py RUN_pred.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from torchvision.ops import box_iou

LARGE_PX = 64.0  # the large bucket's lower edge (size = square root of the box area)
MEDIUM_PX = 16.0
DOT_PX = 20.0
NEAR_CENTRE_PX = 10.0
SCORE_FOUND = 0.4
SCORE_FALSE_POSITIVE = 0.3


def _centres(boxes: torch.Tensor) -> torch.Tensor:
    return (boxes[:, :2] + boxes[:, 2:]) / 2


def _sides(boxes: torch.Tensor) -> torch.Tensor:
    return ((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])).clamp(min=0).sqrt()


def measure(predictions: dict) -> dict[str, float]:
    ring = predictions["class_names"].index("ring")
    best_iou = {"dotted": [], "plain": []}
    false_positives, inside = [], 0
    for image in predictions["images"]:
        truth, found = image["ground_truth"], image["detections"]
        gt_boxes = torch.tensor(truth["boxes"], dtype=torch.float64).reshape(-1, 4)
        gt_labels = torch.tensor(truth["labels"], dtype=torch.long)
        boxes = torch.tensor(found["boxes"], dtype=torch.float64).reshape(-1, 4)
        scores = torch.tensor(found["scores"], dtype=torch.float64)
        is_ring = torch.tensor(found["labels"], dtype=torch.long) == ring
        rings = gt_boxes[gt_labels == ring]
        others = gt_boxes[(gt_labels != ring) & (_sides(gt_boxes) < DOT_PX)]
        confident = boxes[is_ring & (scores >= SCORE_FOUND)]
        ious = box_iou(rings, confident)
        best = ious.amax(dim=1) if confident.shape[0] else torch.zeros(rings.shape[0])
        near = torch.cdist(_centres(rings), _centres(others)) < NEAR_CENTRE_PX
        dotted = near.any(dim=1) if others.shape[0] else torch.zeros(rings.shape[0], dtype=bool)
        for index in torch.nonzero(_sides(rings) > LARGE_PX).flatten().tolist():
            best_iou["dotted" if dotted[index] else "plain"].append(best[index].item())
        candidates = is_ring & (scores >= SCORE_FALSE_POSITIVE)
        sides = _sides(boxes)
        candidates &= (sides >= MEDIUM_PX) & (sides < LARGE_PX)
        for box, score in zip(boxes[candidates], scores[candidates], strict=True):
            if rings.shape[0] and box_iou(box[None], rings).max() >= 0.5:
                continue
            false_positives.append(score.item())
            cx, cy = _centres(box[None])[0].tolist()
            inside += any(x1 <= cx <= x2 and y1 <= cy <= y2 for x1, y1, x2, y2 in rings.tolist())
    result = {}
    for kind, values in best_iou.items():
        result[f"{kind}_rings"] = len(values)
        result[f"{kind}_found"] = (
            sum(v >= 0.5 for v in values) / len(values) if values else math.nan
        )
        result[f"{kind}_mean_iou"] = sum(values) / len(values) if values else math.nan
    result["medium_ring_false_positives"] = len(false_positives)
    result["of_them_inside_a_ring"] = inside
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("predictions", help="an eval --predictions file of the multi-scale preset")
    args = parser.parse_args()
    with open(args.predictions) as handle:
        result = measure(json.load(handle))
    for kind, label in (("dotted", "with a small object near the centre"), ("plain", "without")):
        print(
            f"large rings {label}: {result[f'{kind}_rings']}, found {result[f'{kind}_found']:.3f}, "
            f"mean best IoU {result[f'{kind}_mean_iou']:.3f}"
        )
    print(
        f"medium-sized ring detections on no ring (score >= {SCORE_FALSE_POSITIVE}): "
        f"{result['medium_ring_false_positives']}, {result['of_them_inside_a_ring']} of them "
        "inside a ring's box"
    )


if __name__ == "__main__":
    main()
