"""Pascal VOC splits given as folders of XML files, as exports lay them out (Roboflow's images
beside their XML files, LabelImg's XML folder apart from its images, images/ + labels/), read
through the same code as the VOCdevkit layout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tiny_runs import train_then_evaluate

from pipeline.config import load_config
from pipeline.data import has_test_split, images_dir, load_split, load_splits, split_files
from pipeline.data.shapes import render_sample
from pipeline.data.synthetic import SyntheticSpec
from pipeline.errors import ConfigError, DataError

SPEC = SyntheticSpec(
    num_train=8,
    num_val=4,
    num_test=4,
    image_size=64,
    classes=("circle", "square"),
    max_object_size=32,
)
FOLDERS = {"train": "train", "val": "valid", "test": "test"}


def _xml(file_name: str | None, size: tuple[int, int], objects: list[tuple[str, list]]) -> str:
    """A VOC annotation as exporters write it, boxes 1-based and inclusive; `file_name` None
    leaves <filename> out."""
    parts = ["<annotation>", "<folder></folder>"]
    if file_name is not None:
        parts.append(f"<filename>{file_name}</filename>")
    parts.append(f"<size><width>{size[0]}</width><height>{size[1]}</height><depth>3</depth></size>")
    for name, (x0, y0, x1, y1) in objects:
        parts.append(
            f"<object><name>{name}</name><pose>Unspecified</pose><truncated>0</truncated>"
            f"<difficult>0</difficult><bndbox><xmin>{x0 + 1}</xmin><ymin>{y0 + 1}</ymin>"
            f"<xmax>{x1}</xmax><ymax>{y1}</ymax></bndbox></object>"
        )
    return "\n".join([*parts, "</annotation>"])


def _stem(split: str, index: int) -> str:
    """Roboflow's renamed stems: the original name, its extension and a hash."""
    return f"{split}_{index}_jpg.rf.{index:04x}"


def make_roboflow_export(folder: Path) -> dict[str, list[list[tuple[str, list]]]]:
    """A tiny Roboflow "Pascal VOC XML" export: each split's images beside their XML files, with
    the exporter's readme and a macOS archive's hidden files beside them. Returns each split's
    objects (class name, xyxy box 0-based) per image in file-name order."""
    drawn: dict[str, list[list[tuple[str, list]]]] = {}
    for split, name in FOLDERS.items():
        (folder / name).mkdir(parents=True)
        drawn[split] = []
        for index in range(SPEC.count(split)):
            pixels, objects = render_sample(SPEC, split, index)
            stem = _stem(split, index)
            Image.fromarray(pixels).save(folder / name / f"{stem}.jpg", quality=95)
            # Roboflow writes the renamed file in <filename>; the first image keeps the
            # original name there, which names no file: found by the XML file's stem
            file_name = f"{split}_{index}.jpg" if index == 0 else f"{stem}.jpg"
            named = [(SPEC.classes[obj["label"]], obj["box"]) for obj in objects]
            (folder / name / f"{stem}.xml").write_text(_xml(file_name, (64, 64), named))
            drawn[split].append(named)
        (folder / name / "README.roboflow.txt").write_text("Exported from roboflow.com\n")
        (folder / name / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
        (folder / name / f"._{_stem(split, 0)}.xml").write_bytes(b"\0\5\26\7\0\2\0\0Mac OS X")
    return drawn


def export_settings(folder: Path, *splits: str) -> list[str]:
    return ["data.format=voc"] + [
        f"data.{split}_annotations={folder / FOLDERS[split]}" for split in splits
    ]


@pytest.fixture
def export(tmp_path: Path) -> Path:
    return tmp_path / "my export"


def test_a_roboflow_export_loads_with_its_classes_boxes_and_images_in_sorted_order(
    export: Path,
) -> None:
    drawn = make_roboflow_export(export)
    train, val = load_splits(load_config(None, export_settings(export, "train", "val")))
    assert train.source == export / "train" and val.source == export / "valid"
    assert [record.path for record in train.records] == [
        export / "train" / f"{_stem('train', i)}.jpg" for i in range(8)
    ]
    assert [record.image_id for record in train.records] == list(range(1, 9))
    assert train.class_names == val.class_names == ["circle", "square"]
    for split, loaded in (("train", train), ("val", val)):
        for record, objects in zip(loaded.records, drawn[split], strict=True):
            assert [train.class_names[label] for label in record.labels] == [n for n, _ in objects]
            boxes = np.array([box for _, box in objects], np.float32).reshape(-1, 4)
            np.testing.assert_array_equal(record.boxes, boxes)


def test_xml_files_are_read_in_sorted_order_whatever_order_the_folder_lists_them(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "labelled"
    folder.mkdir()
    for stem in ("b", "C", "a", "a0"):
        Image.new("RGB", (20, 10)).save(folder / f"{stem}.png")
        (folder / f"{stem}.xml").write_text(_xml(f"{stem}.png", (20, 10), [("x", (1, 1, 5, 5))]))
    config = load_config(None, ["data.format=voc", f"data.train_annotations={folder}"])
    records = load_split(config, "train").records
    assert [(r.image_id, r.path.name) for r in records] == [
        (1, "C.png"), (2, "a.png"), (3, "a0.png"), (4, "b.png"),
    ]  # fmt: skip
    assert [path.name for path in split_files(config, ("train",))] == [
        "C.xml", "a.xml", "a0.xml", "b.xml",
    ]  # fmt: skip


@pytest.fixture
def labelimg(tmp_path: Path) -> tuple[Path, Path]:
    """LabelImg's layout: a folder of XML files and a folder of images, no listing; <filename>
    as tools write it: without its extension, with a Windows path, with a Unix path, absent."""
    xml_folder, image_folder = tmp_path / "annotations", tmp_path / "images"
    xml_folder.mkdir(), image_folder.mkdir()
    entries = {
        "raccoon-1": "raccoon-1",  # no extension
        "raccoon-2": "C:\\Users\\x\\Desktop\\raccoon-2.jpg",
        "raccoon-3": "/home/x/raccoon-3.jpg",
        "raccoon-4": None,
    }
    for index, (stem, file_name) in enumerate(entries.items(), start=1):
        Image.new("RGB", (30 + index, 20)).save(image_folder / f"{stem}.jpg")
        box = (index, 2, index + 10, 12)
        (xml_folder / f"{stem}.xml").write_text(
            _xml(file_name, (30 + index, 20), [("raccoon", box)])
        )
    return xml_folder, image_folder


def labelimg_config(xml_folder: Path, image_folder: Path) -> dict:
    """A user's config naming a LabelImg folder as the training split."""
    return load_config(
        None,
        [
            "data.format=voc",
            f"data.train_annotations={xml_folder}",
            f"data.images_dir={image_folder}",
        ],
    )


def test_a_labelimg_folder_finds_images_by_base_name_or_stem_in_images_dir(
    labelimg: tuple[Path, Path],
) -> None:
    xml_folder, image_folder = labelimg
    settings = ["data.format=voc", f"data.train_annotations={xml_folder}"]
    # not beside the XML files: the error says which setting names their folder
    with pytest.raises(DataError, match=r"do not exist.*set data\.images_dir \(or data\.<split>_"):
        load_split(load_config(None, settings), "train")
    config = load_config(None, [*settings, f"data.train_images_dir={image_folder}"])
    split = load_split(config, "train")
    assert [record.path for record in split.records] == [
        image_folder / f"raccoon-{index}.jpg" for index in range(1, 5)
    ]
    assert [record.boxes.tolist() for record in split.records] == [
        [[float(i), 2.0, i + 10.0, 12.0]] for i in range(1, 5)
    ]
    assert split.class_names == ["raccoon"]
    assert images_dir(config, "train") == image_folder
    # data.images_dir serves every split that names no folder of its own
    common = load_config(None, [*settings, f"data.images_dir={image_folder}"])
    assert load_split(common, "train").records[0].path == image_folder / "raccoon-1.jpg"


def test_images_and_labels_subfolders_load_as_a_split(tmp_path: Path) -> None:
    labels, pictures = tmp_path / "train" / "labels", tmp_path / "train" / "images"
    labels.mkdir(parents=True), pictures.mkdir()
    Image.new("RGB", (40, 30)).save(pictures / "cat.JPG")
    (labels / "cat.xml").write_text(_xml("cat.JPG", (40, 30), [("cat", (0, 0, 10, 10))]))
    config = load_config(
        None,
        [
            "data.format=voc",
            f"data.train_annotations={labels}",
            f"data.train_images_dir={pictures}",
        ],
    )
    assert load_split(config, "train").records[0].path == pictures / "cat.JPG"


def test_a_filename_that_fits_two_images_is_refused_naming_both(
    labelimg: tuple[Path, Path],
) -> None:
    xml_folder, image_folder = labelimg
    Image.new("RGB", (31, 20)).save(image_folder / "raccoon-1.png")
    config = labelimg_config(xml_folder, image_folder)
    with pytest.raises(DataError) as raised:
        load_split(config, "train")
    message = str(raised.value)
    assert str(xml_folder / "raccoon-1.xml") in message
    assert "raccoon-1.jpg and raccoon-1.png" in message and "data.images_dir" in message


def test_a_filename_naming_an_existing_image_is_taken_even_where_the_stem_fits_another(
    labelimg: tuple[Path, Path],
) -> None:
    xml_folder, image_folder = labelimg
    Image.new("RGB", (9, 9)).save(image_folder / "raccoon-2.png")  # the XML file's stem too
    config = labelimg_config(xml_folder, image_folder)
    assert load_split(config, "train").records[1].path == image_folder / "raccoon-2.jpg"


def test_a_filename_naming_another_image_than_the_one_of_the_xml_files_name_is_refused(
    labelimg: tuple[Path, Path],
) -> None:
    """A set renamed after annotation keeps each image's earlier name in <filename>: read as
    written, every XML file would describe another existing image, silently."""
    xml_folder, image_folder = labelimg
    stale = xml_folder / "raccoon-3.xml"
    stale.write_text(_xml("raccoon-4.jpg", (33, 20), [("raccoon", (3, 2, 13, 12))]))
    with pytest.raises(DataError) as raised:
        load_split(labelimg_config(xml_folder, image_folder), "train")
    message = str(raised.value)
    assert str(stale) in message and "<filename>raccoon-4.jpg</filename>" in message
    assert "raccoon-3.jpg there has the XML file's own name" in message


def test_a_folder_without_xml_files_is_refused_naming_it_and_the_key(tmp_path: Path) -> None:
    folder = tmp_path / "valid"
    folder.mkdir()
    (folder / "_annotations.coco.json").write_text("{}")
    (folder / "._a.xml").write_bytes(b"\0\5\26\7")  # hidden: not an annotation
    config = load_config(None, ["data.format=voc", f"data.val_annotations={folder}"])
    with pytest.raises(DataError) as raised:
        load_split(config, "val")
    assert str(raised.value) == (
        f"The VOC annotation folder {folder} (data.val_annotations) holds no .xml file: a split "
        "in Pascal VOC format has one XML file per image. _annotations.coco.json there may be "
        "COCO: set data.format=coco and name it."
    )


@pytest.mark.parametrize("what", ["absent", "a file"])
def test_an_annotations_key_that_names_no_folder_is_refused_naming_it(
    tmp_path: Path, what: str
) -> None:
    path = tmp_path / "train.xml"
    if what == "a file":
        path.write_text(_xml("a.jpg", (4, 4), []))
    config = load_config(None, ["data.format=voc", f"data.train_annotations={path}"])
    with pytest.raises(DataError) as raised:
        load_split(config, "train")
    assert str(raised.value).startswith(
        f"The VOC annotation folder {path} (data.train_annotations) "
        + ("is a file" if what == "a file" else "does not exist")
    )


def test_an_xml_file_that_is_not_a_voc_annotation_is_refused_naming_it(
    labelimg: tuple[Path, Path],
) -> None:
    xml_folder, image_folder = labelimg
    (xml_folder / "annotations.xml").write_text("<annotations><image id='0'/></annotations>")
    config = labelimg_config(xml_folder, image_folder)
    with pytest.raises(DataError) as raised:
        load_split(config, "train")
    assert str(raised.value).startswith(
        f"VOC annotation file {xml_folder / 'annotations.xml'} is not a Pascal VOC annotation: "
        "its root element is <annotations>"
    )


def test_a_missing_images_folder_is_refused_naming_it_and_the_key(
    labelimg: tuple[Path, Path], tmp_path: Path
) -> None:
    xml_folder, _ = labelimg
    absent = tmp_path / "pictures"
    config = load_config(
        None,
        [
            "data.format=voc",
            f"data.train_annotations={xml_folder}",
            f"data.train_images_dir={absent}",
        ],
    )
    with pytest.raises(DataError, match=rf"images folder {absent} \(data.train_images_dir\)"):
        load_split(config, "train")


def test_the_rules_of_the_voc_reader_hold_for_a_folder_too(labelimg: tuple[Path, Path]) -> None:
    """Class names from the training split refuse a validation object of another class, and an
    image described by two XML files is refused: the same code as the VOCdevkit layout's."""
    xml_folder, image_folder = labelimg
    val_folder = xml_folder.parent / "val"
    val_folder.mkdir()
    (val_folder / "a.xml").write_text(_xml("raccoon-1.jpg", (31, 20), [("fox", (1, 1, 9, 9))]))
    settings = [
        "data.format=voc",
        f"data.train_annotations={xml_folder}",
        f"data.val_annotations={val_folder}",
        f"data.images_dir={image_folder}",
    ]
    with pytest.raises(DataError) as raised:
        load_splits(load_config(None, settings))
    assert f"VOC annotation file {val_folder / 'a.xml'} (split 'val', listed in {val_folder})" in (
        str(raised.value)
    )
    (xml_folder / "copy.xml").write_text((xml_folder / "raccoon-3.xml").read_text())
    with pytest.raises(DataError) as raised:
        load_split(load_config(None, settings), "train")
    assert str(raised.value).startswith(
        f"VOC split {xml_folder} lists the image file {image_folder / 'raccoon-3.jpg'} twice: "
        f"through {xml_folder / 'copy.xml'} and {xml_folder / 'raccoon-3.xml'}."
    )


def test_a_split_given_as_a_folder_and_as_a_vocdevkit_listing_is_refused_naming_both_keys(
    labelimg: tuple[Path, Path], tmp_path: Path
) -> None:
    xml_folder, _ = labelimg
    root = tmp_path / "VOC2007"
    (root / "ImageSets" / "Main").mkdir(parents=True)
    (root / "ImageSets" / "Main" / "train.txt").write_text("raccoon-1\n")
    config = load_config(
        None, ["data.format=voc", f"data.root={root}", f"data.train_annotations={xml_folder}"]
    )
    for read in (lambda: load_split(config, "train"), lambda: split_files(config)):
        with pytest.raises(ConfigError) as raised:
            read()
        message = str(raised.value)
        assert f"data.train_annotations = {xml_folder}" in message
        assert "data.root" in message and "data.train_split = train" in message


def test_a_folder_split_gives_the_workflow_its_xml_files_and_a_test_split_only_where_named(
    export: Path,
) -> None:
    make_roboflow_export(export)
    two = load_config(None, export_settings(export, "train", "val"))
    assert not has_test_split(two)

    def xml_files(split: str) -> list[Path]:
        return [
            export / FOLDERS[split] / f"{_stem(split, i)}.xml" for i in range(SPEC.count(split))
        ]

    assert split_files(two) == xml_files("train") + xml_files("val")  # not the hidden ._ files
    three = load_config(None, export_settings(export, "train", "val", "test"))
    assert has_test_split(three)
    assert split_files(three, ("test",)) == xml_files("test")
    absent = load_config(None, ["data.format=voc", f"data.train_annotations={export / 'x'}"])
    assert split_files(absent, ("train",)) == [export / "x"]  # for Snakemake to name


def test_a_roboflow_voc_export_trains_and_evaluates_end_to_end_on_its_test_split(
    export: Path, tmp_path: Path
) -> None:
    """The acceptance case: python -m pipeline train, then evaluate, on the export as it is."""
    make_roboflow_export(export)
    _, _, out, _ = train_then_evaluate(tmp_path, export_settings(export, "train", "val", "test"))
    result = json.loads(out.read_text())
    assert result["class_names"] == ["circle", "square"]
    assert result["metrics_split"] == "test"
    assert result["splits"]["test"]["source"] == str(export / "test")
    assert result["splits"]["test"]["num_images"] == 4
    assert result["val_metrics"]["num_images"] == 4
