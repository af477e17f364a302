"""Images and boxes as tensors at the model's input size, with seeded augmentation.

Any image mode (grayscale, RGBA, palette) becomes RGB; any size is letterboxed (or
stretched) to a square input with `torchvision.transforms.v2`, boxes transformed with it.
Augmentation draws from an RNG seeded by (seed, epoch, index), never from global state,
so a resumed run sees exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as TF

from pipeline.data.sources import ImageRecord, SplitAnnotations
from pipeline.errors import DataError

log = logging.getLogger("pipeline")
PAD_VALUE = 114
RESIZE_MODES = ("letterbox", "stretch")


@dataclass(frozen=True)
class Augment:
    """Label-preserving training augmentation (config `data.augment`)."""

    hflip: float = 0.5
    vflip: float = 0.0
    transpose: float = 0.0
    channel_shuffle: float = 0.0
    min_box_size: float = 2.0

    @property
    def enabled(self) -> bool:
        return any((self.hflip, self.vflip, self.transpose, self.channel_shuffle))


def read_image(path: os.PathLike | str) -> torch.Tensor:
    """RGB uint8 [3,H,W]; a missing, truncated or unreadable file raises DataError naming it."""
    try:
        with Image.open(path) as img:
            img.load()
            rgb = img.convert("RGB")
    except FileNotFoundError as error:
        raise DataError(f"Image file {path} does not exist.") from error
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise DataError(
            f"Image file {path} is truncated, corrupt or not an image: {error}."
        ) from error
    return torch.from_numpy(np.asarray(rgb).copy()).permute(2, 0, 1).contiguous()


@dataclass(frozen=True)
class Geometry:
    """How an image of (height, width) maps onto the square input: resized, then padded."""

    resized: tuple[int, int]  # (height, width) after resizing
    left: int
    top: int

    @classmethod
    def of(cls, height: int, width: int, size: int, mode: str) -> Geometry:
        if mode == "stretch":
            return cls((size, size), 0, 0)
        scale = size / max(height, width)
        resized = (max(1, round(height * scale)), max(1, round(width * scale)))
        return cls(resized, (size - resized[1]) // 2, (size - resized[0]) // 2)

    def padding(self, size: int) -> list[int]:
        """[left, top, right, bottom] as torchvision's pad takes it."""
        return [
            self.left,
            self.top,
            size - self.resized[1] - self.left,
            size - self.resized[0] - self.top,
        ]

    def to_original(self, boxes: np.ndarray, height: int, width: int) -> np.ndarray:
        """Input-frame xyxy boxes back in the original image's pixels."""
        scale = np.array([width / self.resized[1], height / self.resized[0]] * 2, np.float32)
        shift = np.array([self.left, self.top] * 2, np.float32)
        return (np.asarray(boxes, np.float32).reshape(-1, 4) - shift) * scale


def fit_to_input(
    image: torch.Tensor, boxes: np.ndarray, size: int, mode: str = "letterbox"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Resize to a `size` square (keeping the aspect ratio and padding, or stretching), boxes alike."""
    height, width = image.shape[-2:]
    img = tv_tensors.Image(image)
    bbs = tv_tensors.BoundingBoxes(
        torch.as_tensor(boxes, dtype=torch.float32).reshape(-1, 4),
        format="XYXY",
        canvas_size=(height, width),
    )
    if (height, width) != (size, size):
        geometry = Geometry.of(height, width, size, mode)
        img = TF.resize(img, list(geometry.resized), antialias=True)
        bbs = TF.resize(bbs, list(geometry.resized))
        if any(geometry.padding(size)):
            img = TF.pad(img, geometry.padding(size), fill=PAD_VALUE)
            bbs = TF.pad(bbs, geometry.padding(size))
    return img.as_subclass(torch.Tensor), bbs.as_subclass(torch.Tensor)


def augment_sample(
    image: torch.Tensor,
    boxes: torch.Tensor,
    labels: torch.Tensor,
    augment: Augment,
    rng: np.random.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flips, transposition and channel shuffles on a square image; boxes follow the image."""
    size = image.shape[-1]
    img = tv_tensors.Image(image)
    bbs = tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(size, size))
    if rng.random() < augment.hflip:
        img, bbs = TF.horizontal_flip(img), TF.horizontal_flip(bbs)
    if rng.random() < augment.vflip:
        img, bbs = TF.vertical_flip(img), TF.vertical_flip(bbs)
    image, boxes = img.as_subclass(torch.Tensor), bbs.as_subclass(torch.Tensor)
    if rng.random() < augment.transpose:  # with the flips, all eight symmetries of the square
        image, boxes = image.transpose(-1, -2), boxes[:, [1, 0, 3, 2]]
    if rng.random() < augment.channel_shuffle:
        image = image[torch.from_numpy(rng.permutation(3))]
    return image.contiguous(), boxes, labels


class DetectionDataset(Dataset):
    """Samples are (image uint8 [3,S,S], target dict); index with (epoch, i) to seed augmentation."""

    def __init__(
        self,
        split: SplitAnnotations,
        image_size: int,
        resize: str = "letterbox",
        augment: Augment | None = None,
        cache: bool = True,
        seed: int = 0,
    ) -> None:
        if resize not in RESIZE_MODES:
            raise DataError(f"data.resize={resize!r} is not one of {', '.join(RESIZE_MODES)}.")
        self.records: list[ImageRecord] = split.records
        self.class_names = split.class_names
        self.image_size = image_size
        self.resize = resize
        self.augment = augment if augment is not None and augment.enabled else None
        self.seed = seed
        self._cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        if cache:
            self._cache = [self._load(i) for i in range(len(self.records))]

    def __len__(self) -> int:
        return len(self.records)

    def to_original(self, index: int, boxes: np.ndarray) -> np.ndarray:
        """Map input-frame boxes of sample `index` back to its image's own pixels."""
        record = self.records[index]
        geometry = Geometry.of(record.height, record.width, self.image_size, self.resize)
        return geometry.to_original(boxes, record.height, record.width)

    def _load(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        record = self.records[index]
        image = read_image(record.path)
        if tuple(image.shape[-2:]) != (record.height, record.width):
            scale_x, scale_y = image.shape[-1] / record.width, image.shape[-2] / record.height
            boxes = record.boxes * np.array([scale_x, scale_y, scale_x, scale_y], np.float32)
        else:
            boxes = record.boxes
        return fit_to_input(image, boxes, self.image_size, self.resize)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, dict[str, Any]]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        image, boxes = self._cache[index] if self._cache is not None else self._load(index)
        labels = torch.from_numpy(self.records[index].labels)
        if self.augment is not None:
            rng = np.random.default_rng([self.seed, epoch, index])
            image, boxes, labels = augment_sample(image, boxes, labels, self.augment, rng)
            keep = ((boxes[:, 2:] - boxes[:, :2]) >= self.augment.min_box_size).all(dim=1)
            boxes, labels = boxes[keep], labels[keep]
        return image, {"boxes": boxes, "labels": labels, "image_id": self.records[index].image_id}


class EpochSampler(Sampler):
    """Yields (epoch, index): a permutation seeded by (seed, epoch), which also seeds augmentation.

    Passing the epoch with each index (instead of setting it on the data set) keeps it
    correct inside persistent DataLoader workers.
    """

    def __init__(self, size: int, shuffle: bool, seed: int) -> None:
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[tuple[int, int]]:
        order = (
            np.random.default_rng([self.seed, self.epoch]).permutation(self.size)
            if self.shuffle
            else range(self.size)
        )
        return iter((self.epoch, int(i)) for i in order)


def collate(
    batch: list[tuple[torch.Tensor, dict[str, Any]]],
) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """Stack images; keep targets as a list, since images hold different numbers of boxes."""
    images, targets = zip(*batch, strict=True)
    return torch.stack(images), list(targets)


def default_num_workers(cached: bool) -> int:
    """Cached samples are cheap to produce: worker processes would only steal cores from compute."""
    if cached:
        return 0
    return max(0, min(4, (os.cpu_count() or 1) - 1))


def make_loader(
    dataset: DetectionDataset,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int,
    num_workers: int,
    pin_memory: bool,
    drop_last: bool,
) -> DataLoader:
    if drop_last and len(dataset) < batch_size:
        drop_last = False
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=EpochSampler(len(dataset), shuffle, seed),
        num_workers=num_workers,
        collate_fn=collate,
        pin_memory=pin_memory,
        drop_last=drop_last,
        persistent_workers=num_workers > 0,
    )


def loader_for(split: SplitAnnotations, config: dict[str, Any], *, train: bool,
               pin_memory: bool) -> DataLoader:  # fmt: skip
    """The DataLoader a config asks for: training (augmented, shuffled) or evaluation."""
    data = config["data"]
    augment = Augment(**data["augment"]) if train else None
    dataset = DetectionDataset(
        split, data["image_size"], data["resize"], augment, data["cache"], config["seed"]
    )
    workers = data["num_workers"]
    if workers == "auto":
        workers = default_num_workers(data["cache"])
    batch_size = config["train"]["batch_size"] if train else config["eval"]["batch_size"]
    return make_loader(dataset, batch_size, shuffle=train, seed=config["seed"], num_workers=workers,
                       pin_memory=pin_memory, drop_last=train)  # fmt: skip
