"""COCO and VOC loaders on small defective data sets, and the tensors DetectionDataset makes of them."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_runs import train_then_evaluate

from pipeline.config import load_config, merge
from pipeline.data import (
    annotation_file,
    class_count,
    has_test_split,
    images_dir,
    load_split,
    load_splits,
    split_files,
)
from pipeline.data.cache import Memory, available_memory
from pipeline.data.coco_source import load_coco
from pipeline.data.dataset import (
    Augment,
    DetectionDataset,
    EpochSampler,
    augment_sample,
    collate,
    default_num_workers,
    loader_for,
    make_loader,
    read_image,
)
from pipeline.data.geometry import PAD_VALUE, fit_boxes, fit_image
from pipeline.data.shapes import render_sample
from pipeline.data.sources import (
    ImageRecord,
    SplitAnnotations,
    check_image_files,
    with_classes,
)
from pipeline.data.synthetic import SyntheticSpec
from pipeline.data.voc_source import load_voc
from pipeline.errors import ConfigError, DataError

PALETTE_COLOUR = (200, 30, 60)
# categories with ids out of order and not contiguous: label order follows the sorted ids
CATEGORIES = [{"id": 7, "name": "dog"}, {"id": 3, "name": "cat"}]


def _write_images(folder: Path) -> dict[str, tuple[int, int]]:
    """One image per awkward mode; returns file name -> (width, height)."""
    folder.mkdir(parents=True, exist_ok=True)
    gray = Image.new("L", (40, 40), 90)
    gray.save(folder / "gray.png")
    rgba = Image.new("RGBA", (40, 40), (10, 20, 30, 128))
    rgba.save(folder / "rgba.png")
    palette = Image.new("P", (40, 40), 1)
    palette.putpalette([0, 0, 0, *PALETTE_COLOUR] + [0] * (256 * 3 - 6))
    palette.save(folder / "palette.png")
    Image.new("RGB", (80, 40), (0, 128, 255)).save(folder / "wide.png")
    Image.new("RGB", (32, 32), (5, 5, 5)).save(folder / "empty.png")
    return {
        "gray.png": (40, 40),
        "rgba.png": (40, 40),
        "palette.png": (40, 40),
        "wide.png": (80, 40),
        "empty.png": (32, 32),
    }


def _coco_document(
    sizes: dict[str, tuple[int, int]],
    annotations: list[dict[str, Any]],
    categories: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    images = [
        {"id": i, "file_name": name, "width": w, "height": h}
        for i, (name, (w, h)) in enumerate(sizes.items(), start=1)
    ]
    anns = [{"id": i, "iscrowd": 0, **ann} for i, ann in enumerate(annotations, start=1)]
    return {
        "images": images,
        "annotations": anns,
        "categories": categories or CATEGORIES,
    }


# image ids: 1 gray, 2 rgba, 3 palette, 4 wide, 5 empty (no annotations)
GOOD = [
    {"image_id": 1, "category_id": 3, "bbox": [2, 4, 10, 12]},
    {"image_id": 2, "category_id": 7, "bbox": [5, 5, 20, 10]},
    {"image_id": 3, "category_id": 3, "bbox": [30, 30, 20, 20]},  # clipped to 40x40
    {"image_id": 4, "category_id": 7, "bbox": [10, 5, 20, 20]},
    {"image_id": 4, "category_id": 3, "bbox": [0, 0, 5, 5], "iscrowd": 1},  # an ignore region
]
DEGENERATE = [
    {"image_id": 1, "category_id": 3, "bbox": [5, 5, 0, 10]},  # zero width
    {"image_id": 2, "category_id": 7, "bbox": [5, 20, 10, -6]},  # negative height
    {"image_id": 4, "category_id": 3, "bbox": [100, 10, 20, 10]},  # right of an 80-wide image
]


def _write_coco(root: Path, name: str, document: dict[str, Any]) -> Path:
    path = root / name
    path.write_text(json.dumps(document))
    return path


@pytest.fixture
def coco_root(tmp_path: Path) -> Path:
    """A COCO set with train and val splits sharing the awkward images."""
    root = tmp_path / "coco"
    sizes = _write_images(root)
    _write_coco(root, "instances_train.json", _coco_document(sizes, GOOD + DEGENERATE))
    _write_coco(root, "instances_val.json", _coco_document(sizes, GOOD))
    return root


def _coco_config(root: Path, *extra: str) -> dict[str, Any]:
    return load_config(None, [f"data.root={root}", "data.format=coco", *extra])


def _pipeline_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "pipeline" and r.levelno == logging.WARNING]


# ----------------------------------------------------------------------------- COCO


def test_coco_boxes_become_xyxy_with_labels_in_category_id_order(coco_root: Path) -> None:
    split = load_coco(coco_root / "instances_val.json", coco_root)
    assert split.class_names == ["cat", "dog"]  # ids 3 < 7
    by_name = {r.path.name: r for r in split.records}
    np.testing.assert_array_equal(by_name["gray.png"].boxes, [[2, 4, 12, 16]])
    np.testing.assert_array_equal(by_name["gray.png"].labels, [0])
    np.testing.assert_array_equal(by_name["rgba.png"].boxes, [[5, 5, 25, 15]])
    np.testing.assert_array_equal(by_name["rgba.png"].labels, [1])
    assert (by_name["wide.png"].width, by_name["wide.png"].height) == (80, 40)
    assert by_name["wide.png"].boxes.dtype == np.float32
    assert by_name["wide.png"].labels.dtype == np.int64


def test_coco_boxes_reaching_past_the_border_are_clipped_not_dropped(coco_root: Path) -> None:
    split = load_coco(coco_root / "instances_val.json", coco_root)
    palette = next(r for r in split.records if r.path.name == "palette.png")
    np.testing.assert_array_equal(palette.boxes, [[30, 30, 40, 40]])
    assert split.dropped_boxes == 0


def test_coco_crowd_annotations_become_ignore_regions_of_their_class(coco_root: Path) -> None:
    split = load_coco(coco_root / "instances_val.json", coco_root)
    wide = next(r for r in split.records if r.path.name == "wide.png")
    np.testing.assert_array_equal(wide.labels, [1])  # the crowd is no object
    np.testing.assert_array_equal(wide.ignore_boxes, [[0, 0, 5, 5]])
    np.testing.assert_array_equal(wide.ignore_labels, [0])  # cat
    gray = next(r for r in split.records if r.path.name == "gray.png")
    assert gray.ignore_boxes.shape == (0, 4) and gray.ignore_labels.shape == (0,)


def test_coco_a_box_cvat_exports_turned_is_read_as_the_upright_box_that_encloses_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """CVAT keeps a turned box's bbox as drawn and its angle in attributes.rotation: read as it
    stands, a box turned by 90 degrees would be wide where the object is tall."""
    sizes = _write_images(tmp_path)
    turned = [
        {
            "image_id": 1,
            "category_id": 3,
            "bbox": [10, 15, 20, 6],
            "attributes": {"rotation": 90.0},
        },
        {"image_id": 2, "category_id": 7, "bbox": [10, 10, 20, 10], "attributes": {"rotation": 30}},
        {"image_id": 4, "category_id": 7, "bbox": [10, 5, 20, 20], "attributes": {"rotation": 0.0}},
    ]
    source = _write_coco(tmp_path, "instances_default.json", _coco_document(sizes, turned))
    with caplog.at_level(logging.INFO, logger="pipeline"):
        split = load_coco(source, tmp_path)
    by_name = {r.path.name: r for r in split.records}
    np.testing.assert_allclose(by_name["gray.png"].boxes, [[17, 8, 23, 28]], atol=1e-4)
    # the corners of the 20 x 10 box turned by 30 degrees about its centre (20, 15)
    corners = np.array([[-10, -5], [10, -5], [10, 5], [-10, 5]], float)
    turn = np.radians(30)
    rotation = np.array([[np.cos(turn), -np.sin(turn)], [np.sin(turn), np.cos(turn)]])
    turned_corners = corners @ rotation.T + [20, 15]
    hull = [*turned_corners.min(axis=0), *turned_corners.max(axis=0)]
    np.testing.assert_allclose(by_name["rgba.png"].boxes, [hull], atol=1e-4)
    np.testing.assert_array_equal(by_name["wide.png"].boxes, [[10, 5, 30, 25]])
    lines = [r.getMessage() for r in caplog.records if "attributes.rotation" in r.getMessage()]
    assert lines == [
        f"{source}: 2 box(es) turned in the annotation tool (the angle in attributes.rotation, "
        "as CVAT exports them): each taken as the upright box that encloses it"
    ]


def test_coco_a_rotation_that_is_no_number_is_named_with_its_annotation(tmp_path: Path) -> None:
    sizes = _write_images(tmp_path)
    bad = [{"image_id": 1, "category_id": 3, "bbox": [1, 1, 5, 5], "attributes": {"rotation": "x"}}]
    source = _write_coco(tmp_path, "instances_default.json", _coco_document(sizes, bad))
    with pytest.raises(DataError, match=r'annotation 1 has the rotation "x" in its attributes'):
        load_coco(source, tmp_path)


def test_coco_degenerate_boxes_are_dropped_and_counted_in_one_warning(
    coco_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clean = load_coco(coco_root / "instances_val.json", coco_root)
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        split = load_coco(coco_root / "instances_train.json", coco_root)
    assert split.dropped_boxes == 3
    for dirty, kept in zip(split.records, clean.records, strict=True):
        np.testing.assert_array_equal(dirty.boxes, kept.boxes)
        np.testing.assert_array_equal(dirty.labels, kept.labels)
    warnings = _pipeline_warnings(caplog)
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "dropped 3 degenerate box(es)" in message
    assert "instances_train.json" in message


def test_coco_boxes_with_an_infinite_or_nan_size_are_dropped_saying_so_not_clipped_to_the_edge(
    coco_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    annotations = [
        {"image_id": 1, "category_id": 3, "bbox": [2, 4, float("inf"), 12]},
        {"image_id": 1, "category_id": 3, "bbox": [2, 4, 10, float("nan")]},
        {"image_id": 1, "category_id": 7, "bbox": [2, 4, 10, 12]},
    ]
    path = _write_coco(
        coco_root, "infinite.json", _coco_document({"gray.png": (40, 40)}, annotations)
    )
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        split = load_coco(path, coco_root)
    np.testing.assert_array_equal(split.records[0].boxes, [[2, 4, 12, 16]])
    assert (split.nonfinite_boxes, split.dropped_boxes) == (2, 0)
    assert [w.getMessage() for w in _pipeline_warnings(caplog)] == [
        f"{path}: dropped 2 box(es) with a coordinate that is not a finite number (NaN or infinity)"
    ]


def test_coco_without_degenerate_boxes_warns_nothing(
    coco_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        load_coco(coco_root / "instances_val.json", coco_root)
    assert _pipeline_warnings(caplog) == []


def test_coco_images_without_annotations_are_kept_as_negatives(coco_root: Path) -> None:
    split = load_coco(coco_root / "instances_val.json", coco_root)
    assert [r.path.name for r in split.records] == [
        "gray.png",
        "rgba.png",
        "palette.png",
        "wide.png",
        "empty.png",
    ]
    empty = split.records[-1]
    assert empty.boxes.shape == (0, 4) and empty.labels.shape == (0,)


def test_coco_missing_image_file_raises_naming_it(coco_root: Path) -> None:
    (coco_root / "rgba.png").unlink()
    with pytest.raises(DataError, match=r"rgba\.png") as caught:
        load_coco(coco_root / "instances_val.json", coco_root)
    assert "instances_val.json" in str(caught.value)


def test_coco_a_file_that_is_no_image_is_named_saying_how_to_leave_it_out(coco_root: Path) -> None:
    (coco_root / "gray.png").write_text("not an image")
    with pytest.raises(DataError) as caught:
        load_coco(coco_root / "instances_val.json", coco_root)
    message = str(caught.value)
    assert message.startswith(f"{coco_root / 'instances_val.json'} refers to file(s) that are not")
    assert str(coco_root / "gray.png") in message
    assert "leave it out of the data set: remove it and its annotation" in message


def test_coco_missing_annotation_file_raises_naming_it(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nowhere\.json"):
        load_coco(tmp_path / "nowhere.json", tmp_path)


def test_a_missing_coco_file_names_the_json_files_of_an_export_laid_out_by_split(
    tmp_path: Path,
) -> None:
    """A Roboflow export under data.root: each split's file in a folder of its own."""
    for split in ("train", "valid"):
        (tmp_path / split).mkdir()
        (tmp_path / split / "_annotations.coco.json").write_text("{}")
    config = _coco_config(tmp_path)
    with pytest.raises(DataError) as raised:
        load_split(config, "train")
    assert str(raised.value) == (
        f"COCO annotation file {tmp_path / 'instances_train.json'} does not exist (config "
        f"data.root / data.{{train,val,test}}_annotations). JSON files under {tmp_path}: "
        "train/_annotations.coco.json, valid/_annotations.coco.json. Name a split's file with "
        "data.train_annotations, data.val_annotations or data.test_annotations."
    )


def test_coco_malformed_json_raises_naming_the_file(coco_root: Path) -> None:
    path = coco_root / "broken.json"
    path.write_text('{"images": [')
    with pytest.raises(DataError, match=r"broken\.json.*not valid JSON"):
        load_coco(path, coco_root)


@pytest.mark.parametrize(
    "document",
    [
        {"images": [], "annotations": []},  # no categories
        {"categories": [{"id": 1}], "images": []},  # category without a name
        [1, 2, 3],  # not an object
    ],
    ids=["no-categories", "nameless-category", "list"],
)
def test_coco_malformed_structure_raises_naming_the_file(coco_root: Path, document: Any) -> None:
    path = _write_coco(coco_root, "odd.json", document)
    with pytest.raises(DataError, match=r"odd\.json"):
        load_coco(path, coco_root)


# how exports leave an image's size out: keys absent, null, or 0 where a tool could not read it
NO_SIZE = {"absent": {}, "null": {"width": None, "height": None}, "zero": {"width": 0, "height": 0}}


@pytest.mark.parametrize("size", NO_SIZE.values(), ids=NO_SIZE)
def test_coco_an_image_entry_without_a_size_takes_the_image_files_size(
    coco_root: Path, size: dict[str, Any]
) -> None:
    # wide.png is 80x40: the box reaching past its right edge is clipped to the file's size
    image = {"id": 1, "file_name": "wide.png", **size}
    annotation = {"id": 1, "image_id": 1, "category_id": 3, "bbox": [70, 5, 20, 10]}
    document = {"images": [image], "annotations": [annotation], "categories": CATEGORIES}
    split = load_coco(_write_coco(coco_root, "sizeless.json", document), coco_root)
    record = split.records[0]
    assert (record.width, record.height) == (80, 40)
    np.testing.assert_array_equal(record.boxes, [[70, 5, 80, 15]])


def test_coco_an_image_without_a_size_has_its_header_read_once_while_loading_checks_images(
    coco_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sized from its header, it has no annotated size for the image check to hold against
    the file: the check does not open it again. One with one side given is still checked."""
    document = _coco_document(_write_images(coco_root), GOOD)
    document["images"][0].update(width=0, height=0)
    document["images"][1].update(height=0)
    path = _write_coco(coco_root, "sizeless.json", document)
    opened: list[str] = []
    real_open = Image.open

    def counted_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(Path(file).name)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(Image, "open", counted_open)
    split = load_coco(path, coco_root)
    names = [record.path.name for record in split.records]
    assert opened.count(names[0]) == 1
    assert opened.count(names[1]) == 2  # its given width is held against the file
    assert all(opened.count(name) == 1 for name in names[2:])


def test_coco_images_without_a_size_are_counted_in_one_info_line_per_split(
    coco_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    document = _coco_document(_write_images(coco_root), GOOD)
    for image in document["images"][:3]:
        image.update(width=0)
    document["images"][3].pop("height")
    path = _write_coco(coco_root, "sizeless.json", document)
    with caplog.at_level(logging.INFO, logger="pipeline"):
        split = load_coco(path, coco_root)
    assert [(r.width, r.height) for r in split.records] == list(_write_images(coco_root).values())
    said = [r.getMessage() for r in caplog.records if "width/height" in r.getMessage()]
    assert said == [
        f"{path}: 4 image(s) have no width/height in the annotations: read from the image files"
    ]


def test_coco_a_given_size_is_still_checked_against_the_file_beside_entries_without_one(
    coco_root: Path,
) -> None:
    # gray.png without a size; wide.png (80x40) with a wrong width and no height; a negative
    # width is no "not given"
    images = [
        {"id": 1, "file_name": "gray.png"},
        {"id": 2, "file_name": "wide.png", "width": 40, "height": 0},
        {"id": 3, "file_name": "empty.png", "width": -32, "height": 32},
    ]
    document = {"images": images, "annotations": [], "categories": CATEGORIES}
    path = _write_coco(coco_root, "half_sized.json", document)
    with pytest.raises(DataError) as raised:
        load_coco(path, coco_root)
    assert str(raised.value).startswith(
        f"{path}: 2 image(s) are not the size their annotation says: {coco_root / 'wide.png'} "
        "is annotated 40x40 but is 80x40 (width x height, EXIF orientation applied), "
        f"{coco_root / 'empty.png'} is annotated -32x32 but is 32x32 (width x height, EXIF "
        "orientation applied)."
    )


@pytest.mark.parametrize("check_images", [True, False])
def test_coco_a_missing_image_whose_size_must_be_read_is_named_as_the_image_check_names_it(
    coco_root: Path, check_images: bool
) -> None:
    images = [{"id": 1, "file_name": "gray.png"}, {"id": 2, "file_name": "gone.png"}]
    document = {"images": images, "annotations": [], "categories": CATEGORIES}
    path = _write_coco(coco_root, "sizeless.json", document)
    with pytest.raises(DataError) as raised:
        load_coco(path, coco_root, check_images=check_images)
    assert str(raised.value) == (
        f"{path} refers to image file(s) that do not exist: {coco_root / 'gone.png'}. Check the "
        f"images folder {coco_root} (by default the annotation file's folder), where a file_name "
        "that names no file as written is looked up by its base name: set data.images_dir (or "
        "data.<split>_images_dir) to the folder that holds the images, or regenerate the data set."
    )


def test_coco_malformed_bbox_raises_naming_the_file(coco_root: Path) -> None:
    sizes = {"gray.png": (40, 40)}
    document = _coco_document(sizes, [{"image_id": 1, "category_id": 3, "bbox": [1, 2, 3]}])
    path = _write_coco(coco_root, "short_bbox.json", document)
    with pytest.raises(DataError, match=r"short_bbox\.json"):
        load_coco(path, coco_root)


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        ({"image_id": 1, "category_id": 3}, "annotation 1 has no 'bbox' ("),
        ({"image_id": 1, "bbox": [1, 2, 3, 4]}, "annotation 1 has no 'category_id' ("),
        (
            {"image_id": 1, "category_id": 3, "bbox": None},
            "annotation 1 has the bbox null, not 4 numbers [x, y, width, height].",
        ),
        (
            {"image_id": "img1", "category_id": 3, "bbox": [1, 2, 3, 4]},
            'annotation 1 has image_id "img1", which is not an integer.',
        ),
    ],
)
def test_coco_an_annotation_that_does_not_read_is_named_with_the_key_or_value_at_fault(
    coco_root: Path, entry: dict[str, Any], said: str
) -> None:
    path = _write_coco(coco_root, "bad.json", _coco_document({"gray.png": (40, 40)}, [entry]))
    with pytest.raises(DataError) as raised:
        load_coco(path, coco_root)
    assert str(raised.value).startswith(f"COCO annotation file {path}: {said}")


@pytest.mark.parametrize(
    ("image", "said"),
    [
        ({"id": 1, "width": 40, "height": 40}, "image entry 0 has no 'file_name' ("),
        (
            {"id": 1, "file_name": "gray.png", "width": "abc", "height": 40},
            'image entry 0 has width "abc", which is not an integer.',
        ),
        (
            {"id": "img1", "file_name": "gray.png", "width": 40, "height": 40},
            'image entry 0 has id "img1", which is not an integer.',
        ),
        (
            {"id": 1, "file_name": "gray.png", "width": 40.5, "height": 40},
            "image entry 0 has width 40.5, which is not an integer.",
        ),
    ],
)
def test_coco_an_image_entry_that_does_not_read_is_named_with_the_key_or_value_at_fault(
    coco_root: Path, image: dict[str, Any], said: str
) -> None:
    document = {"images": [image], "annotations": [], "categories": CATEGORIES}
    path = _write_coco(coco_root, "bad.json", document)
    with pytest.raises(DataError) as raised:
        load_coco(path, coco_root)
    assert str(raised.value).startswith(f"COCO annotation file {path}: {said}")


def test_coco_ids_and_sizes_written_as_whole_floats_or_text_read_as_integers(
    coco_root: Path,
) -> None:
    image = {"id": "1", "file_name": "gray.png", "width": 40.0, "height": "40"}
    document = {"images": [image], "annotations": [], "categories": CATEGORIES}
    split = load_coco(_write_coco(coco_root, "loose.json", document), coco_root)
    record = split.records[0]
    assert (record.image_id, record.width, record.height) == (1, 40, 40)


@pytest.mark.parametrize("value", ["0", "1", 2, None, "no"])
def test_coco_iscrowd_other_than_0_or_1_is_refused_never_read_as_a_crowd(
    coco_root: Path, value: Any
) -> None:
    """Python reads the string "0" as true: the object would silently become an ignore region."""
    entry = {"image_id": 1, "category_id": 3, "bbox": [1, 2, 3, 4]}
    document = _coco_document({"gray.png": (40, 40)}, [entry])
    document["annotations"][0]["iscrowd"] = value
    path = _write_coco(coco_root, "crowd.json", document)
    with pytest.raises(DataError) as raised:
        load_coco(path, coco_root)
    assert str(raised.value) == (
        f"COCO annotation file {path}: annotation 1 has iscrowd {json.dumps(value)}; COCO's "
        "iscrowd is 0 (an object) or 1 (a crowd region, ignored)."
    )


def test_coco_iscrowd_as_a_boolean_or_absent_reads_as_cocos_0_and_1(coco_root: Path) -> None:
    entries = [{"image_id": 1, "category_id": 3, "bbox": [1, 2, 3, 4]}] * 3
    document = _coco_document({"gray.png": (40, 40)}, entries)
    document["annotations"][0]["iscrowd"] = True
    document["annotations"][1]["iscrowd"] = False
    del document["annotations"][2]["iscrowd"]
    split = load_coco(_write_coco(coco_root, "crowd.json", document), coco_root)
    assert (len(split.records[0].boxes), len(split.records[0].ignore_boxes)) == (2, 1)


def test_coco_a_category_id_listed_twice_raises_naming_both_names(coco_root: Path) -> None:
    categories = [*CATEGORIES, {"id": CATEGORIES[0]["id"], "name": "blob"}]
    document = _coco_document({"gray.png": (40, 40)}, [], categories)
    path = _write_coco(coco_root, "twice.json", document)
    with pytest.raises(DataError) as raised:
        load_coco(path, coco_root)
    assert str(raised.value) == (
        f"COCO annotation file {path} lists category id {CATEGORIES[0]['id']} twice: as "
        f"{CATEGORIES[0]['name']!r} and as 'blob'. Category ids must be unique: give each "
        "category its own id."
    )


def test_coco_a_super_category_named_as_its_one_class_is_one_class(coco_root: Path) -> None:
    """A one-class export whose project (its super-category, id 0) has the class's name."""
    categories = [
        {"id": 0, "name": "helmet", "supercategory": "none"},
        {"id": 1, "name": "helmet", "supercategory": "helmet"},
    ]
    entry = {"image_id": 1, "category_id": 1, "bbox": [1, 2, 3, 4]}
    path = _write_coco(
        coco_root, "one.json", _coco_document({"gray.png": (40, 40)}, [entry], categories)
    )
    split = load_coco(path, coco_root)
    assert split.class_names == ["helmet"]
    assert split.records[0].labels.tolist() == [0]


def test_coco_a_file_that_starts_with_a_utf8_byte_order_mark_loads(coco_root: Path) -> None:
    """As Windows tools save UTF-8; json.loads refuses the mark."""
    text = json.dumps(_coco_document({"gray.png": (40, 40)}, GOOD[:1]))
    path = coco_root / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert len(load_coco(path, coco_root).records[0].boxes) == 1
    (coco_root / "bom_nan.json").write_bytes(
        b"\xef\xbb\xbf" + text.replace('"iscrowd": 0', '"area": NaN, "iscrowd": 0').encode()
    )
    assert len(load_coco(coco_root / "bom_nan.json", coco_root).records) == 1


def test_coco_a_file_name_with_windows_separators_names_the_file_in_its_subfolder(
    coco_root: Path,
) -> None:
    (coco_root / "shots").mkdir()
    (coco_root / "gray.png").rename(coco_root / "shots" / "gray.png")
    image = {"id": 1, "file_name": "shots\\gray.png", "width": 40, "height": 40}
    document = {"images": [image], "annotations": [], "categories": CATEGORIES}
    split = load_coco(_write_coco(coco_root, "windows.json", document), coco_root)
    assert split.records[0].path == coco_root / "shots" / "gray.png"


def _tool_export(export: Path, file_names: list[str]) -> Path:
    """An annotation tool's "COCO with images" export: result.json beside images/, each image
    under the base name of its file_name, one box on each; returns result.json."""
    images = export / "images"
    images.mkdir(parents=True)
    entries, annotations = [], []
    for image_id, file_name in enumerate(file_names, 1):
        base = file_name.replace("\\", "/").rsplit("/", 1)[-1]
        Image.new("RGB", (40 + image_id, 30), (image_id, 0, 0)).save(images / base)
        entries.append(
            {"id": image_id, "file_name": file_name, "width": 40 + image_id, "height": 30}
        )
        annotations.append(
            {"id": image_id, "image_id": image_id, "category_id": 3, "bbox": [image_id, 2, 10, 8]}
        )
    document = {"images": entries, "annotations": annotations, "categories": CATEGORIES}
    return _write_coco(export, "result.json", document)


# file_names as annotation tools write them, where the image sits in the export's images/
TOOL_FILE_NAMES = {
    # Label Studio 1.16, "Export COCO with images" (label-studio issue 7294)
    "upload path, Windows": [
        "..\\..\\label-studio\\label-studio\\media\\upload\\4\\cb0618f6-x.png"
    ],
    # Label Studio with local storage and with uploads (label-studio issue 4903)
    "local storage URL": [
        "data/local-files/?d=dataset1/0.png",
        "data/local-files/?d=dataset1/1.png",
    ],
    "upload path": ["/data/upload/12/abc.jpg"],
    # the paths of the annotator's machine
    "absolute paths": ["C:\\Users\\me\\photos\\a.jpg", "/home/me/b.jpg"],
}


@pytest.mark.parametrize("case", TOOL_FILE_NAMES)
def test_coco_an_exports_file_name_that_names_no_file_is_found_by_its_base_name_in_the_images_folder(
    tmp_path: Path, case: str
) -> None:
    file_names = TOOL_FILE_NAMES[case]
    export = tmp_path / "export"
    split = load_coco(_tool_export(export, file_names), export / "images")
    bases = [name.replace("\\", "/").rsplit("/", 1)[-1] for name in file_names]
    assert [record.path for record in split.records] == [export / "images" / b for b in bases]
    for image_id, record in enumerate(split.records, 1):
        assert (record.width, record.height) == (40 + image_id, 30)
        assert record.boxes.tolist() == [[image_id, 2, image_id + 10, 10]]
        assert record.labels.tolist() == [0]


def test_coco_file_names_found_by_base_name_are_counted_in_one_info_line_with_an_example(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    export = tmp_path / "export"
    names = ["data/local-files/?d=dataset1/0.png", "data/local-files/?d=dataset1/1.png"]
    config = _coco_config(
        export,
        f"data.val_annotations={export / 'result.json'}",
        f"data.val_images_dir={export / 'images'}",
    )
    _tool_export(export, names)
    with caplog.at_level(logging.INFO, logger="pipeline"):
        load_split(config, "val")
    resolved = [r.getMessage() for r in caplog.records if "base name" in r.getMessage()]
    assert resolved == [
        f"{export / 'result.json'}: 2 image file_name(s) name no file in {export / 'images'}: "
        f"found there by their base name (e.g. {names[0]} -> {export / 'images' / '0.png'})"
    ]


@pytest.mark.parametrize("check_images", [True, False])
def test_coco_a_file_name_found_neither_as_written_nor_by_base_name_is_named_suggesting_images_dir(
    tmp_path: Path, check_images: bool
) -> None:
    export = tmp_path / "export"
    path = _tool_export(export, ["/data/upload/12/abc.jpg"])
    # the images folder left at its default, the annotation file's folder: images/ is not searched
    with pytest.raises(DataError) as raised:
        check_image_files(load_coco(path, export, check_images=check_images))
    assert str(raised.value) == (
        f"{path} refers to image file(s) that do not exist: /data/upload/12/abc.jpg. Check the "
        f"images folder {export} (by default the annotation file's folder), where a file_name "
        "that names no file as written is looked up by its base name: set data.images_dir (or "
        "data.<split>_images_dir) to the folder that holds the images, or regenerate the data set."
    )


def test_coco_two_file_names_found_by_base_name_as_one_file_are_refused(tmp_path: Path) -> None:
    export = tmp_path / "export"
    path = _tool_export(export, ["C:\\shots\\a.jpg"])
    document = json.loads(path.read_text())
    document["images"].append({**document["images"][0], "id": 2, "file_name": "/home/me/a.jpg"})
    path.write_text(json.dumps(document))
    with pytest.raises(DataError) as raised:
        load_coco(path, export / "images")
    assert str(raised.value) == (
        f"COCO annotation file {path} lists the image file {export / 'images' / 'a.jpg'} twice: "
        "under image ids 1 and 2 (found as 'C:/shots/a.jpg' by its base name and "
        "'/home/me/a.jpg' by its base name). It would count twice; list each file once, with "
        "all its annotations under one id."
    )


def test_coco_a_file_name_that_names_a_file_as_written_is_never_looked_up_by_base_name(
    coco_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (coco_root / "shots").mkdir()
    Image.new("L", (40, 40), 200).save(coco_root / "shots" / "gray.png")  # gray.png is beside
    image = {"id": 1, "file_name": "shots/gray.png", "width": 40, "height": 40}
    document = {"images": [image], "annotations": [], "categories": CATEGORIES}
    with caplog.at_level(logging.INFO, logger="pipeline"):
        split = load_coco(_write_coco(coco_root, "nested.json", document), coco_root)
    assert split.records[0].path == coco_root / "shots" / "gray.png"
    assert not [r for r in caplog.records if "base name" in r.getMessage()]


def test_coco_a_file_name_is_not_looked_up_in_the_subfolders_of_the_images_folder(
    coco_root: Path,
) -> None:
    (coco_root / "shots").mkdir()
    Image.new("L", (40, 40), 200).save(coco_root / "shots" / "deep.png")
    image = {"id": 1, "file_name": "C:\\elsewhere\\deep.png", "width": 40, "height": 40}
    document = {"images": [image], "annotations": [], "categories": CATEGORIES}
    with pytest.raises(DataError, match=r"do not exist: .*deep\.png"):
        load_coco(_write_coco(coco_root, "deep.json", document), coco_root)


def test_coco_boxes_all_under_a_pixel_are_refused_as_fractions_of_the_image(
    coco_root: Path,
) -> None:
    """YOLO's coordinates copied into a COCO file: every object a dot, every figure 0."""
    sizes = {
        "gray.png": (40, 40),
        "rgba.png": (40, 40),
        "palette.png": (40, 40),
        "wide.png": (80, 40),
    }
    entries = [
        {"image_id": 1, "category_id": 3, "bbox": [0.1, 0.2, 0.25, 0.5]},
        {"image_id": 4, "category_id": 7, "bbox": [0.5, 0.5, 0.4, 0.3]},
    ]
    path = _write_coco(
        coco_root,
        "yolo.json",
        _coco_document(sizes, entries),
    )
    with pytest.raises(DataError) as raised:
        load_coco(path, coco_root)
    assert str(raised.value) == (
        f"{path}: every box is less than a pixel wide and high (the largest 0.4 x 0.5): these "
        "look like fractions of the image, as YOLO gives them, where boxes here are in the "
        "image's pixels. Multiply them by each image's width and height."
    )
    entries.append({"image_id": 1, "category_id": 3, "bbox": [5, 5, 1, 1]})  # one pixel: a dot
    path = _write_coco(
        coco_root,
        "dots.json",
        _coco_document(sizes, entries),
    )
    assert sum(len(record.boxes) for record in load_coco(path, coco_root).records) == 3


def test_coco_unknown_category_id_raises_naming_it(coco_root: Path) -> None:
    sizes = {"gray.png": (40, 40)}
    document = _coco_document(sizes, [{"image_id": 1, "category_id": 99, "bbox": [1, 1, 5, 5]}])
    path = _write_coco(coco_root, "unknown_cat.json", document)
    with pytest.raises(DataError, match=r"category_id 99") as caught:
        load_coco(path, coco_root)
    assert "unknown_cat.json" in str(caught.value)


def test_coco_annotation_of_an_unlisted_image_raises(coco_root: Path) -> None:
    sizes = {"gray.png": (40, 40)}
    document = _coco_document(sizes, [{"image_id": 42, "category_id": 3, "bbox": [1, 1, 5, 5]}])
    path = _write_coco(coco_root, "orphan.json", document)
    with pytest.raises(DataError, match=r"orphan\.json.*image_id 42"):
        load_coco(path, coco_root)


def test_coco_duplicate_image_ids_raise_naming_the_id_and_both_files(coco_root: Path) -> None:
    document = _coco_document({"gray.png": (40, 40), "rgba.png": (40, 40)}, [])
    document["images"][1]["id"] = 1
    path = _write_coco(coco_root, "twice.json", document)
    with pytest.raises(DataError) as caught:
        load_coco(path, coco_root)
    message = str(caught.value)
    assert "twice.json" in message and "image id 1" in message
    assert "gray.png" in message and "rgba.png" in message


def test_coco_image_file_listed_under_two_ids_raises_naming_it_and_both_ids(
    coco_root: Path,
) -> None:
    document = _coco_document({"gray.png": (40, 40), "rgba.png": (40, 40)}, [])
    document["images"][1]["file_name"] = "./gray.png"
    path = _write_coco(coco_root, "same_file.json", document)
    with pytest.raises(DataError) as caught:
        load_coco(path, coco_root)
    assert str(caught.value).startswith(
        f"COCO annotation file {path} lists the image file ./gray.png twice: under image ids 1 "
        "and 2."
    )


def test_coco_split_without_images_raises_as_empty(coco_root: Path) -> None:
    path = _write_coco(coco_root, "none.json", {"categories": CATEGORIES, "images": []})
    with pytest.raises(DataError, match=r"none\.json.*empty"):
        load_coco(path, coco_root)


def test_classes_argument_fixes_the_label_order(coco_root: Path) -> None:
    split = load_coco(coco_root / "instances_val.json", coco_root, classes=["dog", "cat"])
    assert split.class_names == ["dog", "cat"]
    labels = {r.path.name: r.labels.tolist() for r in split.records}
    assert labels["gray.png"] == [1]  # cat
    assert labels["rgba.png"] == [0]  # dog


def test_a_subset_of_classes_drops_the_other_classes_objects(coco_root: Path) -> None:
    split = load_coco(coco_root / "instances_val.json", coco_root, classes=["dog"])
    assert split.class_names == ["dog"]
    labels = {r.path.name: r.labels.tolist() for r in split.records}
    assert labels == {
        "gray.png": [],
        "rgba.png": [0],
        "palette.png": [],
        "wide.png": [0],
        "empty.png": [],
    }


def test_classes_the_file_does_not_define_raise_naming_them(coco_root: Path) -> None:
    with pytest.raises(DataError, match=r"horse"):
        load_coco(coco_root / "instances_val.json", coco_root, classes=["cat", "horse"])


def test_classes_the_file_does_not_define_are_named_with_the_names_they_resemble(
    coco_root: Path,
) -> None:
    path = coco_root / "instances_val.json"
    with pytest.raises(DataError) as raised:
        load_coco(path, coco_root, classes=["Cat", "horse"])
    assert str(raised.value) == (
        f"data.classes names ['Cat', 'horse'], which {path} does not define (it has ['cat', "
        "'dog']). Did you mean ['cat']?"
    )


# ------------------------------------------------------- config-driven loading (data/__init__)


def test_load_splits_reads_both_coco_splits_from_the_config(coco_root: Path) -> None:
    train, val = load_splits(_coco_config(coco_root))
    assert train.source == coco_root / "instances_train.json"
    assert val.source == coco_root / "instances_val.json"
    assert train.class_names == val.class_names == ["cat", "dog"]
    assert len(train.records) == len(val.records) == 5


def test_data_classes_in_the_config_fixes_the_label_order(coco_root: Path) -> None:
    train, val = load_splits(_coco_config(coco_root, "data.classes=[dog, cat]"))
    assert train.class_names == val.class_names == ["dog", "cat"]
    gray = next(r for r in val.records if r.path.name == "gray.png")
    assert gray.labels.tolist() == [1]


def test_different_coco_class_lists_in_train_and_val_raise_naming_both_files(
    coco_root: Path,
) -> None:
    sizes = {"gray.png": (40, 40)}
    other = _coco_document(sizes, [], categories=[{"id": 3, "name": "cat"}])
    _write_coco(coco_root, "instances_val.json", other)
    with pytest.raises(DataError) as caught:
        load_splits(_coco_config(coco_root))
    message = str(caught.value)
    assert str(coco_root / "instances_train.json") in message
    assert str(coco_root / "instances_val.json") in message


def test_coco_splits_that_number_the_same_classes_differently_are_matched_by_name(
    coco_root: Path,
) -> None:
    renumbered = [{"id": 1, "name": "dog"}, {"id": 2, "name": "cat"}]  # train: cat 3, dog 7
    sizes = {"gray.png": (40, 40), "rgba.png": (40, 40)}
    annotations = [
        {"image_id": 1, "category_id": 2, "bbox": [2, 4, 10, 12]},  # cat
        {"image_id": 2, "category_id": 1, "bbox": [5, 5, 20, 10]},  # dog
    ]
    _write_coco(coco_root, "instances_val.json", _coco_document(sizes, annotations, renumbered))
    train, val = load_splits(_coco_config(coco_root))
    assert train.class_names == val.class_names == ["cat", "dog"]
    gray, rgba = val.records
    assert val.class_names[gray.labels[0]] == "cat"
    assert val.class_names[rgba.labels[0]] == "dog"


def test_a_coco_class_with_objects_only_in_validation_names_the_file_and_the_class(
    coco_root: Path,
) -> None:
    """Both files list cat and dog, as every split of an export lists its categories, but no
    training object is a dog: the model could not learn it, as a VOC split's is refused."""
    cats_only = [ann for ann in GOOD if ann["category_id"] == 3]
    _write_coco(
        coco_root,
        "instances_train.json",
        _coco_document(
            {
                "gray.png": (40, 40),
                "rgba.png": (40, 40),
                "palette.png": (40, 40),
                "wide.png": (80, 40),
            },
            cats_only,
        ),
    )
    with pytest.raises(DataError) as caught:
        load_splits(_coco_config(coco_root))
    assert str(caught.value).startswith(
        f"COCO annotation file {coco_root / 'instances_val.json'} (split 'val') has objects of "
        f"class(es) ['dog'], which no object of the training split "
        f"{coco_root / 'instances_train.json'} has: a model cannot learn a class it never "
        "trains on."
    )
    train, val = load_splits(_coco_config(coco_root, "data.classes=[cat]"))
    assert train.class_names == val.class_names == ["cat"]
    assert val.other_class_objects == 2


def test_explicit_annotation_files_and_images_dir_override_the_root(
    coco_root: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "annotations"
    elsewhere.mkdir()
    (coco_root / "instances_val.json").rename(elsewhere / "my_val.json")
    config = _coco_config(
        tmp_path,
        f"data.val_annotations={elsewhere / 'my_val.json'}",
        f"data.images_dir={coco_root}",
    )
    assert annotation_file(config, "val") == elsewhere / "my_val.json"
    assert annotation_file(config, "train") == tmp_path / "instances_train.json"
    split = load_split(config, "val")
    assert split.records[0].path == coco_root / "gray.png"


def test_a_missing_data_root_raises_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data\.root"):
        load_split(_coco_config(tmp_path / "absent"), "train")


# ------------------------------------------------------------------------------ VOC


def _voc_xml(file_name: str, size: tuple[int, int], objects: list[tuple]) -> str:
    parts = [
        "<annotation>",
        f"<filename>{file_name}</filename>",
        f"<size><width>{size[0]}</width><height>{size[1]}</height><depth>3</depth></size>",
    ]
    for name, box, *difficult in objects:
        xmin, ymin, xmax, ymax = box
        parts.append(
            f"<object><name>{name}</name><difficult>{difficult[0] if difficult else 0}</difficult>"
            f"<bndbox><xmin>{xmin}</xmin><ymin>{ymin}</ymin><xmax>{xmax}</xmax><ymax>{ymax}</ymax>"
            "</bndbox></object>"
        )
    parts.append("</annotation>")
    return "\n".join(parts)


@pytest.fixture
def voc_root(tmp_path: Path) -> Path:
    root = tmp_path / "voc"
    sizes = _write_images(root / "JPEGImages")
    (root / "Annotations").mkdir()
    (root / "ImageSets" / "Main").mkdir(parents=True)
    objects = {
        # VOC boxes are 1-based and inclusive: xmin=6, xmax=5 is zero pixels wide
        "gray": [("person", (11, 6, 30, 25)), ("bird", (6, 5, 5, 20))],
        "rgba": [("bird", (1, 1, 40, 40)), ("person", (3, 30, 10, 20))],  # 2nd: negative height
        "palette": [("person", (2, 2, 8, 8), 1)],  # difficult: an ignore region
        "wide": [("bird", (11, 6, 30, 25)), ("person", (90, 1, 99, 10))],  # 2nd: outside
        "empty": [],
    }
    for stem, objs in objects.items():
        xml = _voc_xml(f"{stem}.png", sizes[f"{stem}.png"], objs)
        (root / "Annotations" / f"{stem}.xml").write_text(xml)
    (root / "ImageSets" / "Main" / "train.txt").write_text("\n".join(objects) + "\n")
    (root / "ImageSets" / "Main" / "val.txt").write_text("gray\n\nwide\n")
    return root


def test_voc_one_based_inclusive_boxes_become_zero_based_xyxy(voc_root: Path) -> None:
    split = load_voc(voc_root, "val")
    assert split.class_names == ["bird", "person"]
    gray, wide = split.records
    np.testing.assert_array_equal(gray.boxes, [[10, 5, 30, 25]])
    np.testing.assert_array_equal(gray.labels, [1])
    np.testing.assert_array_equal(wide.boxes, [[10, 5, 30, 25]])
    np.testing.assert_array_equal(wide.labels, [0])
    assert (wide.width, wide.height) == (80, 40)
    assert wide.path == voc_root / "JPEGImages" / "wide.png"


def test_voc_degenerate_boxes_are_dropped_in_one_warning_and_difficult_ones_become_ignore_regions(
    voc_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        split = load_voc(voc_root, "train")
    assert split.dropped_boxes == 3
    assert [len(r.boxes) for r in split.records] == [1, 1, 0, 1, 0]
    palette = split.records[2]
    np.testing.assert_array_equal(palette.ignore_boxes, [[1, 1, 8, 8]])
    np.testing.assert_array_equal(palette.ignore_labels, [split.class_names.index("person")])
    warnings = _pipeline_warnings(caplog)
    assert len(warnings) == 1
    assert "dropped 3 degenerate box(es)" in warnings[0].getMessage()
    assert "train.txt" in warnings[0].getMessage()


def test_voc_images_without_objects_are_kept_as_negatives(voc_root: Path) -> None:
    split = load_voc(voc_root, "train")
    assert len(split.records) == 5
    assert split.records[-1].path.name == "empty.png"
    assert split.records[-1].boxes.shape == (0, 4)


def test_voc_malformed_xml_raises_naming_the_file(voc_root: Path) -> None:
    (voc_root / "Annotations" / "wide.xml").write_text("<annotation><size>")
    with pytest.raises(DataError, match=r"wide\.xml.*not valid XML"):
        load_voc(voc_root, "val")


def test_voc_missing_xml_raises_naming_it_and_the_listing(voc_root: Path) -> None:
    (voc_root / "Annotations" / "wide.xml").unlink()
    with pytest.raises(DataError, match=r"wide\.xml") as caught:
        load_voc(voc_root, "val")
    assert "val.txt" in str(caught.value)


def test_voc_a_root_one_level_above_its_vocdevkit_is_refused_naming_the_folder_to_give(
    voc_root: Path,
) -> None:
    """As VOCdevkit/ is given for VOCdevkit/VOC2007/, or a published set's repository for the
    folder inside it that holds ImageSets."""
    with pytest.raises(DataError) as caught:
        load_voc(voc_root.parent, "val")
    assert str(caught.value).endswith(
        f" {voc_root} holds ImageSets/Main/val.txt: set data.root to it."
    )


def test_voc_a_split_without_its_listing_is_refused_naming_the_listings_there(
    voc_root: Path,
) -> None:
    with pytest.raises(DataError) as caught:
        load_voc(voc_root, "valid")
    assert str(caught.value).endswith(
        f" {voc_root / 'ImageSets' / 'Main'} lists the splits train, val: name them in "
        "data.train_split, data.val_split and data.test_split."
    )


def test_voc_a_single_listing_such_as_cvats_default_is_refused_saying_to_carve_the_others(
    voc_root: Path,
) -> None:
    (voc_root / "ImageSets" / "Main" / "val.txt").unlink()
    (voc_root / "ImageSets" / "Main" / "train.txt").rename(
        voc_root / "ImageSets" / "Main" / "default.txt"
    )
    with pytest.raises(DataError) as caught:
        load_voc(voc_root, "train")
    assert str(caught.value).endswith(
        f" {voc_root / 'ImageSets' / 'Main'} lists the splits default alone (as CVAT's export "
        "lists every image in default): set data.train_split=default, and carve validation and "
        "test out of it by data.val_fraction and data.test_fraction (docs/data.md, One set "
        "without splits)."
    )


def test_voc_a_root_without_listings_is_refused_pointing_to_the_folder_layout_and_the_carve(
    voc_root: Path,
) -> None:
    for listing in (voc_root / "ImageSets" / "Main").iterdir():
        listing.unlink()
    with pytest.raises(DataError) as caught:
        load_voc(voc_root, "train")
    message = str(caught.value)
    assert f" {voc_root} has Annotations/ but no split listings: name the XML folder" in message
    assert "data.train_annotations" in message and "data.images_dir" in message
    assert "data.val_fraction" in message


@pytest.mark.parametrize(
    ("written", "difficult"), [("1", True), ("True", True), ("false", False), ("", False)]
)
def test_voc_difficult_reads_0_1_true_false_and_empty(
    voc_root: Path, written: str, difficult: bool
) -> None:
    xml = _voc_xml(
        "gray.png", (40, 40), [("bird", (1, 1, 10, 10), written), ("person", (1, 1, 20, 20))]
    )
    (voc_root / "Annotations" / "gray.xml").write_text(xml)
    gray = load_voc(voc_root, "val").records[0]
    assert (len(gray.boxes), len(gray.ignore_boxes)) == ((1, 1) if difficult else (2, 0))


def test_voc_difficult_of_another_value_is_refused_never_read_as_not_difficult(
    voc_root: Path,
) -> None:
    xml = _voc_xml("gray.png", (40, 40), [("bird", (1, 1, 10, 10), "yes")])
    (voc_root / "Annotations" / "gray.xml").write_text(xml)
    with pytest.raises(DataError) as raised:
        load_voc(voc_root, "val")
    assert str(raised.value) == (
        f"VOC annotation {voc_root / 'Annotations' / 'gray.xml'}: an <object> (bird) has "
        "<difficult>yes</difficult>; VOC's difficult is 0 or 1."
    )


def test_voc_class_names_differing_only_in_case_or_spacing_are_named_in_a_warning(
    voc_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    xml = _voc_xml("gray.png", (40, 40), [("Bird", (1, 1, 10, 10)), ("Person  one", (1, 1, 9, 9))])
    (voc_root / "Annotations" / "gray.xml").write_text(xml)
    xml = _voc_xml("wide.png", (80, 40), [("bird", (1, 1, 10, 10)), ("person one", (1, 1, 9, 9))])
    (voc_root / "Annotations" / "wide.xml").write_text(xml)
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        split = load_voc(voc_root, "val")
    assert split.class_names == ["Bird", "Person  one", "bird", "person one"]
    listing = voc_root / "ImageSets" / "Main" / "val.txt"
    assert [r.getMessage() for r in _pipeline_warnings(caplog)] == [
        f"{listing}: the class names ['Bird', 'bird'] and ['Person  one', 'person one'] differ "
        "only in case or spacing, and are trained as separate classes; if each group is one "
        "class, write it one way in the XML files (or set data.classes to the ones to keep)"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        load_voc(voc_root, "val", ["bird", "Bird"])
    assert _pipeline_warnings(caplog) == []


def test_voc_an_unreadable_listing_or_annotation_file_is_named(voc_root: Path) -> None:
    listing = voc_root / "ImageSets" / "Main" / "val.txt"
    listing.write_bytes("gray\nwide\u00e9\n".encode("latin-1"))
    with pytest.raises(DataError) as raised:
        load_voc(voc_root, "val")
    assert str(raised.value) == (
        f"VOC split file {listing} is not a text listing of image names: the byte at offset 9 "
        "is not UTF-8 (invalid continuation byte)."
    )
    listing.write_text("gray\n")
    (voc_root / "Annotations" / "gray.xml").unlink()
    (voc_root / "Annotations" / "gray.xml").mkdir()
    with pytest.raises(DataError, match=r"gray\.xml cannot be read: Is a directory \(listed in "):
        load_voc(voc_root, "val")


@pytest.mark.parametrize(
    "xml",
    [
        _voc_xml("wide.png", (80, 40), [("bird", (1, 1, "x", 5))]),  # non-numeric box
        _voc_xml("wide.png", (80, 40), [("", (1, 1, 5, 5))]),  # empty name
    ],
    ids=["bad-box", "no-name"],
)
def test_voc_incomplete_annotation_raises_naming_the_file(voc_root: Path, xml: str) -> None:
    (voc_root / "Annotations" / "wide.xml").write_text(xml)
    with pytest.raises(DataError, match=r"wide\.xml"):
        load_voc(voc_root, "val")


# how VOC files leave an image's size out (LabelImg writes 0 where it could not read the image)
VOC_NO_SIZE = {
    "no-size": "",
    "no-width": "<size><height>40</height><depth>3</depth></size>",
    "empty": "<size><width></width><height> </height><depth>3</depth></size>",
    "zero": "<size><width>0</width><height>0</height><depth>3</depth></size>",
}


@pytest.mark.parametrize("size", VOC_NO_SIZE.values(), ids=VOC_NO_SIZE)
def test_voc_an_annotation_without_a_size_takes_the_image_files_size(
    voc_root: Path, size: str, caplog: pytest.LogCaptureFixture
) -> None:
    # wide.png is 80x40: the box reaching past its right edge is clipped to the file's size
    xml = (
        f"<annotation><filename>wide.png</filename>{size}<object><name>bird</name><bndbox>"
        "<xmin>71</xmin><ymin>6</ymin><xmax>95</xmax><ymax>15</ymax></bndbox></object>"
        "</annotation>"
    )
    (voc_root / "Annotations" / "wide.xml").write_text(xml)
    with caplog.at_level(logging.INFO, logger="pipeline"):
        split = load_voc(voc_root, "val")
    gray, wide = split.records
    assert [(gray.width, gray.height), (wide.width, wide.height)] == [(40, 40), (80, 40)]
    np.testing.assert_array_equal(wide.boxes, [[70, 5, 80, 15]])
    listing = voc_root / "ImageSets" / "Main" / "val.txt"
    assert (
        f"{listing}: 1 image(s) have no width/height in the annotations: read from the image files"
        in [r.getMessage() for r in caplog.records]
    )


def test_voc_a_size_that_is_not_a_number_is_refused_naming_the_file(voc_root: Path) -> None:
    xml = _voc_xml("wide.png", ("eighty", 40), [])
    (voc_root / "Annotations" / "wide.xml").write_text(xml)
    with pytest.raises(DataError) as raised:
        load_voc(voc_root, "val")
    assert str(raised.value) == (
        f"VOC annotation file {voc_root / 'Annotations' / 'wide.xml'} has a <size><width>/"
        "<height> that is not a number (eighty x 40)."
    )


def test_voc_a_missing_image_whose_size_must_be_read_is_named_as_the_image_check_names_it(
    voc_root: Path,
) -> None:
    (voc_root / "Annotations" / "wide.xml").write_text(
        "<annotation><filename>gone.png</filename></annotation>"
    )
    (voc_root / "JPEGImages" / "wide.png").unlink()
    with pytest.raises(DataError) as raised:
        load_voc(voc_root, "val", check_images=False)
    assert str(raised.value) == (
        f"{voc_root / 'ImageSets' / 'Main' / 'val.txt'} refers to image file(s) that do not "
        f"exist: {voc_root / 'JPEGImages' / 'wide.png'}. Check {voc_root / 'JPEGImages'} and "
        "the <filename> entries, or regenerate the data set."
    )


def _cvat_rotated_object(name: str, box: tuple[int, int, int, int], rotation: str) -> str:
    """An <object> as CVAT's Pascal VOC export writes a box turned in the tool: the box as drawn
    before it turned, the angle in its attributes."""
    xmin, ymin, xmax, ymax = box
    return (
        f"<object><name>{name}</name><truncated>0</truncated><occluded>0</occluded>"
        f"<difficult>0</difficult><bndbox><xmin>{xmin}</xmin><ymin>{ymin}</ymin>"
        f"<xmax>{xmax}</xmax><ymax>{ymax}</ymax></bndbox><attributes><attribute>"
        f"<name>occluded</name><value>false</value></attribute><attribute><name>rotation</name>"
        f"<value>{rotation}</value></attribute></attributes></object>"
    )


def test_voc_a_box_cvat_exports_turned_is_read_as_the_upright_box_that_encloses_it(
    voc_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    xml = voc_root / "Annotations" / "wide.xml"
    turned = _cvat_rotated_object("bird", (21, 16, 40, 25), "90.0")  # 0-based 20, 15, 40, 25
    upright = _cvat_rotated_object("person", (11, 6, 30, 25), "0.0")
    xml.write_text(xml.read_text().split("<object>")[0] + turned + upright + "</annotation>")
    with caplog.at_level(logging.INFO, logger="pipeline"):
        split = load_voc(voc_root, "val")
    wide = split.records[1]
    np.testing.assert_allclose(wide.boxes, [[25, 10, 35, 30], [10, 5, 30, 25]], atol=1e-5)
    said = [r.getMessage() for r in caplog.records if "turned" in r.getMessage()]
    assert said == [
        f"{voc_root / 'ImageSets' / 'Main' / 'val.txt'}: 1 box(es) turned in the annotation tool "
        "(the angle in an <attribute> named rotation, as CVAT exports them): each taken as the "
        "upright box that encloses it"
    ]


def test_voc_a_rotation_that_is_no_number_is_named_with_its_file(voc_root: Path) -> None:
    xml = voc_root / "Annotations" / "wide.xml"
    turned = _cvat_rotated_object("bird", (21, 16, 40, 25), "ninety")
    xml.write_text(xml.read_text().split("<object>")[0] + turned + "</annotation>")
    with pytest.raises(DataError) as raised:
        load_voc(voc_root, "val")
    assert str(raised.value) == (
        f"VOC annotation {xml}: an <object> (bird) has the rotation 'ninety' in its attributes, "
        "which is not a number of degrees."
    )


def test_voc_a_vocdevkit_image_is_its_listed_id_whatever_a_stale_filename_names(
    voc_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As the devkit reads JPEGImages/<id>.jpg: a set renumbered after annotation keeps each
    image's earlier name in <filename>, another image's (wide.xml names gray.png) or none's."""
    for stem, stale in (("wide", "gray.png"), ("gray", "C:\\shots\\000003_flip.jpg")):
        xml = voc_root / "Annotations" / f"{stem}.xml"
        xml.write_text(xml.read_text().replace(f"{stem}.png", stale))
    with caplog.at_level(logging.INFO, logger="pipeline"):
        split = load_voc(voc_root, "val")
    gray, wide = split.records
    assert (gray.path, wide.path) == (
        voc_root / "JPEGImages" / "gray.png",
        voc_root / "JPEGImages" / "wide.png",
    )
    assert (wide.width, wide.height) == (80, 40)
    said = [r.getMessage() for r in caplog.records if "<filename>" in r.getMessage()]
    assert said == [
        f"{voc_root / 'ImageSets' / 'Main' / 'val.txt'}: 2 XML file(s) name another image in "
        "<filename> than the one named as the listing's id: read as the VOC devkit reads them, "
        "JPEGImages/<id> (e.g. gray.xml: <filename>C:\\shots\\000003_flip.jpg</filename> -> "
        f"{voc_root / 'JPEGImages' / 'gray.png'})"
    ]


def test_voc_two_images_of_a_vocdevkit_id_are_told_apart_by_filename_or_refused(
    voc_root: Path,
) -> None:
    Image.new("RGB", (80, 40)).save(voc_root / "JPEGImages" / "wide.jpg")
    assert load_voc(voc_root, "val").records[1].path == voc_root / "JPEGImages" / "wide.png"
    xml = voc_root / "Annotations" / "wide.xml"
    xml.write_text(xml.read_text().replace("wide.png", "old.png"))
    with pytest.raises(DataError) as raised:
        load_voc(voc_root, "val")
    assert str(raised.value).startswith(
        f"VOC annotation file {xml}: the images wide.jpg and wide.png in "
        f"{voc_root / 'JPEGImages'} both have its id's name, and its <filename>old.png"
        "</filename> names neither: which one it describes is unknown."
    )


def test_voc_missing_image_raises_naming_it(voc_root: Path) -> None:
    (voc_root / "JPEGImages" / "wide.png").unlink()
    with pytest.raises(DataError, match=r"wide\.png"):
        load_voc(voc_root, "val")


def test_voc_objects_of_classes_outside_data_classes_are_dropped_and_counted_as_cocos_are(
    voc_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="pipeline"):
        split = load_split(
            load_config(None, [f"data.root={voc_root}", "data.format=voc", "data.classes=[bird]"]),
            "val",
        )
    assert split.class_names == ["bird"]
    gray, wide = split.records
    assert gray.labels.tolist() == [] and gray.boxes.shape == (0, 4)  # its bird is degenerate
    np.testing.assert_array_equal(wide.boxes, [[10, 5, 30, 25]])
    assert split.other_class_objects == 2  # a person on each image
    assert split.dropped_boxes == 1
    assert f"{split.source}: left out 2 object(s) of classes outside data.classes ['bird']" in (
        caplog.text
    )


def test_voc_image_listed_twice_raises_naming_it_and_both_xml_files(voc_root: Path) -> None:
    (voc_root / "ImageSets" / "Main" / "val.txt").write_text("gray\nwide\ngray\n")
    with pytest.raises(DataError) as caught:
        load_voc(voc_root, "val")
    xml = voc_root / "Annotations" / "gray.xml"
    assert str(caught.value).startswith(
        f"VOC split {voc_root / 'ImageSets' / 'Main' / 'val.txt'} lists the image file "
        f"{voc_root / 'JPEGImages' / 'gray.png'} twice: through {xml} and {xml}."
    )


def test_voc_a_listed_id_with_spaces_is_the_whole_line_as_cvat_writes_it(voc_root: Path) -> None:
    """CVAT names ids after the images (`Screenshot (573)`); a per-class listing's `<id> <flag>`
    line still reads as its id."""
    for folder, suffix in (("Annotations", "xml"), ("JPEGImages", "png")):
        (voc_root / folder / f"wide.{suffix}").rename(voc_root / folder / f"Wide (573).{suffix}")
    (voc_root / "ImageSets" / "Main" / "val.txt").write_text("gray  1\nWide (573) \r\n")
    gray, wide = load_voc(voc_root, "val").records
    assert gray.path == voc_root / "JPEGImages" / "gray.png"
    assert wide.path == voc_root / "JPEGImages" / "Wide (573).png"
    np.testing.assert_array_equal(wide.boxes, [[10, 5, 30, 25]])


def test_voc_empty_split_listing_raises(voc_root: Path) -> None:
    (voc_root / "ImageSets" / "Main" / "val.txt").write_text("\n  \n")
    with pytest.raises(DataError, match=r"val\.txt.*empty"):
        load_voc(voc_root, "val")


def test_voc_missing_split_listing_raises_naming_it(voc_root: Path) -> None:
    with pytest.raises(DataError, match=r"test\.txt"):
        load_voc(voc_root, "test")


def test_voc_val_split_takes_the_training_class_list(voc_root: Path) -> None:
    # val holds only 'person' objects here, yet its labels must follow train's class list
    (voc_root / "ImageSets" / "Main" / "val.txt").write_text("palette\ngray\n")
    config = load_config(None, [f"data.root={voc_root}", "data.format=voc"])
    train, val = load_splits(config)
    assert train.class_names == val.class_names == ["bird", "person"]
    assert val.records[1].labels.tolist() == [1]


# ------------------------------------------------------------------------- read_image


@pytest.mark.parametrize("name", ["gray.png", "rgba.png", "palette.png", "wide.png"])
def test_read_image_gives_rgb_uint8_for_any_mode(tmp_path: Path, name: str) -> None:
    sizes = _write_images(tmp_path)
    image = read_image(tmp_path / name)
    width, height = sizes[name]
    assert image.shape == (3, height, width)
    assert image.dtype == torch.uint8


def test_read_image_converts_the_colours_of_each_mode(tmp_path: Path) -> None:
    _write_images(tmp_path)
    assert read_image(tmp_path / "gray.png")[:, 0, 0].tolist() == [90, 90, 90]
    assert read_image(tmp_path / "rgba.png")[:, 0, 0].tolist() == [10, 20, 30]
    assert read_image(tmp_path / "palette.png")[:, 0, 0].tolist() == list(PALETTE_COLOUR)


def test_read_image_of_a_truncated_png_raises_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cut.png"
    noise = np.random.default_rng(0).integers(0, 256, (48, 48, 3), dtype=np.uint8)
    Image.fromarray(noise).save(path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(DataError, match=r"cut\.png"):
        read_image(path)


def test_read_image_of_a_non_image_or_missing_file_raises_naming_it(tmp_path: Path) -> None:
    (tmp_path / "text.png").write_text("not a picture")
    with pytest.raises(DataError, match=r"text\.png"):
        read_image(tmp_path / "text.png")
    with pytest.raises(DataError, match=r"gone\.png"):
        read_image(tmp_path / "gone.png")


@pytest.mark.parametrize("suffix", [".png", ".tif"])
def test_a_16_bit_greyscale_image_reads_by_its_high_byte_not_clipped_to_white(
    tmp_path: Path, suffix: str
) -> None:
    """Pillow's own conversion clips every 16-bit value above 255 to white."""
    path = tmp_path / f"microscope{suffix}"
    values = np.array([[0, 255, 256 * 100 + 99, 65535]], np.uint16)
    Image.fromarray(values).save(path)
    assert Image.open(path).mode.startswith("I")
    assert read_image(path).tolist() == [[[0, 0, 100, 255]]] * 3


@pytest.mark.parametrize(
    ("values", "read"),
    [
        ([0, 16, 2048 + 15, 4095], [0, 1, 128, 255]),  # a 12-bit camera's: bits 4-11
        ([0, 100, 200, 255], [0, 100, 200, 255]),  # 8-bit values stored in 16 bits
        ([0, 0, 0, 0], [0, 0, 0, 0]),
    ],
)
def test_a_16_bit_greyscale_image_reads_by_the_top_8_of_the_bits_it_uses_not_dark(
    tmp_path: Path, values: list[int], read: list[int]
) -> None:
    """By its high byte, a 12-bit image would read at most 15 of 255, and 8-bit values 0."""
    path = tmp_path / "camera.png"
    Image.fromarray(np.array([values], np.uint16)).save(path)
    assert read_image(path).tolist() == [[read]] * 3


@pytest.mark.parametrize(
    ("values", "described"),
    [
        (
            np.array([[0.0, 0.5, 1.0]], np.float32),
            "floating-point pixel values (Pillow mode F, from 0.0 to 1.0)",
        ),
        (
            np.array([[0, 300, 70000]], np.int32),
            "32-bit integer pixel values (Pillow mode I, from 0 to 70000)",
        ),
    ],
)
def test_a_float_or_wide_integer_image_is_refused_naming_its_values_never_clipped(
    tmp_path: Path, values: np.ndarray, described: str
) -> None:
    path = tmp_path / "depth.tif"
    Image.fromarray(values).save(path)
    with pytest.raises(DataError) as raised:
        read_image(path)
    assert str(raised.value) == (
        f"Image file {path} holds {described}, which have no brightness scale to read them in: "
        "convert the images to 8- or 16-bit PNG or TIFF."
    )


def test_a_32_bit_integer_image_within_8_bits_reads_as_its_values(tmp_path: Path) -> None:
    path = tmp_path / "labels.tif"
    Image.fromarray(np.array([[0, 7, 255]], np.int32)).save(path)
    assert read_image(path).tolist() == [[[0, 7, 255]]] * 3


def test_an_image_beyond_the_decompression_bomb_limit_is_named_when_checked_and_when_read(
    coco_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pillow refuses an image of more than twice Image.MAX_IMAGE_PIXELS with an error of its
    own, neither an OSError nor a ValueError; here the limit is lowered, not the image raised."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(DataError) as raised:
        read_image(coco_root / "wide.png")
    assert str(raised.value).startswith(
        f"Image file {coco_root / 'wide.png'} is too large to decode: "
    )
    assert str(raised.value).endswith(
        "Downscale or tile such images: the model sees them at data.image_size in any case."
    )
    with pytest.raises(
        DataError,
        match=r"too large to decode: \S*gray\.png \(Image size \(1600 pixels\)",
    ):
        load_coco(coco_root / "instances_val.json", coco_root)


def test_a_corrupt_image_in_a_data_set_raises_naming_it_when_read(coco_root: Path) -> None:
    path = coco_root / "wide.png"
    path.write_bytes(path.read_bytes()[:60])
    split = load_coco(coco_root / "instances_val.json", coco_root)  # files exist: loads fine
    with pytest.raises(DataError, match=r"wide\.png"):
        DetectionDataset(split, 32)


# --------------------------------------------------------------------- DetectionDataset


@pytest.mark.parametrize("size", [32, 48])
@pytest.mark.parametrize("mode", ["letterbox", "stretch"])
def test_dataset_gives_rgb_uint8_squares_for_every_mode_and_size(
    coco_root: Path, mode: str, size: int
) -> None:
    split = load_coco(coco_root / "instances_val.json", coco_root)
    dataset = DetectionDataset(split, size, resize=mode)
    assert len(dataset) == 5
    for index in range(len(dataset)):
        image, target = dataset[index]
        assert image.shape == (3, size, size)
        assert image.dtype == torch.uint8
        assert target["boxes"].shape == (len(split.records[index].boxes), 4)
        assert target["boxes"].dtype == torch.float32
        assert target["labels"].tolist() == split.records[index].labels.tolist()
        assert target["image_id"] == split.records[index].image_id


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # 80x40 -> 32x16, padded 8 rows above and below
        ("letterbox", [4.0, 10.0, 12.0, 18.0]),
        # x scaled by 32/80, y by 32/40
        ("stretch", [4.0, 4.0, 12.0, 20.0]),
    ],
)
def test_boxes_of_a_non_square_image_map_into_the_input_frame_and_back(
    coco_root: Path, mode: str, expected: list[float]
) -> None:
    split = load_coco(coco_root / "instances_val.json", coco_root)
    dataset = DetectionDataset(split, 32, resize=mode)
    index = next(i for i, r in enumerate(split.records) if r.path.name == "wide.png")
    _, target = dataset[index]
    np.testing.assert_allclose(target["boxes"].numpy(), [expected], atol=1e-4)
    back = dataset.to_original(index, target["boxes"].numpy())
    np.testing.assert_allclose(back, [[10, 5, 30, 25]], atol=1e-3)


def test_letterbox_pads_with_the_pad_value_and_keeps_the_picture_centred(
    coco_root: Path,
) -> None:
    split = load_coco(coco_root / "instances_val.json", coco_root)
    dataset = DetectionDataset(split, 32, resize="letterbox")
    index = next(i for i, r in enumerate(split.records) if r.path.name == "wide.png")
    image, _ = dataset[index]
    assert (image[:, :8] == PAD_VALUE).all() and (image[:, 24:] == PAD_VALUE).all()
    assert (
        image[:, 8:24].tolist()
        == torch.tensor([0, 128, 255])[:, None, None].expand(3, 16, 32).tolist()
    )


def test_an_image_that_is_not_the_size_its_annotation_says_is_an_error_naming_both_sizes(
    coco_root: Path,
) -> None:
    # the annotation claims 160x80; the file is 80x40: never rescaled, always reported
    document = _coco_document(
        {"wide.png": (160, 80)}, [{"image_id": 1, "category_id": 3, "bbox": [20, 10, 40, 40]}]
    )
    path = _write_coco(coco_root, "claims_bigger.json", document)
    with pytest.raises(DataError) as caught:
        load_coco(path, coco_root)
    message = str(caught.value)
    assert str(path) in message
    assert f"{coco_root / 'wide.png'} is annotated 160x80 but is 80x40" in message


@pytest.mark.parametrize("cache", [True, False])
def test_a_split_loaded_unchecked_is_checked_by_its_dataset_with_loadings_own_error(
    coco_root: Path, cache: bool
) -> None:
    # evaluate loads its splits so: where the dataset decodes every file up front, the header
    # check would read each file a second time; where it does not, the check must still come
    # before the first image is used
    (coco_root / "palette.png").unlink()
    path = coco_root / "instances_val.json"
    split = load_coco(path, coco_root, check_images=False)  # no error yet
    relabelled = with_classes(split, split.class_names[::-1])  # as evaluate may: still unchecked
    with pytest.raises(DataError) as caught:
        DetectionDataset(relabelled, 32, cache=cache)
    assert str(caught.value).startswith(
        f"{path} refers to image file(s) that do not exist: {coco_root / 'palette.png'}. "
        f"Check the images folder {coco_root} "
    )


@pytest.mark.parametrize("cache", [True, False])
def test_a_split_loaded_unchecked_gives_the_samples_a_checked_one_gives(
    coco_root: Path, cache: bool
) -> None:
    path = coco_root / "instances_val.json"
    unchecked = load_coco(path, coco_root, check_images=False)
    assert unchecked.unchecked_images is not None
    checked = DetectionDataset(load_coco(path, coco_root), 32, cache=cache)
    dataset = DetectionDataset(unchecked, 32, cache=cache)
    assert unchecked.unchecked_images is None  # checked once: another dataset does not again
    for index in range(len(dataset)):
        (image, target), (want_image, want) = dataset[index], checked[index]
        assert torch.equal(image, want_image)
        assert all(torch.equal(target[key], want[key]) for key in ("boxes", "ignore_boxes"))


def test_voc_split_loaded_unchecked_leaves_a_missing_image_to_its_dataset(voc_root: Path) -> None:
    (voc_root / "JPEGImages" / "wide.png").unlink()
    split = load_voc(voc_root, "val", check_images=False)
    with pytest.raises(
        DataError, match=r"refers to image file\(s\) that do not exist: .*wide\.png"
    ):
        DetectionDataset(split, 32, cache=True)


def test_relabelling_a_split_keeps_its_counts_each_in_its_own_field(coco_root: Path) -> None:
    annotations = [
        {"image_id": 1, "category_id": 3, "bbox": [2, 4, float("inf"), 12]},
        {"image_id": 1, "category_id": 3, "bbox": [2, 4, 10, float("nan")]},
        {"image_id": 1, "category_id": 3, "bbox": [2, 4, 0, 12]},
        {"image_id": 1, "category_id": 7, "bbox": [2, 4, 10, 12]},
    ]
    path = _write_coco(
        coco_root, "counts.json", _coco_document({"gray.png": (40, 40)}, annotations)
    )
    cats = with_classes(load_coco(path, coco_root), ["cat"])  # leaves out the dog
    assert (cats.nonfinite_boxes, cats.dropped_boxes, cats.other_class_objects) == (2, 1, 1)


def test_the_dataset_refuses_a_file_whose_decoded_size_differs_from_its_record(
    tmp_path: Path,
) -> None:
    # a record made by hand (or a file replaced after loading): the decoded image is the geometry
    split = _rectangle_split(tmp_path, (3, 5, 11, 20))
    split.records[0].width = 64
    with pytest.raises(DataError, match=r"rect\.png is 32x32 .* annotation says 64x32"):
        DetectionDataset(split, 32)


def _exif_jpeg(path: Path, orientation: int) -> None:
    """A 48x24 (width x height) JPEG, white in its top-left 16x16 corner, with an EXIF orientation.

    The corner is aligned to JPEG's 8x8 blocks, so compression leaves its edges sharp.
    """
    pixels = np.zeros((24, 48, 3), np.uint8)
    pixels[:16, :16] = 255
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(pixels).save(path, format="JPEG", quality=95, exif=exif.tobytes())


def test_read_image_turns_a_photo_upright_by_its_exif_orientation(tmp_path: Path) -> None:
    # orientation 6: the stored pixels are shown turned 90 degrees clockwise
    _exif_jpeg(tmp_path / "photo.jpg", orientation=6)
    image = read_image(tmp_path / "photo.jpg")
    assert image.shape == (3, 48, 24)
    white = (image > 128).all(dim=0).numpy()
    ys, xs = np.nonzero(white)
    assert (xs.min(), xs.max(), ys.min(), ys.max()) == (8, 23, 0, 15)  # now the top-right corner


def test_an_exif_rotated_photo_annotated_upright_loads_with_boxes_where_its_pixels_are(
    tmp_path: Path,
) -> None:
    _exif_jpeg(tmp_path / "photo.jpg", orientation=6)
    document = _coco_document(
        {"photo.jpg": (24, 48)}, [{"image_id": 1, "category_id": 3, "bbox": [8, 0, 16, 16]}]
    )
    split = load_coco(_write_coco(tmp_path, "upright.json", document), tmp_path)
    image, target = DetectionDataset(split, 48, resize="letterbox")[0]
    x0, y0, x1, y1 = (int(v) for v in target["boxes"][0].tolist())
    inside = image[:, y0 + 1 : y1 - 1, x0 + 1 : x1 - 1]
    assert (inside > 128).all()  # the box covers the white corner of the upright picture


def test_an_exif_rotated_photo_annotated_as_stored_is_an_error_that_names_the_orientation(
    tmp_path: Path,
) -> None:
    _exif_jpeg(tmp_path / "photo.jpg", orientation=6)
    document = _coco_document({"photo.jpg": (48, 24)}, [])
    path = _write_coco(tmp_path, "stored.json", document)
    with pytest.raises(DataError) as caught:
        load_coco(path, tmp_path)
    message = str(caught.value)
    assert "photo.jpg is annotated 48x24 but is 24x48" in message
    assert "EXIF orientation" in message


def test_an_exif_rotated_photo_without_a_size_in_its_annotation_takes_its_upright_size(
    tmp_path: Path,
) -> None:
    _exif_jpeg(tmp_path / "photo.jpg", orientation=6)  # stored 48x24, shown 24x48
    image = {"id": 1, "file_name": "photo.jpg"}
    annotation = {"id": 1, "image_id": 1, "category_id": 3, "bbox": [8, 30, 30, 30]}
    document = {"images": [image], "annotations": [annotation], "categories": CATEGORIES}
    split = load_coco(_write_coco(tmp_path, "sizeless.json", document), tmp_path)
    record = split.records[0]
    assert (record.width, record.height) == (24, 48)
    np.testing.assert_array_equal(record.boxes, [[8, 30, 24, 48]])  # clipped to the upright size


XMP_ORIENTATION_6 = (
    b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF '
    b'xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#"><rdf:Description '
    b'xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>'
)


def test_a_photo_turned_only_by_its_xmp_orientation_is_checked_as_it_is_decoded(
    tmp_path: Path,
) -> None:
    """No EXIF block, only XMP's tiff:Orientation: the size check and the decoder agree."""
    pixels = np.zeros((24, 48, 3), np.uint8)
    pixels[:16, :16] = 255
    Image.fromarray(pixels).save(tmp_path / "photo.jpg", quality=95, xmp=XMP_ORIENTATION_6)
    assert "exif" not in Image.open(tmp_path / "photo.jpg").info
    assert read_image(tmp_path / "photo.jpg").shape == (3, 48, 24)
    upright = _coco_document(
        {"photo.jpg": (24, 48)}, [{"image_id": 1, "category_id": 3, "bbox": [8, 0, 16, 16]}]
    )
    split = load_coco(_write_coco(tmp_path, "upright.json", upright), tmp_path)
    image, target = DetectionDataset(split, 48, resize="letterbox")[0]
    x0, y0, x1, y1 = (int(v) for v in target["boxes"][0].tolist())
    assert (image[:, y0 + 1 : y1 - 1, x0 + 1 : x1 - 1] > 128).all()
    stored = _coco_document({"photo.jpg": (48, 24)}, [])
    with pytest.raises(DataError, match=r"photo\.jpg is annotated 48x24 but is 24x48"):
        load_coco(_write_coco(tmp_path, "stored.json", stored), tmp_path)


def test_mapped_detections_are_clipped_to_the_image(coco_root: Path) -> None:
    split = load_coco(coco_root / "instances_val.json", coco_root)
    index = next(i for i, r in enumerate(split.records) if r.path.name == "wide.png")
    dataset = DetectionDataset(split, 32, resize="letterbox")  # 80x40 -> rows 8..24 hold the image
    mapped = dataset.to_original(index, np.array([[-4, 2, 16, 30], [10, 10, 20, 20]], np.float32))
    np.testing.assert_allclose(mapped, [[0, 0, 40, 40], [25, 5, 50, 30]])


@pytest.mark.parametrize("resize", ["letterbox", "stretch"])
def test_each_evaluation_samples_region_is_where_its_own_image_lies_in_the_input(
    coco_root: Path, resize: str
) -> None:
    """The regions are worked out once per image size: each sample's is still its own image's
    (40x40, 80x40 and 32x32), and an augmented (training) sample has none."""
    split = load_coco(coco_root / "instances_val.json", coco_root)
    dataset = DetectionDataset(split, 32, resize=resize, cache=False)
    regions = [dataset[i][1]["region"] for i in range(len(dataset))]
    assert len({tuple(region.tolist()) for region in regions}) == (
        2 if resize == "letterbox" else 1
    )
    for index, region in enumerate(regions):
        assert region.dtype == torch.float32
        assert region.tolist() == dataset.geometry(index).region()
    if resize == "letterbox":
        wide = next(i for i, r in enumerate(split.records) if r.path.name == "wide.png")
        assert regions[wide].tolist() == [0.0, 8.0, 32.0, 24.0]  # 80x40 -> rows 8..24
    training = DetectionDataset(split, 32, resize=resize, augment=Augment(hflip=1.0), cache=False)
    assert "region" not in training[0][1]


@pytest.mark.parametrize("resize", ["letterbox", "stretch"])
def test_all_samples_boxes_map_back_bit_for_bit_as_each_samples_do(
    coco_root: Path, resize: str
) -> None:
    split = load_coco(coco_root / "instances_val.json", coco_root)  # 40x40, 80x40 and 32x32
    dataset = DetectionDataset(split, 32, resize=resize, cache=False)
    rng = np.random.default_rng(0)
    boxes = [
        np.sort(rng.uniform(-8, 40, (count, 4)), axis=1).astype(np.float32)[:, [0, 2, 1, 3]]
        for count in rng.integers(0, 5, len(dataset))
    ]
    boxes[0] = np.zeros((0, 4), np.float32)  # an image without detections
    every = dataset.all_to_original(boxes)
    one_by_one = np.concatenate([dataset.to_original(i, b) for i, b in enumerate(boxes)])
    assert every.dtype == np.float32 and every.tobytes() == one_by_one.tobytes()


def test_uncached_dataset_gives_the_same_samples_as_the_cached_one(coco_root: Path) -> None:
    split = load_coco(coco_root / "instances_val.json", coco_root)
    cached, lazy = DetectionDataset(split, 32), DetectionDataset(split, 32, cache=False)
    for index in range(len(split.records)):
        (a, ta), (b, tb) = cached[index], lazy[index]
        assert torch.equal(a, b)
        assert torch.equal(ta["boxes"], tb["boxes"])


def test_a_cache_decoded_on_several_threads_holds_every_sample_in_order(
    coco_root: Path, two_torch_threads: None
) -> None:
    split = load_coco(coco_root / "instances_val.json", coco_root)
    cached, lazy = DetectionDataset(split, 32), DetectionDataset(split, 32, cache=False)
    assert len(split.records) >= 2
    for index in range(len(split.records)):
        (a, ta), (b, tb) = cached[index], lazy[index]
        assert torch.equal(a, b) and ta["image_id"] == tb["image_id"]
        assert torch.equal(ta["boxes"], tb["boxes"])
    (coco_root / "wide.png").write_bytes((coco_root / "wide.png").read_bytes()[:60])
    with pytest.raises(DataError, match=r"wide\.png"):
        DetectionDataset(split, 32)


def test_of_bad_files_in_both_threads_shares_the_first_is_named(
    coco_root: Path, two_torch_threads: None
) -> None:
    split = load_coco(coco_root / "instances_val.json", coco_root)
    first, last = split.records[1].path, split.records[-1].path  # one in each thread's share
    assert first != last and len(split.records) >= 4
    for path in (first, last):
        path.write_bytes(path.read_bytes()[:60])
    with pytest.raises(DataError) as error:
        DetectionDataset(split, 32)
    assert str(first) in str(error.value) and str(last) not in str(error.value)


def _memory(available: int | None) -> Callable[[], Memory]:
    """A memory reader that reports `available` bytes: no test allocates what it decides on."""
    return lambda: Memory(available, "available (test)")


@pytest.mark.parametrize(("spare", "cached"), [(0, True), (-2, False)])
def test_auto_cache_keeps_a_split_in_memory_only_while_it_fits_the_budget(
    coco_root: Path, caplog: pytest.LogCaptureFixture, spare: int, cached: bool
) -> None:
    """5 images at 32 px decode to 5 x 3 x 32 x 32 bytes; budget 0.5 of twice that holds them
    exactly, two bytes less does not."""
    split = load_coco(coco_root / "instances_val.json", coco_root)
    config = _coco_config(coco_root, "data.cache=auto", "data.cache_budget=0.5")
    config["data"]["image_size"] = 32
    need = 5 * 3 * 32 * 32
    with caplog.at_level(logging.INFO, logger="pipeline"):
        loader = loader_for(
            split, config, train=False, pin_memory=False, memory=_memory(2 * need + spare)
        )
    assert loader.num_workers == default_num_workers(cached)
    [line] = [r.getMessage() for r in caplog.records if "decoded images" in r.getMessage()]
    assert "5 decoded images at 32 px (15.0 KiB)" in line
    assert ("within" if cached else "over") + " data.cache_budget 0.5 x 30.0 KiB" in line
    assert str(split.source) in line
    # a cached split needs its files no more; an uncached one decodes each sample when loaded
    split.records[0].path.unlink()
    if cached:
        assert loader.dataset[0][0].shape == (3, 32, 32)
    else:
        with pytest.raises(DataError, match=split.records[0].path.name):
            loader.dataset[0]


@pytest.mark.parametrize(("setting", "cached"), [(True, True), (False, False)])
def test_a_cache_setting_of_true_or_false_is_obeyed_whatever_the_memory(
    coco_root: Path, setting: bool, cached: bool
) -> None:
    split = load_coco(coco_root / "instances_val.json", coco_root)
    memory = _memory(0 if setting else 2**40)
    dataset = DetectionDataset(split, 32, cache=setting, memory=memory)
    assert dataset.cache_decision.cache is cached


def test_auto_cache_decodes_on_access_where_the_available_memory_is_unknown(
    coco_root: Path,
) -> None:
    split = load_coco(coco_root / "instances_val.json", coco_root)
    dataset = DetectionDataset(split, 32, cache="auto", memory=_memory(None))
    assert not dataset.cache_decision.cache
    assert "unknown" in dataset.cache_decision.reason


def _fake_proc(tmp_path: Path, available_kb: int, cgroup_line: str) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(
        f"MemTotal:       99999999 kB\nMemFree:  1 kB\nMemAvailable:   {available_kb} kB\n"
    )
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    return proc


def test_available_memory_is_memavailable_without_a_cgroup_limit(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, 4096, "0::/user.slice")
    root = tmp_path / "cgroup"
    (root / "user.slice").mkdir(parents=True)
    (root / "user.slice" / "memory.max").write_text("max\n")
    (root / "user.slice" / "memory.current").write_text("123\n")
    assert available_memory(proc, root).available == 4096 * 1024


def test_available_memory_is_what_an_ancestor_cgroup_limit_leaves(tmp_path: Path) -> None:
    """A SLURM job's limit sits on job_7, its processes in job_7/step_0: page cache the kernel
    can drop counts as free."""
    proc = _fake_proc(tmp_path, 10_000_000, "0::/slurm/job_7/step_0")
    root = tmp_path / "cgroup"
    step = root / "slurm" / "job_7" / "step_0"
    step.mkdir(parents=True)
    (step / "memory.max").write_text("max\n")
    (step / "memory.current").write_text("100\n")
    job = step.parent
    (job / "memory.max").write_text(f"{2**30}\n")
    (job / "memory.current").write_text(f"{2**29}\n")
    (job / "memory.stat").write_text("anon 1\ninactive_file 1000\n")
    found = available_memory(proc, root)
    assert found.available == 2**29 + 1000
    assert "cgroup" in found.source


def test_available_memory_reads_a_cgroup_v1_hierarchical_limit(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, 10_000_000, "4:memory:/docker/abc")
    folder = tmp_path / "cgroup" / "memory" / "docker" / "abc"
    folder.mkdir(parents=True)
    (folder / "memory.limit_in_bytes").write_text(f"{2**62}\n")  # its own: none
    (folder / "memory.usage_in_bytes").write_text(f"{2**20}\n")
    (folder / "memory.stat").write_text(
        f"hierarchical_memory_limit {2**22}\ntotal_inactive_file 0\n"
    )
    assert available_memory(proc, tmp_path / "cgroup").available == 2**22 - 2**20


def test_an_unknown_resize_mode_raises(coco_root: Path) -> None:
    split = load_coco(coco_root / "instances_val.json", coco_root)
    with pytest.raises(DataError, match=r"crop"):
        DetectionDataset(split, 32, resize="crop")


# ------------------------------------------------------------------------ augmentation


def _rectangle_split(tmp_path: Path, box: tuple[int, int, int, int]) -> SplitAnnotations:
    """A black 32x32 image with a white rectangle (xyxy, exclusive ends) and its box."""
    pixels = np.zeros((32, 32, 3), np.uint8)
    x0, y0, x1, y1 = box
    pixels[y0:y1, x0:x1] = 255
    path = tmp_path / "rect.png"
    Image.fromarray(pixels).save(path)
    record = ImageRecord(1, path, 32, 32, np.array([box], np.float32), np.array([0], np.int64))
    return SplitAnnotations([record], ["thing"], tmp_path / "fake.json")


def _white_box(image: torch.Tensor) -> list[float]:
    ys, xs = np.nonzero((image == 255).all(dim=0).numpy())
    return [float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1)]


ALL_HALF = Augment(hflip=0.5, vflip=0.5, transpose=0.5, channel_shuffle=0.5)


@pytest.mark.parametrize(
    "augment",
    [
        Augment(hflip=1.0),
        Augment(hflip=0.0, vflip=1.0),
        Augment(hflip=0.0, transpose=1.0),
        Augment(hflip=1.0, vflip=1.0, transpose=1.0, channel_shuffle=1.0),
    ],
    ids=["hflip", "vflip", "transpose", "all"],
)
def test_flips_and_transposes_move_the_box_with_the_pixels(
    tmp_path: Path, augment: Augment
) -> None:
    split = _rectangle_split(tmp_path, (3, 5, 11, 20))
    image, target = DetectionDataset(split, 32, augment=augment)[0]
    assert _white_box(image) != [3, 5, 11, 20]  # the image did move
    assert target["boxes"].tolist() == [_white_box(image)]


def test_random_augmentation_keeps_box_and_pixels_together_in_every_epoch(
    tmp_path: Path,
) -> None:
    split = _rectangle_split(tmp_path, (3, 5, 11, 20))
    dataset = DetectionDataset(split, 32, augment=ALL_HALF, seed=4)
    boxes = set()
    for epoch in range(12):
        image, target = dataset[(epoch, 0)]
        assert target["boxes"].tolist() == [_white_box(image)]
        boxes.add(tuple(target["boxes"][0].tolist()))
    assert len(boxes) > 2  # several of the eight symmetries were drawn


def test_augmentation_is_reproducible_for_the_same_seed_epoch_and_index(
    coco_root: Path,
) -> None:
    split = load_coco(coco_root / "instances_val.json", coco_root)
    first = DetectionDataset(split, 32, augment=ALL_HALF, seed=7)
    second = DetectionDataset(split, 32, augment=ALL_HALF, seed=7, cache=False)
    for key in [(0, 1), (3, 1), (5, 3)]:
        (a, ta), (b, tb) = first[key], second[key]
        assert torch.equal(a, b)
        assert torch.equal(ta["boxes"], tb["boxes"])
        assert torch.equal(ta["labels"], tb["labels"])


def test_augmentation_differs_between_epochs(coco_root: Path) -> None:
    split = load_coco(coco_root / "instances_val.json", coco_root)
    dataset = DetectionDataset(split, 32, augment=ALL_HALF, seed=7)
    index = next(i for i, r in enumerate(split.records) if r.path.name == "wide.png")
    outcomes = {
        (dataset[(epoch, index)][0].numpy().tobytes(), str(dataset[(epoch, index)][1]["boxes"]))
        for epoch in range(6)
    }
    assert len(outcomes) > 1
    # and an un-augmented dataset gives the same sample whatever the epoch
    plain = DetectionDataset(split, 32, augment=Augment(0, 0, 0, 0))
    assert torch.equal(plain[(0, index)][0], plain[(5, index)][0])


def test_boxes_smaller_than_min_box_size_are_dropped_with_their_labels(tmp_path: Path) -> None:
    split = _rectangle_split(tmp_path, (3, 5, 5, 20))  # 2 pixels wide
    split.records[0].boxes = np.array([[3, 5, 5, 20], [10, 10, 20, 20]], np.float32)
    split.records[0].labels = np.array([0, 1], np.int64)
    _, target = DetectionDataset(split, 32, augment=Augment(hflip=1.0, min_box_size=3))[0]
    assert target["labels"].tolist() == [1]
    assert target["boxes"].tolist() == [[12.0, 10.0, 22.0, 20.0]]


# ------------------------------------------------------------------ batching and order


def test_collate_stacks_images_and_keeps_the_targets_as_a_list(coco_root: Path) -> None:
    split = load_coco(coco_root / "instances_val.json", coco_root)
    dataset = DetectionDataset(split, 32)
    samples = [dataset[i] for i in range(3)]
    images, targets = collate(samples)
    assert images.shape == (3, 3, 32, 32) and images.dtype == torch.uint8
    assert torch.equal(images[1], samples[1][0])
    assert targets == [t for _, t in samples]
    assert isinstance(targets, list)


def test_a_cached_splits_consecutive_samples_batch_as_a_view_of_the_cache_equal_to_a_stack(
    coco_root: Path,
) -> None:
    """Evaluation's batches (a cached split in order) are views of the cache, no copy, with
    the values stacking gives; samples out of order are stacked; so are a worker's."""
    split = load_coco(coco_root / "instances_val.json", coco_root)
    dataset = DetectionDataset(split, 32)
    samples = [dataset[i] for i in range(len(dataset))]
    cache = samples[0][0].untyped_storage().data_ptr()
    for order in (range(5), range(1, 4), [2], [0, 2, 1], [4, 3]):
        images, _ = collate([samples[i] for i in order])
        assert torch.equal(images, torch.stack([samples[i][0] for i in order]))
        assert images.is_contiguous()
        in_order = list(order) == list(range(order[0], order[0] + len(order)))
        assert (images.untyped_storage().data_ptr() == cache) == in_order, list(order)
    stacked = [torch.stack([samples[i][0] for i in batch]) for batch in ([0, 1], [2, 3], [4])]
    for workers in (0, 1):
        loader = make_loader(
            dataset,
            2,
            shuffle=False,
            seed=0,
            num_workers=workers,
            pin_memory=False,
            drop_last=False,
        )
        batches = [images for images, _ in loader]
        assert all(torch.equal(a, b) for a, b in zip(batches, stacked, strict=True))


def test_epoch_sampler_order_depends_on_seed_and_epoch_only() -> None:
    sampler = EpochSampler(20, shuffle=True, seed=3)
    first = list(sampler)
    assert first == list(EpochSampler(20, shuffle=True, seed=3))
    assert sorted(i for _, i in first) == list(range(20))
    assert {epoch for epoch, _ in first} == {0}
    sampler.set_epoch(1)
    second = list(sampler)
    assert {epoch for epoch, _ in second} == {1}
    assert [i for _, i in second] != [i for _, i in first]
    assert list(sampler) == second
    other_seed = EpochSampler(20, shuffle=True, seed=4)
    assert [i for _, i in other_seed] != [i for _, i in first]


def test_epoch_sampler_without_shuffle_keeps_the_file_order() -> None:
    sampler = EpochSampler(5, shuffle=False, seed=3)
    sampler.set_epoch(2)
    assert list(sampler) == [(2, i) for i in range(5)]
    assert len(sampler) == 5


def test_loader_yields_batches_in_the_sampler_order_and_keeps_a_short_last_batch(
    coco_root: Path,
) -> None:
    split = load_coco(coco_root / "instances_val.json", coco_root)
    dataset = DetectionDataset(split, 32)
    loader = make_loader(
        dataset, 2, shuffle=True, seed=1, num_workers=0, pin_memory=False, drop_last=False
    )
    order = [i for _, i in EpochSampler(5, shuffle=True, seed=1)]
    batches = list(loader)
    assert [len(targets) for _, targets in batches] == [2, 2, 1]
    ids = [t["image_id"] for _, targets in batches for t in targets]
    assert ids == [split.records[i].image_id for i in order]


# every kind of augmentation: flips and shuffles drawn from numpy, scale jitter and colour
# distortion from torch's RNG (torchvision's transforms.v2)
EVERY_AUGMENTATION = Augment(
    hflip=0.5, vflip=0.5, transpose=0.5, channel_shuffle=0.5, scale_min=0.5, scale_max=1.5,
    photometric=0.5,
)  # fmt: skip


def _epoch_batches(split: SplitAnnotations, cache: bool, workers: int) -> list[Any]:
    dataset = DetectionDataset(split, 32, augment=EVERY_AUGMENTATION, cache=cache, seed=5)
    loader = make_loader(
        dataset, 2, shuffle=True, seed=5, num_workers=workers, pin_memory=False, drop_last=False
    )
    batches = []
    for epoch in (1, 2):
        loader.sampler.set_epoch(epoch)
        for images, targets in loader:
            fields = [(t["image_id"], t["boxes"].tolist(), t["labels"].tolist()) for t in targets]
            batches.append((images, fields))
    return batches


def test_the_batches_depend_on_seed_epoch_and_index_alone_not_on_workers_or_cache(
    coco_root: Path,
) -> None:
    """Worker processes start with RNG states of their own, and a cached sample skips the
    decoding: neither may change an augmented batch (data.cache and data.num_workers are speed
    settings, which a resumed run may change)."""
    split = load_coco(coco_root / "instances_train.json", coco_root)
    reference = _epoch_batches(split, cache=True, workers=0)
    assert len(reference) == 2 * 3  # 5 images in batches of 2, two epochs
    for cache, workers in [(False, 0), (True, 2), (False, 2)]:
        batches = _epoch_batches(split, cache, workers)
        assert [fields for _, fields in batches] == [fields for _, fields in reference]
        assert all(torch.equal(a, b) for (a, _), (b, _) in zip(batches, reference, strict=True))


def test_drop_last_is_ignored_when_the_data_set_is_smaller_than_a_batch(coco_root: Path) -> None:
    split = load_coco(coco_root / "instances_val.json", coco_root)
    loader = make_loader(
        DetectionDataset(split, 32),
        8,
        shuffle=False,
        seed=0,
        num_workers=0,
        pin_memory=False,
        drop_last=True,
    )
    assert [len(t) for _, t in loader] == [5]
    assert len(loader) == 1


def test_voc_box_with_equal_min_and_max_is_one_pixel_wide_and_kept(voc_root: Path) -> None:
    xml = _voc_xml("wide.png", (80, 40), [("bird", (5, 7, 5, 7))])
    (voc_root / "Annotations" / "wide.xml").write_text(xml)
    (voc_root / "ImageSets" / "Main" / "val.txt").write_text("wide\n")
    split = load_voc(voc_root, "val")
    np.testing.assert_array_equal(split.records[0].boxes, [[4, 6, 5, 7]])
    assert split.dropped_boxes == 0


# ------------------------------------------------- COCO exports laid out per split (Roboflow)

EXPORT_SPEC = SyntheticSpec(
    num_train=8, num_val=4, num_test=4, image_size=64, classes=("circle",), max_object_size=32
)
EXPORT_FOLDERS = {"train": "train", "val": "valid", "test": "test"}
# id 0 is the export's super-category: no annotation uses it
EXPORT_CATEGORIES = [
    {"id": 0, "name": "cells", "supercategory": "none"},
    {"id": 1, "name": "cell", "supercategory": "cells"},
]


def _export_file_name(split: str, index: int) -> str:
    """Names as exports write them: a leading '-', and a space in every third one."""
    stem = f"-{split}_{index}_jpg.rf.{index:04x}" if index % 3 else f"{split} image {index}"
    return f"{stem}.jpg"


def make_export(folder: Path) -> Path:
    """A tiny COCO export: <split>/_annotations.coco.json with its JPEGs beside it."""
    for split, name in EXPORT_FOLDERS.items():
        (folder / name).mkdir(parents=True)
        images, annotations = [], []
        for index in range(EXPORT_SPEC.count(split)):
            pixels, objects = render_sample(EXPORT_SPEC, split, index)
            file_name = _export_file_name(split, index)
            Image.fromarray(pixels).save(folder / name / file_name, quality=95)
            images.append({"id": index, "file_name": file_name, "width": 64, "height": 64})
            for obj in objects:
                x0, y0, x1, y1 = obj["box"]
                annotations.append(
                    {
                        "id": len(annotations),
                        "image_id": index,
                        "category_id": 1,
                        "bbox": [x0, y0, x1 - x0, y1 - y0],
                        "area": (x1 - x0) * (y1 - y0),
                        "iscrowd": 0,
                    }
                )
        document = {"images": images, "annotations": annotations, "categories": EXPORT_CATEGORIES}
        (folder / name / "_annotations.coco.json").write_text(json.dumps(document))
    return folder


def export_settings(folder: Path, *splits: str) -> list[str]:
    return ["data.format=coco"] + [
        f"data.{split}_annotations={folder / EXPORT_FOLDERS[split] / '_annotations.coco.json'}"
        for split in splits
    ]


@pytest.fixture
def export(tmp_path: Path) -> Path:
    return make_export(tmp_path / "my export")


def test_an_export_loads_with_only_its_annotation_files_set_images_found_beside_them(
    export: Path,
) -> None:
    config = load_config(None, export_settings(export, "train", "val"))  # data.root is not there
    train, val = load_splits(config)
    assert train.records[0].path == export / "train" / "train image 0.jpg"
    assert train.records[1].path == export / "train" / "-train_1_jpg.rf.0001.jpg"
    assert val.records[0].path == export / "valid" / "val image 0.jpg"
    assert len(train.records) == 8 and len(val.records) == 4


def test_a_category_no_annotation_uses_is_left_out_in_one_info_line(
    export: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = load_config(None, export_settings(export, "train", "val"))
    with caplog.at_level(logging.INFO, logger="pipeline"):
        train, val = load_splits(config)
    assert train.class_names == val.class_names == ["cell"]
    labels = np.concatenate([r.labels for r in train.records + val.records])
    assert labels.size and (labels == 0).all()
    left_out = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(left_out) == 1
    # the benchmarks time the model training builds, with as many classes
    assert class_count(config) == 1
    assert "['cells']" in left_out[0] and "_annotations.coco.json" in left_out[0]


@pytest.mark.parametrize("carved", [False, True], ids=["given", "carved"])
def test_each_split_line_counts_the_classes_training_uses_not_the_files_unused_ones(
    export: Path, carved: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The export lists 'cells' and 'cell', and only 'cell' has objects: training uses one
    class, and no line of counts says two (a given validation file or a carved part alike)."""
    settings = (
        export_settings(export, "train") if carved else export_settings(export, "train", "val")
    )
    config = load_config(None, [*settings, *(["data.val_fraction=0.5"] if carved else [])])
    with caplog.at_level(logging.INFO, logger="pipeline"):
        load_splits(config)
    lines = [r.getMessage() for r in caplog.records if " images, " in r.getMessage()]
    assert len(lines) == 2
    assert all(" objects of 1 classes, " in line for line in lines)


def test_data_classes_keeps_the_categories_it_names_even_without_objects(export: Path) -> None:
    config = load_config(
        None, [*export_settings(export, "train", "val"), "data.classes=[cells, cell]"]
    )
    train, _ = load_splits(config)
    assert train.class_names == ["cells", "cell"]


def test_images_dir_per_split_overrides_the_common_one_and_the_annotation_folder(
    export: Path, tmp_path: Path
) -> None:
    moved = tmp_path / "pictures"
    (export / "valid").rename(moved)
    (export / "valid").mkdir()
    (moved / "_annotations.coco.json").rename(export / "valid" / "_annotations.coco.json")
    settings = export_settings(export, "train", "val")
    with pytest.raises(DataError, match=r"images folder .*valid"):
        load_splits(load_config(None, settings))
    config = load_config(None, [*settings, f"data.val_images_dir={moved}"])
    _, val = load_splits(config)
    assert val.records[0].path == moved / "val image 0.jpg"
    assert images_dir(config, "train") == export / "train"
    common = load_config(None, [*settings, f"data.images_dir={moved}"])
    assert images_dir(common, "val") == moved == images_dir(common, "train")


def test_a_test_split_exists_where_its_file_is_named_or_found(
    export: Path, voc_root: Path, coco_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert has_test_split(load_config(None, export_settings(export, "train", "val", "test")))
    # files named one by one: never the default data.root's test file (the synthetic set's,
    # there after the default pipeline ran), which would evaluate the user's model on shapes
    monkeypatch.chdir(tmp_path)
    default_root = Path(load_config(None)["data"]["root"])
    default_root.mkdir(parents=True)
    (default_root / "instances_test.json").write_text("{}")
    assert not has_test_split(load_config(None, export_settings(export, "train", "val")))
    coco = load_config(None, [f"data.root={coco_root}", "data.format=coco"])
    assert not has_test_split(coco)
    (coco_root / "instances_val.json").rename(coco_root / "instances_test.json")
    assert has_test_split(coco)
    assert not has_test_split(merge(coco, {"data": {"test_split": None}}))
    voc = load_config(None, [f"data.root={voc_root}", "data.format=voc"])
    assert split_files(voc) == [
        voc_root / "ImageSets/Main/train.txt",
        voc_root / "ImageSets/Main/val.txt",
    ]
    (voc_root / "ImageSets" / "Main" / "test.txt").write_text("wide\n")
    assert split_files(voc)[-1] == voc_root / "ImageSets/Main/test.txt"
    synthetic = load_config(None, [])
    assert has_test_split(synthetic)  # generated: num_test defaults to 2048
    assert not has_test_split(load_config(None, ["data.synthetic.num_test=0"]))


def test_an_export_trains_and_evaluates_end_to_end_reporting_on_its_test_split(
    export: Path, tmp_path: Path
) -> None:
    """The acceptance case: python -m pipeline train, then eval, on the export's folders as they are."""
    settings = export_settings(export, "train", "val", "test")
    trained, _, out, predictions = train_then_evaluate(tmp_path, settings)
    assert "left out of training and metrics" in trained.stderr
    result = json.loads(out.read_text())
    assert result["class_names"] == ["cell"]
    assert result["metrics_split"] == "test"
    assert result["splits"]["test"]["source"] == str(export / "test" / "_annotations.coco.json")
    assert result["splits"]["test"]["num_images"] == 4
    assert result["val_metrics"]["num_images"] == 4
    assert result["operating_point"]["threshold"] == result["val_metrics"]["best_f1_threshold"]
    assert predictions.read_text().count("\n") == 1  # compact: one line
    files = [image["file"] for image in json.loads(predictions.read_text())["images"]]
    assert files[0] == str(export / "test" / "test image 0.jpg")


# ------------------------------------------- ignore regions in targets, natural-image augmentation


def test_ignore_regions_reach_the_targets_in_the_input_frame(coco_root: Path) -> None:
    split = load_coco(coco_root / "instances_val.json", coco_root)
    index = next(i for i, r in enumerate(split.records) if r.path.name == "wide.png")
    _, target = DetectionDataset(split, 32, resize="letterbox")[index]
    # 80x40 -> 32x16 at rows 8..24: the crowd region [0, 0, 5, 5] scales by 0.4
    np.testing.assert_allclose(target["ignore_boxes"].numpy(), [[0, 8, 2, 10]], atol=1e-5)
    assert target["ignore_labels"].tolist() == [0]
    assert target["labels"].tolist() == [1]


def test_ignore_regions_follow_the_pixels_through_augmentation(tmp_path: Path) -> None:
    split = _rectangle_split(tmp_path, (3, 5, 11, 20))
    record = split.records[0]
    record.ignore_boxes, record.ignore_labels = record.boxes, record.labels
    record.boxes, record.labels = np.zeros((0, 4), np.float32), np.zeros((0,), np.int64)
    image, target = DetectionDataset(split, 32, augment=ALL_HALF, seed=1)[(3, 0)]
    assert target["boxes"].shape == (0, 4)
    assert target["ignore_boxes"].tolist() == [_white_box(image)]


NATURAL = Augment(hflip=0.5, scale_min=0.5, scale_max=1.5, photometric=0.5)


def test_scale_jitter_moves_and_resizes_the_box_with_the_pixels(tmp_path: Path) -> None:
    split = _rectangle_split(tmp_path, (8, 8, 24, 24))
    dataset = DetectionDataset(split, 32, augment=Augment(hflip=0.0, scale_min=0.5, scale_max=1.5))
    sizes = set()
    for epoch in range(8):
        image, target = dataset[(epoch, 0)]
        assert image.shape == (3, 32, 32)
        if len(target["boxes"]) == 0:
            continue  # cropped away entirely (or under min_box_size)
        box = target["boxes"][0].tolist()
        # resizing blurs the rectangle's edge by at most a pixel
        np.testing.assert_allclose(box, _white_box(image), atol=1.0)
        sizes.add(round(box[2] - box[0]))
    assert len(sizes) > 2  # the object took several sizes


def test_natural_augmentation_is_a_function_of_seed_epoch_and_index_alone(
    coco_root: Path,
) -> None:
    split = load_coco(coco_root / "instances_val.json", coco_root)
    first = DetectionDataset(split, 32, augment=NATURAL, seed=7)
    second = DetectionDataset(split, 32, augment=NATURAL, seed=7, cache=False)
    torch.manual_seed(123)
    a, ta = first[(2, 3)]
    state = torch.get_rng_state()
    torch.manual_seed(999)  # whatever the global RNG holds, the sample is the same
    b, tb = second[(2, 3)]
    assert torch.equal(a, b) and torch.equal(ta["boxes"], tb["boxes"])
    torch.manual_seed(123)
    first[(2, 3)]
    assert torch.equal(torch.get_rng_state(), state)  # and the global RNG is left as it was
    outcomes = {first[(epoch, 3)][0].numpy().tobytes() for epoch in range(4)}
    assert len(outcomes) == 4


def test_the_photographs_preset_switches_flips_off_and_jitter_on() -> None:
    preset = load_config(Path(__file__).parents[1] / "config" / "presets" / "photographs.yaml")
    augment = Augment(**preset["data"]["augment"])
    assert (augment.vflip, augment.transpose, augment.channel_shuffle) == (0, 0, 0)
    assert augment.hflip > 0 and augment.scales and augment.photometric > 0
    assert Augment(**load_config(None)["data"]["augment"]).library_transforms(32) is None


# Colours a class may be told apart by: mid-range, so that no distortion of the preset clips them.
PALETTE = [(0.65, 0.35, 0.35), (0.35, 0.62, 0.38), (0.38, 0.42, 0.66), (0.62, 0.58, 0.34)]
DARK, LIGHT = (0.36, 0.36, 0.40), (0.64, 0.62, 0.62)


def _hues_and_lumas(image: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Each 8-px-wide patch's hue (degrees) and luma, from its mean colour."""
    rgb = image.float().view(3, 8, -1, 8).mean(dim=(1, 3)).T.numpy() / 255  # [patch, 3]
    r, g, b = rgb.T
    hue = np.degrees(np.arctan2(np.sqrt(3) * (g - b), 2 * r - g - b)) % 360
    return hue, rgb @ np.array([0.299, 0.587, 0.114])


def test_the_photographs_presets_colour_distortion_keeps_hues_and_light_above_dark() -> None:
    """Colour may tell classes apart (a red part from a green one, a white piece from a black
    one): the preset's distortion changes light and camera, never a colour's hue or which of
    two objects is the lighter."""
    preset = load_config(Path(__file__).parents[1] / "config" / "presets" / "photographs.yaml")
    colour_only = dataclasses.replace(
        Augment(**preset["data"]["augment"]),
        hflip=0.0,
        scale_min=1.0,
        scale_max=1.0,
        photometric=1.0,
    )
    patches = torch.tensor([*PALETTE, DARK, LIGHT]).T[:, None, :, None].expand(3, 8, -1, 8)
    image = (patches.reshape(3, 8, -1) * 255).round().to(torch.uint8)
    hue, _ = _hues_and_lumas(image)
    for seed in range(40):
        out, _ = augment_sample(
            image,
            torch.zeros(0, 4),
            colour_only,
            np.random.default_rng(seed),
            colour_only.library_transforms(image.shape[-1]),
        )
        assert not torch.equal(out, image)
        shifted, luma = _hues_and_lumas(out)
        turn = np.abs((shifted - hue + 180) % 360 - 180)[: len(PALETTE)]
        assert turn.max() < 5.0, (seed, turn)  # uint8 rounding alone
        assert luma[-2] < luma[-1], seed


def test_scale_min_above_scale_max_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"data\.augment\.scale_min = 2\.0 and scale_max = 1\.5"):
        load_config(None, ["data.augment.scale_min=2.0", "data.augment.scale_max=1.5"])


# ---------------------------------------------------- the training batches, pinned by hash


def _noise_split(root: Path) -> SplitAnnotations:
    """20 noise images (some not square) with 0-5 random boxes each, a few ignore regions."""
    rng = np.random.default_rng(11)
    root.mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(20):
        width, height = (48, 48) if i % 4 else (60, 40)
        path = root / f"{i:02d}.png"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
        count = int(rng.integers(0, 6))
        corners = rng.uniform(0, [width, height], size=(count, 2, 2))
        boxes = np.concatenate([corners.min(axis=1), corners.max(axis=1)], axis=1)
        labels = rng.integers(0, 3, count)
        ignore = boxes[:1] if i % 3 == 0 else np.zeros((0, 4))
        records.append(
            ImageRecord(
                i + 1,
                path,
                width,
                height,
                boxes.astype(np.float32),
                labels.astype(np.int64),
                ignore.astype(np.float32),
                labels[: len(ignore)].astype(np.int64),
            )
        )
    return SplitAnnotations(records, ["a", "b", "c"], root / "fake.json")


def _batches_digest(batches, pixels: bool) -> str:
    """The batches' draws bit for bit: shapes, labels, ids, boxes (to 1e-3 px: their arithmetic
    is scalar, the same on every CPU) and, where `pixels`, the images' bytes. Resized and
    colour-distorted images are left out: torch's kernels for them differ by CPU (AVX2, AVX-512)
    in the last bit, and may round a pixel the other way."""
    digest = hashlib.sha256()
    for images, targets in batches:
        digest.update(f"{images.dtype} {tuple(images.shape)}".encode())
        if pixels:
            digest.update(images.numpy().tobytes())
        for target in targets:
            for key in ("boxes", "labels", "ignore_boxes", "ignore_labels"):
                value = target[key].numpy()
                digest.update(f"{key} {value.dtype} {value.shape}".encode())
                digest.update((value.round(3) if value.dtype.kind == "f" else value).tobytes())
            digest.update(str(target["image_id"]).encode())
    return digest.hexdigest()


# Written from the loader as it was before its augmentation was made cheaper (main at ff74fe1):
# a change is a change to what is trained, which must be deliberate.
PINNED_DEFAULT_BATCHES = "a0c82e79a8dfb406190f1622ec19fd8bfd002207284b9e8d8fab58c82c6f0267"
PINNED_NATURAL_BATCHES = "6aacfecd90bb7369d3632c73daf998d362d5c41955a80738a10bd0a6d26e4ba2"


@pytest.mark.parametrize(
    ("augment", "pixels", "expected"),
    [
        (Augment(**load_config(None)["data"]["augment"]), True, PINNED_DEFAULT_BATCHES),
        (NATURAL, False, PINNED_NATURAL_BATCHES),
    ],
    ids=["default", "natural"],
)
def test_the_training_loader_draws_the_same_augmented_batches_as_it_always_has(
    tmp_path: Path, augment: Augment, pixels: bool, expected: str
) -> None:
    dataset = DetectionDataset(_noise_split(tmp_path), 32, augment=augment, seed=5)
    loader = make_loader(
        dataset, 6, shuffle=True, seed=5, num_workers=0, pin_memory=False, drop_last=True
    )
    batches = []
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        batches.extend(loader)
    assert _batches_digest(batches, pixels) == expected


def test_an_image_already_at_input_size_is_handed_on_as_decoded_with_its_boxes() -> None:
    """Nothing to resize or pad: the decoded tensor itself, and the boxes as float32 [N, 4],
    without torchvision's wrappers (their cost per image is most of a small image's)."""
    image = torch.randint(0, 255, (3, 32, 32), dtype=torch.uint8)
    fitted = fit_image(image, 32)
    boxes = fit_boxes(np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int64), 32, 32, 32)
    assert fitted is image
    assert boxes.dtype == torch.float32 and boxes.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    smaller = fit_image(image, 16)
    moved = fit_boxes(np.array([[0, 0, 32, 16]], np.float32), 32, 32, 16)
    assert smaller.shape == (3, 16, 16) and moved.tolist() == [[0.0, 0.0, 16.0, 8.0]]
