"""What a user's data set is, wherever it lies: a digest of each split's annotation files.

The summary records these digests, and `compare` sets accuracy side by side by them instead of
by the files' paths: the same annotations at another mount path on another machine compare,
different annotations at the same path never do. Images are not hashed (a data set's images
are many and large; what was drawn on them is its annotations), so a data set whose images
alone were replaced reads the same. The synthetic set needs none: its settings say what it
holds.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from pipeline.config import validate
from pipeline.data import SPLITS, carved_splits, has_test_split, split_file
from pipeline.data.voc_source import xml_files

log = logging.getLogger("pipeline")
USER_FORMATS = ("coco", "voc")  # data.format of a user's data set: the others are generated
# The data keys that only say where the files are: with the files' digests beside them, two runs
# on the same annotations at other paths ran the same settings.
LOCATION_KEYS = (
    "root",
    "images_dir",
    *(f"{split}_{key}" for split in SPLITS for key in ("split", "annotations", "images_dir")),
)


def annotation_digests(config: dict[str, Any]) -> dict[str, str] | None:
    """Each split's sha256 of the annotation files training and evaluation read (a carved
    split: the training split's, whose fraction the settings hold); None for the synthetic set
    (and a config that names no format), and, with a warning, where a file cannot be read here
    (the summary then identifies the data by their paths, as before digests were recorded)."""
    data_format = (config.get("data") or {}).get("format")
    if data_format not in USER_FORMATS:
        return None
    voc = data_format == "voc"
    config = {"data": validate({"data": config["data"]})["data"]}  # defaults of a partial one
    carved = carved_splits(config)
    splits = [split for split in SPLITS if split != "test" or has_test_split(config)]
    read: dict[Path, str] = {}  # a VOCdevkit's Annotations folder is every split's: read once
    try:
        return {
            split: split_digest(
                split_file(config, "train" if split in carved else split), voc, read
            )
            for split in splits
        }
    except OSError as error:
        log.warning(
            "the annotation files cannot be read here (%s): the summary identifies the data set "
            "by its paths, so compare sets its accuracy only beside runs on the same paths",
            error,
        )
        return None


def split_digest(path: Path, voc: bool, read: dict[Path, str]) -> str:
    """The sha256 of what defines a split: a COCO file's bytes; a folder of VOC XML files'
    names and bytes; a VOCdevkit listing's bytes with every XML file of its Annotations folder
    (those of other splits too: more than the split reads, never less). `read`: the files'
    digests taken so far, by path, added to."""
    if path.is_dir():
        named = xml_files(path)
    elif voc:  # root/ImageSets/Main/<split>.txt
        named = [path, *xml_files(path.parents[2] / "Annotations")]
    else:
        named = [path]
    digest = hashlib.sha256()
    for file in named:
        if file not in read:
            read[file] = file_digest(file)
        digest.update(f"{file.name if len(named) > 1 else ''}\0{read[file]}\n".encode())
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    with path.open("rb") as stream:
        return hashlib.file_digest(stream, "sha256").hexdigest()


def identity(settings: dict[str, Any], digests: dict[str, str]) -> dict[str, Any]:
    """The accuracy settings as two runs on the same annotations share them, wherever their
    files lie: the data keys that locate files replaced by the files' digests."""
    data = {key: value for key, value in settings["data"].items() if key not in LOCATION_KEYS}
    return {**settings, "data": data, "annotations": digests}
