"""A trained model on images without annotations: batched, each image's detections in its own
pixels, an unreadable image reported and skipped.

Images are decoded and fitted to the model's input exactly as evaluation decodes them
(`read_image` turns them upright by their EXIF orientation, `fit_image` letterboxes them),
and the boxes are mapped back with the same geometry, so the detections of an image are the
ones evaluation's predictions file holds for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch.utils.data import DataLoader, Dataset

from pipeline.data.dataset import read_image
from pipeline.data.geometry import Geometry, fit_image, has_area
from pipeline.device import DeviceLike, autocast
from pipeline.errors import DataError
from pipeline.models.inference import for_inference

log = logging.getLogger("pipeline")
FORMAT = "pipeline.predict/1"  # schemas/predict.schema.yaml
PROGRESS_INTERVAL_S = 10.0
# distinct, readable on photographs; class i takes colour i modulo their number
BOX_COLOURS = ("#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4", "#f032e6")


@dataclass(frozen=True)
class Detections:
    """One image's detections at or above the score threshold, xyxy in its own pixels."""

    index: int  # position among the images predicted on
    path: Path
    width: int
    height: int
    boxes: np.ndarray
    scores: np.ndarray
    labels: np.ndarray
    image: torch.Tensor | None = None  # the upright image, uint8 [3,H,W], when asked for


@dataclass(frozen=True)
class Unreadable:
    index: int
    path: Path
    reason: str


@dataclass(frozen=True)
class _Sample:
    index: int
    fitted: torch.Tensor | None  # the model's input; None where the file could not be read
    original: torch.Tensor | None
    height: int
    width: int
    error: str | None


class _Images(Dataset):
    """Decodes in the loader's workers: a photograph's decoding costs more than its forward pass."""

    def __init__(self, paths: Sequence[Path], image_size: int, resize: str, keep: bool) -> None:
        self.paths, self.image_size, self.resize, self.keep = list(paths), image_size, resize, keep

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> _Sample:
        try:
            image = read_image(self.paths[index])
        except DataError as error:
            return _Sample(index, None, None, 0, 0, str(error))
        height, width = image.shape[-2:]
        fitted = fit_image(image, self.image_size, self.resize)
        return _Sample(index, fitted, image if self.keep else None, height, width, None)


def _as_list(batch: list[_Sample]) -> list[_Sample]:
    return batch


class Progress:
    """A log line every PROGRESS_INTERVAL_S seconds: how far, how fast, how long still."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self.started = self.last = time.perf_counter()

    def advance(self, count: int) -> None:
        self.done += count
        now = time.perf_counter()
        if now - self.last < PROGRESS_INTERVAL_S or self.done >= self.total:
            return
        self.last = now
        rate = self.done / (now - self.started)
        log.info(
            "predicted %d of %d images (%.0f%%), %.1f images/s, about %.0f s left",
            self.done,
            self.total,
            100 * self.done / self.total,
            rate,
            (self.total - self.done) / rate,
        )


def predict(
    model: torch.nn.Module,
    paths: Sequence[Path],
    device: DeviceLike,
    precision: str,
    *,
    image_size: int,
    resize: str,
    score_threshold: float,
    batch_size: int,
    max_detections: int,
    workers: int = 0,
    keep_images: bool = False,
    flip_test: bool = False,
) -> Iterator[Detections | Unreadable]:
    """Each image's detections (or why it could not be read), in the order of `paths`;
    `flip_test` (eval.flip_test) decodes as evaluation does with it. `model` runs in its
    inference form (`for_inference`), as in evaluation, so predictions match its detections."""
    loader = DataLoader(
        _Images(paths, image_size, resize, keep_images),
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=_as_list,
    )
    device = torch.device(device)
    progress = Progress(len(paths))
    model = for_inference(model)
    with torch.inference_mode():
        for batch in loader:
            readable = [sample for sample in batch if sample.fitted is not None]
            found: dict[int, dict[str, torch.Tensor]] = {}
            if readable:
                images = torch.stack([sample.fitted for sample in readable]).to(device)
                with autocast(device, precision):
                    outputs = model(images, flip_test=flip_test)
                decoded = model.decode(
                    outputs, max_detections=max_detections, min_score=score_threshold
                )
                found = {sample.index: d for sample, d in zip(readable, decoded, strict=True)}
            for sample in batch:
                if sample.error is not None:
                    yield Unreadable(sample.index, Path(paths[sample.index]), sample.error)
                else:
                    yield _in_image_pixels(sample, paths, found[sample.index], image_size, resize)
            progress.advance(len(batch))


def _in_image_pixels(
    sample: _Sample,
    paths: Sequence[Path],
    found: dict[str, torch.Tensor],
    image_size: int,
    resize: str,
) -> Detections:
    geometry = Geometry.of(sample.height, sample.width, image_size, resize)
    boxes = geometry.to_original(
        found["boxes"].detach().to("cpu", torch.float32).numpy(), sample.height, sample.width
    )
    kept = has_area(boxes)  # as evaluation keeps them
    return Detections(
        sample.index,
        Path(paths[sample.index]),
        sample.width,
        sample.height,
        boxes[kept],
        found["scores"].detach().to("cpu", torch.float32).numpy()[kept],
        found["labels"].detach().cpu().numpy()[kept],
        sample.original,
    )


def coco_results(detections: Sequence[Detections]) -> list[dict[str, Any]]:
    """The COCO results format (what pycocotools' loadRes reads): image ids are 1-based
    positions among the images, category ids 1-based class indices."""
    results = []
    for image in detections:
        for box, score, label in zip(image.boxes, image.scores, image.labels, strict=True):
            x1, y1, x2, y2 = (float(value) for value in box)
            results.append(
                {
                    "image_id": image.index + 1,
                    "category_id": int(label) + 1,
                    "bbox": [round(x1, 2), round(y1, 2), round(x2 - x1, 2), round(y2 - y1, 2)],
                    "score": round(float(score), 4),
                }
            )
    return results


def drawn(image: Detections, class_names: Sequence[str]) -> Image.Image:
    """The upright image with each detection's box, class and score drawn on it."""
    if image.image is None:
        raise ValueError("drawn() needs the image: predict with keep_images=True.")
    picture = Image.fromarray(image.image.permute(1, 2, 0).numpy())
    pen = ImageDraw.Draw(picture)
    width = max(1, round(max(image.width, image.height) / 400))
    for box, score, label in zip(image.boxes, image.scores, image.labels, strict=True):
        colour = BOX_COLOURS[int(label) % len(BOX_COLOURS)]
        x1, y1, x2, y2 = (float(value) for value in box)
        pen.rectangle((x1, y1, x2, y2), outline=colour, width=width)
        text = f"{class_names[int(label)]} {score:.2f}"
        left, top, right, bottom = pen.textbbox((x1, y1), text)
        lift = bottom - top + 2
        pen.rectangle((left, top - lift, right + 2, bottom - lift), fill=colour)
        pen.text((x1 + 1, y1 - lift), text, fill="white")
    return picture
