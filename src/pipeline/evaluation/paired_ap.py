"""The paired AP@.5 change of two runs scored on the same images (a reduced precision against
its fp32 twin): each resample reweighs both runs' own pycocotools matches at the same images,
as `image_bootstrap.f1_change` does for F1."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from pipeline.evaluation.image_bootstrap import (
    PairedChange,
    bootstrap_weights,
    paired_change,
    reference_positions,
)
from pipeline.evaluation.weighted_ap import ClassMatches, class_mean, weighted_class_ap
from pipeline.stats import BOOTSTRAP_RESAMPLES, CONFIDENCE


def read_ap50_matches(
    matches: Mapping[str, Any],
) -> tuple[list[Any], list[int], list[ClassMatches]]:
    """(image ids, class labels, their matches, in label order) from an eval JSON's
    `metrics.ap50_matches`; ValueError where it is malformed."""
    image_ids = list(matches["image_ids"])
    found = sorted(matches["classes"], key=lambda row: int(row["label"]))
    labels = [int(row["label"]) for row in found]
    return image_ids, labels, [ClassMatches.from_document(row, len(image_ids)) for row in found]


def ap50_change(
    reference: Mapping[str, Any],
    candidate: Mapping[str, Any],
    *,
    tolerance: float,
    confidence: float = CONFIDENCE,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> PairedChange:
    """The AP@.5 change from `reference` to `candidate`, each an eval JSON's
    `metrics.ap50_matches`, resampling images in pairs as `image_bootstrap.f1_change` does: each
    resample reweighs both runs' own matches at the same images.

    ValueError where the two were not scored on the same images and classes.
    """
    ref_ids, ref_labels, ref = read_ap50_matches(reference)
    cand_ids, cand_labels, cand = read_ap50_matches(candidate)
    placed = reference_positions(ref_ids, cand_ids)
    if ref_labels != cand_labels:
        raise ValueError(
            f"the two evaluations scored different classes ({ref_labels}, {cand_labels})"
        )
    cand = [found.reordered(placed) for found in cand]

    def difference(weights: np.ndarray) -> np.ndarray:
        return class_mean(weighted_class_ap(cand, weights)) - class_mean(
            weighted_class_ap(ref, weights)
        )

    change = float(difference(np.ones((1, len(ref_ids)), dtype=np.int64))[0])
    changes = np.concatenate(
        [difference(weights) for weights in bootstrap_weights(len(ref_ids), resamples, seed)]
    )
    changes = changes[np.isfinite(changes)]
    if changes.size == 0:
        raise ValueError("the evaluations hold no objects to compare AP@.5 on")
    return paired_change(change, changes, len(ref_ids), tolerance, confidence)
