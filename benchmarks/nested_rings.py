"""How the detector handles large rings with a small object in their hole (multi-scale preset).

Reads an `eval --predictions` file of the multi-scale preset's test split and prints, for the
large rings (over 64 px, the size buckets' rule) with a small object (under 20 px) within 10 px
of their centre and for the other large rings: how many are found (a ring detection at score
>= 0.4, the default threshold, with IoU >= 0.5) and the mean IoU of the best ring detection;
and the medium-sized ring detections (score >= 0.3) that match no ring, with how many of them
lie inside a ring's box. Those are what the medium bucket's rings lose to: a dot in a ring's
hole led the box head to give the ring its hole's box. Many more objects than the medium
bucket's handful of rings, so a change shows here before it shows in that bucket's AP.
Then each medium ring (cut at the image's edges) itself: the score of its best ring detection
at IoU >= 0.5, and how many medium-sized ring detections on no ring, of any score, rank above
it in its class's AP.

    python -m pipeline eval --checkpoint RUN/best.pth --out RUN.json --predictions RUN_pred.json
    .venv/bin/python benchmarks/nested_rings.py RUN_pred.json
"""

from __future__ import annotations

import argparse
import json
import math

import harness
import torch
from torchvision.ops import box_area, box_iou

from pipeline.evaluation.coco import SIZE_BUCKETS

MEDIUM_PX, LARGE_PX = SIZE_BUCKETS["medium"]  # the size buckets' edges (square root of the area)
DOT_PX = 20.0
NEAR_CENTRE_PX = 10.0
SCORE_FOUND = 0.4
SCORE_FALSE_POSITIVE = 0.3
MATCH_IOU = 0.5  # a detection on a ring, as the evaluator matches at AP@.5


def _centres(boxes: torch.Tensor) -> torch.Tensor:
    return (boxes[:, :2] + boxes[:, 2:]) / 2


def _sides(boxes: torch.Tensor) -> torch.Tensor:
    return box_area(boxes).clamp(min=0).sqrt()


def _best_iou(boxes: torch.Tensor, others: torch.Tensor) -> torch.Tensor:
    """Each box's highest IoU with any of others (0 where there are none)."""
    if others.shape[0] == 0:
        return boxes.new_zeros(boxes.shape[0])
    return box_iou(boxes, others).amax(dim=1)


def _is_medium(boxes: torch.Tensor) -> torch.Tensor:
    sides = _sides(boxes)
    return (sides >= MEDIUM_PX) & (sides < LARGE_PX)


def measure(predictions: dict) -> dict[str, float | list]:
    ring = predictions["class_names"].index("ring")
    best_iou = {"dotted": [], "plain": []}
    false_positives = inside = 0
    medium_ring_scores: list[float] = []  # each medium ring's best matching ring detection
    false_medium_scores: list[float] = []  # medium ring detections on no ring, any score
    for image in predictions["images"]:
        truth, found = image["ground_truth"], image["detections"]
        gt_boxes = torch.tensor(truth["boxes"], dtype=torch.float64).reshape(-1, 4)
        gt_labels = torch.tensor(truth["labels"], dtype=torch.long)
        boxes = torch.tensor(found["boxes"], dtype=torch.float64).reshape(-1, 4)
        scores = torch.tensor(found["scores"], dtype=torch.float64)
        is_ring = torch.tensor(found["labels"], dtype=torch.long) == ring
        rings = gt_boxes[gt_labels == ring]
        dots = gt_boxes[(gt_labels != ring) & (_sides(gt_boxes) < DOT_PX)]
        best = _best_iou(rings, boxes[is_ring & (scores >= SCORE_FOUND)])
        dotted = (torch.cdist(_centres(rings), _centres(dots)) < NEAR_CENTRE_PX).any(dim=1)
        for index in torch.nonzero(_sides(rings) > LARGE_PX).flatten().tolist():
            best_iou["dotted" if dotted[index] else "plain"].append(best[index].item())
        ring_boxes, ring_scores = boxes[is_ring], scores[is_ring]
        matches = box_iou(rings, ring_boxes) >= MATCH_IOU
        for row in matches[_is_medium(rings)]:
            matching = ring_scores[row]
            medium_ring_scores.append(matching.max().item() if matching.numel() else 0.0)
        on_no_ring = _is_medium(ring_boxes) & ~matches.any(dim=0)
        false_medium_scores += ring_scores[on_no_ring].tolist()
        unmatched = _centres(ring_boxes[on_no_ring & (ring_scores >= SCORE_FALSE_POSITIVE)])
        false_positives += unmatched.shape[0]
        within = (unmatched[:, None] >= rings[None, :, :2]) & (
            unmatched[:, None] <= rings[None, :, 2:]
        )
        inside += int(within.all(dim=2).any(dim=1).sum())
    result = {}
    for kind, values in best_iou.items():
        result[f"{kind}_rings"] = len(values)
        result[f"{kind}_found"] = (
            sum(v >= MATCH_IOU for v in values) / len(values) if values else math.nan
        )
        result[f"{kind}_mean_iou"] = sum(values) / len(values) if values else math.nan
    result["medium_ring_false_positives"] = false_positives
    result["of_them_inside_a_ring"] = inside
    result["medium_ring_scores"] = medium_ring_scores
    result["medium_ring_outranked_by"] = [
        sum(other > score for other in false_medium_scores) for score in medium_ring_scores
    ]
    return result


def record_figures(result: dict[str, float | list]) -> list[dict]:
    """The counts and fractions `measure` found, for the record (no targets: a diagnostic)."""
    figures = []
    for kind, label in (("dotted", "with a small object near the centre"), ("plain", "without")):
        found, mean_iou = result[f"{kind}_found"], result[f"{kind}_mean_iou"]
        figures += [
            harness.figure(
                f"{kind}.rings", f"large rings {label}", result[f"{kind}_rings"], "count"
            ),
            harness.figure(
                f"{kind}.found",
                f"large rings {label}: share found",
                None if math.isnan(found) else found,
                "fraction",
            ),
            harness.figure(
                f"{kind}.mean_iou",
                f"large rings {label}: mean best IoU",
                None if math.isnan(mean_iou) else mean_iou,
                "IoU",
            ),
        ]
    figures += [
        harness.figure(
            "medium_false_rings",
            f"medium-sized ring detections on no ring (score >= {SCORE_FALSE_POSITIVE})",
            result["medium_ring_false_positives"],
            "count",
        ),
        harness.figure(
            "medium_false_rings_inside",
            "of them inside a ring's box",
            result["of_them_inside_a_ring"],
            "count",
        ),
        harness.figure("medium_rings", "medium rings", len(result["medium_ring_scores"]), "count"),
    ]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("predictions", help="an eval --predictions file of the multi-scale preset")
    harness.add_record_options(parser)
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
    scores = ", ".join(f"{score:.3f}" for score in result["medium_ring_scores"])
    outranked = ", ".join(str(count) for count in result["medium_ring_outranked_by"])
    print(
        f"medium rings: {len(result['medium_ring_scores'])}, their best ring detection at IoU "
        f">= 0.5 scored {scores or '-'}; medium-sized ring detections on no ring scoring higher: "
        f"{outranked or '-'}"
    )
    harness.write_record(
        args,
        harness.record(
            "nested_rings", record_figures(result), settings={"predictions": args.predictions}
        ),
    )


if __name__ == "__main__":
    main()
