"""Validation and test splits carved out of the training split by fraction
(data.val_fraction, data.test_fraction; pipeline.data.holdout)."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tiny_runs import train_then_evaluate

from pipeline.config import load_config
from pipeline.data import has_test_split, load_split, load_splits, split_files
from pipeline.data.holdout import carve, carve_key
from pipeline.data.shapes import render_sample
from pipeline.data.sources import ImageRecord, SplitAnnotations
from pipeline.data.synthetic import SyntheticSpec
from pipeline.errors import ConfigError, DataError
from pipeline.setting_groups import accuracy_settings, result_settings

FOLDER = Path("/data/task/images")


def _records(names: list[str], folder: Path = FOLDER) -> SplitAnnotations:
    records = [
        ImageRecord(
            index,
            folder / name,
            32,
            32,
            np.array([[1, 1, 9, 9]], np.float32),
            np.zeros(1, np.int64),
        )
        for index, name in enumerate(names, 1)
    ]
    return SplitAnnotations(records, ["cell"], Path("/data/task/task.json"))


def _names(count: int, start: int = 0) -> list[str]:
    return [f"shot_{index:04d}.jpg" for index in range(start, start + count)]


def _assignment(parts: dict[str, SplitAnnotations]) -> dict[str, str]:
    """Each image's relative path -> the split it went to."""
    return {
        record.path.relative_to(FOLDER).as_posix(): split
        for split, part in parts.items()
        for record in part.records
    }


def test_the_carve_key_of_a_path_is_pinned_so_no_release_moves_images_between_splits() -> None:
    # SHA-256 of "sub/shot_0001.jpg", its first 8 bytes as a fraction of 2**64
    assert carve_key(FOLDER / "sub" / "shot_0001.jpg", FOLDER) == pytest.approx(
        0.06073278606178888, abs=1e-15
    )


def test_the_carve_depends_on_the_path_relative_to_the_images_folder_alone() -> None:
    names = _names(50)
    here = carve(_records(names), FOLDER, {"val": 0.3})
    elsewhere = carve(_records(names, Path("/mnt/copy")), Path("/mnt/copy"), {"val": 0.3})
    for split in ("train", "val"):
        assert [r.path.name for r in here[split].records] == [
            r.path.name for r in elsewhere[split].records
        ]


def test_the_carve_is_the_same_in_every_process_whatever_its_string_hash_seed() -> None:
    script = (
        "from pathlib import Path; from pipeline.data.holdout import carve_key; "
        "print([carve_key(Path(f'/d/{i}.jpg'), Path('/d')) < 0.5 for i in range(40)])"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.pathsep.join(sys.path)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outputs) == 1 and "True" in outputs.pop()


def test_adding_images_moves_no_existing_image_between_splits() -> None:
    fractions = {"test": 0.1, "val": 0.2}
    before = _assignment(carve(_records(_names(300)), FOLDER, fractions))
    grown = _names(300) + _names(100, start=300) + [f"new/{n}" for n in _names(50)]
    after = _assignment(carve(_records(grown), FOLDER, fractions))
    assert {name: after[name] for name in before} == before
    assert len(after) == 450


def test_every_image_goes_to_exactly_one_split_and_the_fractions_hold_within_sampling_error() -> (
    None
):
    count, fractions = 400, {"test": 0.1, "val": 0.25}
    parts = carve(_records(_names(count)), FOLDER, fractions)
    ids = [record.image_id for part in parts.values() for record in part.records]
    assert sorted(ids) == list(range(1, count + 1))
    for split, fraction in [*fractions.items(), ("train", 0.65)]:
        spread = 4 * math.sqrt(count * fraction * (1 - fraction))  # 4 binomial sigmas
        assert abs(len(parts[split].records) - count * fraction) < spread, split


def test_a_change_of_val_fraction_keeps_the_test_split() -> None:
    records = _records(_names(200))
    small = carve(records, FOLDER, {"test": 0.1, "val": 0.1})
    large = carve(records, FOLDER, {"test": 0.1, "val": 0.3})
    assert [r.path for r in small["test"].records] == [r.path for r in large["test"].records]
    assert {r.path for r in small["val"].records} < {r.path for r in large["val"].records}


# --------------------------------------------------------------- a COCO task exported as one file

SPEC = SyntheticSpec(
    num_train=24, num_val=1, num_test=1, image_size=64, classes=("circle",), min_objects=1,
    max_object_size=32,
)  # fmt: skip


def make_task(folder: Path, count: int = 24, with_objects=lambda name: True) -> Path:
    """One COCO file for a whole task (as CVAT or Label Studio export it), images in a subfolder;
    `with_objects(file_name)` says which images keep their objects."""
    (folder / "images").mkdir(parents=True)
    images, annotations = [], []
    for index in range(count):
        pixels, objects = render_sample(SPEC, "train", index)
        file_name = f"images/frame_{index:03d}.jpg"
        Image.fromarray(pixels).save(folder / file_name, quality=95)
        images.append({"id": index + 1, "file_name": file_name, "width": 64, "height": 64})
        for obj in objects if with_objects(file_name) else []:
            x0, y0, x1, y1 = obj["box"]
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": index + 1,
                    "category_id": 1,
                    "bbox": [x0, y0, x1 - x0, y1 - y0],
                    "area": (x1 - x0) * (y1 - y0),
                    "iscrowd": 0,
                }
            )
    document = {
        "images": images,
        "annotations": annotations,
        "categories": [{"id": 1, "name": "circle"}],
    }
    (folder / "task.json").write_text(json.dumps(document))
    return folder / "task.json"


def _task_config(task: Path, *settings: str) -> dict:
    return load_config(None, ["data.format=coco", f"data.train_annotations={task}", *settings])


def test_load_splits_carves_validation_out_of_one_file_and_logs_each_part_as_carved(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    task = make_task(tmp_path / "task")
    config = _task_config(task, "data.val_fraction=0.25", "data.test_fraction=0.25")
    with caplog.at_level(logging.INFO, logger="pipeline"):
        train, val = load_splits(config)
    test = load_split(config, "test")
    paths = [{r.path for r in split.records} for split in (train, val, test)]
    assert sum(map(len, paths)) == 24 and len(set.union(*paths)) == 24
    assert all(paths)
    lines = [record.getMessage() for record in caplog.records]
    assert any(
        line.startswith(f"{task} (its validation part, carved out by data.val_fraction=0.25): ")
        and f"{len(val.records)} images" in line
        for line in lines
    )
    assert any(
        line.startswith(
            f"{task} (its training part, what data.test_fraction=0.25 and "
            "data.val_fraction=0.25 leave): "
        )
        for line in lines
    )


def test_the_training_part_left_by_one_fraction_is_named_in_the_singular(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    task = make_task(tmp_path / "task")
    with caplog.at_level(logging.INFO, logger="pipeline"):
        load_splits(_task_config(task, "data.val_fraction=0.25"))
    assert any(
        record.getMessage().startswith(
            f"{task} (its training part, what data.val_fraction=0.25 leaves): "
        )
        for record in caplog.records
    )


def test_a_carved_test_split_is_one_the_workflow_knows_defined_by_the_training_file(
    tmp_path: Path,
) -> None:
    task = tmp_path / "task.json"
    config = _task_config(task, "data.test_fraction=0.2")
    assert has_test_split(config)
    assert split_files(config, ("val", "test")) == [
        Path(config["data"]["root"]) / "instances_val.json",
        task,
    ]
    carved = _task_config(task, "data.test_fraction=0.2", "data.val_fraction=0.2")
    assert split_files(carved) == split_files(carved, ("val", "test")) == [task]


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        (["data.val_fraction=0.6", "data.test_fraction=0.4"], "together they carve 1 of the"),
        (["data.val_fraction=1"], "data.val_fraction"),
        (["data.test_fraction=0"], "data.test_fraction"),
        (["data.val_fraction=-0.1"], "data.val_fraction"),
    ],
)
def test_fractions_outside_0_to_1_or_summing_to_1_are_refused_naming_the_keys(
    settings: list[str], words: str
) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config(None, ["data.format=coco", *settings])


def test_a_fraction_for_the_synthetic_set_is_refused_naming_its_own_split_sizes() -> None:
    with pytest.raises(ConfigError, match=r"data.val_fraction = 0.2 .*\(data.synthetic.num_val"):
        load_config(None, ["data.val_fraction=0.2"])


def test_a_split_given_and_carved_is_refused_naming_both_keys(tmp_path: Path) -> None:
    named = _task_config(
        tmp_path / "task.json", f"data.val_annotations={tmp_path / 'val.json'}",
        "data.val_fraction=0.2",
    )  # fmt: skip
    with pytest.raises(ConfigError) as caught:
        load_splits(named)
    message = str(caught.value)
    assert (
        "data.val_fraction = 0.2 and data.val_annotations each give a validation split" in message
    )
    assert "remove data.val_fraction to use that file, or unset data.val_annotations" in message
    root = tmp_path / "root"
    root.mkdir()
    (root / "instances_test.json").write_text("{}")
    found = load_config(None, ["data.format=coco", f"data.root={root}", "data.test_fraction=0.2"])
    with pytest.raises(
        ConfigError, match=r"data.test_split = 'test', which finds it under data.root"
    ):
        has_test_split(found)
    with pytest.raises(ConfigError, match=r"set data.test_split: null to carve"):
        load_split(found, "train")


def test_a_carved_split_without_objects_names_its_fraction_and_what_to_change(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "task"
    # objects only on images the carve keeps for training
    task = make_task(folder, with_objects=lambda name: carve_key(folder / name, folder) >= 0.3)
    config = _task_config(task, "data.val_fraction=0.3")
    with pytest.raises(DataError) as caught:
        load_splits(config)
    message = str(caught.value)
    assert message.startswith(
        f"The validation split {task} (its validation part, carved out by data.val_fraction=0.3) "
        "has no objects ("
    )
    assert message.endswith(
        "It was carved out of the training split by fraction: Raise data.val_fraction, or give a "
        "validation split of your own."
    )


def test_the_fractions_are_result_settings_only_while_set() -> None:
    base = load_config(None, ["data.format=coco"])
    carved = load_config(None, ["data.format=coco", "data.test_fraction=0.1"])
    assert "test_fraction" not in result_settings(base)["data"]
    assert "val_fraction" not in accuracy_settings(base)["data"]
    assert result_settings(carved)["data"]["test_fraction"] == 0.1  # it changes what is trained
    assert accuracy_settings(carved)["data"]["test_fraction"] == 0.1
    # a checkpoint's config from before the keys existed resumes under today's defaults
    before = {**base, "data": {k: v for k, v in base["data"].items() if "fraction" not in k}}
    assert result_settings(before) == result_settings(base)


def test_one_task_file_trains_and_evaluates_end_to_end_reporting_on_its_carved_test_split(
    tmp_path: Path,
) -> None:
    """The acceptance case: python -m pipeline train, then evaluate, on one COCO file with no
    validation or test split; evaluate carves the same splits as training did."""
    task = make_task(tmp_path / "task")
    settings = [
        "data.format=coco",
        f"data.train_annotations={task}",
        "data.val_fraction=0.25",
        "data.test_fraction=0.25",
    ]
    trained, evaluated, out, predictions = train_then_evaluate(tmp_path, settings)
    config = load_config(None, settings)
    val, test = load_split(config, "val"), load_split(config, "test")
    result = json.loads(out.read_text())
    assert result["metrics_split"] == "test"
    assert result["splits"]["test"] == {
        "name": "test",
        "source": f"{task} (its test part, carved out by data.test_fraction=0.25)",
        "num_images": len(test.records),
    }
    assert result["val_metrics"]["num_images"] == len(val.records)
    files = [image["file"] for image in json.loads(predictions.read_text())["images"]]
    assert files == [str(record.path) for record in test.records]
    # training validated on the very images evaluate took for validation
    val_line = f"{task} (its validation part, carved out by data.val_fraction=0.25): "
    logged = [
        next(line for line in stream.splitlines() if val_line in line).split(val_line)[1]
        for stream in (trained.stderr, evaluated.stderr)
    ]
    assert logged[0] == logged[1]
