"""Whether detection scores track box quality: two variants' real-set runs side by side.

Each side is a list of `real_sets.py measure` records (several seeds of one variant). From each
record's own figures: AP@.5, AP@[.5:.95], F1 at the saved operating point and that threshold;
from the test predictions its run folder kept (`work`/predictions.json): F1 at fixed score
thresholds (the matcher of pipeline.evaluation at IoU 0.5), and the rank correlation
(Spearman) between a true positive's score and its IoU with the object it matched, which is
what lets a score ranking raise AP@[.5:.95]. Prints every run and each side's means over its
runs, and records the means (no target: a comparison).

    python benchmarks/score_quality.py --set eggs \\
        --a benchmarks/records/real/eggs-fp32-15ep-iouscore-seed*-SHA.json \\
        --b benchmarks/records/real/eggs-fp32-15ep-uniform-seed*-7c43c07.json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import harness
import numpy as np

from pipeline.errors import DataError
from pipeline.evaluation.matching import matched_objects
from pipeline.evaluation.records import as_boxes

NAME = "score_quality"
FIXED_THRESHOLDS = (0.3, 0.4, 0.5)
IOU_THRESHOLD = 0.5
COLUMNS = (
    ("ap50", "AP@.5", "AP"),
    ("ap", "AP@[.5:.95]", "AP"),
    ("f1_op", "F1 at the operating point", "F1"),
    ("threshold", "operating point (score threshold)", "fraction"),
    *((f"f1_at_{t}", f"F1 at score >= {t}", "F1") for t in FIXED_THRESHOLDS),
    ("tp_rank_correlation", "Spearman of score and IoU over true positives", "ratio"),
)


def parse_args(argv: list[str]):
    parser = harness.parser(NAME, __doc__)
    parser.add_argument("--set", required=True, help="the set's name, for the record")
    parser.add_argument("--a", nargs="+", type=Path, required=True, help="side A's records")
    parser.add_argument("--b", nargs="+", type=Path, required=True, help="side B's records")
    parser.add_argument("--label-a", default="A", help="side A's name")
    parser.add_argument("--label-b", default="B", help="side B's name")
    return parser.parse_args(argv)


def _ranks(values: np.ndarray) -> np.ndarray:
    return np.argsort(np.argsort(values, kind="stable"), kind="stable").astype(np.float64)


def spearman(first: np.ndarray, second: np.ndarray) -> float | None:
    if len(first) < 3:
        return None
    return float(np.corrcoef(_ranks(first), _ranks(second))[0, 1])


def _iou(box: np.ndarray, other: np.ndarray) -> float:
    overlap = np.clip(np.minimum(box[2:], other[2:]) - np.maximum(box[:2], other[:2]), 0, None)
    inter = overlap[0] * overlap[1]
    union = np.prod(box[2:] - box[:2]) + np.prod(other[2:] - other[:2]) - inter
    return float(inter / union) if union > 0 else 0.0


def run_figures(record_path: Path) -> dict[str, Any]:
    record = json.loads(record_path.read_text(encoding="utf-8"))
    predictions_path = Path(record["work"]) / "predictions.json"
    if not predictions_path.is_file():
        raise DataError(
            f"{record_path}: its run folder's test predictions {predictions_path} are gone; "
            "rerun the measure with --work to keep them."
        )
    predictions = json.loads(predictions_path.read_text(encoding="utf-8"))
    scores, matched, ious, objects = [], [], [], 0
    for image in predictions["images"]:
        truth, found = image["ground_truth"], image["detections"]
        if truth.get("ignore_boxes"):
            raise DataError(f"{predictions_path}: ignore regions are not counted here")
        gt_boxes = as_boxes(truth["boxes"])
        objects += len(gt_boxes)
        match = matched_objects(
            found["boxes"],
            found["scores"],
            found["labels"],
            gt_boxes,
            truth["labels"],
            IOU_THRESHOLD,
        )
        boxes = as_boxes(found["boxes"])
        for box, score, index in zip(boxes, found["scores"], match, strict=True):
            scores.append(score)
            matched.append(index >= 0)
            ious.append(_iou(box, gt_boxes[index]) if index >= 0 else 0.0)
    scores, matched, ious = np.array(scores), np.array(matched, dtype=bool), np.array(ious)
    figures = record["figures"]
    row = {
        "record": str(record_path),
        "seed": record["settings"]["seed"],
        "ap50": figures["ap50"],
        "ap": figures["ap"],
        "f1_op": figures["at_operating_point"]["f1"],
        "threshold": figures["at_operating_point"]["threshold"],
    }
    for threshold in FIXED_THRESHOLDS:
        kept = scores >= threshold
        tp = int((kept & matched).sum())
        fp = int(kept.sum()) - tp
        row[f"f1_at_{threshold}"] = 2 * tp / max(2 * tp + fp + (objects - tp), 1)
    row["tp_rank_correlation"] = spearman(scores[matched], ious[matched])
    return row


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    sides = {
        args.label_a: [run_figures(path) for path in sorted(args.a)],
        args.label_b: [run_figures(path) for path in sorted(args.b)],
    }
    keys = [key for key, _, _ in COLUMNS]
    rows = [
        [label, run["seed"], *(run[k] for k in keys)]
        for label, runs in sides.items()
        for run in runs
    ]
    means = {
        label: {k: float(np.mean([run[k] for run in runs if run[k] is not None])) for k in keys}
        for label, runs in sides.items()
    }
    rows += [[f"{label} mean", len(sides[label]), *means[label].values()] for label in sides]
    print(
        f"{NAME}: {args.set}, test split, {len(sides[args.label_a])} and {len(sides[args.label_b])} runs"
    )
    print(harness.table(["side", "seed", *keys], rows))
    figures = [
        harness.figure(
            f"{side}.{key}", f"{label}, {title}, mean over runs", means[label][key], unit
        )
        for side, label in (("a", args.label_a), ("b", args.label_b))
        for key, title, unit in COLUMNS
    ]
    settings = {
        "set": args.set,
        "sides": {label: [run["record"] for run in runs] for label, runs in sides.items()},
        "iou_threshold": IOU_THRESHOLD,
        "fixed_thresholds": list(FIXED_THRESHOLDS),
    }
    harness.write_record(args, harness.record(NAME, figures, settings=settings))
    return harness.finish(
        args.out, {"benchmark": NAME, "settings": settings, "runs": sides}, True, False
    )


if __name__ == "__main__":
    harness.run(main)
