"""The COCO JSON reader: one instances file lists a split's images, categories and annotations
(COCO's own layout and most exports'), read into the records of pipeline.data.sources; its
structure is checked entry by entry, so a malformed file is named, never half read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path

import orjson

from pipeline.config import close_match
from pipeline.data.sources import (
    FoundBox,
    ImageRecord,
    SplitAnnotations,
    attach_objects,
    check_image_files,
    no_boxes,
    no_labels,
    read_missing_sizes,
    report_split,
    report_turned,
    upright_hull,
    written_base_name,
)
from pipeline.errors import DataError

log = logging.getLogger("pipeline")

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


_UTF8_BOM = b"\xef\xbb\xbf"


def _json_document(source: Path) -> object:
    """The file's JSON, parsed by orjson (a fraction of json's time on a large export); where
    orjson refuses the text (an error, or the NaN and Infinity that json reads), by json, whose
    reading and errors are the loaders' own."""
    data = source.read_bytes().removeprefix(_UTF8_BOM)  # as Windows tools save UTF-8
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data.decode("utf-8"))


_MISSING = object()


def _field(entry: dict, key: str, what: str, source: Path) -> object:
    """`entry[key]`, or a DataError naming the entry (`what`) and the missing key."""
    if key not in entry:
        raise DataError(
            f"COCO annotation file {source}: {what} has no {key!r} ({json.dumps(entry)[:80]})."
        )
    return entry[key]


def _integer(entry: dict, key: str, what: str, source: Path) -> int:
    """An id or a size: an integer (or its text, or a float with nothing after the point), else
    a DataError naming the entry, the key and the value; never a float cut to an integer."""
    value = entry.get(key, _MISSING)
    if type(value) is int:  # nearly always: the checks below are for the rest
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return int(value)
    if value is _MISSING:
        _field(entry, key, what, source)  # raises, naming the key
    raise DataError(
        f"COCO annotation file {source}: {what} has {key} {json.dumps(value)}, which is not an "
        "integer."
    )


def _size(entry: dict, key: str, what: str, source: Path) -> int:
    """An image entry's width or height; absent, null or 0 (as converters write where they
    could not read the image) is 0, "not given": read from the image file instead
    (`read_missing_sizes`). pycocotools never needs them, so exports may leave them out."""
    if entry.get(key) is None:
        return 0
    return _integer(entry, key, what, source)


def _coco_categories(entries: list[dict], source: Path) -> dict[int, str]:
    """Category names by id; an id listed twice would silently take the last name for both."""
    categories: dict[int, str] = {}
    for index, entry in enumerate(entries):
        what = f"category entry {index}"
        category_id = _integer(entry, "id", what, source)
        name = _field(entry, "name", what, source)
        if not isinstance(name, str | int | float) or isinstance(name, bool) or not str(name):
            raise DataError(
                f"COCO annotation file {source}: {what} (id {category_id}) has the name "
                f"{json.dumps(name)}: a class needs a name."
            )
        name = str(name)  # a number, as in digit data sets, names its class as its text
        if category_id in categories:
            raise DataError(
                f"COCO annotation file {source} lists category id {category_id} twice: as "
                f"{categories[category_id]!r} and as {name!r}. Category ids must be unique: give "
                "each category its own id."
            )
        categories[category_id] = name
    return categories


def _malformed_annotation(ann: dict, source: Path) -> DataError:
    """What is wrong with an annotation that would not read: the key it lacks, or the value."""
    what = f"annotation {ann.get('id', '?')}"
    _integer(ann, "image_id", what, source)
    _integer(ann, "category_id", what, source)
    bbox = _field(ann, "bbox", what, source)
    return DataError(
        f"COCO annotation file {source}: {what} has the bbox {json.dumps(bbox)[:80]}, not 4 "
        "numbers [x, y, width, height]."
    )


def _bad_crowd(ann: dict, source: Path) -> DataError:
    return DataError(
        f"COCO annotation file {source}: annotation {ann.get('id', '?')} has iscrowd "
        f"{json.dumps(ann['iscrowd'])}; COCO's iscrowd is 0 (an object) or 1 (a crowd region, "
        "ignored)."
    )


def _rotation(ann: dict, source: Path) -> float:
    """The degrees an annotation tool turned the box by, 0 where none. CVAT (and Datumaro) keep a
    rotated box's bbox as drawn before it turned, with the angle in `attributes.rotation` about
    its centre: read as it stands, the box would cover another part of the image."""
    attributes = ann.get("attributes")
    if type(attributes) is not dict or not attributes.get("rotation"):
        return 0.0
    rotation = attributes["rotation"]
    if type(rotation) not in (int, float) or not math.isfinite(rotation):
        raise DataError(
            f"COCO annotation file {source}: annotation {ann.get('id', '?')} has the rotation "
            f"{json.dumps(rotation)[:40]} in its attributes, which is not a number of degrees."
        )
    return float(rotation)


def _names_in(folder: str) -> frozenset[str]:
    """The names in a folder; none where it is no folder that can be read."""
    try:
        return frozenset(os.listdir(folder))
    except OSError:
        return frozenset()


def _base_name_finder(folder: str) -> Callable[[str], str | None]:
    """How an image entry's file is found: as its file_name (with / separators) names it in
    `folder`; where that names no file, by the file_name's base name in `folder` itself (never
    its subfolders: which one is meant would be unknown), as exports write the path on the
    annotator's machine or an upload URL and put the images in one folder. Gives the path found
    by base name, or None where the file_name stands as written (there, or missing either way).

    Whether a file is there is read from one listing per folder the file names lead into, not
    from a stat per image on top of the header check's open; only a name the listing lacks is
    looked for on disk (a case-insensitive file system may still hold it)."""
    listings: dict[str, frozenset[str]] = {}

    def find(file_name: str) -> str | None:
        directory, _, name = file_name.rpartition("/")
        if directory not in listings:
            listings[directory] = _names_in(os.path.join(folder, directory))
        if name in listings[directory] or os.path.exists(os.path.join(folder, file_name)):
            return None
        path = os.path.join(folder, written_base_name(file_name))
        return path if os.path.isfile(path) else None

    return find


def _coco_images(images: list, images_dir: Path, source: Path) -> dict[int, ImageRecord]:
    """The image entries by id; an id listed twice would silently merge two images into one,
    and a file listed under two ids (its file_names as written, or as found by base name) would
    count twice (in training and in every metric)."""
    records: dict[int, ImageRecord] = {}
    file_names: dict[int, str] = {}
    id_of_file: dict[str, int] = {}
    found_by_base_name: dict[int, str] = {}  # image id -> where its file_name was found
    folder = str(images_dir)  # normalised as strings: turning each record's Path back costs more
    find_by_base_name = _base_name_finder(folder)
    for index, img in enumerate(images):
        what = f"image entry {index}"
        file_name = _field(img, "file_name", what, source)
        if not isinstance(file_name, str) or not file_name:
            raise DataError(
                f"COCO annotation file {source}: {what} has the file_name "
                f"{json.dumps(file_name)}, which names no file."
            )
        if "\\" in file_name:  # a path a Windows tool wrote: its separators (Windows takes /)
            file_name = file_name.replace("\\", "/")
        path = find_by_base_name(file_name)
        record = ImageRecord(
            _integer(img, "id", what, source),
            images_dir / file_name if path is None else Path(path),
            _size(img, "width", what, source),
            _size(img, "height", what, source),
            # placeholders, not arrays of its own: attach_objects gives every record its boxes
            *_NO_OBJECTS,
        )
        if record.image_id in records:
            raise DataError(
                f"COCO annotation file {source} lists image id {record.image_id} twice: for "
                f"{file_names[record.image_id]} and for {file_name}. Image ids must be "
                "unique: give each image its own id."
            )
        if path is None:
            path = os.path.join(folder, file_name)
        else:
            found_by_base_name[record.image_id] = path
        same_file = id_of_file.setdefault(os.path.normpath(path), record.image_id)
        if same_file != record.image_id:
            raise _listed_twice(
                source, file_names[same_file], file_name, same_file, record, found_by_base_name
            )
        records[record.image_id] = record
        file_names[record.image_id] = file_name
    if found_by_base_name:
        example = next(iter(found_by_base_name))
        log.info(
            "%s: %d image file_name(s) name no file in %s: found there by their base name "
            "(e.g. %s -> %s)",
            source,
            len(found_by_base_name),
            folder,
            file_names[example],
            found_by_base_name[example],
        )
    return records


def _listed_twice(
    source: Path,
    first: str,
    file_name: str,
    first_id: int,
    record: ImageRecord,
    found_by_base_name: dict[int, str],
) -> DataError:
    """Two image entries that name one file, as written or as found by base name."""
    found = [
        f"{written!r} by its base name"
        for image_id, written in ((first_id, first), (record.image_id, file_name))
        if image_id in found_by_base_name
    ]
    how = f" (found as {' and '.join(found)})" if found else ""
    return DataError(
        f"COCO annotation file {source} lists the image file "
        f"{record.path if found else file_name} twice: under image ids {first_id} and "
        f"{record.image_id}{how}. It would count twice; list each file once, with all its "
        "annotations under one id."
    )


def _json_files_near(source: Path) -> str:
    """The JSON files in the folder where a missing annotation file was looked for, and in its
    subfolders: an export that puts each split in a folder of its own (Roboflow's
    `train/_annotations.coco.json`) is found by naming its files, not by data.root alone."""
    folder = source.parent
    if not folder.is_dir():
        return ""
    found = sorted(
        path.relative_to(folder).as_posix()
        for path in [*folder.glob("*.json"), *folder.glob("*/*.json")]
    )
    if not found:
        return ""
    more = f" and {len(found) - 6} more" if len(found) > 6 else ""
    return (
        f" JSON files under {folder}: {', '.join(found[:6])}{more}. Name a split's file with "
        "data.train_annotations, data.val_annotations or data.test_annotations."
    )


def load_coco(
    annotation_file: str | Path,
    images_dir: str | Path,
    classes: list[str] | None = None,
    *,
    check_images: bool = True,
) -> SplitAnnotations:
    """Records from a COCO instances JSON; class order follows category ids unless `classes` is given.

    `file_name` entries are relative to `images_dir`; one that names no file there is looked up
    by its base name in `images_dir`, as exports write the annotator's paths. Crowd annotations
    become ignore regions.
    `check_images=False` leaves the check of the image files to whoever decodes them
    (`check_image_files`).
    """
    source = Path(annotation_file)
    if not source.is_file():
        raise DataError(
            f"COCO annotation file {source} "
            f"{'is a folder' if source.is_dir() else 'does not exist'} (config data.root / "
            "data.{train,val,test}_annotations)." + _json_files_near(source)
        )
    try:
        document = _json_document(source)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataError(f"COCO annotation file {source} is not valid JSON: {error}.") from error
    images = _coco_list(document, "images", source)
    annotations = _coco_list(document, "annotations", source)
    categories = _coco_categories(_coco_list(document, "categories", source), source)
    if not images:
        raise DataError(f"COCO annotation file {source} lists no images: the split is empty.")
    # one class per name: an export's super-category may share its one class's name
    names = list(dict.fromkeys(categories[key] for key in sorted(categories)))
    class_names = list(classes) if classes else names
    unknown_classes = sorted(set(class_names) - set(names))
    if unknown_classes:
        meant = [match for name in unknown_classes if (match := close_match(name, names))]
        raise DataError(
            f"data.classes names {unknown_classes}, which {source} does not define (it has {names})."
            + (f" Did you mean {meant}?" if meant else "")
        )
    label_of = {
        cid: class_names.index(name) for cid, name in categories.items() if name in class_names
    }

    records = _coco_images(images, Path(images_dir), source)
    position = {image_id: index for index, image_id in enumerate(records)}
    found: list[FoundBox] = []
    other_class_objects = rotated = 0
    for ann in annotations:
        try:
            image_id, category_id = int(ann["image_id"]), int(ann["category_id"])
            x, y, w, h = map(float, ann["bbox"])
        except (KeyError, TypeError, ValueError) as error:
            raise _malformed_annotation(ann, source) from error
        if category_id not in categories:
            raise DataError(
                f"COCO annotation file {source}: annotation {ann.get('id', '?')} has category_id "
                f"{category_id}, which is not among the categories {sorted(categories)}."
            )
        if image_id not in records:
            raise DataError(
                f"COCO annotation file {source}: annotation {ann.get('id', '?')} refers to image_id {image_id}, which is not listed."
            )
        crowd = ann.get("iscrowd", 0)
        if crowd not in (0, 1):  # a string such as "0" would be true, and the object ignored
            raise _bad_crowd(ann, source)
        crowd = bool(crowd)
        if category_id not in label_of:
            other_class_objects += not crowd
            continue
        degrees = _rotation(ann, source)
        if degrees:
            rotated += 1
            box = upright_hull([x, y, x + w, y + h], degrees)
        else:
            box = [x, y, x + w, y + h]
        found.append((position[image_id], crowd, label_of[category_id], box))
    split = SplitAnnotations(
        list(records.values()), class_names, source, other_class_objects=other_class_objects
    )
    report_turned(source, rotated, "attributes.rotation")
    where = (
        f"the images folder {images_dir} (by default the annotation file's folder), where a "
        "file_name that names no file as written is looked up by its base name: set "
        "data.images_dir (or data.<split>_images_dir) to the folder that holds the images"
    )
    read_missing_sizes(split, where)
    attach_objects(split, found)
    report_split(split)
    split.unchecked_images = where
    if check_images:
        check_image_files(split)
    return split
