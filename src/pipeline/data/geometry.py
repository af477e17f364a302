"""Where an image lands in the model's square input: resized to fit (keeping its aspect ratio
and padded, or stretched), its boxes alike, and back. With `torchvision.transforms.v2`, so
that boxes move exactly as the pixels do. torchvision is imported where an image or its boxes
are resized (`_transforms`), not with this module: importing it imports torch's compiler
(torch._dynamo), seconds at every start of a command whose images are at input size already."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

PAD_VALUE = 114
RESIZE_MODES = ("letterbox", "stretch")


def _transforms():
    """torchvision's `tv_tensors` and `transforms.v2.functional`, imported at first use."""
    from torchvision import tv_tensors
    from torchvision.transforms.v2 import functional

    return tv_tensors, functional


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

    def region(self) -> list[float]:
        """The image's own area in the input frame, xyxy: what a detection is clipped to."""
        return [
            float(self.left),
            float(self.top),
            float(self.left + self.resized[1]),
            float(self.top + self.resized[0]),
        ]

    def padding(self, size: int) -> list[int]:
        """[left, top, right, bottom] as torchvision's pad takes it."""
        return [
            self.left,
            self.top,
            size - self.resized[1] - self.left,
            size - self.resized[0] - self.top,
        ]

    def to_original(self, boxes: np.ndarray, height: int, width: int) -> np.ndarray:
        """Input-frame xyxy boxes back in the original image's pixels, clipped to the image.

        A detection reaching into the letterbox padding would otherwise map outside the image.
        """
        scale = np.array([width / self.resized[1], height / self.resized[0]] * 2, np.float32)
        shift = np.array([self.left, self.top] * 2, np.float32)
        boxes = (np.asarray(boxes, np.float32).reshape(-1, 4) - shift) * scale
        return boxes.clip(0, np.array([width, height] * 2, np.float32))


def has_area(boxes: np.ndarray) -> np.ndarray:
    """Which xyxy boxes [N, 4] cover some area. A detection clipped to its image can be left
    with none: one centred in the letterbox padding, or beyond the image. Such a box is no
    detection of anything, only a false positive in AP's ranking and a line in the predictions:
    evaluation and prediction drop it, as detectors drop the boxes their clip leaves empty
    (torchvision's `remove_small_boxes` after `clip_boxes_to_image`)."""
    return (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])


def fit_image(image: torch.Tensor, size: int, mode: str = "letterbox") -> torch.Tensor:
    """The image resized to a `size` square, keeping its aspect ratio and padded (letterbox),
    or stretched."""
    height, width = image.shape[-2:]
    if (height, width) == (size, size):  # nothing to do: torchvision's wrappers cost more
        return image
    geometry = Geometry.of(height, width, size, mode)
    tv_tensors, functional = _transforms()
    img = functional.resize(tv_tensors.Image(image), list(geometry.resized), antialias=True)
    if any(geometry.padding(size)):
        img = functional.pad(img, geometry.padding(size), fill=PAD_VALUE)
    return img.as_subclass(torch.Tensor)


def fit_boxes(
    boxes: np.ndarray, height: int, width: int, size: int, mode: str = "letterbox"
) -> torch.Tensor:
    """Boxes moved as `fit_image` moves an image of (height, width): no pixels needed."""
    boxes = torch.as_tensor(boxes, dtype=torch.float32).reshape(-1, 4)
    if (height, width) == (size, size):
        return boxes
    tv_tensors, functional = _transforms()
    bbs = tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(height, width))
    geometry = Geometry.of(height, width, size, mode)
    bbs = functional.resize(bbs, list(geometry.resized))
    if any(geometry.padding(size)):
        bbs = functional.pad(bbs, geometry.padding(size))
    return bbs.as_subclass(torch.Tensor)
