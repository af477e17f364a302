"""Data sets: the built-in synthetic set and loaders for a user's COCO or Pascal VOC data.

A data set has a training and a validation split, and may have a test split, which the
evaluate stage reports on (the threshold it applies there is picked on validation). The
validation and test splits may be carved out of the training split by fraction
(pipeline.data.holdout) where the data set has none of its own.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pipeline.data import holdout
from pipeline.data.coco_source import load_coco
from pipeline.data.sources import SplitAnnotations, report_counts, with_classes
from pipeline.data.voc_source import load_voc, load_voc_folder, xml_files
from pipeline.errors import ConfigError, DataError

log = logging.getLogger("pipeline")
SPLITS = ("train", "val", "test")
# the keys that name files of a split one by one, each beside data.root and winning over it
SPLIT_FILE_KEYS = (
    "images_dir",
    *(f"{split}_{kind}" for split in SPLITS for kind in ("annotations", "images_dir")),
)


def at_root(root: str) -> dict[str, Any]:
    """The data settings of the data set at `root` alone: with every split's own files unset,
    so that none named for another data set (a checkpoint's) is read instead of root's."""
    return {"root": root, **dict.fromkeys(SPLIT_FILE_KEYS)}


def _path(value: str) -> Path:
    """A path from the config: `~` names the home folder there too (no shell expands it)."""
    return Path(value).expanduser()


def annotation_file(config: dict[str, Any], split: str) -> Path:
    """Where a COCO-format split's annotations are (the synthetic set is COCO too), or the
    folder of a VOC split's XML files that data.<split>_annotations names."""
    data = config["data"]
    explicit = data.get(f"{split}_annotations")
    return (
        _path(explicit)
        if explicit
        else _path(data["root"]) / f"instances_{data[f'{split}_split']}.json"
    )


def _images_key(config: dict[str, Any], split: str) -> str:
    """The config key that says where a split's images are, for messages."""
    data = config["data"]
    if data.get(f"{split}_images_dir"):
        return f"data.{split}_images_dir"
    return "data.images_dir" if data["images_dir"] else f"by default data.{split}_annotations"


def images_dir(config: dict[str, Any], split: str) -> Path:
    """The folder a COCO split's `file_name` entries are relative to, or where a VOC split
    given as a folder of XML files finds each <filename>; a VOCdevkit split's, JPEGImages.

    `data.<split>_images_dir`, else `data.images_dir`, else where the split's annotations are:
    exports put each split's images beside its annotation file (`train/_annotations.coco.json`)
    or beside its XML files (`train/a_jpg.rf.0c1d.xml`).
    """
    data = config["data"]
    if data["format"] == "voc" and not _is_voc_folder(config, split):
        return _path(data["root"]) / "JPEGImages"
    given = data.get(f"{split}_images_dir") or data["images_dir"]
    if given:
        return _path(given)
    annotations = annotation_file(config, split)
    return annotations if data["format"] == "voc" else annotations.parent


def _voc_listing(config: dict[str, Any], split: str) -> Path:
    data = config["data"]
    return _path(data["root"]) / "ImageSets" / "Main" / f"{data[f'{split}_split']}.txt"


def _is_voc_folder(config: dict[str, Any], split: str) -> bool:
    """Whether a VOC split is a folder of XML files (data.<split>_annotations), not a listing
    of the VOCdevkit layout at data.root. A split given both ways is refused: which one is
    meant is unknown."""
    data = config["data"]
    if not data[f"{split}_annotations"]:
        return False
    if data[f"{split}_split"] is not None and _voc_listing(config, split).is_file():
        raise ConfigError(
            f"The VOC {split} split is given twice: as the folder of XML files "
            f"data.{split}_annotations = {data[f'{split}_annotations']}, and as the VOCdevkit "
            f"listing {_voc_listing(config, split)} (data.root = {data['root']}, "
            f"data.{split}_split = {data[f'{split}_split']}). Unset data.{split}_annotations "
            f"or set data.root to another folder."
        )
    return True


def split_file(config: dict[str, Any], split: str) -> Path:
    """What defines a split: its COCO annotation file, its VOC listing, or the folder of its
    VOC XML files."""
    data = config["data"]
    if data["format"] == "voc" and not _is_voc_folder(config, split):
        return _voc_listing(config, split)
    return annotation_file(config, split)


def has_test_split(config: dict[str, Any]) -> bool:
    """Whether the data set has a test split: generated (data.synthetic.num_test > 0), carved
    out of training (data.test_fraction), named explicitly (data.test_annotations), or found
    where data.test_split puts it.

    A COCO or VOC data set whose train or val split is named one by one is not under
    data.root, so its test split is data.test_annotations or none: data.root then still holds
    its default, the synthetic set, whose test file must never stand in for the user's."""
    data = config["data"]
    if data["format"] == "synthetic":
        return data["synthetic"]["num_test"] > 0 and data["test_split"] is not None
    return "test" in carved_splits(config) or _given_split_file(config, "test") is not None


def _given_split_file(config: dict[str, Any], split: str) -> Path | None:
    """The file of a validation or test split of the user's own, if there is one: named
    (data.<split>_annotations), or found where data.<split>_split puts it under data.root.

    A COCO or VOC data set whose splits are named one by one is not under data.root: data.root
    then still holds its default, the synthetic set, whose files must never stand in for the
    user's.
    """
    data = config["data"]
    if any(data[f"{name}_annotations"] for name in SPLITS):
        return _path(data[f"{split}_annotations"]) if data[f"{split}_annotations"] else None
    if data[f"{split}_split"] is None:
        return None
    found = split_file(config, split)
    return found if found.is_file() else None


def carved_splits(config: dict[str, Any]) -> dict[str, float]:
    """The splits carved out of the training split (data.test_fraction, data.val_fraction),
    each with its fraction. A split both carved and given (data.<split>_annotations, or its
    file found under data.root) is refused: which one was meant is not ours to guess."""
    data = config["data"]
    carved = holdout.fractions(data)
    for split in carved:
        given = _given_split_file(config, split)
        if given is None:
            continue
        key, role = holdout.FRACTION_KEYS[split], holdout.ROLES[split]
        named = data.get(f"{split}_annotations")
        if named and given == _path(named):
            how, undo = f"data.{split}_annotations", f"unset data.{split}_annotations"
        else:
            how = f"data.{split}_split = {data[f'{split}_split']!r}, which finds it under data.root"
            undo = "set data.test_split: null" if split == "test" else "move it out of data.root"
        raise ConfigError(
            f"Config keys data.{key} = {carved[split]} and {how} each give a {role} split: "
            f"data.{key} carves one out of the training split, and {given} is one. Keep one: "
            f"remove data.{key} to use that file, or {undo} to carve. (Only a file named by "
            f"data.{split}_annotations or found under data.root counts as a given {role} split.)"
        )
    return carved


def split_files(config: dict[str, Any], splits: tuple[str, ...] = SPLITS) -> list[Path]:
    """The files that define the given splits (a test split only where the data set has one;
    a carved split is defined by the training split's files), each once: what the workflow's
    rules take as input. A VOC split given as a folder gives its XML files: a folder's time
    changes where a file is added or removed, not where one is rewritten, and editing an
    annotation must rerun what read it. A folder that does not exist is given itself, for
    Snakemake to name as missing."""
    carved = carved_splits(config)
    files: list[Path] = []
    for split in splits:
        if split == "test" and not has_test_split(config):
            continue
        path = split_file(config, "train" if split in carved else split)
        files += xml_files(path) if config["data"]["format"] == "voc" and path.is_dir() else [path]
    return list(dict.fromkeys(files))


def _check_root(config: dict[str, Any]) -> Path:
    data = config["data"]
    root = _path(data["root"])
    if not root.is_dir():
        hint = (
            "Generate it with 'python -m pipeline prepare-data' (or 'snakemake prepare_data')."
            if data["format"] == "synthetic"
            else "Point data.root at your data set."
        )
        raise DataError(f"Data root {root} does not exist (config key data.root). {hint}")
    return root


def load_split(
    config: dict[str, Any],
    which: str,
    classes: list[str] | None = None,
    classes_from: str | None = None,
    *,
    check_images: bool = True,
) -> SplitAnnotations:
    """One split ('train', 'val' or 'test'); `classes` fixes the label order (else the config's,
    else the file's). A COCO split named by its own annotation file needs no data.root.

    Objects of classes outside data.classes are left out and counted. A VOC split, whose file
    lists no classes, given the list of `classes_from` (the training split, a checkpoint)
    instead, refuses objects of other classes, naming their XML file. `check_images=False`
    leaves the check of the image files to the dataset that decodes them
    (pipeline.data.sources.check_image_files).

    A split carved out of the training split (data.val_fraction, data.test_fraction), and the
    training split those leave, are cut out of the training split's file as it loads."""
    split = _read_split(config, which, classes, classes_from, check_images)
    report_counts(split)
    return split


def _read_split(
    config: dict[str, Any],
    which: str,
    classes: list[str] | None,
    classes_from: str | None,
    check_images: bool = True,
) -> SplitAnnotations:
    """`load_split` without the split's line of counts, which `load_splits` logs once the
    classes no object has are dropped."""
    carved = carved_splits(config)
    if carved and (which == "train" or which in carved):
        return _carve_training(config, carved, classes, classes_from, check_images)[which]
    data = config["data"]
    if data["format"] == "voc":
        strict = classes_from if classes and not data["classes"] else None
        if _is_voc_folder(config, which):
            return load_voc_folder(
                annotation_file(config, which),
                images_dir(config, which),
                which,
                classes or data["classes"],
                strict,
                keys=(f"data.{which}_annotations", _images_key(config, which)),
                check_images=check_images,
            )
        return load_voc(
            _check_root(config),
            data[f"{which}_split"],
            classes or data["classes"],
            strict,
            check_images=check_images,
        )
    classes = classes or data["classes"]
    if not (data["format"] == "coco" and data.get(f"{which}_annotations")):
        _check_root(config)
    return load_coco(
        annotation_file(config, which),
        images_dir(config, which),
        classes,
        check_images=check_images,
    )


def _carve_training(
    config: dict[str, Any],
    carved: dict[str, float],
    classes: list[str] | None = None,
    classes_from: str | None = None,
    check_images: bool = True,
) -> dict[str, SplitAnnotations]:
    """The training split's file, loaded whole and cut into 'train' and the `carved` splits,
    each image by its path relative to the training split's images folder."""
    data = config["data"]
    whole_config = {**config, "data": {**data, **dict.fromkeys(holdout.FRACTION_KEYS.values())}}
    whole = _read_split(whole_config, "train", classes, classes_from, check_images)
    return holdout.carve(whole, images_dir(config, "train"), carved)


# why a split of each role needs objects, and what to do about one without: (why, what);
# for a carved split, what to change instead
_WITHOUT_OBJECTS = {
    "training": (
        "there is nothing to learn from it.",
        "Give the training split images with objects.",
    ),
    "validation": (
        "F1 and AP are undefined on it, so neither the best checkpoint nor the score threshold "
        "could be picked.",
        "Give the validation split images with objects.",
    ),
    "test": (
        "recall, F1 and AP are undefined on it, and would read as 0.",
        "Give the test split images with objects, or set data.test_split=null to report on "
        "validation.",
    ),
}
_CARVED_WITHOUT_OBJECTS = {
    "training": "Lower data.val_fraction and data.test_fraction.",
    "validation": "Raise data.val_fraction, or give a validation split of your own.",
    "test": "Raise data.test_fraction, or set data.test_fraction=null to report on validation.",
}


def require_objects(split: SplitAnnotations, role: str = "validation") -> SplitAnnotations:
    """A split without objects is refused: a training split teaches nothing, and F1 and AP are
    undefined on a validation or test split (0 whatever the model), so a validation split would
    pick the best checkpoint and the score threshold from nothing, and a test split would report
    figures of nothing."""
    if any(len(record.boxes) for record in split.records):
        return split
    others = (
        f"; its {split.other_class_objects} object(s) are all of classes outside data.classes"
        if split.other_class_objects
        else ""
    )
    why, what = _WITHOUT_OBJECTS[role]
    if split.carving:
        what = (
            f"It was carved out of the training split by fraction: {_CARVED_WITHOUT_OBJECTS[role]}"
        )
    raise DataError(
        f"The {role} split {split.origin} has no objects ({len(split.records)} image(s), "
        f"none with an object of {split.class_names}{others}): {why} {what}"
    )


def load_splits(config: dict[str, Any]) -> tuple[SplitAnnotations, SplitAnnotations]:
    """Train and val annotations with one class list, matched by name (per-split exports may
    number the same categories differently); different sets of names are an error.

    Unless data.classes names them, classes that no object of either split has (an export's
    unused super-category, say) are left out of training and metrics, in one info line; each
    split's line of counts follows, with the classes training uses.
    """
    train, val = _splits_for_training(config)
    for split in (train, val):
        report_counts(split)
    return train, val


def _splits_for_training(config: dict[str, Any]) -> tuple[SplitAnnotations, SplitAnnotations]:
    """`load_splits` before its lines of counts."""
    carved = carved_splits(config)
    if "val" in carved:
        # one file, one class list: loaded once, both splits cut out of it
        parts = _carve_training(config, carved)
        return _without_unused_classes(
            config, require_objects(parts["train"], "training"), parts["val"]
        )
    train = require_objects(_read_split(config, "train", None, None), "training")
    if config["data"]["format"] == "voc":
        return train, require_objects(
            _read_split(config, "val", train.class_names, f"the training split {train.source}")
        )
    val = _read_split(config, "val", None, None)
    if train.class_names != val.class_names and set(train.class_names) == set(val.class_names):
        # per-split exports may number the same categories differently: names decide
        val = with_classes(val, train.class_names)
    if train.class_names != val.class_names:
        raise DataError(
            f"The training and validation splits define different classes: {train.source} has "
            f"{train.class_names}, {val.source} has {val.class_names}. Make them agree, or set "
            "data.classes to the list to use."
        )
    _refuse_classes_only_in_validation(config, train, val)
    return _without_unused_classes(config, train, val)


def _refuse_classes_only_in_validation(
    config: dict[str, Any], train: SplitAnnotations, val: SplitAnnotations
) -> None:
    """A COCO validation split with objects of a class that no training object has is refused,
    as a VOC one is: every split of an export lists the same categories, so the class would
    train with no example, and its objects would weigh in validation as certain misses. A
    generated set's splits are drawn by class at random: a tiny one may lack a class in
    training, which says nothing about the data."""
    if config["data"]["format"] != "coco" or config["data"]["classes"]:
        return
    trained = set(train.used_classes)
    untrained = [name for name in val.used_classes if name not in trained]
    if untrained:
        raise DataError(
            f"COCO annotation file {val.source} (split 'val') has objects of class(es) "
            f"{untrained}, which no object of the training split {train.source} has: a model "
            "cannot learn a class it never trains on. Add images of it to the training split, "
            "or set data.classes to the classes to use (objects of the others are then left "
            "out and counted)."
        )


def _without_unused_classes(
    config: dict[str, Any], train: SplitAnnotations, val: SplitAnnotations
) -> tuple[SplitAnnotations, SplitAnnotations]:
    """Both splits without the classes that neither has an object of (unless data.classes names
    them), in one info line; a validation split without objects refused."""
    if config["data"]["classes"]:
        return train, require_objects(val)
    used = set(train.used_classes) | set(val.used_classes)
    kept = [name for name in train.class_names if name in used]
    if len(kept) < len(train.class_names):
        log.info(
            "%s: categories %s have no objects in either split: left out of training and "
            "metrics; %d classes remain %s",
            ", ".join(dict.fromkeys(str(split.source) for split in (train, val))),
            [name for name in train.class_names if name not in used],
            len(kept),
            kept,
        )
        train, val = with_classes(train, kept), with_classes(val, kept)
    return train, require_objects(val)


def class_count(config: dict[str, Any]) -> int:
    """How many classes training will have, read as cheaply as the config allows: a data set's
    from both splits, as training leaves out the categories neither has an object of (an
    export's unused super-category; most of COCO's in a subset of it)."""
    data = config["data"]
    if data["classes"]:
        return len(data["classes"])
    if data["format"] == "synthetic":
        return len(data["synthetic"]["classes"])
    return len(load_splits(config)[0].class_names)
