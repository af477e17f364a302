"""Read a detection data set's annotations (COCO JSON or Pascal VOC XML) into plain records.

Real data sets carry defects: zero-size boxes, boxes outside the image, unknown category
ids. Degenerate boxes are dropped and counted in one warning; anything that would make
the result silently wrong (an unknown category, a missing file, an image that is not the
size its annotation says, malformed annotations) raises a DataError that names the file.

COCO crowd regions (`iscrowd=1`) and VOC `difficult` objects are kept as ignore regions:
the evaluator counts a detection on one neither as a true nor as a false positive, as
the COCO and VOC protocols do.
"""

from __future__ import annotations

import json
import logging
import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson
from PIL import Image, UnidentifiedImageError

from pipeline.data.orientation import oriented_size
from pipeline.errors import DataError

log = logging.getLogger("pipeline")


def _no_boxes() -> np.ndarray:
    return np.zeros((0, 4), np.float32)


def _no_labels() -> np.ndarray:
    return np.zeros((0,), np.int64)


# an image's boxes, labels, ignore regions and their labels before the annotations are read
_NO_OBJECTS = (_no_boxes(), _no_labels(), _no_boxes(), _no_labels())


@dataclass
class ImageRecord:
    """One image, its objects and its ignore regions in the image's own pixels (xyxy).

    `width` and `height` are the image as decoded with its EXIF orientation applied; the
    loaders check that the annotation says the same.
    """

    image_id: int
    path: Path
    width: int
    height: int
    boxes: np.ndarray = field(default_factory=_no_boxes)
    labels: np.ndarray = field(default_factory=_no_labels)
    ignore_boxes: np.ndarray = field(default_factory=_no_boxes)
    ignore_labels: np.ndarray = field(default_factory=_no_labels)


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

    @property
    def negatives(self) -> int:
        """Images without objects: valid negatives, kept (they teach the model to stay quiet)."""
        return sum(1 for record in self.records if len(record.boxes) == 0)

    @property
    def used_classes(self) -> list[str]:
        """Class names that at least one object (not an ignore region) has, in label order."""
        # one array of every label: per label, a numpy scalar made into an int costs far more
        labels = np.concatenate([_no_labels(), *(record.labels for record in self.records)])
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
            ImageRecord(
                record.image_id,
                record.path,
                record.width,
                record.height,
                record.boxes[labels >= 0],
                labels[labels >= 0],
                record.ignore_boxes[ignore_labels >= 0],
                ignore_labels[ignore_labels >= 0],
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
    )


def _report(split: SplitAnnotations) -> None:
    objects = sum(len(record.boxes) for record in split.records)
    ignored = sum(len(record.ignore_boxes) for record in split.records)
    log.info(
        "%s: %d images, %d objects of %d classes, %d image(s) without objects (kept as negatives)%s",
        split.source,
        len(split.records),
        objects,
        len(split.class_names),
        split.negatives,
        f", {ignored} ignore region(s) (crowd or difficult)" if ignored else "",
    )
    if split.other_class_objects:
        log.info(
            "%s: left out %d object(s) of classes outside data.classes %s",
            split.source,
            split.other_class_objects,
            split.class_names,
        )
    if split.nonfinite_boxes:
        log.warning(
            "%s: dropped %d box(es) with a coordinate that is not a finite number (NaN or "
            "infinity)",
            split.source,
            split.nonfinite_boxes,
        )
    if split.dropped_boxes:
        log.warning(
            "%s: dropped %d degenerate box(es) (zero or negative width or height, or entirely "
            "outside the image)",
            split.source,
            split.dropped_boxes,
        )


def _listing(items: list[str]) -> str:
    more = f" and {len(items) - 3} more" if len(items) > 3 else ""
    return ", ".join(items[:3]) + more


def _check_images(records: list[ImageRecord], source: Path, where: str) -> None:
    """Every image exists, is an image, and is the size its annotation says (headers only).

    A size mismatch is an error, never rescaled: the commonest cause is an EXIF orientation
    that the annotation tool did not apply, and rescaling would put every box in the wrong
    place without a word.
    """
    missing, unreadable, mismatched = [], [], []
    for record in records:
        try:
            with Image.open(record.path) as image:
                width, height = oriented_size(image)
        except FileNotFoundError:
            missing.append(str(record.path))
            continue
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
            unreadable.append(f"{record.path} ({error})")
            continue
        if (width, height) != (record.width, record.height):
            mismatched.append(
                f"{record.path} is annotated {record.width}x{record.height} but is "
                f"{width}x{height} (width x height, EXIF orientation applied)"
            )
    if missing:
        raise DataError(
            f"{source} refers to image file(s) that do not exist: {_listing(missing)}. "
            f"Check {where}, or regenerate the data set."
        )
    if unreadable:
        raise DataError(f"{source} refers to file(s) that are not images: {_listing(unreadable)}.")
    if mismatched:
        raise DataError(
            f"{source}: {len(mismatched)} image(s) are not the size their annotation says: "
            f"{_listing(mismatched)}. Boxes are never rescaled to fit. If width and height are "
            "swapped, the annotation tool ignored the photo's EXIF orientation: re-export the "
            "annotations from the upright images; otherwise correct width and height."
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
        _check_images(split.records, split.source, split.unchecked_images)
        split.unchecked_images = None


def _attach_all(split: SplitAnnotations, found: list[tuple[int, bool, int, list[float]]]) -> None:
    """Every record's objects and ignore regions, each in the order read, clipped to its image,
    without the degenerate ones and the ones with a coordinate that is no finite number (an
    infinite width would otherwise clip to the edge), both counted. `found`: each box as (its
    record's index in `split.records`, whether it is an ignore region, its label, its xyxy
    corners). All records in one go: per image, numpy's per-call cost would be most of it."""
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
    # kept boxes grouped by record, objects before ignore regions, each group in reading order
    group = (2 * owners + ignored)[keep]
    order = np.argsort(group, kind="stable")
    boxes, labels = boxes[keep][order], labels[keep][order]
    bounds = [0, *np.cumsum(np.bincount(group, minlength=2 * len(records))).tolist()]
    for index, record in enumerate(records):
        start, middle, end = bounds[2 * index : 2 * index + 3]
        record.boxes, record.labels = boxes[start:middle], labels[start:middle]
        record.ignore_boxes, record.ignore_labels = boxes[middle:end], labels[middle:end]


_JSON_TYPES = {
    dict: "an object",
    list: "a list",
    str: "a string",
    bool: "a boolean",
    int: "a number",
    float: "a number",
    type(None): "null",
}


def _coco_list(document: object, key: str, source: Path) -> list[dict]:
    """`document[key]` as a list of objects ('annotations' may be absent: no objects)."""
    if not isinstance(document, dict):
        raise DataError(
            f"COCO annotation file {source} is malformed: it holds {_JSON_TYPES[type(document)]}, "
            "not an object with 'images', 'categories' and 'annotations'."
        )
    if key not in document and key != "annotations":
        raise DataError(
            f"COCO annotation file {source} is malformed: it has no {key!r} "
            "(expected 'images', 'categories' with id and name, and 'annotations')."
        )
    entries = document.get(key, [])
    if not isinstance(entries, list):
        raise DataError(
            f"COCO annotation file {source} is malformed: {key!r} is "
            f"{_JSON_TYPES[type(entries)]}, not a list of objects."
        )
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise DataError(
                f"COCO annotation file {source} is malformed: entry {index} of {key!r} is "
                f"{_JSON_TYPES[type(entry)]} ({json.dumps(entry)[:40]}), not an object."
            )
    return entries


def _json_document(source: Path) -> object:
    """The file's JSON, parsed by orjson (a fraction of json's time on a large export); where
    orjson refuses the text (an error, or the NaN and Infinity that json reads), by json, whose
    reading and errors are the loaders' own."""
    try:
        return orjson.loads(source.read_bytes())
    except orjson.JSONDecodeError:
        return json.loads(source.read_text(encoding="utf-8"))


def _coco_images(images: list, images_dir: Path, source: Path) -> dict[int, ImageRecord]:
    """The image entries by id; an id listed twice would silently merge two images into one,
    and a file listed under two ids would count twice (in training and in every metric)."""
    records: dict[int, ImageRecord] = {}
    file_names: dict[int, str] = {}
    id_of_file: dict[str, int] = {}
    folder = str(images_dir)  # normalised as strings: turning each record's Path back costs more
    for img in images:
        try:
            record = ImageRecord(
                int(img["id"]),
                images_dir / img["file_name"],
                int(img["width"]),
                int(img["height"]),
                # placeholders, not arrays of its own: _attach_all gives every record its boxes
                *_NO_OBJECTS,
            )
        except (KeyError, TypeError, ValueError) as error:
            raise DataError(
                f"COCO annotation file {source}: an image entry lacks id, file_name, width or "
                f"height ({error})."
            ) from error
        if record.image_id in records:
            raise DataError(
                f"COCO annotation file {source} lists image id {record.image_id} twice: for "
                f"{file_names[record.image_id]} and for {img['file_name']}. Image ids must be "
                "unique: give each image its own id."
            )
        normal = os.path.normpath(os.path.join(folder, img["file_name"]))
        same_file = id_of_file.setdefault(normal, record.image_id)
        if same_file != record.image_id:
            raise DataError(
                f"COCO annotation file {source} lists the image file {img['file_name']} twice: "
                f"under image ids {same_file} and {record.image_id}. It would count twice; "
                "list each file once, with all its annotations under one id."
            )
        records[record.image_id] = record
        file_names[record.image_id] = str(img["file_name"])
    return records


def load_coco(
    annotation_file: str | Path,
    images_dir: str | Path,
    classes: list[str] | None = None,
    *,
    check_images: bool = True,
) -> SplitAnnotations:
    """Records from a COCO instances JSON; class order follows category ids unless `classes` is given.

    `file_name` entries are relative to `images_dir`. Crowd annotations become ignore regions.
    `check_images=False` leaves the check of the image files to whoever decodes them
    (`check_image_files`).
    """
    source = Path(annotation_file)
    if not source.is_file():
        raise DataError(
            f"COCO annotation file {source} does not exist (config data.root / "
            "data.{train,val,test}_annotations)."
        )
    try:
        document = _json_document(source)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataError(f"COCO annotation file {source} is not valid JSON: {error}.") from error
    images = _coco_list(document, "images", source)
    annotations = _coco_list(document, "annotations", source)
    try:
        categories = {
            int(c["id"]): str(c["name"]) for c in _coco_list(document, "categories", source)
        }
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

    records = _coco_images(images, Path(images_dir), source)
    position = {image_id: index for index, image_id in enumerate(records)}
    found: list[tuple[int, bool, int, list[float]]] = []
    other_class_objects = 0
    for ann in annotations:
        try:
            image_id, category_id = int(ann["image_id"]), int(ann["category_id"])
            x, y, w, h = map(float, ann["bbox"])
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
        crowd = bool(ann.get("iscrowd", 0))
        if category_id not in label_of:
            other_class_objects += not crowd
            continue
        found.append((position[image_id], crowd, label_of[category_id], [x, y, x + w, y + h]))
    split = SplitAnnotations(
        list(records.values()), class_names, source, other_class_objects=other_class_objects
    )
    _attach_all(split, found)
    _report(split)
    split.unchecked_images = (
        f"the images folder {images_dir} (data.images_dir or data.<split>_images_dir; "
        "by default the annotation file's folder)"
    )
    if check_images:
        check_image_files(split)
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
    root: str | Path,
    split_name: str,
    classes: list[str] | None = None,
    classes_from: str | None = None,
    *,
    check_images: bool = True,
) -> SplitAnnotations:
    """Records from Pascal VOC: ImageSets/Main/<split>.txt, Annotations/*.xml, JPEGImages/.

    Difficult objects become ignore regions; class names come from the other objects unless
    `classes` is given. Objects of classes outside `classes` are dropped and counted, as COCO's
    are, where the list is the user's (data.classes); where it comes from elsewhere,
    `classes_from` says where (the training split, a checkpoint), and such an object is an
    error naming its XML file: a class the model never trained on cannot be scored.
    `check_images=False` leaves the check of the image files to whoever decodes them
    (`check_image_files`).
    """
    root = Path(root)
    listing = root / "ImageSets" / "Main" / f"{split_name}.txt"
    if not listing.is_file():
        raise DataError(
            f"VOC split file {listing} does not exist (config data.root and data.{{train,val,test}}_split)."
        )
    ids = [line.split()[0] for line in listing.read_text().splitlines() if line.strip()]
    if not ids:
        raise DataError(f"VOC split file {listing} lists no images: the split is empty.")
    parsed = []
    xml_of_image: dict[Path, Path] = {}
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
        objects, difficult = [], []
        for obj in tree.findall("object"):
            is_difficult = obj.findtext("difficult", "0").strip() == "1"
            (difficult if is_difficult else objects).append(_voc_object(obj, xml_file))
        path = root / "JPEGImages" / file_name
        if path in xml_of_image:
            raise DataError(
                f"VOC split {listing} lists the image file {path} twice: through "
                f"{xml_of_image[path]} and {xml_file}. It would count twice; list each image once."
            )
        xml_of_image[path] = xml_file
        parsed.append((xml_file, path, width, height, objects, difficult))
    names = sorted({name for *_, objects, _ in parsed for name, _ in objects})
    class_names = list(classes) if classes else names
    if not class_names:
        raise DataError(
            f"VOC split {listing} has no objects and data.classes is not set: the class list is unknown."
        )
    split = SplitAnnotations([], class_names, listing)
    found: list[tuple[int, bool, int, list[float]]] = []
    for image_id, (xml_file, path, width, height, objects, difficult) in enumerate(parsed, 1):
        unknown = sorted({name for name, _ in objects} - set(class_names))
        if unknown and classes_from:
            raise DataError(
                f"VOC annotation file {xml_file} (split {split_name!r}, listed in {listing}) has "
                f"objects of class(es) {unknown}, which are not among the classes of "
                f"{classes_from} {class_names}: a model cannot learn a class it never trains on. "
                "Add images of it to the training split, or set data.classes to the classes to "
                "use (objects of the others are then left out and counted)."
            )
        split.other_class_objects += sum(1 for name, _ in objects if name not in class_names)
        owner = len(split.records)
        split.records.append(ImageRecord(image_id, path, width, height))
        for ignored, named in ((False, objects), (True, difficult)):
            # a difficult object of a class outside the list has nothing to be ignored for
            found += [
                (owner, ignored, class_names.index(n), box) for n, box in named if n in class_names
            ]
    _attach_all(split, found)
    _report(split)
    split.unchecked_images = f"{root / 'JPEGImages'} and the <filename> entries"
    if check_images:
        check_image_files(split)
    return split
