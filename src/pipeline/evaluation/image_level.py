"""Image-level multi-label F1: which classes an image holds, from the model's per-image scores."""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.evaluation.matching import count_figures, macro_figures


def image_level_f1(image_scores: Any, present: Any, threshold: float = 0.5) -> dict[str, Any]:
    """Multi-label "which classes are in this image" F1: a class is predicted when score >= threshold.

    Micro pools over all (image, class) pairs; macro averages over classes present in the
    ground truth or predicted in some image, the same rule as the detection macro. 0/0 is 0.
    """
    scores = np.asarray(image_scores, dtype=np.float64)
    truth = np.asarray(present, dtype=bool)
    if scores.ndim != 2 or scores.shape != truth.shape:
        raise ValueError(
            f"image_scores {scores.shape} and present {truth.shape} must both be [images, classes]."
        )
    predicted = scores >= threshold
    tp = (predicted & truth).sum(axis=0)
    fp = (predicted & ~truth).sum(axis=0)
    fn = (~predicted & truth).sum(axis=0)
    per_class = [count_figures(tp[c], fp[c], fn[c]) for c in range(scores.shape[1])]
    micro = count_figures(tp.sum(), fp.sum(), fn.sum())
    macro = macro_figures(per_class, truth.any(axis=0) | predicted.any(axis=0))
    return {
        "threshold": float(threshold),
        "num_images": int(scores.shape[0]),
        "f1": micro["f1"],
        "precision": micro["precision"],
        "recall": micro["recall"],
        "f1_macro": macro["f1"],
        "micro": micro,
        "macro": macro,
    }
