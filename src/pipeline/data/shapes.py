"""One sample of the synthetic set: shapes drawn anti-aliased on a noisy, textured background,
each object's box taken from its pixels left visible after occlusion and truncation.

Every sample has its own RNG seeded by (seed, split, index): any sample can be rendered on
its own, and the same spec always renders the same pixels. `pipeline.data.synthetic` holds
the spec and writes the set.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image, ImageDraw

if TYPE_CHECKING:
    from pipeline.data.synthetic import SyntheticSpec

SHAPES = ("circle", "square", "triangle", "cross", "ring", "star")
_SPLIT_CODES = {"train": 1, "val": 2, "test": 3}
_SUPERSAMPLE = 4
_ALPHA_VISIBLE = 0.5


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
