"""Read a detection data set's annotations (COCO JSON or Pascal VOC XML) into plain records.

Real data sets carry defects: zero-size boxes, boxes outside the image, unknown category
ids. Degenerate boxes are dropped and counted in one warning; anything that would make
the result silently wrong (an unknown category, a missing file, malformed annotations)
raises a DataError that names the file.
"""

from __future__ import annotations

import json
import logging
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.errors import DataError

log = logging.getLogger("pipeline")


@dataclass
class ImageRecord:
    """One image and its objects in the image's own pixel coordinates (xyxy)."""

    image_id: int
    path: Path
    width: int
    height: int
    boxes: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), np.float32))
    labels: np.ndarray = field(default_factory=lambda: np.zeros((0,), np.int64))


@dataclass
class SplitAnnotations:
    records: list[ImageRecord]
    class_names: list[str]
    source: Path
    dropped_boxes: int = 0

    @property
    def negatives(self) -> int:
        """Images without objects: valid negatives, kept (they teach the model to stay quiet)."""
        return sum(1 for record in self.records if len(record.boxes) == 0)


def _sanitize(boxes: np.ndarray, width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
    """Clip boxes to the image; report which keep a positive width and height."""
    clipped = boxes.copy()
    clipped[:, [0, 2]] = clipped[:, [0, 2]].clip(0, width)
    clipped[:, [1, 3]] = clipped[:, [1, 3]].clip(0, height)
    keep = (clipped[:, 2] > clipped[:, 0]) & (clipped[:, 3] > clipped[:, 1])
    return clipped, keep


def _report(split: SplitAnnotations) -> None:
    objects = sum(len(record.boxes) for record in split.records)
    log.info(
        "%s: %d images, %d objects of %d classes, %d image(s) without objects (kept as negatives)",
        split.source,
        len(split.records),
        objects,
        len(split.class_names),
        split.negatives,
    )
    if split.dropped_boxes:
        log.warning(
            "%s: dropped %d degenerate box(es) (zero or negative width or height, or entirely "
            "outside the image)",
            split.source,
            split.dropped_boxes,
        )


def _check_file_list(records: list[ImageRecord], source: Path) -> None:
    missing = [str(r.path) for r in records if not r.path.is_file()]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise DataError(
            f"{source} refers to image file(s) that do not exist: {', '.join(missing[:3])}{more}. "
            "Check data.root / data.images_dir, or regenerate the data set."
        )


def load_coco(
    annotation_file: str | Path, images_dir: str | Path, classes: list[str] | None = None
) -> SplitAnnotations:
    """Records from a COCO instances JSON; class order follows category ids unless `classes` is given."""
    source = Path(annotation_file)
    if not source.is_file():
        raise DataError(
            f"COCO annotation file {source} does not exist (config data.root / data.{{train,val}}_annotations)."
        )
    try:
        document = json.loads(source.read_text(encoding="utf-8"))
        categories = {int(c["id"]): str(c["name"]) for c in document["categories"]}
        images = document["images"]
        annotations = document.get("annotations", [])
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataError(f"COCO annotation file {source} is not valid JSON: {error}.") from error
    except (KeyError, TypeError, ValueError) as error:
        raise DataError(
            f"COCO annotation file {source} is malformed: missing or invalid {error} "
            "(expected 'images', 'categories' with id and name, and 'annotations')."
        ) from error
    if not images:
        raise DataError(f"COCO annotation file {source} lists no images: the split is empty.")
    names = [categories[key] for key in sorted(categories)]
    class_names = list(classes) if classes else names
    unknown_classes = sorted(set(class_names) - set(names))
    if unknown_classes:
        raise DataError(
            f"data.classes names {unknown_classes}, which {source} does not define (it has {names})."
        )
    label_of = {
        cid: class_names.index(name) for cid, name in categories.items() if name in class_names
    }

    try:
        records = {
            int(img["id"]): ImageRecord(
                int(img["id"]),
                Path(images_dir) / img["file_name"],
                int(img["width"]),
                int(img["height"]),
            )
            for img in images
        }
    except (KeyError, TypeError, ValueError) as error:
        raise DataError(
            f"COCO annotation file {source}: an image entry lacks id, file_name, width or height ({error})."
        ) from error
    per_image: dict[int, list[tuple[list[float], int]]] = {}
    for ann in annotations:
        try:
            image_id, category_id = int(ann["image_id"]), int(ann["category_id"])
            x, y, w, h = (float(v) for v in ann["bbox"])
        except (KeyError, TypeError, ValueError) as error:
            raise DataError(
                f"COCO annotation file {source}: annotation {ann.get('id', '?')} is malformed ({error})."
            ) from error
        if category_id not in categories:
            raise DataError(
                f"COCO annotation file {source}: annotation {ann.get('id', '?')} has category_id "
                f"{category_id}, which is not among the categories {sorted(categories)}."
            )
        if image_id not in records:
            raise DataError(
                f"COCO annotation file {source}: annotation {ann.get('id', '?')} refers to image_id {image_id}, which is not listed."
            )
        if ann.get("iscrowd", 0) or category_id not in label_of:
            continue
        per_image.setdefault(image_id, []).append(([x, y, x + w, y + h], label_of[category_id]))
    split = SplitAnnotations(list(records.values()), class_names, source)
    for record in split.records:
        objects = per_image.get(record.image_id, [])
        if not objects:
            continue  # images without annotations are valid negatives
        boxes = np.array([b for b, _ in objects], np.float32)
        labels = np.array([label for _, label in objects], np.int64)
        boxes, keep = _sanitize(boxes, record.width, record.height)
        split.dropped_boxes += int((~keep).sum())
        record.boxes, record.labels = boxes[keep], labels[keep]
    _report(split)
    _check_file_list(split.records, source)
    return split


def _voc_object(obj: ET.Element, xml_file: Path) -> tuple[str, list[float]]:
    try:
        name = obj.findtext("name", "").strip()
        box = obj.find("bndbox")
        coords = [float(box.findtext(tag)) for tag in ("xmin", "ymin", "xmax", "ymax")]
    except (AttributeError, TypeError, ValueError) as error:
        raise DataError(
            f"VOC annotation {xml_file}: an <object> lacks <name> or a numeric <bndbox> ({error})."
        ) from error
    if not name:
        raise DataError(f"VOC annotation {xml_file}: an <object> has an empty <name>.")
    # VOC pixel indices are 1-based and inclusive
    return name, [coords[0] - 1, coords[1] - 1, coords[2], coords[3]]


def load_voc(
    root: str | Path, split_name: str, classes: list[str] | None = None
) -> SplitAnnotations:
    """Records from Pascal VOC: ImageSets/Main/<split>.txt, Annotations/*.xml, JPEGImages/."""
    root = Path(root)
    listing = root / "ImageSets" / "Main" / f"{split_name}.txt"
    if not listing.is_file():
        raise DataError(
            f"VOC split file {listing} does not exist (config data.root and data.{{train,val}}_split)."
        )
    ids = [line.split()[0] for line in listing.read_text().splitlines() if line.strip()]
    if not ids:
        raise DataError(f"VOC split file {listing} lists no images: the split is empty.")
    parsed = []
    for image_name in ids:
        xml_file = root / "Annotations" / f"{image_name}.xml"
        try:
            tree = ET.parse(xml_file).getroot()
        except FileNotFoundError as error:
            raise DataError(
                f"VOC annotation file {xml_file} does not exist (listed in {listing})."
            ) from error
        except ET.ParseError as error:
            raise DataError(f"VOC annotation file {xml_file} is not valid XML: {error}.") from error
        try:
            width = int(float(tree.findtext("size/width")))
            height = int(float(tree.findtext("size/height")))
        except (TypeError, ValueError) as error:
            raise DataError(
                f"VOC annotation file {xml_file} lacks a numeric <size><width>/<height>."
            ) from error
        file_name = tree.findtext("filename") or f"{image_name}.jpg"
        objects = [
            _voc_object(obj, xml_file)
            for obj in tree.findall("object")
            if obj.findtext("difficult", "0").strip() != "1"
        ]
        parsed.append((image_name, root / "JPEGImages" / file_name, width, height, objects))
    names = sorted({name for *_, objects in parsed for name, _ in objects})
    class_names = list(classes) if classes else names
    if not class_names:
        raise DataError(
            f"VOC split {listing} has no objects and data.classes is not set: the class list is unknown."
        )
    split = SplitAnnotations([], class_names, listing)
    for image_id, (_, path, width, height, objects) in enumerate(parsed, start=1):
        unknown = sorted({name for name, _ in objects} - set(class_names))
        if unknown:
            raise DataError(
                f"VOC annotation for {path.name} names class(es) {unknown}, which are not in data.classes {class_names}."
            )
        record = ImageRecord(image_id, path, width, height)
        if objects:
            boxes, keep = _sanitize(np.array([b for _, b in objects], np.float32), width, height)
            labels = np.array([class_names.index(name) for name, _ in objects], np.int64)
            split.dropped_boxes += int((~keep).sum())
            record.boxes, record.labels = boxes[keep], labels[keep]
        split.records.append(record)
    _report(split)
    _check_file_list(split.records, listing)
    return split
