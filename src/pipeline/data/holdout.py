"""Validation and test splits carved out of the training annotations by fraction
(data.val_fraction, data.test_fraction), for data sets exported as one set with no split of
their own (a CVAT or Label Studio task, a LabelImg folder).

Where an image goes depends on its path relative to its images folder alone, so the same
images are held out on every machine, in every run and under every seed, and images added to
the set later leave the others where they were.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Any

from pipeline.data.sources import SplitAnnotations

# The carved splits with their keys, in the order their stretches of [0, 1) follow each other:
# test first, so that a change of data.val_fraction leaves the test split, on which runs are
# compared, as it was.
FRACTION_KEYS = {"test": "test_fraction", "val": "val_fraction"}
ROLES = {"test": "test", "val": "validation"}


def fractions(data: Mapping[str, Any]) -> dict[str, float]:
    """The splits the data settings carve out of the training split, each with its fraction,
    in carving order (none where both keys are null)."""
    return {split: data[key] for split, key in FRACTION_KEYS.items() if data.get(key) is not None}


def carve_key(path: Path, images_folder: Path) -> float:
    """Where an image falls in [0, 1): the SHA-256 of its path relative to its images folder
    ('/'-separated on every system), its first 8 bytes read as a fraction. Python's own `hash`
    of a string is salted per process, and would carve differently in every run."""
    relative = PurePath(os.path.relpath(path, images_folder)).as_posix()
    digest = hashlib.sha256(relative.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def carve(
    whole: SplitAnnotations, images_folder: Path, carved: Mapping[str, float]
) -> dict[str, SplitAnnotations]:
    """The training annotations cut in two or three: each split of `carved` ('val', 'test')
    takes the images whose carve key falls in its stretch of [0, 1), 'train' the rest.

    What loading dropped or left out is counted in the whole file's own log lines, not again
    for each part."""
    stretches, start = {}, 0.0
    for split in FRACTION_KEYS:
        if split in carved:
            stretches[split] = (start, start + carved[split])
            start += carved[split]
    records: dict[str, list] = {split: [] for split in [*stretches, "train"]}
    for record in whole.records:
        key = carve_key(record.path, images_folder)
        owner = next((s for s, (low, high) in stretches.items() if low <= key < high), "train")
        records[owner].append(record)
    by = " and ".join(f"data.{FRACTION_KEYS[split]}={carved[split]}" for split in stretches)
    carvings = {
        split: f"its {ROLES[split]} part, carved out by data.{FRACTION_KEYS[split]}={fraction}"
        for split, fraction in carved.items()
    }
    carvings["train"] = (
        f"its training part, what {by} {'leaves' if len(stretches) == 1 else 'leave'}"
    )
    return {
        split: SplitAnnotations(
            part,
            list(whole.class_names),
            whole.source,
            unchecked_images=whole.unchecked_images,
            carving=carvings[split],
        )
        for split, part in records.items()
    }
