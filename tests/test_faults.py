"""The bad-input matrix, through the real CLI: every user error exits 2 with one paragraph
that names the culprit, and leaves no partial output behind.

Config, device, data, checkpoint and runtime faults run `cli.main` in-process on a tiny
synthetic set; three subprocess runs of `python -m pipeline` show that stderr carries no
traceback without `--debug`, and one with it.
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import shutil
import subprocess
import sys
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision
from PIL import Image
from tiny_runs import make_data, tiny_config, tiny_settings

from pipeline import cli
from pipeline import device as dev
from pipeline.config import load_schema
from pipeline.data import SPLITS
from pipeline.engine import checkpoint
from pipeline.engine.trainer import Trainer
from pipeline.errors import ConfigError
from pipeline.evaluation.loop import Evaluator
from pipeline.models import build_from_config

pytestmark = pytest.mark.usefixtures("torch_flags_threads_and_logger")

CLASSES = ["circle", "square", "triangle", "cross"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("data") / "shapes")


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_pipeline_logger) -> Path:
    """Run commands outside the repository, so its config/config.yaml is not picked up."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def pipeline(*argv: str) -> int:
    return cli.main(["--cpu-threads", "1", *argv])


def user_error(capsys: pytest.CaptureFixture, *argv: str) -> str:
    """Run the CLI; assert exit 2 and exactly one error line, last, without a traceback."""
    code = pipeline(*argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if " ERROR " in line]
    assert len(errors) == 1, err
    assert err.rstrip().splitlines()[-1] == errors[0]  # one paragraph: nothing follows it
    return errors[0].split(" ERROR ", 1)[1]


def train_fails(capsys: pytest.CaptureFixture, out: Path, data_root: Path, *extra: str) -> str:
    message = user_error(capsys, "train", "--out", str(out), *tiny_settings(data_root, *extra))
    assert not out.exists()
    return message


def train_succeeds(capsys: pytest.CaptureFixture, out: Path, *settings: str) -> tuple[dict, str]:
    code = pipeline("train", "--out", str(out), *settings)
    err = capsys.readouterr().err
    assert code == 0, err
    return json.loads((out / "train_summary.json").read_text()), err


def warnings_in(err: str) -> list[str]:
    return [line.split(" WARNING ", 1)[1] for line in err.splitlines() if " WARNING " in line]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


# --- config ------------------------------------------------------------------------------------


def test_an_unknown_config_key_names_it_and_the_valid_keys_of_its_section(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture
) -> None:
    message = train_fails(capsys, here / "run", data_root, "data.image_sise=64")
    assert message.startswith(
        "Unknown config key data.image_sise in the command line. Did you mean data.image_size? "
    )
    assert "Valid keys in data: augment, cache," in message and "image_size" in message


def test_config_files_layer_and_an_error_names_the_file_the_bad_key_came_from(
    here: Path, capsys: pytest.CaptureFixture
) -> None:
    (here / "preset.yaml").write_text("data:\n  image_size: 96\n")
    (here / "mine.yaml").write_text("data:\n  image_sise: 64\n")
    message = user_error(capsys, "prepare-data", "--configfile", "preset.yaml", "mine.yaml")
    assert message.startswith("Unknown config key data.image_sise in mine.yaml. ")


def test_config_with_a_file_instead_of_a_setting_says_to_use_configfile(
    here: Path, capsys: pytest.CaptureFixture
) -> None:
    (here / "mine.yaml").write_text("train:\n  epochs: 2\n")
    message = user_error(capsys, "prepare-data", "--config", "mine.yaml")
    assert message == (
        "--config mine.yaml is not a key=value setting: --config takes settings, as snakemake "
        "--config does; give a config file as --configfile mine.yaml."
    )


def test_a_value_of_the_wrong_type_names_the_key_the_value_and_the_type(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture
) -> None:
    message = train_fails(capsys, here / "run", data_root, "train.batch_size=eight")
    assert message == (
        "Config key train.batch_size = 'eight' in the command line is not valid: 'eight' is not "
        "of type 'integer' (train.batch_size: images per step)."
    )


@pytest.mark.parametrize(
    ("setting", "minimum"),
    [
        ("train.epochs=0", 1),
        ("train.epochs=-3", 1),
        ("train.batch_size=0", 1),
        ("train.batch_size=-8", 1),
        ("data.image_size=0", 16),
        ("data.image_size=-64", 16),
    ],
)
def test_zero_or_negative_sizes_name_the_key_and_the_minimum(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture, setting: str, minimum: int
) -> None:
    key, value = setting.split("=")
    message = train_fails(capsys, here / "run", data_root, setting)
    assert message.startswith(f"Config key {key} = {value} in the command line")
    assert f"{value} is less than the minimum of {minimum}" in message


@pytest.mark.parametrize("threads", ["0", "-3", "abc", "1.5"])
def test_a_cpu_thread_count_that_is_no_positive_integer_is_named(
    threads: str, here: Path, capsys: pytest.CaptureFixture
) -> None:
    assert cli.main(["--cpu-threads", threads, "check-env", "--out", str(here / "env.json")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.rstrip().endswith(
        f"ERROR cpu_threads must be 'auto' or a positive integer, got {threads!r}."
    )
    assert not (here / "env.json").exists()


def test_an_image_size_the_models_stride_cannot_divide_names_the_stride_and_two_sizes_that_fit(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture
) -> None:
    message = train_fails(capsys, here / "run", data_root, "data.image_size=100")
    assert message == (
        "data.image_size=100 does not fit model 'tiny_conv': its total stride is 32, so the input "
        "size must be a multiple of 32 (for example 96 or 128)."
    )


@pytest.mark.parametrize(
    ("setting", "choices"),
    [
        ("model.name=yolo", "['tiny_conv', 'resnet18']"),
        ("train.optimizer=lamb", "['adamw', 'sgd']"),
        ("train.scheduler=linear", "['cosine', 'step', 'none']"),
        ("precision=fp8", "['auto', 'fp32', 'fp16', 'bf16', 'measured']"),
    ],
)
def test_an_unknown_model_optimizer_scheduler_or_precision_lists_the_choices(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture, setting: str, choices: str
) -> None:
    key, value = setting.split("=")
    message = train_fails(capsys, here / "run", data_root, setting)
    assert message.startswith(f"Config key {key} = '{value}' in the command line")
    assert f"'{value}' is not one of {choices}" in message


def test_bench_with_an_unknown_precision_exits_2_listing_the_precisions(
    here: Path, capsys: pytest.CaptureFixture
) -> None:
    out = here / "bench.json"
    with pytest.raises(SystemExit) as caught:
        pipeline("bench", "--device", "cpu", "--precision", "fp8", "--out", str(out))
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "argument --precision: invalid choice: 'fp8'" in err
    assert "fp32" in err and "fp16" in err and "bf16" in err
    assert "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize(
    "asked", [["precision=fp16"], ["precision='fp16'"], ["--precision", "fp16"]]
)
def test_a_reduced_precision_the_cpu_lacks_warns_and_trains_in_fp32(
    here: Path,
    data_root: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    asked: list[str],
) -> None:
    """fp16 autocast asked for on a CPU without native fp16 (hidden here, whatever this one has)."""
    monkeypatch.setenv(dev.HIDE_CPU_NATIVE_ENV, "fp16,bf16")
    summary, err = train_succeeds(
        capsys, here / "run", *tiny_settings(data_root, "train.epochs=1"), *asked
    )
    assert any(
        "AMP was asked for, but cpu does not support it in fp16 (this CPU has no native fp16" in w
        and "training in fp32 instead" in w
        for w in warnings_in(err)
    ), err
    assert summary["amp"] is False and summary["precision"] == "fp32"
    assert checkpoint.load(here / "run" / "last.pth")["config"]["precision"] == "fp16"


def test_bf16_asked_for_on_a_cpu_with_native_bf16_trains_bf16(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(dev.HIDE_CPU_NATIVE_ENV, raising=False)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": True}, raising=False)
    settings = tiny_settings(data_root, "train.epochs=1", "precision=bf16")
    summary, err = train_succeeds(capsys, here / "run", *settings)
    assert summary["amp"] is True and summary["precision"] == "bf16"
    assert warnings_in(err) == []


@pytest.mark.parametrize(
    ("amp", "named"),
    [
        (["amp='false'"], "Config key amp = 'false' in the command line: amp and amp_dtype were"),
        (["amp=off"], "Config key amp = False in the command line: amp and amp_dtype were"),
        (["--amp", "false"], "--amp false was replaced by --precision"),
    ],
)
def test_the_replaced_amp_key_is_refused_and_never_read_as_true(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture, amp: list[str], named: str
) -> None:
    """amp and amp_dtype are replaced by precision: their old spellings are refused, saying
    what replaces them (precision=fp32 here), and never read as anything."""
    out = here / "run"
    message = user_error(capsys, "train", "--out", str(out), *tiny_settings(data_root), *amp)
    assert message.startswith(named)
    assert "precision: fp32" in message or "--precision fp32" in message
    assert not out.exists()


@pytest.mark.parametrize(
    ("amp", "named"),
    [
        (["precision=fp61"], "Config key precision = 'fp61' in the command line"),
        (["precision=2"], "Config key precision = 2 in the command line"),
        (["--amp", "ture"], "--amp ture was replaced by --precision (auto, fp32, fp16, bf16 or"),
    ],
)
def test_a_junk_spelling_of_the_precision_is_rejected_naming_the_accepted_values(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture, amp: list[str], named: str
) -> None:
    out = here / "run"
    message = user_error(capsys, "train", "--out", str(out), *tiny_settings(data_root), *amp)
    assert message.startswith(named)
    if amp[0] != "--amp":
        assert "is not one of ['auto', 'fp32', 'fp16', 'bf16', 'measured']" in message
    assert not out.exists()


# --- device ------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["train", "eval"])
def test_an_unknown_device_name_lists_the_valid_choices(
    here: Path,
    data_root: Path,
    capsys: pytest.CaptureFixture,
    checkpoints: dict[str, Path],
    command: str,
) -> None:
    if command == "train":
        message = train_fails(capsys, here / "run", data_root, "device=gpu")
        assert message.startswith("Config key device = 'gpu' in the command line")
        assert "auto, cpu, cuda, cuda:N or mps" in message
    else:
        out = here / "eval.json"
        message = user_error(
            capsys,
            "eval",
            "--checkpoint",
            str(checkpoints["good"]),
            "--device",
            "gpu",
            "--out",
            str(out),
        )
        assert message == "Unknown device 'gpu': valid choices are auto, cpu, cuda, cuda:N, mps."
        assert not out.exists()


@pytest.mark.parametrize("backend", ["cuda", "mps"])
def test_an_absent_backend_names_it_the_reason_and_what_is_available(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture, no_cuda, no_mps, backend: str
) -> None:
    message = train_fails(capsys, here / "run", data_root, f"device={backend}")
    assert message.startswith(f"Device '{backend}' is not available: ")
    assert message.endswith(
        "Available backends: ['cpu']. Ask for one of those, or 'auto' to take the best one."
    )
    assert f"is not available: {dev.backend_status(backend).reason}. Available" in message


def test_a_cuda_index_out_of_range_says_how_many_gpus_are_visible(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture, fake_cuda
) -> None:
    message = train_fails(capsys, here / "run", data_root, "device=cuda:7")
    assert message == (
        "Device 'cuda:7' is not available: index 7 is out of range, only 2 cuda device(s) are "
        "visible (cuda:0 to cuda:1). Available backends: ['cuda', 'cpu']."
    )


# --- data --------------------------------------------------------------------------------------


def copy_data(data_root: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(data_root, tmp_path / "data"))


def edit_json(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


def test_a_missing_data_root_names_the_key_and_how_to_generate_it(
    here: Path, capsys: pytest.CaptureFixture
) -> None:
    absent = here / "absent"
    message = train_fails(capsys, here / "run", absent)
    assert message == (
        f"Data root {absent} does not exist (config key data.root). Generate it with "
        "'python -m pipeline prepare-data' (or 'snakemake prepare_data')."
    )


def test_a_home_folder_tilde_in_data_root_and_out_is_expanded_not_taken_literally(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = here / "home"
    monkeypatch.setenv("HOME", str(home))
    shutil.copytree(data_root, home / "shapes")
    settings = tiny_settings(Path("~/shapes"), "train.epochs=1")
    assert "data.root=~/shapes" in settings
    code = pipeline("train", "--out", "~/run", *settings)  # what --out '~/run', quoted, passes
    assert code == 0, capsys.readouterr().err
    summary = json.loads((home / "run" / "train_summary.json").read_text())
    assert summary["paths"]["last"] == str(home / "run" / "last.pth")
    assert not (here / "~").exists()


def test_an_empty_split_names_its_annotation_file(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture
) -> None:
    data = copy_data(data_root, here)
    edit_json(data / "instances_val.json", lambda d: d.update(images=[], annotations=[]))
    message = train_fails(capsys, here / "run", data)
    assert message == (
        f"COCO annotation file {data / 'instances_val.json'} lists no images: the split is empty."
    )


def test_a_training_split_without_objects_is_refused_as_nothing_to_learn(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture
) -> None:
    """An images-only COCO file (no 'annotations') for training: every image a negative."""
    data = copy_data(data_root, here)
    edit_json(data / "instances_train.json", lambda d: d.pop("annotations"))
    message = train_fails(capsys, here / "run", data)
    assert message == (
        f"The training split {data / 'instances_train.json'} has no objects (16 image(s), none "
        f"with an object of {CLASSES}): there is nothing to learn from it. Give the training "
        "split images with objects."
    )


def test_a_validation_split_without_objects_is_refused_as_nothing_could_pick_the_checkpoint(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture
) -> None:
    data = copy_data(data_root, here)
    edit_json(data / "instances_val.json", lambda d: d.update(annotations=[]))
    message = train_fails(capsys, here / "run", data)
    assert message == (
        f"The validation split {data / 'instances_val.json'} has no objects (8 image(s), none "
        f"with an object of {CLASSES}): F1 and AP are undefined on it, so neither the best "
        "checkpoint nor the score threshold could be picked. Give the validation split images "
        "with objects."
    )


def test_a_missing_image_file_is_named_with_the_annotation_file_that_lists_it(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture
) -> None:
    data = copy_data(data_root, here)
    (data / "train" / "000003.png").unlink()
    message = train_fails(capsys, here / "run", data)
    assert message.startswith(
        f"{data / 'instances_train.json'} refers to image file(s) that do not exist: "
        f"{data / 'train' / '000003.png'}."
    )


def test_a_truncated_image_is_named_when_the_cache_decodes_it_at_start_up(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture
) -> None:
    data = copy_data(data_root, here)
    image = data / "train" / "000005.png"
    image.write_bytes(image.read_bytes()[:200])
    message = train_fails(capsys, here / "run", data)  # data.cache is true by default
    assert message.startswith(f"Image file {image} is truncated, corrupt or not an image: ")
    # a published set's image has no copy to regenerate: the message says what else to do
    assert "or leave it out of the data set: remove it and its annotation" in message


@pytest.mark.parametrize(
    ("image_name", "workers"),
    [("train/000005.png", 0), ("train/000005.png", 1), ("val/000003.png", 0)],
)
def test_a_truncated_image_found_while_training_uncached_leaves_no_run_folder_behind(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture, image_name: str, workers: int
) -> None:
    data = copy_data(data_root, here)
    image = data / image_name
    image.write_bytes(image.read_bytes()[:200])
    settings = ("data.cache=false", f"data.num_workers={workers}")
    message = train_fails(capsys, here / "run", data, *settings)  # asserts no folder is left
    assert message.startswith(f"Image file {image} is truncated, corrupt or not an image: ")


def test_an_image_whose_size_differs_from_its_annotation_is_named_with_both_sizes(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture
) -> None:
    data = copy_data(data_root, here)
    edit_json(data / "instances_val.json", lambda d: d["images"][2].update(width=128))
    message = train_fails(capsys, here / "run", data)
    assert message.startswith(
        f"{data / 'instances_val.json'}: 1 image(s) are not the size their annotation says: "
        f"{data / 'val' / '000002.png'} is annotated 128x64 but is 64x64 (width x height, EXIF "
        "orientation applied). Boxes are never rescaled to fit."
    )


def drop_sizes(document: dict[str, Any]) -> None:
    """Every image entry's size left out, as exports do: keys absent, null, or 0."""
    for index, image in enumerate(document["images"]):
        if index % 3 == 0:
            del image["width"], image["height"]
        else:
            image.update(width=None if index % 3 == 1 else 0, height=0)


def test_a_missing_image_whose_entry_has_no_size_is_named_and_nothing_is_written(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture
) -> None:
    data = copy_data(data_root, here)
    edit_json(data / "instances_train.json", drop_sizes)
    (data / "train" / "000003.png").unlink()
    message = train_fails(capsys, here / "run", data)
    assert message.startswith(
        f"{data / 'instances_train.json'} refers to image file(s) that do not exist: "
        f"{data / 'train' / '000003.png'}. Check the images folder {data} "
    )


def test_a_category_that_no_annotation_uses_is_left_out_in_one_info_line(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture
) -> None:
    data = copy_data(data_root, here)
    for name in ("instances_train.json", "instances_val.json"):
        edit_json(
            data / name,
            lambda d: d["categories"].insert(
                0, {"id": 0, "name": "shapes", "supercategory": "none"}
            ),
        )
    summary, err = train_succeeds(capsys, here / "run", *tiny_settings(data, "train.epochs=1"))
    assert (
        f"{data / 'instances_train.json'}, {data / 'instances_val.json'}: categories ['shapes'] "
        f"have no objects in either split: left out of training and metrics; 4 classes remain "
        f"{CLASSES}"
    ) in err
    assert summary["class_names"] == CLASSES
    assert warnings_in(err) == []


def test_malformed_annotation_json_names_the_file_and_the_position(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture
) -> None:
    data = copy_data(data_root, here)
    (data / "instances_train.json").write_text('{"images": [')
    message = train_fails(capsys, here / "run", data)
    assert message.startswith(
        f"COCO annotation file {data / 'instances_train.json'} is not valid JSON: "
    )
    assert "line 1 column" in message


@pytest.mark.parametrize(
    ("change", "what"),
    [
        (lambda d: d.update(annotations={"1": d["annotations"][0]}), "'annotations' is an object"),
        (lambda d: d["annotations"].insert(2, 7), "entry 2 of 'annotations' is a number (7)"),
        (lambda d: d["images"].append("a.png"), "entry 16 of 'images' is a string (\"a.png\")"),
    ],
    ids=["annotations-object", "annotation-number", "image-string"],
)
def test_annotations_that_are_not_a_list_of_objects_name_the_file_and_the_entry(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture, change, what: str
) -> None:
    data = copy_data(data_root, here)
    edit_json(data / "instances_train.json", change)
    message = train_fails(capsys, here / "run", data)
    assert message.startswith(
        f"COCO annotation file {data / 'instances_train.json'} is malformed: {what}"
    )


def voc_root(data_root: Path, folder: Path, broken: str | None = None) -> Path:
    """A Pascal VOC copy of three synthetic images of circles; the XML of `broken` is cut short."""
    (folder / "JPEGImages").mkdir(parents=True)
    (folder / "Annotations").mkdir()
    (folder / "ImageSets" / "Main").mkdir(parents=True)
    names = ["000000", "000001", "000002"]
    for name in names:
        shutil.copy(data_root / "train" / f"{name}.png", folder / "JPEGImages")
        (folder / "Annotations" / f"{name}.xml").write_text(
            f"<annotation><filename>{name}.png</filename><size><width>64</width>"
            "<height>64</height></size><object><name>circle</name><bndbox><xmin>1</xmin>"
            "<ymin>1</ymin><xmax>20</xmax><ymax>20</ymax></bndbox></object></annotation>"
        )
    if broken:
        xml = folder / "Annotations" / f"{broken}.xml"
        xml.write_text(xml.read_text()[:60])
    (folder / "ImageSets" / "Main" / "train.txt").write_text("\n".join(names) + "\n")
    (folder / "ImageSets" / "Main" / "val.txt").write_text("000000\n")
    return folder


def test_malformed_voc_xml_names_the_file_and_the_position(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture
) -> None:
    voc = voc_root(data_root, here / "voc", broken="000001")
    message = train_fails(capsys, here / "run", voc, "data.format=voc")
    assert message.startswith(
        f"VOC annotation file {voc / 'Annotations' / '000001.xml'} is not valid XML: "
    )
    assert "line 1, column" in message


def test_a_voc_class_only_in_validation_names_the_xml_file_and_the_split_not_data_classes(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture
) -> None:
    voc = voc_root(data_root, here / "voc")
    xml = voc / "Annotations" / "000000.xml"
    xml.write_text(xml.read_text().replace("circle", "star"))
    (voc / "ImageSets" / "Main" / "train.txt").write_text("000001\n000002\n")
    message = train_fails(capsys, here / "run", voc, "data.format=voc")
    assert message.startswith(
        f"VOC annotation file {xml} (split 'val', listed in {voc / 'ImageSets/Main/val.txt'}) has "
        "objects of class(es) ['star'], which are not among the classes of the training split "
        f"{voc / 'ImageSets/Main/train.txt'} ['circle']: a model cannot learn a class it never "
        "trains on."
    )
    assert "data.classes ['circle']" not in message


def test_a_box_with_negative_size_is_dropped_in_one_counted_warning_and_training_goes_on(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture
) -> None:
    data = copy_data(data_root, here)

    def add_bad_boxes(document: dict[str, Any]) -> None:
        for ann_id, bbox in ((9001, [10, 10, -5, 6]), (9002, [20, 20, 8, -1])):
            document["annotations"].append(
                {"id": ann_id, "image_id": 1, "category_id": 2, "bbox": bbox, "iscrowd": 0}
            )

    edit_json(data / "instances_train.json", add_bad_boxes)
    summary, err = train_succeeds(capsys, here / "run", *tiny_settings(data, "train.epochs=1"))
    assert warnings_in(err) == [
        f"{data / 'instances_train.json'}: dropped 2 degenerate box(es) (zero or negative width "
        "or height, or entirely outside the image)"
    ]
    assert summary["epochs"] == 1


def test_a_category_id_outside_the_categories_names_the_annotation_and_the_known_ids(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture
) -> None:
    data = copy_data(data_root, here)
    edit_json(data / "instances_train.json", lambda d: d["annotations"][4].update(category_id=99))
    annotation_id = json.loads((data / "instances_train.json").read_text())["annotations"][4]["id"]
    message = train_fails(capsys, here / "run", data)
    assert message == (
        f"COCO annotation file {data / 'instances_train.json'}: annotation {annotation_id} has "
        "category_id 99, which is not among the categories [1, 2, 3, 4]."
    )


def test_images_without_annotations_are_kept_as_negatives_and_counted(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture
) -> None:
    data = copy_data(data_root, here)
    cleared = {1, 2, 3, 4, 5}
    edit_json(
        data / "instances_train.json",
        lambda d: d.update(
            annotations=[a for a in d["annotations"] if a["image_id"] not in cleared]
        ),
    )
    document = json.loads((data / "instances_train.json").read_text())
    annotated = {a["image_id"] for a in document["annotations"]}
    negatives = sum(1 for image in document["images"] if image["id"] not in annotated)
    assert negatives >= len(cleared)
    summary, err = train_succeeds(capsys, here / "run", *tiny_settings(data, "train.epochs=1"))
    assert (
        f"{data / 'instances_train.json'}: 16 images, {len(document['annotations'])} objects of 4 "
        f"classes, {negatives} image(s) without objects (kept as negatives)"
    ) in err
    assert summary["steps"] == 2  # all 16 images trained: 2 batches of 8
    assert warnings_in(err) == []


def test_different_class_lists_in_train_and_val_name_both_files_and_lists(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture
) -> None:
    data = copy_data(data_root, here)
    edit_json(
        data / "instances_val.json",
        lambda d: d["categories"].append({"id": 5, "name": "star", "supercategory": "shape"}),
    )
    message = train_fails(capsys, here / "run", data)
    assert message == (
        "The training and validation splits define different classes: "
        f"{data / 'instances_train.json'} has {CLASSES}, {data / 'instances_val.json'} has "
        f"{[*CLASSES, 'star']}. Make them agree, or set data.classes to the list to use."
    )


# --- checkpoints -------------------------------------------------------------------------------


class RunsCode:
    """Unpickling this calls os.system, which would create the file `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


@pytest.fixture(scope="module")
def checkpoints(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A good checkpoint of a one-epoch run, and one of each defect, made from it."""
    trainer = Trainer(tiny_config(data_root, "train.epochs=1"), tmp_path_factory.mktemp("trained"))
    trainer.fit()
    folder = tmp_path_factory.mktemp("checkpoints")
    good = trainer.paths["last"]
    state = checkpoint.load(good)
    data = good.read_bytes()
    (folder / "truncated.pth").write_bytes(data[: len(data) // 2])
    wider = build_from_config({**state["config"]["model"], "width": 16}, len(CLASSES))
    checkpoint.save(folder / "other_width.pth", {**state, "model": wider.state_dict()})
    two = build_from_config(state["config"]["model"], 2)
    checkpoint.save(
        folder / "two_classes.pth",
        {**state, "model": two.state_dict(), "class_names": ["circle", "square"]},
    )
    torch.save(
        {"format": checkpoint.FORMAT, "x": RunsCode(folder / "code-ran")}, folder / "evil.pth"
    )
    (folder / "notes.pth").write_text("These are my notes on the run, not a checkpoint.\n")
    (folder / "empty.pth").touch()
    (folder / "random_bytes.pth").write_bytes(random.Random(0).randbytes(4096))
    with zipfile.ZipFile(folder / "zip.pth", "w") as archive:
        archive.writestr("notes.txt", "a zip archive, not a checkpoint")
    resnet = torchvision.models.resnet18(weights=None)
    torch.save(resnet.state_dict(), folder / "state_dict.pth")
    torch.save(resnet, folder / "whole_model.pth")
    with warnings.catch_warnings():  # TorchScript is deprecated, yet such files are around
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), folder / "torchscript.pth")
    torch.save({**state, "format": "pipeline.checkpoint/0"}, folder / "other_format.pth")
    resnet_config = {**state["config"], "model": {**state["config"]["model"], "name": "resnet18"}}
    resnet_run = build_from_config(resnet_config["model"], len(CLASSES))
    checkpoint.save(
        folder / "resnet18_run.pth",
        {**state, "config": resnet_config, "model": resnet_run.state_dict()},
    )
    (folder / "directory.pth").mkdir()
    bad_eval = {**state["config"]["eval"], "min_score": 5}
    checkpoint.save(
        folder / "bad_config.pth", {**state, "config": {**state["config"], "eval": bad_eval}}
    )
    return {
        "good": good,
        "missing": folder / "missing.pth",
        "marker": folder / "code-ran",
        **{path.stem: path for path in folder.glob("*.pth")},
    }


# What each file that is no usable checkpoint is called in its one-line message, after
# "Checkpoint <path> ", and how the message ends.
EXPECTED = checkpoint.EXPECTED
USE_ANOTHER = "Use the run's other checkpoint (best.pth or last.pth), or train again."
NOT_USABLE = {
    "notes": (
        "is not a checkpoint: it is a text file (it starts with 'These are my notes on the run, not a che')",
        EXPECTED,
    ),
    "empty": ("is empty (0 bytes): a copy or a save that never finished", EXPECTED),
    "random_bytes": ("is not a checkpoint: its first bytes (", EXPECTED),
    "truncated": (
        "is damaged: it starts as a torch checkpoint (a zip archive) does, but its end is missing",
        USE_ANOTHER,
    ),
    "zip": (
        "is a zip archive but not a torch checkpoint: it holds notes.txt and no data.pkl",
        EXPECTED,
    ),
    "torchscript": ("is a TorchScript model (torch.jit.save), not a checkpoint", EXPECTED),
    "state_dict": (
        "was not written by this pipeline: it holds a bare state_dict of 122 tensors (first "
        "'conv1.weight'), as torch.save(model.state_dict()) writes",
        EXPECTED,
    ),
    "whole_model": (
        "was refused by torch.load(weights_only=True): it holds pickled Python objects",
        "(Unsupported global: GLOBAL torchvision.models.resnet.ResNet was not an allowed global "
        "by default)",
    ),
    "other_format": ("has the format tag 'pipeline.checkpoint/0', which this version", EXPECTED),
    "other_width": ("does not fit model 'tiny_conv' (4 classes, width 8)", "unedited."),
    "two_classes": ("was trained on 2 classes ['circle', 'square'], but the data", "them all."),
    "directory": ("is a directory", EXPECTED),
}


def test_a_good_checkpoint_evaluates_and_writes_its_metrics(
    here: Path, checkpoints: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    out = here / "eval.json"
    assert pipeline("eval", "--checkpoint", str(checkpoints["good"]), "--out", str(out)) == 0
    assert json.loads(out.read_text())["class_names"] == CLASSES


def test_eval_reports_the_test_split_at_the_threshold_picked_on_validation(
    here: Path, checkpoints: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    out = here / "eval.json"
    assert pipeline("eval", "--checkpoint", str(checkpoints["good"]), "--out", str(out)) == 0
    result = json.loads(out.read_text())
    assert (result["split"], result["metrics_split"]) == ("test", "test")
    assert {name: split["num_images"] for name, split in result["splits"].items()} == {
        "val": 8,
        "test": 8,
    }
    chosen = result["metrics"]["chosen_threshold"]
    assert chosen["threshold"] == result["val_metrics"]["best_f1_threshold"]
    assert result["operating_point"] == {
        "threshold": chosen["threshold"],
        "picked_on": "val",
        "applied_to": "test",
        "precision": chosen["precision"],
        "recall": chosen["recall"],
        "f1": chosen["f1"],
        "f1_interval": chosen["f1_interval"],
    }
    low, high = chosen["f1_interval"]["low"], chosen["f1_interval"]["high"]
    assert low <= chosen["f1"] <= high and chosen["f1_interval"]["images"] == 8
    # the headline's AP has its intervals; validation's, beside it, only its point figures
    assert result["metrics"]["ap50_interval"] and result["metrics"]["ap50_matches"]
    val = result["val_metrics"]
    assert val["ap50_interval"] is val["ap_interval"] is val["ap50_matches"] is None
    assert val["f1_interval"] and val["ap50"] is not None


def test_eval_without_a_test_split_reports_validation_and_says_so(
    here: Path, checkpoints: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    out = here / "eval.json"
    argv = ["eval", "--checkpoint", str(checkpoints["good"]), "--out", str(out)]
    assert pipeline(*argv, "data.test_split=null") == 0
    result = json.loads(out.read_text())
    assert (result["split"], result["metrics_split"]) == ("val", "val")
    assert set(result["splits"]) == {"val"} and result["val_metrics"] is None
    assert result["metrics"]["ap50_interval"] and result["metrics"]["ap_interval"]
    best = result["metrics"]["best"]
    assert result["operating_point"] == {
        "threshold": best["threshold"],
        "picked_on": "val",
        "applied_to": "val",
        "precision": best["precision"],
        "recall": best["recall"],
        "f1": best["f1"],
        "f1_interval": None,  # picked on these very images: no honest interval
    }


def test_a_failing_eval_leaves_the_previous_metrics_file_unchanged(
    here: Path, checkpoints: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    out = here / "eval.json"
    assert pipeline("eval", "--checkpoint", str(checkpoints["good"]), "--out", str(out)) == 0
    before = out.read_bytes()
    argv = ["eval", "--checkpoint", str(checkpoints["good"]), "--out", str(out)]
    message = user_error(capsys, *argv, "data.root=" + str(here / "absent"))
    assert message.startswith(f"Data root {here / 'absent'} does not exist")
    assert out.read_bytes() == before
    assert sorted(path.name for path in here.iterdir()) == ["eval.json"]


def eval_fails(capsys, here: Path, path: Path, *extra: str) -> str:
    out, predictions = here / "eval.json", here / "predictions.json"
    argv = ["eval", "--checkpoint", str(path), "--out", str(out), "--predictions", str(predictions)]
    message = user_error(capsys, *argv, *extra)
    assert not out.exists() and not predictions.exists()
    return message


def profile_fails(capsys, here: Path, path: Path) -> str:
    out = here / "profile"
    message = user_error(capsys, "profile", "--checkpoint", str(path), "--out", str(out))
    assert not out.exists()
    return message


def resume_fails(capsys, here: Path, path: Path, data_root: Path) -> str:
    """`train --resume` on a run folder whose last.pth is `path`; the folder stays as it was."""
    run = here / "run"
    run.mkdir()
    if path.exists():
        shutil.copy(path, run / "last.pth")
    before = snapshot(run)
    message = user_error(
        capsys, "train", "--resume", "--out", str(run), *tiny_settings(data_root, "train.epochs=1")
    )
    assert snapshot(run) == before
    return message


def predict_fails(capsys, here: Path, path: Path) -> str:
    images, out = here / "images", here / "predicted"
    images.mkdir()
    Image.new("RGB", (32, 32)).save(images / "one.png")
    message = user_error(
        capsys, "predict", "--checkpoint", str(path), str(images), "--out", str(out)
    )
    assert not out.exists()
    return message


FAILS = {"eval": eval_fails, "profile": profile_fails, "predict": predict_fails}


Refusal = Callable[[str], tuple[str, Path]]


@pytest.fixture(params=["eval", "profile", "resume"])
def refused(
    request: pytest.FixtureRequest,
    here: Path,
    data_root: Path,
    checkpoints: dict[str, Path],
    capsys: pytest.CaptureFixture,
) -> Refusal:
    """For each command that reads a checkpoint (evaluate, profile, train --resume): the message
    it refuses checkpoints[kind] with, and the path the message should name (`train --resume`
    reads its copy in the run folder)."""

    def refuse(kind: str) -> tuple[str, Path]:
        path = checkpoints[kind]
        if request.param == "resume":
            return resume_fails(capsys, here, path, data_root), here / "run" / "last.pth"
        return FAILS[request.param](capsys, here, path), path

    return refuse


@pytest.fixture
def no_evaluation(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The splits that evaluation started on (none, where the data is refused first)."""
    started: list[str] = []
    real = Evaluator.evaluate

    def evaluate(self, model, loader, *args, **kwargs):
        started.append(str(loader.dataset.records[0].path.parent.name))
        return real(self, model, loader, *args, **kwargs)

    monkeypatch.setattr(Evaluator, "evaluate", evaluate)
    return started


@pytest.mark.parametrize("cache", ["true", "false"])
@pytest.mark.parametrize("split", ["val", "test"])
def test_eval_names_a_missing_image_as_loading_does_before_evaluating_cached_or_not(
    here: Path,
    data_root: Path,
    checkpoints: dict[str, Path],
    capsys: pytest.CaptureFixture,
    no_evaluation: list[str],
    cache: str,
    split: str,
) -> None:
    # cached, the files are checked as they are decoded; uncached, by their headers up front
    data = copy_data(data_root, here)
    (data / split / "000003.png").unlink()
    message = eval_fails(
        capsys, here, checkpoints["good"], f"data.root={data}", f"data.cache={cache}"
    )
    assert message.startswith(
        f"{data / f'instances_{split}.json'} refers to image file(s) that do not exist: "
        f"{data / split / '000003.png'}. Check the images folder {data} "
    )
    assert no_evaluation == []


@pytest.mark.parametrize("cache", ["true", "false"])
def test_eval_of_splits_without_image_sizes_reads_them_from_the_files_with_the_same_results(
    here: Path,
    data_root: Path,
    checkpoints: dict[str, Path],
    capsys: pytest.CaptureFixture,
    cache: str,
) -> None:
    data = copy_data(data_root, here)
    for split in ("val", "test"):
        edit_json(data / f"instances_{split}.json", drop_sizes)
    results = {}
    for name, root in (("given", data_root), ("read", data)):
        out, predictions = here / f"{name}.json", here / f"{name}_predictions.json"
        argv = ["--out", str(out), "--predictions", str(predictions), f"data.cache={cache}"]
        assert (
            pipeline("eval", "--checkpoint", str(checkpoints["good"]), *argv, f"data.root={root}")
            == 0
        )
        results[name] = (json.loads(out.read_text()), predictions.read_bytes())
    err = capsys.readouterr().err
    for split in ("val", "test"):
        assert (
            f"{data / f'instances_{split}.json'}: 8 image(s) have no width/height in the "
            "annotations: read from the image files"
        ) in err
    (given, given_predictions), (read, read_predictions) = results.values()
    # the same file, but for the folder each set is in
    assert read_predictions.replace(bytes(data), bytes(data_root)) == given_predictions
    for key in ("metrics", "val_metrics"):
        del read[key]["timing"], given[key]["timing"]
        assert read[key] == given[key]


@pytest.mark.parametrize("cache", ["true", "false"])
def test_eval_names_a_test_image_of_another_size_than_annotated_before_evaluating(
    here: Path,
    data_root: Path,
    checkpoints: dict[str, Path],
    capsys: pytest.CaptureFixture,
    no_evaluation: list[str],
    cache: str,
) -> None:
    data = copy_data(data_root, here)
    edit_json(data / "instances_test.json", lambda d: d["images"][2].update(width=128))
    message = eval_fails(
        capsys, here, checkpoints["good"], f"data.root={data}", f"data.cache={cache}"
    )
    assert message.startswith(
        f"{data / 'instances_test.json'}: 1 image(s) are not the size their annotation says: "
        f"{data / 'test' / '000002.png'} is annotated 128x64 but is 64x64 (width x height, EXIF "
        "orientation applied). Boxes are never rescaled to fit."
    )
    assert no_evaluation == []


def test_eval_refuses_a_test_split_without_objects_before_evaluating_never_reporting_zeros(
    here: Path,
    data_root: Path,
    checkpoints: dict[str, Path],
    capsys: pytest.CaptureFixture,
    no_evaluation: list[str],
) -> None:
    """Recall and AP of no objects would read 0 whatever the model (an images-only COCO file,
    as a test set without public annotations ships, says 'no objects' the same way)."""
    data = copy_data(data_root, here)
    edit_json(data / "instances_test.json", lambda d: d.pop("annotations"))
    message = eval_fails(capsys, here, checkpoints["good"], f"data.root={data}")
    assert message == (
        f"The test split {data / 'instances_test.json'} has no objects (8 image(s), none with an "
        f"object of {CLASSES}): recall, F1 and AP are undefined on it, and would read as 0. Give "
        "the test split images with objects, or set data.test_split=null to report on "
        "validation."
    )
    assert no_evaluation == []
    out = here / "eval.json"
    argv = ["eval", "--checkpoint", str(checkpoints["good"]), "--out", str(out)]
    assert pipeline(*argv, f"data.root={data}", "data.test_split=null") == 0
    assert json.loads(out.read_text())["split"] == "val"


def test_eval_names_a_truncated_test_image_found_by_the_cache_before_evaluating(
    here: Path,
    data_root: Path,
    checkpoints: dict[str, Path],
    capsys: pytest.CaptureFixture,
    no_evaluation: list[str],
) -> None:
    data = copy_data(data_root, here)
    image = data / "test" / "000005.png"
    image.write_bytes(image.read_bytes()[:200])  # its header intact: only decoding finds it
    message = eval_fails(capsys, here, checkpoints["good"], f"data.root={data}", "data.cache=true")
    assert message.startswith(f"Image file {image} is truncated, corrupt or not an image: ")
    assert no_evaluation == []


@pytest.mark.parametrize(("cache", "reads"), [("true", 1), ("false", 2)])
def test_eval_opens_each_image_file_once_where_it_caches_them_and_twice_where_not(
    here: Path,
    checkpoints: dict[str, Path],
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    cache: str,
    reads: int,
) -> None:
    # cached, decoding every file checks it: the header check up front would read it twice;
    # uncached, the headers are checked before the first image is decoded
    opened: collections.Counter[str] = collections.Counter()
    real_open = Image.open

    def counted_open(fp, *args, **kwargs):
        opened[str(fp)] += 1
        return real_open(fp, *args, **kwargs)

    monkeypatch.setattr(Image, "open", counted_open)
    out = here / "eval.json"
    argv = ["eval", "--checkpoint", str(checkpoints["good"]), "--out", str(out)]
    settings = (f"data.cache={cache}", "data.num_workers=0")  # decoded in this process
    assert pipeline(*argv, *settings) == 0, capsys.readouterr().err
    assert len(opened) == 16 and set(opened.values()) == {reads}  # 8 val and 8 test images


def test_eval_of_a_missing_checkpoint_says_it_does_not_exist(
    here: Path, checkpoints: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    # profile and train --resume: test_profile.py and test_trainer.py
    path = checkpoints["missing"]
    assert eval_fails(capsys, here, path) == (
        f"Checkpoint {path} does not exist. Train first (python -m pipeline train) or check the path."
    )


@pytest.mark.parametrize("command", ["eval", "profile", "predict"])
def test_a_bad_value_in_a_checkpoints_config_is_named_with_the_checkpoint_file(
    here: Path, checkpoints: dict[str, Path], capsys: pytest.CaptureFixture, command: str
) -> None:
    path = checkpoints["bad_config"]
    message = FAILS[command](capsys, here, path)
    assert message.startswith(
        f"Config key eval.min_score = 5 in the config of {path} is not valid: 5 is greater than "
        "or equal to the maximum of 1"
    )


def test_a_checkpoints_config_is_read_with_todays_defaults_and_the_command_line_on_top(
    checkpoints: dict[str, Path],
) -> None:
    """One reading for evaluate, predict and profile: keys added since the checkpoint was
    written get their defaults; evaluate's overrides win, and a bad one names the command line."""
    path = checkpoints["good"]
    state = checkpoint.load(path)
    state["config"]["eval"].pop("min_score")  # as a checkpoint of an older version
    default = load_schema()["properties"]["eval"]["properties"]["min_score"]["default"]
    assert checkpoint.config_of(state, path)["eval"]["min_score"] == default
    ours = checkpoint.config_of(state, path, {"eval": {"min_score": 0.25}})
    assert ours["eval"]["min_score"] == 0.25
    assert ours["model"] == state["config"]["model"]
    with pytest.raises(ConfigError, match=r"eval\.min_score = 7 in the command line is not valid"):
        checkpoint.config_of(state, path, {"eval": {"min_score": 7}})


def test_a_truncated_checkpoint_is_named_as_damaged(refused: Refusal) -> None:
    message, path = refused("truncated")
    assert message.startswith(
        f"Checkpoint {path} is damaged: it starts as a torch checkpoint (a zip archive) does, but "
        "its end is missing after "
    )


def test_weights_of_another_width_name_the_model_and_the_first_mismatch(refused: Refusal) -> None:
    message, path = refused("other_width")
    assert message.startswith(
        f"Checkpoint {path} does not fit model 'tiny_conv' (4 classes, width 8) that its own "
        "config describes: its weights are of another architecture, width or class count "
        "(size mismatch for "
    )
    assert message.endswith(
        "backbone.stem.0.0.weight: copying a param with shape torch.Size([8, 3, 3, 3]) from "
        "checkpoint, the shape in current model is torch.Size([4, 3, 3, 3])). Use a best.pth or "
        "last.pth that training wrote, unedited."
    )


def test_eval_of_a_checkpoint_with_other_classes_names_both_class_lists_and_counts(
    here: Path, data_root: Path, checkpoints: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    path = checkpoints["two_classes"]
    message = eval_fails(capsys, here, path)
    assert message == (
        f"Checkpoint {path} was trained on 2 classes ['circle', 'square'], but the data it is "
        f"evaluated on ({data_root / 'instances_val.json'}) has 4 classes {CLASSES}. Evaluate it "
        "on data with the same classes (--data ROOT), or set data.classes to the checkpoint's "
        "list if the data defines them all."
    )


def test_eval_of_a_measured_bf16_checkpoint_on_a_cpu_without_bf16_says_to_give_fp32(
    here: Path,
    checkpoints: dict[str, Path],
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Trained where the benchmarks chose bf16, evaluated on a laptop without native bf16."""
    state = checkpoint.load(checkpoints["good"])
    measured = here / "measured.pth"
    config = {**state["config"], "precision": "measured"}
    checkpoint.save(measured, {**state, "config": config, "precision": "bf16"})
    monkeypatch.setenv(dev.HIDE_CPU_NATIVE_ENV, "bf16,fp16")
    out = here / "eval.json"
    message = user_error(capsys, "eval", "--checkpoint", str(measured), "--out", str(out))
    assert message.startswith("precision=measured cannot evaluate in bf16 on cpu: ")
    assert message.endswith(". Give --precision fp32 to evaluate in fp32 here.")
    argv = ["eval", "--checkpoint", str(measured), "--out", str(out), "--precision", "fp32"]
    assert pipeline(*argv) == 0
    assert json.loads(out.read_text())["precision"] == "fp32"


def test_eval_with_data_reads_that_roots_splits_not_the_files_the_checkpoint_named(
    here: Path, data_root: Path, checkpoints: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    """A run trained on an export names its files one by one (data.val_annotations, ...):
    --data ROOT must not leave them in effect, evaluating the old data under the new name."""
    state = checkpoint.load(checkpoints["good"])
    data = {
        **state["config"]["data"],
        **{f"{split}_annotations": str(data_root / f"instances_{split}.json") for split in SPLITS},
    }
    named = here / "named.pth"
    checkpoint.save(named, {**state, "config": {**state["config"], "data": data}})
    other = copy_data(data_root, here)

    def five_images(document: dict[str, Any]) -> None:
        document["images"] = document["images"][:5]
        kept = {image["id"] for image in document["images"]}
        document["annotations"] = [a for a in document["annotations"] if a["image_id"] in kept]

    edit_json(other / "instances_test.json", five_images)
    out = here / "eval.json"
    assert (
        pipeline("eval", "--checkpoint", str(named), "--out", str(out), "--data", str(other)) == 0
    )
    splits = json.loads(out.read_text())["splits"]
    assert splits["val"]["source"] == str(other / "instances_val.json")
    assert (splits["test"]["source"], splits["test"]["num_images"]) == (
        str(other / "instances_test.json"),
        5,
    )
    # a split's file named beside --data wins over the root's
    argv = ["eval", "--checkpoint", str(named), "--out", str(out), "--data", str(other)]
    assert pipeline(*argv, f"data.test_annotations={data_root / 'instances_test.json'}") == 0
    assert json.loads(out.read_text())["splits"]["test"]["num_images"] == 8
    capsys.readouterr()


def test_eval_with_data_classes_set_to_the_checkpoints_evaluates_those_classes(
    here: Path, checkpoints: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    out = here / "eval.json"
    argv = ["eval", "--checkpoint", str(checkpoints["two_classes"]), "--out", str(out)]
    assert pipeline(*argv, "data.classes=[circle, square]") == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["class_names"] == ["circle", "square"]


def test_resume_from_a_checkpoint_with_other_classes_names_them_as_the_difference(
    here: Path, data_root: Path, checkpoints: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    message = resume_fails(capsys, here, checkpoints["two_classes"], data_root)
    assert message == (
        f"Cannot resume: {here / 'run' / 'last.pth'} was trained with different settings (class "
        "names). Use another --out folder, or the same settings."
    )


def test_a_pickle_that_would_run_code_is_refused_and_never_runs(
    refused: Refusal, checkpoints: dict[str, Path]
) -> None:
    message, path = refused("evil")
    assert message.startswith(
        f"Checkpoint {path} was refused by torch.load(weights_only=True): it holds pickled Python "
        "objects beyond tensors and plain containers, which could run code when loaded"
    )
    assert not checkpoints["marker"].exists()


@pytest.mark.parametrize("kind", sorted(NOT_USABLE))
def test_eval_of_a_file_that_is_no_usable_checkpoint_exits_2_saying_what_it_is(
    here: Path, checkpoints: dict[str, Path], capsys: pytest.CaptureFixture, kind: str
) -> None:
    """In-process; a real `python -m pipeline eval` process exits the same way (below)."""
    path, (what, ending) = checkpoints[kind], NOT_USABLE[kind]
    message = eval_fails(capsys, here, path)
    assert message.startswith(f"Checkpoint {path} {what}")
    assert message.endswith(ending)


@pytest.mark.parametrize("kind", sorted(set(NOT_USABLE) - {"two_classes"}))
def test_profile_of_a_file_that_is_no_usable_checkpoint_says_what_it_is(
    here: Path, checkpoints: dict[str, Path], capsys: pytest.CaptureFixture, kind: str
) -> None:
    """The same message as eval's (profile does not compare classes with any data)."""
    path, (what, ending) = checkpoints[kind], NOT_USABLE[kind]
    message = profile_fails(capsys, here, path)
    assert message.startswith(f"Checkpoint {path} {what}")
    assert message.endswith(ending)


def test_resuming_from_a_resnet18_runs_checkpoint_names_the_model_as_the_difference(
    here: Path, data_root: Path, checkpoints: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    message = resume_fails(capsys, here, checkpoints["resnet18_run"], data_root)
    assert message == (
        f"Cannot resume: {here / 'run' / 'last.pth'} was trained with different settings (model.name). "
        "Use another --out folder, or the same settings."
    )


# --- runtime -----------------------------------------------------------------------------------


def metric_rows(path: Path, kind: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [row for row in rows if row["type"] == kind]


def test_a_diverging_run_stops_naming_train_lr_and_its_last_checkpoint_still_loads(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture
) -> None:
    """lr=1e6 with grad clipping on: AdamW's step does not shrink with the clipped gradient, so
    the loss is ~3e10 after one step, ~2e18 after three and not finite from step 5 on. (The
    checkpoint of epoch 2 loads, but its BatchNorm running variances are already infinite.)"""
    run = here / "run"
    settings = tiny_settings(
        data_root, "train.epochs=4", "train.lr=1e6", "train.max_nonfinite_steps=2"
    )
    message = user_error(capsys, "train", "--out", str(run), *settings)
    assert message == (
        "Training stopped in epoch 3, step 6: the loss was not finite for 2 consecutive steps, so "
        "the run is diverging. Lower train.lr (now 1000000.0), keep train.grad_clip on, or use "
        f"precision=fp32. The last checkpoint, written after epoch 2, is {run / 'last.pth'}."
    )
    state = checkpoint.load(run / "last.pth")
    assert state["epoch"] == 2 and state["config"]["train"]["grad_clip"] == 10.0
    assert checkpoint.load(run / "best.pth")["epoch"] in (1, 2)
    assert not (run / "train_summary.json").exists()
    assert [row["epoch"] for row in metric_rows(run / "metrics.jsonl", "epoch")] == [1, 2]


def test_non_finite_steps_count_across_epochs_and_such_epochs_have_no_mean_loss(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture
) -> None:
    """Two steps per epoch, stop after 6: the count must run on over epoch boundaries."""
    run = here / "run"
    settings = tiny_settings(
        data_root, "train.epochs=8", "train.lr=1e6", "train.max_nonfinite_steps=6"
    )
    message = user_error(capsys, "train", "--out", str(run), *settings)
    assert message.startswith(
        "Training stopped in epoch 5, step 10: the loss was not finite for 6 consecutive steps"
    )
    epochs = metric_rows(run / "metrics.jsonl", "epoch")
    assert [row["epoch"] for row in epochs] == [1, 2, 3, 4]
    assert [row["train_loss"] is None for row in epochs] == [False, False, True, True]


# --- outputs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["train", "profile", "prepare-data", "--log"])
def test_an_output_folder_where_a_file_is_names_the_file_and_leaves_it_as_it_was(
    command: str,
    here: Path,
    data_root: Path,
    checkpoints: dict[str, Path],
    capsys: pytest.CaptureFixture,
) -> None:
    blocker = here / "taken"
    blocker.write_text("my notes\n")
    out = blocker / "run"
    argv = {
        "train": ["train", "--out", str(out), *tiny_settings(data_root)],
        "profile": ["profile", "--checkpoint", str(checkpoints["good"]), "--out", str(out)],
        "prepare-data": ["prepare-data", "--out", str(out)],
        "--log": ["--log", str(out / "train.log"), "config"],
    }[command]
    option = "--log" if command == "--log" else "--out"
    message = user_error(capsys, *argv)
    assert message == (
        f"Could not create the folder {out} ({option}): {blocker} is a file, not a folder. "
        f"Nothing was written. Move that file away, or give {option} a path elsewhere."
    )
    assert blocker.read_text() == "my notes\n"


def test_an_output_that_names_the_checkpoint_or_the_other_output_is_refused_before_any_work(
    here: Path, checkpoints: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    """`evaluate --out best.pth` wrote the metrics over the checkpoint it had just read."""
    kept = here / "best.pth"
    shutil.copy(checkpoints["good"], kept)
    before = kept.read_bytes()
    message = user_error(capsys, "eval", "--checkpoint", str(kept), "--out", str(kept))
    assert message == (
        f"--out {kept} names the same file as --checkpoint, which the command reads: it would be "
        "written over. Give --out a path of its own."
    )
    out = here / "eval.json"
    twice = here / "sub" / ".." / "eval.json"
    argv = ["eval", "--checkpoint", str(kept), "--out", str(out), "--predictions", str(twice)]
    (here / "sub").mkdir()
    assert user_error(capsys, *argv) == (
        f"--predictions {twice} names the same file as --out, which the command writes: it would "
        "be written over. Give --predictions a path of its own."
    )
    assert kept.read_bytes() == before and not out.exists()


@pytest.mark.parametrize("command", ["report", "compare"])
def test_report_or_compare_writing_over_the_summary_it_reads_is_refused(
    command: str, here: Path, capsys: pytest.CaptureFixture
) -> None:
    summary = here / "summary.json"
    summary.write_text("{}\n")
    if command == "report":
        argv, option, other = ["report", "--summary", str(summary), "--out"], "--out", "--summary"
    else:
        argv, option, other = (
            ["compare", str(summary), "--markdown"],
            "--markdown",
            "a SUMMARY.json argument",
        )
    assert user_error(capsys, *argv, str(summary)).startswith(
        f"{option} {summary} names the same file as {other}, which the command reads"
    )
    assert summary.read_text() == "{}\n"


def test_a_log_file_that_is_a_folder_is_named_and_nothing_runs(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture
) -> None:
    (here / "logs").mkdir()
    message = user_error(
        capsys,
        "--log",
        str(here / "logs"),
        "train",
        "--out",
        str(here / "run"),
        *tiny_settings(data_root),
    )
    assert message == (
        f"Could not open the log file {here / 'logs'} (--log): Is a directory. Nothing was run. "
        "Give --log a file path in a folder that can be written."
    )
    assert not (here / "run").exists()


# --- the real process: no traceback without --debug ------------------------------------------


def python_m_pipeline(cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", "--cpu-threads", "1", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_python_m_pipeline_eval_of_a_damaged_checkpoint_prints_one_line_and_exits_2(
    tmp_path: Path, checkpoints: dict[str, Path]
) -> None:
    out = tmp_path / "eval.json"
    result = python_m_pipeline(
        tmp_path, "eval", "--checkpoint", str(checkpoints["truncated"]), "--out", str(out)
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1
    assert " ERROR Checkpoint " in result.stderr and "is damaged" in result.stderr
    assert not out.exists()


def test_python_m_pipeline_with_debug_shows_the_traceback(
    tmp_path: Path, checkpoints: dict[str, Path]
) -> None:
    out = tmp_path / "eval.json"
    result = python_m_pipeline(
        tmp_path,
        "--debug",
        "eval",
        "--checkpoint",
        str(checkpoints["truncated"]),
        "--out",
        str(out),
    )
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert "pipeline.errors.CheckpointError: Checkpoint " in result.stderr
    assert not out.exists()


def test_python_m_pipeline_profile_refuses_a_hostile_pickle_without_running_it(
    tmp_path: Path, checkpoints: dict[str, Path]
) -> None:
    out = tmp_path / "profile"
    result = python_m_pipeline(
        tmp_path, "profile", "--checkpoint", str(checkpoints["evil"]), "--out", str(out)
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "was refused by torch.load(weights_only=True)" in result.stderr
    assert not checkpoints["marker"].exists()
    assert not out.exists()


def test_the_error_line_also_goes_to_the_log_file_that_snakemake_keeps(
    here: Path, data_root: Path, capsys: pytest.CaptureFixture
) -> None:
    log_file = here / "logs" / "train.log"
    code = cli.main(
        [
            "--cpu-threads",
            "1",
            "--log",
            str(log_file),
            "train",
            "--out",
            str(here / "run"),
            *tiny_settings(here / "absent"),
        ]
    )
    capsys.readouterr()
    assert code == 2
    assert "ERROR Data root " in log_file.read_text()


def test_every_failure_mode_in_the_docs_names_a_test_that_exists() -> None:
    """docs/failure-modes.md stays true: each row of its table names the test that checks it."""
    page = Path(__file__).resolve().parents[1] / "docs" / "failure-modes.md"
    table = page.read_text(encoding="utf-8")
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    named = [re.findall(r"tests/(\w+\.py)::(\w+)", row) for row in rows[1:]]  # skip the header
    assert rows and all(named), [
        r[:80] for r, refs in zip(rows[1:], named, strict=True) if not refs
    ]
    tests = Path(__file__).resolve().parent
    for refs in named:
        for file, function in refs:
            source = (tests / file).read_text(encoding="utf-8")
            assert f"def {function}(" in source, f"{file}::{function} does not exist"
