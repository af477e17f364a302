"""The Pascal VOC reader: one XML file per image, read into the records of
pipeline.data.sources, from the VOCdevkit layout (a split's listing in ImageSets/Main, its XML
files in Annotations, its images in JPEGImages) or from a folder of XML files, as exports lay
a split out.
"""

from __future__ import annotations

import logging
import math
import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

from pipeline.data.image_files import IMAGE_SUFFIXES
from pipeline.data.sources import (
    FoundBox,
    ImageRecord,
    SplitAnnotations,
    attach_objects,
    check_image_files,
    read_missing_sizes,
    report_split,
    report_turned,
    upright_hull,
    written_base_name,
)
from pipeline.errors import DataError

log = logging.getLogger("pipeline")


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


def _rotation(obj: ET.Element, xml_file: Path) -> float:
    """The degrees an annotation tool turned the box by, 0 where none: CVAT's Pascal VOC export
    keeps a turned box's <bndbox> as drawn before it turned, with the angle about its centre in
    `<attributes><attribute><name>rotation</name><value>`, as its COCO export does."""
    for attribute in obj.iterfind("attributes/attribute"):
        if (attribute.findtext("name") or "").strip() != "rotation":
            continue
        text = (attribute.findtext("value") or "").strip()
        try:
            degrees = float(text or 0)
        except ValueError:
            degrees = math.nan
        if not math.isfinite(degrees):
            raise DataError(
                f"VOC annotation {xml_file}: an <object> ({obj.findtext('name', '').strip()}) "
                f"has the rotation {text[:40]!r} in its attributes, which is not a number of "
                "degrees."
            )
        return degrees
    return 0.0


# what annotation tools write in <difficult>; absent or empty is not difficult
_DIFFICULT = {"0": False, "1": True, "false": False, "true": True, "": False}


def _difficult(obj: ET.Element, xml_file: Path) -> bool:
    """An object's <difficult> flag; any other value is an error, never read as "not difficult"
    (the object would count as a miss wherever the model does not find it)."""
    text = obj.findtext("difficult", "").strip()
    if text.lower() not in _DIFFICULT:
        raise DataError(
            f"VOC annotation {xml_file}: an <object> ({obj.findtext('name', '').strip()}) has "
            f"<difficult>{text}</difficult>; VOC's difficult is 0 or 1."
        )
    return _DIFFICULT[text.lower()]


def _warn_of_near_names(names: list[str], listing: Path) -> None:
    """Class names that differ only in case or spacing are separate classes: say so, as it is
    most often one class typed two ways."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(" ".join(name.casefold().split()), []).append(name)
    alike = [group for group in groups.values() if len(group) > 1]
    if alike:
        log.warning(
            "%s: the class names %s differ only in case or spacing, and are trained as separate "
            "classes; if each group is one class, write it one way in the XML files (or set "
            "data.classes to the ones to keep)",
            listing,
            " and ".join(str(group) for group in alike),
        )


def _where_voc_is(root: Path, split_name: str) -> str:
    """What a root without the split's listing holds instead, for the error: the VOCdevkit one
    level down (`VOCdevkit/` given for `VOCdevkit/VOC2007/`), the listings it has, or XML files
    and images without listings (a published set that ships no splits)."""
    nested = sorted(path.parents[2] for path in root.glob(f"*/ImageSets/Main/{split_name}.txt"))
    if nested:
        return (
            f" {' and '.join(map(str, nested))} hold{'s' if len(nested) == 1 else ''} "
            f"ImageSets/Main/{split_name}.txt: set data.root to "
            f"{'it' if len(nested) == 1 else 'one of them'}."
        )
    listings = sorted(path.stem for path in (root / "ImageSets" / "Main").glob("*.txt"))
    if listings:
        where = f" {root / 'ImageSets' / 'Main'} lists the splits {', '.join(listings)}"
        if len(listings) > 1:
            return f"{where}: name them in data.train_split, data.val_split and data.test_split."
        return (
            f"{where} alone (as CVAT's export lists every image in default): set "
            f"data.train_split={listings[0]}, and carve validation and test out of it by "
            "data.val_fraction and data.test_fraction (docs/data.md, One set without splits)."
        )
    if (root / "Annotations").is_dir():
        return (
            f" {root} has Annotations/ but no split listings: name the XML folder in "
            f"data.train_annotations and the images folder in data.images_dir "
            f"({root / 'JPEGImages'} in a VOCdevkit), and carve validation and test out by "
            "data.val_fraction and data.test_fraction (docs/data.md, One set without splits)."
        )
    return ""


# a line of VOC's per-class listings (ImageSets/Main/<class>_<split>.txt): an id and a flag
_PER_CLASS_LINE = re.compile(r"(\S+)\s+(-1|0|1)")


def _listed_id(line: str, annotations: Path) -> str:
    """A listing line's image id: the whole line, as torchvision's and MMDetection's readers take
    it (CVAT writes ids with spaces, `Screenshot (573)`); a line of the per-class listings'
    form, `000005 -1`, its first word, unless an XML file is named by the whole line."""
    text = line.strip()
    per_class = _PER_CLASS_LINE.fullmatch(text)
    if per_class and not (annotations / f"{text}.xml").is_file():
        return per_class.group(1)
    return text


def load_voc(
    root: str | Path,
    split_name: str,
    classes: list[str] | None = None,
    classes_from: str | None = None,
    *,
    check_images: bool = True,
) -> SplitAnnotations:
    """Records from Pascal VOC in the VOCdevkit layout: ImageSets/Main/<split>.txt,
    Annotations/*.xml, JPEGImages/.

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
            f"VOC split file {listing} does not exist (config data.root and "
            f"data.{{train,val,test}}_split).{_where_voc_is(root, split_name)}"
        )
    try:
        text = listing.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DataError(
            f"VOC split file {listing} is not a text listing of image names: the byte at offset "
            f"{error.start} is not UTF-8 ({error.reason})."
        ) from error
    ids = [_listed_id(line, root / "Annotations") for line in text.splitlines() if line.strip()]
    if not ids:
        raise DataError(f"VOC split file {listing} lists no images: the split is empty.")

    renamed: list[tuple[Path, str, Path]] = []
    split = _read_split(
        [root / "Annotations" / f"{image_name}.xml" for image_name in ids],
        _devkit_image_finder(root / "JPEGImages", renamed),
        listing,
        split_name,
        classes,
        classes_from,
        images_where=f"{root / 'JPEGImages'} and the <filename> entries",
        check_images=check_images,
    )
    if renamed:
        xml_file, file_name, path = renamed[0]
        log.info(
            "%s: %d XML file(s) name another image in <filename> than the one named as the "
            "listing's id: read as the VOC devkit reads them, JPEGImages/<id> (e.g. %s: "
            "<filename>%s</filename> -> %s)",
            listing,
            len(renamed),
            xml_file.name,
            file_name,
            path,
        )
    return split


def _read_split(
    xml_files: list[Path],
    image_path: Callable[[Path, str | None], Path],
    listing: Path,
    split_name: str,
    classes: list[str] | None,
    classes_from: str | None,
    *,
    images_where: str,
    check_images: bool,
) -> SplitAnnotations:
    """A split's records from its XML files, in their order (image ids 1, 2, ...), whatever
    layout listed them: `listing` (a VOCdevkit listing, or a folder of XML files) is the split's
    source in messages, `image_path` finds an XML file's image from its <filename> (None where
    it has none), `images_where` says where to look for a missing image."""
    parsed = []
    xml_of_image: dict[Path, Path] = {}
    rotated = 0
    for xml_file in xml_files:
        try:
            tree = ET.parse(xml_file).getroot()
        except FileNotFoundError as error:
            raise DataError(
                f"VOC annotation file {xml_file} does not exist (listed in {listing})."
            ) from error
        except ET.ParseError as error:
            raise DataError(f"VOC annotation file {xml_file} is not valid XML: {error}.") from error
        except OSError as error:  # a folder of that name, no permission
            raise DataError(
                f"VOC annotation file {xml_file} cannot be read: {error.strerror or error} "
                f"(listed in {listing})."
            ) from error
        if tree.tag != "annotation":
            raise DataError(
                f"VOC annotation file {xml_file} is not a Pascal VOC annotation: its root "
                f"element is <{tree.tag}>, where VOC's is <annotation> (listed in {listing})."
            )
        # absent, empty or 0 (LabelImg's where it could not read the image): read from the file
        sizes = [(tree.findtext(f"size/{key}") or "").strip() or "0" for key in ("width", "height")]
        try:
            width, height = (int(float(size)) for size in sizes)
        except (ValueError, OverflowError) as error:
            raise DataError(
                f"VOC annotation file {xml_file} has a <size><width>/<height> that is not a "
                f"number ({' x '.join(sizes)})."
            ) from error
        objects, difficult = [], []
        for obj in tree.findall("object"):
            is_difficult = _difficult(obj, xml_file)
            name, box = _voc_object(obj, xml_file)
            if degrees := _rotation(obj, xml_file):
                rotated += 1
                box = upright_hull(box, degrees)
            (difficult if is_difficult else objects).append((name, box))
        path = image_path(xml_file, tree.findtext("filename"))
        if path in xml_of_image:
            raise DataError(
                f"VOC split {listing} lists the image file {path} twice: through "
                f"{xml_of_image[path]} and {xml_file}. It would count twice; list each image once."
            )
        xml_of_image[path] = xml_file
        parsed.append((xml_file, path, width, height, objects, difficult))
    names = sorted({name for *_, objects, _ in parsed for name, _ in objects})
    if not classes:
        _warn_of_near_names(names, listing)
    class_names = list(classes) if classes else names
    if not class_names:
        raise DataError(
            f"VOC split {listing} has no objects and data.classes is not set: the class list is unknown."
        )
    split = SplitAnnotations([], class_names, listing)
    found: list[FoundBox] = []
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
    report_turned(listing, rotated, "an <attribute> named rotation")
    read_missing_sizes(split, images_where)
    attach_objects(split, found)
    report_split(split)
    split.unchecked_images = images_where
    if check_images:
        check_image_files(split)
    return split


def xml_files(folder: Path) -> list[Path]:
    """A folder's VOC annotation files, sorted so that image ids are the same on every machine.

    Hidden files are not annotations: archives made on macOS hold a `._name.xml` of resource
    data beside each file."""
    with os.scandir(folder) as entries:  # its file types without a stat per file
        return sorted(
            folder / entry.name
            for entry in entries
            if entry.name.lower().endswith(".xml")
            and not entry.name.startswith(".")
            and entry.is_file()
        )


def _images_by_stem(images: Path, key: str) -> tuple[set[str], dict[str, list[str]]]:
    """The file names in `images`, and its image files' names by name without suffix."""
    try:
        names = {entry.name for entry in os.scandir(images) if entry.is_file()}
    except (FileNotFoundError, NotADirectoryError) as error:
        raise DataError(
            f"The images folder {images} ({key}) does not exist or is not a folder."
        ) from error
    by_stem: dict[str, list[str]] = {}
    for name in sorted(names):
        stem, suffix = os.path.splitext(name)
        if suffix.lower() in IMAGE_SUFFIXES:
            by_stem.setdefault(stem, []).append(name)
    return names, by_stem


def _devkit_image_finder(
    images: Path, renamed: list[tuple[Path, str, Path]]
) -> Callable[[Path, str | None], Path]:
    """How a VOCdevkit split's image is found: as the devkit (and torchvision's, Detectron2's
    and MMDetection's readers) finds it, by the listing's id, `JPEGImages/<id>.jpg` (or the one
    image of that name with another suffix), whatever <filename> says: a set renumbered after
    annotation keeps each image's earlier name there, which may be another image's. Where no
    image has the id's name, by <filename>'s base name; where none has either, the missing image
    is named as the id. Each XML file whose <filename> names
    another file than the one found goes into `renamed`, for one info line."""
    names, by_stem = _images_by_stem(images, "in data.root")

    def find(xml_file: Path, file_name: str | None) -> Path:
        base = written_base_name(file_name.strip()) if file_name else ""
        candidates = by_stem.get(xml_file.stem, [])
        if len(candidates) > 1 and base not in candidates:
            raise DataError(
                f"VOC annotation file {xml_file}: the images {' and '.join(candidates)} in "
                f"{images} both have its id's name, and its <filename>{file_name or ''}"
                "</filename> names neither: which one it describes is unknown. Write the "
                "image's file name in <filename>, or remove the other image."
            )
        if not candidates:  # missing: named as the id, with <filename>'s suffix
            return images / (
                base if base in names else xml_file.stem + (Path(base).suffix or ".jpg")
            )
        found = base if base in candidates else candidates[0]
        if base and base != found:
            renamed.append((xml_file, file_name or "", images / found))
        return images / found

    return find


def _image_finder(images: Path, key: str) -> Callable[[Path, str | None], Path]:
    """How an XML file's image is found in `images`, as exports write <filename>: by its base
    name (tools write the original path, Windows' or another's); else the one image named as
    the XML file, or as an extension-less <filename> (Roboflow renames images, LabelImg may
    leave the extension out). Two such images are an error: which one is meant is unknown. So
    is a <filename> that names another image than one named as the XML file: a set renamed
    after annotation keeps each image's earlier name there, which may be another image's."""
    names, by_stem = _images_by_stem(images, key)

    def find(xml_file: Path, file_name: str | None) -> Path:
        base = written_base_name(file_name.strip()) if file_name else ""
        if base in names:
            own = by_stem.get(xml_file.stem, [])
            if own and os.path.splitext(base)[0] != xml_file.stem:
                raise DataError(
                    f"VOC annotation file {xml_file}: its <filename>{file_name}</filename> "
                    f"names the image {base} in {images} ({key}), but {' and '.join(own)} "
                    "there has the XML file's own name: which one it describes is unknown (a "
                    "set renamed after annotation keeps each image's earlier name in "
                    "<filename>). Write the image's file name in <filename>, or remove the "
                    "other image."
                )
            return images / base
        stems = [xml_file.stem]
        if base and Path(base).suffix.lower() not in IMAGE_SUFFIXES:
            stems.append(base)
        candidates = sorted({name for stem in stems for name in by_stem.get(stem, [])})
        if len(candidates) > 1:
            raise DataError(
                f"VOC annotation file {xml_file}: its <filename>{file_name or ''}</filename> "
                f"names no file in {images} ({key}), and the images "
                f"{' and '.join(candidates)} there fit its name: which one it describes is "
                "unknown. Write the image's file name in <filename>, or remove the other image."
            )
        return images / (candidates[0] if candidates else base or f"{xml_file.stem}.jpg")

    return find


def load_voc_folder(
    folder: str | Path,
    images: str | Path,
    split_name: str,
    classes: list[str] | None = None,
    classes_from: str | None = None,
    *,
    keys: tuple[str, str],
    check_images: bool = True,
) -> SplitAnnotations:
    """Records from a folder of Pascal VOC XML files, one per image, as exports lay a split out
    (Roboflow's with each image beside its XML file, LabelImg's with the images apart), read as
    `load_voc` reads a VOCdevkit split. `keys`: the config keys naming `folder` and `images`,
    for messages."""
    folder, images = Path(folder), Path(images)
    if not folder.is_dir():
        what = "is a file" if folder.is_file() else "does not exist"
        raise DataError(
            f"The VOC annotation folder {folder} ({keys[0]}) {what}: with data.format=voc, "
            f"{keys[0]} names a folder of Pascal VOC XML files, one per image."
        )
    found = xml_files(folder)
    if not found:
        coco = next(folder.glob("*.json"), None)
        raise DataError(
            f"The VOC annotation folder {folder} ({keys[0]}) holds no .xml file: a split in "
            "Pascal VOC format has one XML file per image."
            + (f" {coco.name} there may be COCO: set data.format=coco and name it." if coco else "")
        )
    return _read_split(
        found,
        _image_finder(images, keys[1]),
        folder,
        split_name,
        classes,
        classes_from,
        images_where=(
            f"{images} ({keys[1]}) and the <filename> entries: where the images are in a folder "
            "of their own, set data.images_dir (or data.<split>_images_dir) to it"
        ),
        check_images=check_images,
    )
