"""The COCO JSON reader: one instances file lists a split's images, categories and annotations
(COCO's own layout and most exports'), read into the records of pipeline.data.sources; its
structure is checked entry by entry, so a malformed file is named, never half read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import orjson

from pipeline.data.sources import (
    FoundBox,
    ImageRecord,
    SplitAnnotations,
    attach_objects,
    check_image_files,
    no_boxes,
    no_labels,
    report_split,
)
from pipeline.errors import DataError

# an image's boxes, labels, ignore regions and their labels before the annotations are read
_NO_OBJECTS = (no_boxes(), no_labels(), no_boxes(), no_labels())


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
                # placeholders, not arrays of its own: attach_objects gives every record its boxes
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
    found: list[FoundBox] = []
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
    attach_objects(split, found)
    report_split(split)
    split.unchecked_images = (
        f"the images folder {images_dir} (data.images_dir or data.<split>_images_dir; "
        "by default the annotation file's folder)"
    )
    if check_images:
        check_image_files(split)
    return split
