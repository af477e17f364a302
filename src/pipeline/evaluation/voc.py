"""AP@.5 as the VOC devkit computes it: detections matched by the VOC rules
(`matching.match_voc`), all-point interpolated AP per class (VOC2010 and later; VOC2007: 11
recall points), the mean over the classes with objects; with its intervals over images from the
same resamples as every other figure."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from pipeline.evaluation.intervals import interval_of, resampled_class_ap
from pipeline.evaluation.matching import pool
from pipeline.evaluation.records import Record
from pipeline.evaluation.weighted_ap import ClassMatches, class_mean, weighted_class_ap

# the VOC2007 devkit's recall points, np.arange(0, 1.1, 0.1) as it writes them (0.30000000000000004)
VOC2007_RECALL_POINTS = np.arange(0.0, 1.1, 0.1)


def class_matches(
    gts: Iterable[Record], dets: Iterable[Record], num_classes: int, iou_threshold: float
) -> tuple[list[ClassMatches], int]:
    """Each class's detections ranked by descending score (stable, as the devkit sorts) with
    their VOC flags, detections on difficult objects left out; and the number of images."""
    pooled = pool(gts, dets, num_classes, iou_threshold, "voc")
    classes = []
    for label in range(num_classes):
        mine = np.flatnonzero(pooled.labels == label)
        order = mine[np.argsort(-pooled.scores[mine], kind="mergesort")]
        classes.append(
            ClassMatches(pooled.image_index[order], pooled.is_tp[order], pooled.gt_by_class[label])
        )
    return classes, len(pooled.image_ids)


def voc_ap(
    gts: Iterable[Record],
    dets: Iterable[Record],
    num_classes: int,
    iou_threshold: float = 0.5,
    intervals: bool = False,
    eleven_points: bool = False,
) -> dict[str, Any]:
    """`ap50` (the mean over classes with objects; 0 without any) and `per_class` AP (None for
    a class without objects), with their intervals over images where asked (else None);
    `eleven_points`: VOC2007's interpolation."""
    classes, images = class_matches(gts, dets, num_classes, iou_threshold)
    points = VOC2007_RECALL_POINTS if eleven_points else None
    ones = np.ones((1, images), dtype=np.int64)
    per_class = weighted_class_ap(classes, ones, points)[:, 0] if classes else np.zeros(0)
    mean = class_mean(per_class[:, None])[0] if per_class.size else np.nan
    samples = resampled_class_ap(classes, images, points) if intervals and images else None
    return {
        "ap50": float(mean) if np.isfinite(mean) else 0.0,
        "ap50_interval": interval_of(class_mean(samples), images, mean)
        if samples is not None
        else None,
        "per_class": [
            {
                "ap50": float(value) if np.isfinite(value) else None,
                "ap50_interval": interval_of(samples[label], images, value)
                if samples is not None
                else None,
            }
            for label, value in enumerate(per_class)
        ],
    }
