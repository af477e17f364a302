"""What the IoU branch (`model.iou_score: true`) costs a training step.

Side A is a Trainer built with `model.iou_score=true` (the IoU branch's 1x1 conv on the box
head's hidden features, and its BCE term in the loss), side B the same config with the key off
(the default). Both run the Trainer's own step, `trainer.step` (forward, loss, backward,
clipping, AdamW, scheduler), on the same K batches taken once from the training DataLoader and
held in memory. Blocks of N steps alternate ABBA for R rounds. Target: median A / median B <=
1.05 (in a fixed time budget, a slower step is fewer epochs).
"""

from __future__ import annotations

import harness
from config_ab import Comparison
from config_ab import main as compare

NAME = "iou_score_step"
TARGET = 1.05
COMPARISON = Comparison(
    name=NAME,
    doc=__doc__,
    sides={
        "A": ("iou_score on", ["model.iou_score=true"]),
        "B": ("iou_score off (default)", ["model.iou_score=false"]),
    },
    target=TARGET,
    ratio_words="median step with the IoU branch / median step without it",
    settings_help="config overrides for both sides, e.g. train.batch_size=4 (the presets' batch)",
)


def main(argv: list[str]) -> int:
    return compare(COMPARISON, argv)


if __name__ == "__main__":
    harness.run(main)
