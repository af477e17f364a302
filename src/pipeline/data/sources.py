"""The records every split is read into (ImageRecord, SplitAnnotations) and what the COCO and
Pascal VOC readers (coco_source, voc_source) share: attaching the boxes they found, the report
of what was dropped, the check of the image files; so both formats are held to the same rules.

Real data sets carry defects: zero-size boxes, boxes outside the image, unknown category
ids. Degenerate boxes are dropped and counted in one warning; anything that would make
the result silently wrong (an unknown category, a missing file, an image that is not the
size its annotation says, malformed annotations) raises a DataError that names the file.

COCO crowd regions (`iscrowd=1`) and VOC `difficult` objects are kept as ignore regions:
the evaluator counts a detection on one neither as a true nor as a false positive, as
the COCO and VOC protocols do.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path, PureWindowsPath

import numpy as np
from PIL import Image, UnidentifiedImageError

from pipeline.data.orientation import oriented_size
from pipeline.errors import DataError

log = logging.getLogger("pipeline")
# what to do with an image beyond Pillow's limit against decompression bombs
TOO_LARGE = "Downscale or tile such images: the model sees them at data.image_size in any case."
# a published set's broken image has no copy to regenerate it from: what the user can do
NOT_AN_IMAGE = (
    "Replace such a file with a complete copy, or leave it out of the data set: remove it and its "
    "annotation (its XML file, or its entries under 'images' and 'annotations' of the COCO file)."
)


def written_base_name(file_name: str) -> str:
    """The base name of an image's path as an annotation tool wrote it, where the image is
    looked up when the path itself names no file: tools write the path on the annotator's
    machine (Windows' or another's), or a URL such as Label Studio's `?d=folder/a.png`.
    PureWindowsPath splits at both / and \\."""
    return PureWindowsPath(file_name).name


def upright_hull(box: list[float], degrees: float) -> list[float]:
    """x1, y1, x2, y2 of the upright box that encloses `box` (x1, y1, x2, y2) turned by `degrees`
    about its centre: the box a detector of upright boxes is to find (a turn either way gives
    the same one). CVAT keeps a turned box as drawn before it turned, with the angle beside it,
    in its COCO and its Pascal VOC exports alike."""
    cos, sin = abs(math.cos(math.radians(degrees))), abs(math.sin(math.radians(degrees)))
    width, height = box[2] - box[0], box[3] - box[1]
    half_w, half_h = (width * cos + height * sin) / 2, (width * sin + height * cos) / 2
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    return [cx - half_w, cy - half_h, cx + half_w, cy + half_h]


def report_turned(source: Path | str, turned: int, angle_in: str) -> None:
    """The one info line of a split's boxes turned in the annotation tool (`upright_hull`),
    for COCO's and Pascal VOC's readers alike; `angle_in` says where the file keeps the angle."""
    if turned:
        log.info(
            "%s: %d box(es) turned in the annotation tool (the angle in %s, as CVAT exports "
            "them): each taken as the upright box that encloses it",
            source,
            turned,
            angle_in,
        )


def no_boxes() -> np.ndarray:
    return np.zeros((0, 4), np.float32)


def no_labels() -> np.ndarray:
    return np.zeros((0,), np.int64)


@dataclass
class ImageRecord:
    """One image, its objects and its ignore regions in the image's own pixels (xyxy).

    `width` and `height` are the image as decoded with its EXIF orientation applied; the
    loaders check that the annotation says the same, or read them from the file where the
    annotation gives none (`read_missing_sizes`).
    """

    image_id: int
    path: Path
    width: int
    height: int
    boxes: np.ndarray = field(default_factory=no_boxes)
    labels: np.ndarray = field(default_factory=no_labels)
    ignore_boxes: np.ndarray = field(default_factory=no_boxes)
    ignore_labels: np.ndarray = field(default_factory=no_labels)
    # both sides read from the file's header (`read_missing_sizes`): the image check has no
    # annotated size to hold against the file, which that read found and opened already
    sized_from_header: bool = False


@dataclass
class SplitAnnotations:
    records: list[ImageRecord]
    class_names: list[str]
    source: Path
    dropped_boxes: int = 0
    # boxes with a coordinate that is NaN or infinite (dropped too, with their own reason)
    nonfinite_boxes: int = 0
    # objects of categories the file defines but `class_names` leaves out (data.classes)
    other_class_objects: int = 0
    # while the image files are not yet checked (loaded with check_images=False): where to look
    # for a missing one, as the check's error says; see check_image_files
    unchecked_images: str | None = None
    # a split carved out of the file at `source` by a fraction (pipeline.data.holdout): which
    # part of it, by which key, for logs and errors
    carving: str | None = None

    @property
    def origin(self) -> str:
        """Where the split comes from, for logs and errors: its file, and for a carved split
        which part of it (the file alone would name the training split too)."""
        return f"{self.source} ({self.carving})" if self.carving else str(self.source)

    @property
    def negatives(self) -> int:
        """Images without objects: valid negatives, kept (they teach the model to stay quiet)."""
        return sum(1 for record in self.records if len(record.boxes) == 0)

    @property
    def used_classes(self) -> list[str]:
        """Class names that at least one object (not an ignore region) has, in label order."""
        # one array of every label: per label, a numpy scalar made into an int costs far more
        labels = np.concatenate([no_labels(), *(record.labels for record in self.records)])
        used = set(np.unique(labels).tolist())
        return [name for label, name in enumerate(self.class_names) if label in used]


def with_classes(split: SplitAnnotations, class_names: list[str]) -> SplitAnnotations:
    """The split relabelled to `class_names` (a subset of its classes, in any order).

    Objects and ignore regions of the classes left out are removed and counted in
    `other_class_objects`.
    """
    unknown = sorted(set(class_names) - set(split.class_names))
    if unknown:
        raise ValueError(f"{split.source} has no classes {unknown} (it has {split.class_names}).")
    new_label = np.array(
        [class_names.index(name) if name in class_names else -1 for name in split.class_names],
        np.int64,
    )
    records, removed = [], 0
    for record in split.records:
        labels, ignore_labels = new_label[record.labels], new_label[record.ignore_labels]
        removed += int((labels < 0).sum())
        records.append(
            replace(
                record,
                boxes=record.boxes[labels >= 0],
                labels=labels[labels >= 0],
                ignore_boxes=record.ignore_boxes[ignore_labels >= 0],
                ignore_labels=ignore_labels[ignore_labels >= 0],
            )
        )
    return SplitAnnotations(
        records,
        list(class_names),
        split.source,
        dropped_boxes=split.dropped_boxes,
        nonfinite_boxes=split.nonfinite_boxes,
        other_class_objects=split.other_class_objects + removed,
        unchecked_images=split.unchecked_images,
        carving=split.carving,
    )


def report_counts(split: SplitAnnotations) -> None:
    """The split's one line of what it holds, logged by whoever fixes its classes last
    (pipeline.data.load_splits drops the classes no object of either split has), so that its
    class count is the one training and metrics use."""
    objects = sum(len(record.boxes) for record in split.records)
    ignored = sum(len(record.ignore_boxes) for record in split.records)
    log.info(
        "%s: %d images, %d objects of %d classes, %d image(s) without objects (kept as negatives)%s",
        split.origin,
        len(split.records),
        objects,
        len(split.class_names),
        split.negatives,
        f", {ignored} ignore region(s) (crowd or difficult)" if ignored else "",
    )


def report_split(split: SplitAnnotations) -> None:
    """What a reader dropped or left out, in the log: no box leaves a split unsaid."""
    if split.other_class_objects:
        log.info(
            "%s: left out %d object(s) of classes outside data.classes %s",
            split.origin,
            split.other_class_objects,
            split.class_names,
        )
    if split.nonfinite_boxes:
        log.warning(
            "%s: dropped %d box(es) with a coordinate that is not a finite number (NaN or "
            "infinity)",
            split.origin,
            split.nonfinite_boxes,
        )
    if split.dropped_boxes:
        log.warning(
            "%s: dropped %d degenerate box(es) (zero or negative width or height, or entirely "
            "outside the image)",
            split.origin,
            split.dropped_boxes,
        )


def _listing(items: list[str]) -> str:
    more = f" and {len(items) - 3} more" if len(items) > 3 else ""
    return ", ".join(items[:3]) + more


def _header_sizes(records: list[ImageRecord], source: Path, where: str) -> list[tuple[int, int]]:
    """Each record's image size as the pipeline decodes it (orientation applied), from the
    file's header alone; a file that is missing, no image or too large to decode is an error
    naming every such file of the split at once, not the first of them on each new try."""
    sizes, missing, unreadable, too_large = [], [], [], []
    for record in records:
        try:
            with Image.open(record.path) as image:
                sizes.append(oriented_size(image))
        except FileNotFoundError:
            missing.append(str(record.path))
        except Image.DecompressionBombError as error:
            too_large.append(f"{record.path} ({error})")
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
            unreadable.append(f"{record.path} ({error})")
    if missing:
        raise DataError(
            f"{source} refers to image file(s) that do not exist: {_listing(missing)}. "
            f"Check {where}, or regenerate the data set."
        )
    if unreadable:
        raise DataError(
            f"{source} refers to file(s) that are not images: {_listing(unreadable)}. "
            + NOT_AN_IMAGE
        )
    if too_large:
        raise DataError(
            f"{source} refers to image(s) too large to decode: {_listing(too_large)}. {TOO_LARGE}"
        )
    return sizes


def _check_images(records: list[ImageRecord], source: Path, where: str) -> None:
    """Every image exists, is an image, and is the size its annotation says (headers only).

    A size mismatch is an error, never rescaled: the commonest cause is an EXIF orientation
    that the annotation tool did not apply, and rescaling would put every box in the wrong
    place without a word.
    """
    mismatched = [
        f"{record.path} is annotated {record.width}x{record.height} but is "
        f"{width}x{height} (width x height, EXIF orientation applied)"
        for record, (width, height) in zip(
            records, _header_sizes(records, source, where), strict=True
        )
        if (width, height) != (record.width, record.height)
    ]
    if mismatched:
        raise DataError(
            f"{source}: {len(mismatched)} image(s) are not the size their annotation says: "
            f"{_listing(mismatched)}. Boxes are never rescaled to fit. If width and height are "
            "swapped, the annotation tool ignored the photo's EXIF orientation: re-export the "
            "annotations from the upright images; otherwise correct width and height."
        )


def read_missing_sizes(split: SplitAnnotations, where: str) -> None:
    """The width or height that an annotation leaves out (0: not given), read from the image
    file's header, as exports and annotation tools that could not read an image write none or
    0; needed before boxes are clipped to their image (`attach_objects`). A size that is
    given stays as written, for the image check to hold against the file; an image with
    neither side given is not read again by that check. `where`: where to look for a missing
    file, as the image check's error says."""
    unsized = [record for record in split.records if not (record.width and record.height)]
    if not unsized:
        return
    for record, (width, height) in zip(
        unsized, _header_sizes(unsized, split.source, where), strict=True
    ):
        record.sized_from_header = not (record.width or record.height)
        record.width, record.height = record.width or width, record.height or height
    log.info(
        "%s: %d image(s) have no width/height in the annotations: read from the image files",
        split.source,
        len(unsized),
    )


def check_image_files(split: SplitAnnotations) -> None:
    """The check of every image file's header that loading left to later (`check_images=False`),
    with the errors loading would have raised; nothing where it ran already.

    For whoever decodes the split: decoding every image up front checks more than the headers
    (a decoded image of the wrong size is an error too), so a cache that decoded them all needs
    this only to word an error as loading would have; a split decoded one image at a time as
    training goes needs it before the first image, as loading did.
    """
    if split.unchecked_images is not None:
        unread = [record for record in split.records if not record.sized_from_header]
        _check_images(unread, split.source, split.unchecked_images)
        split.unchecked_images = None


# a box as a reader finds it: its record's index in `split.records`, whether it is an ignore
# region, its label, its xyxy corners
FoundBox = tuple[int, bool, int, list[float]]


def _refuse_fractions(split: SplitAnnotations, boxes: np.ndarray) -> None:
    """Boxes all under a pixel wide and high are fractions of the image (YOLO's coordinates,
    converted without the image's size), not pixels: the objects would be dots in a corner,
    and every figure 0 without a word."""
    sides = boxes[:, 2:] - boxes[:, :2]
    if len(boxes) and (sides < 1).all():
        raise DataError(
            f"{split.source}: every box is less than a pixel wide and high (the largest "
            f"{float(sides[:, 0].max()):.3g} x {float(sides[:, 1].max()):.3g}): these look like "
            "fractions of the image, as YOLO gives them, where boxes here are in the image's "
            "pixels. Multiply them by each image's width and height."
        )


def attach_objects(split: SplitAnnotations, found: list[FoundBox]) -> None:
    """Every record's objects and ignore regions, each in the order read, clipped to its image,
    without the degenerate ones and the ones with a coordinate that is no finite number (an
    infinite width would otherwise clip to the edge), both counted. `found`: each box as a
    reader found it (`FoundBox`). All records in one go: per image, numpy's per-call cost
    would be most of it."""
    records = split.records
    owners = np.array([box[0] for box in found], np.int64)
    ignored = np.array([box[1] for box in found], bool)
    labels = np.array([box[2] for box in found], np.int64)
    boxes = np.array([box[3] for box in found], np.float32).reshape(-1, 4)
    sizes = np.array([(r.width, r.height) for r in records], np.float32).reshape(-1, 2)
    finite = np.isfinite(boxes).all(axis=1)
    boxes = boxes.clip(0, np.tile(sizes, 2)[owners])  # x to the width, y to the height
    keep = finite & (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
    split.dropped_boxes += int((~keep & finite).sum())
    split.nonfinite_boxes += int((~finite).sum())
    _refuse_fractions(split, boxes[keep])
    # kept boxes grouped by record, objects before ignore regions, each group in reading order
    group = (2 * owners + ignored)[keep]
    order = np.argsort(group, kind="stable")
    boxes, labels = boxes[keep][order], labels[keep][order]
    bounds = [0, *np.cumsum(np.bincount(group, minlength=2 * len(records))).tolist()]
    for index, record in enumerate(records):
        start, middle, end = bounds[2 * index : 2 * index + 3]
        record.boxes, record.labels = boxes[start:middle], labels[start:middle]
        record.ignore_boxes, record.ignore_labels = boxes[middle:end], labels[middle:end]
