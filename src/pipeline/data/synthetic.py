"""The built-in synthetic detection set: shapes on noisy, textured backgrounds, in COCO format.
Here are its spec (config `data.synthetic`) and the writer of its splits; `pipeline.data.shapes`
renders each sample.

Each sample has its own RNG seeded by (seed, split, index), so the same settings give
byte-identical files, and any sample can be regenerated on its own. Boxes are taken from
the rendered pixels (what is visible after occlusion and truncation), never from the
shape's nominal size.
"""

from __future__ import annotations

import json
import logging
import struct
import zlib
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, fields
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np

from pipeline import atomic
from pipeline.cpus import usable_cpu_count
from pipeline.data.shapes import SHAPES, render_sample
from pipeline.errors import ConfigError

log = logging.getLogger("pipeline")

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_bytes(pixels: np.ndarray) -> bytes:
    """An RGB image [H, W, 3] uint8 as a PNG file whose rows are neither filtered nor compressed.

    Written here, not by Pillow, which filters every row of an RGB image with no way to ask it
    not to: undoing those filters is most of what decoding one costs, and every loader that
    reads the set pays it again. Stored, not compressed, as before: pixel noise leaves
    filters and compression little to find, so the file is no larger. It is an ordinary 8-bit
    RGB PNG (filter type None, zlib's stored blocks) that any reader decodes to the same
    pixels."""
    height, width, _ = pixels.shape
    rows = np.zeros((height, 1 + 3 * width), np.uint8)  # each row: its filter type (0), its pixels
    rows[:, 1:] = pixels.reshape(height, -1)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, not interlaced
    chunks = ((b"IHDR", header), (b"IDAT", zlib.compress(rows.tobytes(), 0)), (b"IEND", b""))
    return _PNG_SIGNATURE + b"".join(
        struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        for kind, data in chunks
    )


@dataclass(frozen=True)
class SyntheticSpec:
    """The knobs of the synthetic set; defaults are the documented difficulty (config `data.synthetic`)."""

    num_train: int = 1024
    num_val: int = 256
    num_test: int = 2048
    image_size: int = 128
    classes: tuple[str, ...] = ("circle", "square", "triangle", "cross")
    min_objects: int = 0
    max_objects: int = 6
    min_object_size: float = 8.0
    max_object_size: float = 48.0
    max_overlap: float = 0.3
    max_truncation: float = 0.35
    min_visible: float = 0.5
    min_contrast: float = 90.0
    noise_std: float = 12.0
    texture_strength: float = 40.0
    seed: int = 0
    # (class, smallest, largest) per class whose sizes differ from the global range, as in real
    # data where classes differ in size by an order of magnitude
    class_sizes: tuple[tuple[str, float, float], ...] = ()

    @classmethod
    def from_config(cls, settings: dict[str, Any]) -> SyntheticSpec:
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ConfigError(f"Unknown key(s) in data.synthetic: {', '.join(unknown)}.")
        values = dict(settings)
        if "classes" in values:
            values["classes"] = tuple(values["classes"])
        if "class_sizes" in values:
            values["class_sizes"] = _class_sizes(values["class_sizes"])
        spec = cls(**values)
        spec.check()
        return spec

    def check(self) -> None:
        bad = [name for name in self.classes if name not in SHAPES]
        if bad or not self.classes or len(set(self.classes)) != len(self.classes):
            raise ConfigError(
                f"data.synthetic.classes={list(self.classes)} is not valid: give distinct shapes "
                f"from {', '.join(SHAPES)}."
            )
        if not 0 <= self.min_objects <= self.max_objects:
            raise ConfigError(
                f"data.synthetic: min_objects={self.min_objects} and max_objects={self.max_objects} "
                "must satisfy 0 <= min_objects <= max_objects."
            )
        if not 2 <= self.min_object_size <= self.max_object_size <= self.image_size:
            raise ConfigError(
                "data.synthetic: object sizes must satisfy 2 <= min_object_size <= max_object_size "
                f"<= image_size, got {self.min_object_size}, {self.max_object_size}, {self.image_size}."
            )
        self._check_class_sizes()

    def _check_class_sizes(self) -> None:
        for name, smallest, largest in self.class_sizes:
            if name not in self.classes:
                raise ConfigError(
                    f"data.synthetic.class_sizes names {name!r}, which is not one of "
                    f"data.synthetic.classes ({', '.join(self.classes)})."
                )
            if not self.min_object_size <= smallest <= largest <= self.max_object_size:
                raise ConfigError(
                    f"data.synthetic.class_sizes.{name}=[{smallest}, {largest}] must be a range "
                    f"[smallest, largest] inside min_object_size={self.min_object_size} to "
                    f"max_object_size={self.max_object_size}."
                )
        # every size the generator draws must belong to some class, or it would be wasted
        ranges = sorted(self.size_range(c) for c in range(len(self.classes)))
        covered = self.min_object_size
        for smallest, largest in ranges:
            if smallest > covered:
                break
            covered = max(covered, largest)
        if covered < self.max_object_size:
            raise ConfigError(
                f"data.synthetic.class_sizes leaves object sizes from {covered} px upwards to no "
                f"class (up to max_object_size={self.max_object_size}): widen a class's range or "
                "lower max_object_size."
            )

    def size_range(self, label: int) -> tuple[float, float]:
        """The sizes class `label` is drawn at: its own range, else the global one."""
        name = self.classes[label]
        for named, smallest, largest in self.class_sizes:
            if named == name:
                return smallest, largest
        return self.min_object_size, self.max_object_size

    def classes_of_size(self, size: float) -> list[int]:
        """Labels whose size range holds `size` (every label when no class_sizes are set).

        The bounds get a relative slack of 1e-9: exp(log(x)) may miss x by a rounding error.
        """
        slack = 1e-9
        ranges = (self.size_range(label) for label in range(len(self.classes)))
        return [
            label
            for label, (smallest, largest) in enumerate(ranges)
            if smallest * (1 - slack) <= size <= largest * (1 + slack)
        ]

    def count(self, split: str) -> int:
        return {"train": self.num_train, "val": self.num_val, "test": self.num_test}[split]

    @property
    def splits(self) -> tuple[str, ...]:
        """The splits to generate: train, val and, unless num_test is 0, test."""
        return ("train", "val", "test") if self.num_test else ("train", "val")


def _class_sizes(value: Any) -> tuple[tuple[str, float, float], ...]:
    """{class: [smallest, largest]} (or null) from the config as the spec's tuple."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ConfigError(
            f"data.synthetic.class_sizes={value!r} must map class names to [smallest, largest] "
            "sizes in pixels, for example {circle: [4, 16]}."
        )
    result = []
    for name, pair in value.items():
        if not (isinstance(pair, list | tuple) and len(pair) == 2):
            raise ConfigError(
                f"data.synthetic.class_sizes.{name}={pair!r} must be [smallest, largest] in pixels."
            )
        result.append((str(name), float(pair[0]), float(pair[1])))
    return tuple(result)


def _coco_document(
    spec: SyntheticSpec, split: str, images: list[dict], annotations: list[dict]
) -> dict:
    return {
        "info": {
            "description": "pipeline synthetic shapes",
            "version": "1",
            "split": split,
            "generator": {"seed": spec.seed, "image_size": spec.image_size},
        },
        "images": images,
        "annotations": annotations,
        "categories": [
            {"id": i + 1, "name": name, "supercategory": "shape"}
            for i, name in enumerate(spec.classes)
        ],
    }


class _InProcess:
    """The executor interface without processes, for workers=1."""

    def __enter__(self) -> _InProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    @staticmethod
    def map(fn, *iterables, chunksize: int = 1):
        return map(fn, *iterables)


def _image_path(root: Path, split: str, index: int) -> Path:
    return root / f"{split}/{index:06d}.png"


def _write_sample(spec: SyntheticSpec, root: Path, split: str, index: int) -> list[dict[str, Any]]:
    """Render one sample and write its PNG; returns its objects (runs in a worker process).

    The PNG is flushed to disk with the rest of its split (`generate`), not on its own."""
    pixels, objects = render_sample(spec, split, index)
    atomic.write_with(
        _image_path(root, split, index),
        lambda tmp: tmp.write_bytes(png_bytes(pixels)),
        durable=False,
    )
    return objects


def generate(
    spec: SyntheticSpec,
    root: str | Path,
    workers: int | None = None,
    splits: Sequence[str] | None = None,
) -> dict[str, Path]:
    """Write `<root>/<split>/NNNNNN.png` and `<root>/instances_<split>.json` for each of
    `splits` (default: all the spec has).

    Samples are independent (each seeded by its split and index), so they are rendered in
    `workers` processes (default: every usable CPU) with identical results, and one split can
    be made alone: the same as it would be beside the others. The annotation file of a split is
    written last and atomically, once the split's images are flushed to disk (together, not
    one by one): its presence means the split is complete.
    """
    root = Path(root)
    splits = spec.splits if splits is None else tuple(splits)
    missing = [split for split in splits if split not in spec.splits]
    if missing:
        raise ConfigError(
            f"The synthetic set has no {missing[0]!r} split to generate: it has "
            f"{', '.join(spec.splits)} (a test split needs data.synthetic.num_test > 0)."
        )
    workers = workers or usable_cpu_count()
    written = {}
    with ProcessPoolExecutor(max_workers=workers) if workers > 1 else _InProcess() as pool:
        for split in splits:
            atomic.make_folder(root / split)
            count = spec.count(split)
            per_sample = pool.map(
                _write_sample, repeat(spec), repeat(root), repeat(split), range(count), chunksize=32
            )
            images, annotations = [], []
            for index, objects in enumerate(per_sample):
                image_id = index + 1
                images.append(
                    {
                        "id": image_id,
                        "file_name": f"{split}/{index:06d}.png",
                        "width": spec.image_size,
                        "height": spec.image_size,
                    }
                )
                for obj in objects:
                    x0, y0, x1, y1 = obj["box"]
                    annotations.append(
                        {
                            "id": len(annotations) + 1,
                            "image_id": image_id,
                            "category_id": obj["label"] + 1,
                            "bbox": [x0, y0, x1 - x0, y1 - y0],
                            "area": (x1 - x0) * (y1 - y0),
                            "iscrowd": 0,
                        }
                    )
            # the images on disk before the file that says the split is complete
            atomic.sync(_image_path(root, split, index) for index in range(count))
            path = root / f"instances_{split}.json"
            atomic.write_text(
                path,
                json.dumps(
                    _coco_document(spec, split, images, annotations), indent=1, sort_keys=True
                ),
            )
            written[split] = path
            log.info(
                "synthetic %s: %d images, %d objects -> %s",
                split,
                len(images),
                len(annotations),
                path,
            )
    return written
