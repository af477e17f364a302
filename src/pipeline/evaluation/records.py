"""Per-image records of ground truth and detections as every matcher reads them: their
arrays checked to agree, indexed by image id, and laid end to end (one conversion for all
images, where one per image would cost more than the matching).

A record is a mapping with `image_id`, `boxes` (xyxy pixels, [N, 4]), `labels` (0-based class
indices) and, for detections, `scores`; ground truth may add `ignore_boxes` and
`ignore_labels` (COCO crowd regions, VOC difficult objects)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.errors import DataError

Record = Mapping[str, Any]


def as_boxes(value: Any) -> np.ndarray:
    # float64 so that IoU at the threshold is decided as pycocotools (double precision) decides it
    return np.asarray(value, dtype=np.float64).reshape(-1, 4)


def as_vector(value: Any, dtype: type) -> np.ndarray:
    return np.asarray(value, dtype=dtype).reshape(-1)


def image_detections(boxes: Any, scores: Any, labels: Any) -> tuple[np.ndarray, ...]:
    """One image's detections as the matcher reads them, checked to agree in length."""
    found = as_boxes(boxes), as_vector(scores, np.float64), as_vector(labels, np.int64)
    if not len(found[0]) == len(found[1]) == len(found[2]):
        raise ValueError(
            f"Detections disagree in length: {len(found[0])} boxes, {len(found[1])} scores, "
            f"{len(found[2])} labels."
        )
    return found


def image_objects(boxes: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    """One image's ground truth as the matcher reads it, checked to agree in length."""
    truth = as_boxes(boxes), as_vector(labels, np.int64)
    if len(truth[0]) != len(truth[1]):
        raise ValueError(
            f"Ground truth disagrees in length: {len(truth[0])} boxes, {len(truth[1])} labels."
        )
    return truth


@dataclass(frozen=True)
class Images:
    """Boxes of many images end to end, each tagged with its image's position (ascending)."""

    boxes: np.ndarray  # float64 [N, 4]
    scores: np.ndarray | None  # float64 [N]; None for ground truth
    labels: np.ndarray  # int64 [N]
    image: np.ndarray  # int64 [N]

    def of_image(self, position: int) -> slice:
        """Where one image's boxes are."""
        return slice(*np.searchsorted(self.image, [position, position + 1]).tolist())


def index_by_image(records: Iterable[Record], what: str) -> dict[int, Record]:
    indexed: dict[int, Record] = {}
    for record in records:
        image_id = int(record["image_id"])
        if image_id in indexed:
            raise DataError(
                f"The {what} list holds image_id {image_id} twice; image ids must be unique."
            )
        indexed[image_id] = record
    return indexed


def by_image(gts: Iterable[Record], dets: Iterable[Record]) -> tuple[dict[int, Record], ...]:
    """Ground truth and detections by image id; detections of an image without ground truth
    are refused, since nothing could score them."""
    truth = index_by_image(gts, "ground truth")
    found = index_by_image(dets, "detections")
    unknown = sorted(set(found) - set(truth))
    if unknown:
        raise ValueError(f"Detections for image ids without ground truth: {unknown[:10]}.")
    return truth, found


def check_labels(labels: np.ndarray, num_classes: int, image_id: int, what: str) -> None:
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        bad = labels[(labels < 0) | (labels >= num_classes)][0]
        message = (
            f"{what} of image {image_id} has label {int(bad)}, outside [0, {num_classes}): "
            "labels are 0-based class indices, so check the class list against the data."
        )
        raise DataError(message) if what == "Ground truth" else ValueError(message)


def check_joined_labels(
    labels: np.ndarray, owner: np.ndarray, ids: Sequence[Any], num_classes: int, what: str
) -> None:
    """`check_labels` over many images' labels laid end to end in one pass (`owner`: each
    label's image, as a position in `ids`, ascending): the first image with a label out of
    range is refused as `check_labels` words it."""
    wrong = (labels < 0) | (labels >= num_classes)
    if wrong.any():
        at = int(owner[np.flatnonzero(wrong)[0]])
        check_labels(labels[owner == at], num_classes, ids[at], what)


NOTHING_FOUND = {"boxes": np.zeros((0, 4)), "scores": np.zeros(0), "labels": np.zeros(0)}


def laid_end_to_end(records: Sequence[Record], scores: bool) -> Images:
    """The records' boxes, [scores,] and labels laid end to end, tagged by image position: one
    conversion for all images (one per image cost more than the matching), each image's
    fields checked to agree in length, a disagreement refused as `image_detections` or `image_objects`
    refuse it for the first image that has one."""
    boxes = [np.asarray(record["boxes"]) for record in records]
    labels = [np.asarray(record["labels"]) for record in records]
    found = [np.asarray(record["scores"]) for record in records] if scores else labels
    counts, box_sizes, score_sizes = (
        np.fromiter((part.size for part in parts), np.int64, len(parts))
        for parts in (labels, boxes, found)
    )
    wrong = np.flatnonzero((box_sizes != 4 * counts) | (score_sizes != counts))
    if wrong.size:  # the first such image's own check raises, naming what disagrees
        at = int(wrong[0])
        if scores:
            image_detections(boxes[at], found[at], labels[at])
        image_objects(boxes[at], labels[at])
    return Images(
        end_to_end(boxes, 4).astype(np.float64),
        end_to_end(found).astype(np.float64) if scores else None,
        end_to_end(labels).astype(np.int64),
        np.repeat(np.arange(len(records)), counts),
    )


def end_to_end(parts: Sequence[np.ndarray], width: int | None = None) -> np.ndarray:
    """The parts' rows of `width` values (None: single values) one after the other, an empty
    float64 part closing them (what no parts lay out). Parts that have that shape already (a
    record's arrays) are joined as they are: reshaping each of thousands of small parts costs
    more than joining them; any other part is reshaped first, as all of them then are."""
    shape = (-1,) if width is None else (-1, width)
    closing = np.zeros((0, *shape[1:]))
    try:
        return np.concatenate([*parts, closing])
    except ValueError:  # some part of another shape (a flat list of corners, a scalar)
        return np.concatenate([*(part.reshape(shape) for part in parts), closing])
