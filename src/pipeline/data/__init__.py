"""Data sets: the built-in synthetic set and loaders for a user's COCO or Pascal VOC data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.data.sources import SplitAnnotations, load_coco, load_voc
from pipeline.errors import DataError


def annotation_file(config: dict[str, Any], split: str) -> Path:
    """Where a COCO-format split's annotations are (the synthetic set is COCO too)."""
    data = config["data"]
    explicit = data.get(f"{split}_annotations")
    return (
        Path(explicit)
        if explicit
        else Path(data["root"]) / f"instances_{data[f'{split}_split']}.json"
    )


def _check_root(config: dict[str, Any]) -> Path:
    data = config["data"]
    root = Path(data["root"])
    if not root.is_dir():
        hint = (
            "Generate it with 'python -m pipeline prepare-data' (or 'snakemake prepare_data')."
            if data["format"] == "synthetic"
            else "Point data.root at your data set."
        )
        raise DataError(f"Data root {root} does not exist (config key data.root). {hint}")
    return root


def load_split(
    config: dict[str, Any], which: str, classes: list[str] | None = None
) -> SplitAnnotations:
    """One split ('train' or 'val'); `classes` fixes the label order (else the config's, else the file's)."""
    data = config["data"]
    root = _check_root(config)
    classes = classes or data["classes"]
    if data["format"] == "voc":
        return load_voc(root, data[f"{which}_split"], classes)
    return load_coco(annotation_file(config, which), data["images_dir"] or root, classes)


def load_splits(config: dict[str, Any]) -> tuple[SplitAnnotations, SplitAnnotations]:
    """Train and val annotations with one class list; different class lists are an error."""
    train = load_split(config, "train")
    if config["data"]["format"] == "voc":
        return train, load_split(config, "val", train.class_names)
    val = load_split(config, "val")
    if train.class_names != val.class_names:
        raise DataError(
            f"The training and validation splits define different classes: {train.source} has "
            f"{train.class_names}, {val.source} has {val.class_names}. Make them agree, or set "
            "data.classes to the list to use."
        )
    return train, val


def class_count(config: dict[str, Any]) -> int:
    """How many classes training will have, read as cheaply as the config allows."""
    data = config["data"]
    if data["classes"]:
        return len(data["classes"])
    if data["format"] == "synthetic":
        return len(data["synthetic"]["classes"])
    return len(load_split(config, "train").class_names)
