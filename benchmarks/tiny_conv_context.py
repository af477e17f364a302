"""tiny_conv's training step with stride-32 context against the stride-16 tiny_conv it replaced.

Side A is the default tiny_conv (`model.max_stride: 32`: a stride-32 stage whose features
the top-down neck brings back to the stride-4 head); side B is the same config with
`model.max_stride=16`, which builds the earlier architecture (the same modules and parameter
names; both sides have the per-class box channels, so the ratio is what the context costs).
Each side is a Trainer built from the default config plus the overrides given, and runs the
Trainer's own step, `trainer.step` (forward, loss, backward, clipping,
AdamW, scheduler), on the same K batches taken once from the training DataLoader and held in memory.
Blocks of N steps alternate ABBA for R rounds. Target: median A / median B <= 1.3.
"""

from __future__ import annotations

import harness
from config_ab import Comparison
from config_ab import main as compare

NAME = "tiny_conv_context"
TARGET = 1.3
COMPARISON = Comparison(
    name=NAME,
    doc=__doc__,
    sides={
        "A": ("max_stride 32 (default)", ["model.name=tiny_conv", "model.max_stride=32"]),
        "B": ("max_stride 16 (before)", ["model.name=tiny_conv", "model.max_stride=16"]),
    },
    target=TARGET,
    ratio_words="median step with stride-32 context / median step of the stride-16 tiny_conv",
    settings_help="config overrides for both sides, e.g. data.image_size=256 (the data set's size)",
)


def main(argv: list[str]) -> int:
    return compare(COMPARISON, argv)


if __name__ == "__main__":
    harness.run(main)
