"""The built-in synthetic detection set: shapes on noisy, textured backgrounds, in COCO format.

Each sample has its own RNG seeded by (seed, split, index), so the same settings give
byte-identical files, and any sample can be regenerated on its own. Boxes are taken from
the rendered pixels (what is visible after occlusion and truncation), never from the
shape's nominal size.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, fields
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from pipeline import atomic
from pipeline.cpus import usable_cpu_count
from pipeline.errors import ConfigError

log = logging.getLogger("pipeline")

SHAPES = ("circle", "square", "triangle", "cross", "ring", "star")
_SPLIT_CODES = {"train": 1, "val": 2, "test": 3}
_SUPERSAMPLE = 4
_ALPHA_VISIBLE = 0.5
# stored, not compressed (zlib level 0): the pixel noise leaves compression little to find,
# so a compressed file is only a little smaller, and inflating it is most of what decoding an
# image costs every loader that reads the set. The files are plain PNG either way.
_PNG_OPTIONS = {"compress_level": 0}


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


@dataclass
class _Placed:
    """One object's own visible pixels (coverage >= _ALPHA_VISIBLE), in the window around it."""

    label: int
    top: int
    left: int
    mask: np.ndarray  # the window's pixels; none outside it is covered
    area: int  # pixels of mask

    def overlap(self, other: _Placed) -> tuple[tuple[slice, slice], tuple[slice, slice]] | None:
        """Where the two windows meet, as slices into this window and into the other's."""
        top, left = max(self.top, other.top), max(self.left, other.left)
        bottom = min(self.top + self.mask.shape[0], other.top + other.mask.shape[0])
        right = min(self.left + self.mask.shape[1], other.left + other.mask.shape[1])
        if bottom <= top or right <= left:
            return None
        mine = (
            slice(top - self.top, bottom - self.top),
            slice(left - self.left, right - self.left),
        )
        theirs = (
            slice(top - other.top, bottom - other.top),
            slice(left - other.left, right - other.left),
        )
        return mine, theirs


@functools.cache
def _grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel rows and columns as float32 (read-only): the same for every background of a size."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    yy.flags.writeable = xx.flags.writeable = False
    return yy, xx


def _background(rng: np.random.Generator, spec: SyntheticSpec) -> tuple[np.ndarray, np.ndarray]:
    """A textured background (low-frequency blotches plus stripes) and its base colour."""
    size = spec.image_size
    base = rng.uniform(30, 225, size=3)
    coarse = rng.normal(0.0, 1.0, size=(rng.integers(3, 9), rng.integers(3, 9), 3))
    blotches = np.asarray(
        Image.fromarray(
            ((coarse - coarse.min()) / (np.ptp(coarse) + 1e-6) * 255).astype(np.uint8)
        ).resize((size, size), Image.BICUBIC),
        dtype=np.float32,
    )
    blotches = (blotches / 255.0 - 0.5) * 2.0 * spec.texture_strength
    yy, xx = _grid(size)
    angle = rng.uniform(0, math.pi)
    period = rng.uniform(6, 24)
    stripes = np.sin((xx * math.cos(angle) + yy * math.sin(angle)) * 2 * math.pi / period)
    stripes = stripes[..., None] * rng.uniform(0, 0.5) * spec.texture_strength
    # base + blotches + stripes, in float64 as numpy's broadcasting would give it, without its
    # slow mixed-type broadcast: (base + blotches) + stripes, rounded the same way
    image = blotches.astype(np.float64)
    image += base
    image += stripes
    return image, base


def _shape_polygon(
    shape: str, radius: float, angle: float, rng: np.random.Generator
) -> list[tuple[float, float]]:
    def rotate(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
        c, s = math.cos(angle), math.sin(angle)
        return [(x * c - y * s, x * s + y * c) for x, y in points]

    if shape == "square":
        r = radius / math.sqrt(2)
        return rotate([(-r, -r), (r, -r), (r, r), (-r, r)])
    if shape == "triangle":
        return rotate(
            [
                (radius * math.cos(a), radius * math.sin(a))
                for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)
            ]
        )
    if shape == "cross":
        arm = radius * rng.uniform(0.3, 0.42)
        r = radius / math.sqrt(1 + (arm / radius) ** 2)
        outline = [
            (-arm, -r),
            (arm, -r),
            (arm, -arm),
            (r, -arm),
            (r, arm),
            (arm, arm),
            (arm, r),
            (-arm, r),
            (-arm, arm),
            (-r, arm),
            (-r, -arm),
            (-arm, -arm),
        ]
        return rotate(outline)
    if shape == "star":
        inner = radius * 0.45
        return rotate(
            [
                (
                    (radius if k % 2 == 0 else inner) * math.cos(k * math.pi / 5 - math.pi / 2),
                    (radius if k % 2 == 0 else inner) * math.sin(k * math.pi / 5 - math.pi / 2),
                )
                for k in range(10)
            ]
        )
    raise ValueError(shape)


def _render_alpha(
    shape: str, size: float, center: tuple[float, float], image_size: int, rng: np.random.Generator
) -> tuple[int, int, np.ndarray]:
    """Anti-aliased coverage of one shape (supersampled, then averaged) in the window around it:
    (top, left, coverage of the window); the coverage is 0 everywhere outside the window.

    The window is drawn at `_SUPERSAMPLE` times the resolution.
    """
    ss = _SUPERSAMPLE
    x0 = max(math.floor(center[0] - size / 2) - 1, 0)
    y0 = max(math.floor(center[1] - size / 2) - 1, 0)
    x1 = min(math.ceil(center[0] + size / 2) + 1, image_size)
    y1 = min(math.ceil(center[1] + size / 2) + 1, image_size)
    angle = rng.uniform(0, 2 * math.pi)
    if x1 <= x0 or y1 <= y0:
        return 0, 0, np.zeros((0, 0), dtype=np.float32)
    canvas = Image.new("L", ((x1 - x0) * ss, (y1 - y0) * ss), 0)
    draw = ImageDraw.Draw(canvas)
    cx, cy = (center[0] - x0) * ss, (center[1] - y0) * ss
    radius = size * ss / 2
    if shape in ("circle", "ring"):
        draw.ellipse((cx - radius, cy - radius, cx + radius, cy + radius), fill=255)
        if shape == "ring":
            hole = radius * rng.uniform(0.45, 0.6)
            draw.ellipse((cx - hole, cy - hole, cx + hole, cy + hole), fill=0)
    else:
        points = [(cx + x, cy + y) for x, y in _shape_polygon(shape, radius, angle, rng)]
        draw.polygon(points, fill=255)
    window = canvas.resize((x1 - x0, y1 - y0), Image.BOX)
    return y0, x0, np.asarray(window, dtype=np.float32) / 255.0


def _box_of(mask: np.ndarray, top: int, left: int) -> tuple[float, float, float, float] | None:
    """The tight box of a window's mask, in image pixels."""
    rows, columns = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    if len(columns) == 0:
        return None
    return (
        float(left + columns[0]),
        float(top + rows[0]),
        float(left + columns[-1] + 1),
        float(top + rows[-1] + 1),
    )


def _iou(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _contrasting_colour(
    rng: np.random.Generator, base: np.ndarray, min_contrast: float
) -> np.ndarray:
    """A random colour (independent of class) far enough from the background to be visible."""
    for _ in range(100):
        colour = rng.uniform(0, 255, size=3)
        if np.linalg.norm(colour - base) >= min_contrast:
            return colour
    return 255.0 - base


def render_sample(
    spec: SyntheticSpec, split: str, index: int
) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """One image (HxWx3 uint8) and its objects: class index and tight box from visible pixels."""
    rng = np.random.default_rng([spec.seed, _SPLIT_CODES[split], index])
    size = spec.image_size
    image, base = _background(rng, spec)
    wanted = int(rng.integers(spec.min_objects, spec.max_objects + 1))
    placed: list[_Placed] = []
    nominal: list[tuple[float, float, float, float]] = []
    log_min, log_max = math.log(spec.min_object_size), math.log(spec.max_object_size)
    for _ in range(wanted):
        for _attempt in range(30):
            obj_size = math.exp(rng.uniform(log_min, log_max))
            # the centre may come this close to the border, so up to max_truncation is cut off
            margin = obj_size / 2 - spec.max_truncation * obj_size
            cx, cy = rng.uniform(margin, size - margin, size=2)
            box = (cx - obj_size / 2, cy - obj_size / 2, cx + obj_size / 2, cy + obj_size / 2)
            if any(_iou(box, other) > spec.max_overlap for other in nominal):
                continue
            # a class the size fits, drawn uniformly (without class_sizes: any class, so the
            # random stream, and the files, are the same as before class_sizes existed)
            eligible = spec.classes_of_size(obj_size)
            label = eligible[int(rng.integers(len(eligible)))]
            top, left, alpha = _render_alpha(spec.classes[label], obj_size, (cx, cy), size, rng)
            mask = alpha >= _ALPHA_VISIBLE
            new = _Placed(label, top, left, mask, int(np.count_nonzero(mask)))
            if new.area < 4:
                continue
            # earlier objects must stay mostly visible under this one
            if any(_visible_fraction(p, new) < spec.min_visible for p in placed):
                continue
            placed.append(new)
            nominal.append(box)
            colour = _contrasting_colour(rng, base, spec.min_contrast)
            # the blend of the whole image, image * (1 - alpha) + colour * alpha, where it
            # changes anything: outside the window alpha is 0 and the pixels stay as they are
            window = image[top : top + alpha.shape[0], left : left + alpha.shape[1]]
            window[...] = window * (1 - alpha[..., None]) + colour[None, None, :] * alpha[..., None]
            break
    # the same draws as rng.normal(0.0, noise_std): loc + scale * a standard normal
    noise = rng.standard_normal(size=image.shape)
    noise *= spec.noise_std
    noise += image
    pixels = np.clip(np.rint(noise, out=noise), 0, 255, out=noise).astype(np.uint8)

    objects = []
    for i, obj in enumerate(placed):
        visible = obj.mask.copy()
        for later in placed[i + 1 :]:
            meet = obj.overlap(later)
            if meet is not None:
                visible[meet[0]] &= ~later.mask[meet[1]]
        box = _box_of(visible, obj.top, obj.left)
        if box is not None:
            objects.append({"label": obj.label, "box": box})
    return pixels, objects


def _visible_fraction(earlier: _Placed, new: _Placed) -> float:
    """The share of `earlier`'s visible pixels that `new` leaves visible."""
    meet = earlier.overlap(new)
    hidden = 0 if meet is None else int(np.count_nonzero(earlier.mask[meet[0]] & new.mask[meet[1]]))
    return (earlier.area - hidden) / max(earlier.area, 1)


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
        lambda tmp: Image.fromarray(pixels).save(tmp, format="PNG", **_PNG_OPTIONS),
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
            (root / split).mkdir(parents=True, exist_ok=True)
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
