"""benchmarks/real_sets.py: fetched sets laid out as their exports are, loading as a user's data."""

from __future__ import annotations

import importlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from pipeline.config import load_config
from pipeline.data import has_test_split, load_split, load_splits
from pipeline.errors import ConfigError, DataError

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the scripts import their shared harness by name
real_sets = importlib.import_module("real_sets")


def jpeg(size: tuple[int, int], colour: tuple[int, int, int] = (90, 120, 60)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, "JPEG")
    return out.getvalue()


def voc_xml(file_name: str, size: tuple[int, int], objects: list[tuple[str, list[int]]]) -> str:
    parts = "".join(
        f"<object><name>{name}</name><difficult>0</difficult><bndbox><xmin>{x0}</xmin>"
        f"<ymin>{y0}</ymin><xmax>{x1}</xmax><ymax>{y1}</ymax></bndbox></object>"
        for name, (x0, y0, x1, y1) in objects
    )
    return (
        f"<annotation><filename>{file_name}</filename><size><width>{size[0]}</width>"
        f"<height>{size[1]}</height><depth>3</depth></size>{parts}</annotation>"
    )


def write_tree(root: Path, files: dict[str, bytes | str]) -> Path:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            path.write_text(content, encoding="utf-8")
        else:
            path.write_bytes(content)
    return root


def bare_mirror(tmp_path: Path, files: dict[str, bytes | str]) -> Path:
    """A bare git mirror of the files, laid out as fetch leaves one: <name>/repo."""
    work = write_tree(tmp_path / "checkout", files)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "set"]):
        subprocess.run([*git, *args], cwd=work, check=True)
    mirror = tmp_path / "owner+set"
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(mirror / "repo")], check=True)
    return mirror


def raccoon_files(count: int) -> dict[str, bytes | str]:
    """The raccoon repository's layout: annotations/*.xml and images/*.jpg, no ImageSets."""
    files: dict[str, bytes | str] = {"README.md": "raccoons", "data/train_labels.csv": "a,b"}
    for i in range(1, count + 1):
        files[f"annotations/raccoon-{i}.xml"] = voc_xml(
            f"raccoon-{i}.jpg", (64, 48), [("raccoon", [5, 6, 40, 30])]
        )
        files[f"images/raccoon-{i}.jpg"] = jpeg((64, 48))
    return files


def rsod_files() -> dict[str, bytes | str]:
    """RSOD's layout: published splits whose val images are also in test, and the images of
    train+val in one folder, of test in another, with val's images in both."""
    splits = {"train": ["plane_1", "plane_2", "tank_1", "tank_2", "plane_3"], "test": []}
    splits["val"] = ["plane_9", "tank_9"]
    splits["test"] = ["plane_8", *splits["val"]]
    files: dict[str, bytes | str] = {}
    for split, ids in splits.items():
        files[f"ImageSets/Main/{split}.txt"] = "".join(f"{i}\n" for i in ids)
        for image_id in ids:
            kind = image_id.split("_")[0]
            files[f"Annotations/{image_id}.xml"] = voc_xml(
                f"{image_id}.jpg", (80, 60), [(kind, [10, 10, 30, 25])]
            )
            folder = "JPEGImages-test" if split != "train" else "JPEGImages-trainval"
            files[f"{folder}/{image_id}.jpg"] = jpeg((80, 60))
            if split == "val":
                files[f"JPEGImages-trainval/{image_id}.jpg"] = jpeg((80, 60))
    return files


def coco_files() -> dict[str, bytes | str]:
    """A Roboflow per-split export: an unused super-category 0, file names starting with '-'."""
    categories = [
        {"id": 0, "name": "eggs", "supercategory": "none"},
        {"id": 1, "name": "fertile", "supercategory": "eggs"},
        {"id": 2, "name": "infertile", "supercategory": "eggs"},
    ]
    files: dict[str, bytes | str] = {"train.ipynb": "{}", ".gitignore": "*.pt"}
    for folder, count in (("train", 4), ("valid", 2), ("test", 2)):
        images = [
            {"id": i, "file_name": f"-{folder}_{i}_jpg.rf.ab.jpg", "width": 56, "height": 56}
            for i in range(count)
        ]
        annotations = [
            {"id": i, "image_id": i, "category_id": 1 + i % 2, "bbox": [8, 8, 20, 24], "iscrowd": 0}
            for i in range(count - 1)  # the last image is a negative
        ]
        document = {"images": images, "annotations": annotations, "categories": categories}
        files[f"{folder}/_annotations.coco.json"] = json.dumps(document)
        for image in images:
            files[f"{folder}/{image['file_name']}"] = jpeg((56, 56))
    return files


def stock_config(name: str, root: Path) -> dict:
    """The stock config with only what a user's file says about the set."""
    path = root.parent / f"{name}.yaml"
    path.write_text(json.dumps(real_sets.user_data(real_sets.SETS[name], root)), encoding="utf-8")
    return load_config(path)


def loaded(config: dict) -> dict[str, list[str]]:
    """Each split's image file names as pipeline.data loads them."""
    train, val = load_splits(config)
    splits = {"train": train, "val": val}
    if has_test_split(config):
        splits["test"] = load_split(config, "test", train.class_names)
    return {name: sorted(r.path.name for r in split.records) for name, split in splits.items()}


def listing(root: Path, split: str) -> list[str]:
    return (root / "ImageSets" / "Main" / f"{split}.txt").read_text(encoding="utf-8").split()


def test_voc_without_image_sets_gets_a_seeded_disjoint_split_that_loads_as_a_users_voc_set(
    tmp_path: Path,
) -> None:
    mirror = bare_mirror(tmp_path, raccoon_files(20))
    out = tmp_path / "raccoon"
    real_sets.prepare(real_sets.SETS["raccoon"], mirror, out, seed=0)

    splits = {split: listing(out, split) for split in ("train", "val", "test")}
    assert [len(ids) for ids in splits.values()] == [14, 3, 3]
    every = [image_id for ids in splits.values() for image_id in ids]
    assert sorted(every) == sorted(f"raccoon-{i}" for i in range(1, 21))  # disjoint, complete
    assert sorted(p.name for p in (out / "Annotations").iterdir()) == sorted(
        f"{i}.xml" for i in every
    )
    assert not (out / "README.md").exists() and not (out / "data").exists()
    assert loaded(stock_config("raccoon", out)) == {
        split: sorted(f"{i}.jpg" for i in ids) for split, ids in splits.items()
    }

    again = tmp_path / "again"
    real_sets.prepare(real_sets.SETS["raccoon"], mirror, again, seed=0)
    other = tmp_path / "other"
    real_sets.prepare(real_sets.SETS["raccoon"], mirror, other, seed=1)
    assert listing(again, "test") == splits["test"]
    assert listing(other, "test") != splits["test"]


def test_voc_with_split_image_folders_merges_them_and_takes_validation_out_of_the_test_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rsod"
    real_sets.prepare(real_sets.SETS["rsod"], bare_mirror(tmp_path, rsod_files()), out, seed=0)

    assert listing(out, "test") == ["plane_8", "plane_9", "tank_9"]  # kept whole
    train, val = listing(out, "train"), listing(out, "val")
    assert len(val) == 1 and sorted(train + val) == [
        "plane_1",
        "plane_2",
        "plane_3",
        "tank_1",
        "tank_2",
    ]
    assert "2 of its 2 images are also in test.txt" in capsys.readouterr().out
    names = loaded(stock_config("rsod", out))
    assert names["test"] == ["plane_8.jpg", "plane_9.jpg", "tank_9.jpg"]
    assert len(list((out / "JPEGImages").iterdir())) == 8


def test_published_splits_that_are_disjoint_are_kept_as_published(tmp_path: Path) -> None:
    files = rsod_files()
    files["ImageSets/Main/test.txt"] = "plane_8\n"
    out = tmp_path / "rsod"
    real_sets.prepare(real_sets.SETS["rsod"], write_tree(tmp_path / "folder", files), out, seed=0)
    assert [listing(out, split) for split in ("val", "test")] == [
        ["plane_9", "tank_9"],
        ["plane_8"],
    ]


def test_a_listed_image_without_annotation_names_the_split_and_the_missing_file(
    tmp_path: Path,
) -> None:
    files = rsod_files()
    files["ImageSets/Main/test.txt"] += "plane_77\n"
    with pytest.raises(DataError, match=r"test split lists plane_77, .* no Annotations/plane_77"):
        real_sets.prepare(
            real_sets.SETS["rsod"], write_tree(tmp_path / "f", files), tmp_path / "o", seed=0
        )


def test_two_different_images_of_one_name_stop_prepare_and_leave_nothing_behind(
    tmp_path: Path,
) -> None:
    files = rsod_files()
    files["JPEGImages-trainval/plane_9.jpg"] = jpeg((80, 60), colour=(0, 0, 0))
    out = tmp_path / "rsod"
    with pytest.raises(DataError, match=r"Two different files would both become .*plane_9\.jpg"):
        real_sets.prepare(real_sets.SETS["rsod"], bare_mirror(tmp_path, files), out, seed=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkout", "owner+set"]


def test_an_annotation_naming_an_image_the_set_lacks_is_an_error_naming_both(
    tmp_path: Path,
) -> None:
    files = raccoon_files(5)
    del files["images/raccoon-3.jpg"]
    with pytest.raises(DataError, match=r"annotations/raccoon-3\.xml names image raccoon-3\.jpg"):
        real_sets.prepare(
            real_sets.SETS["raccoon"], write_tree(tmp_path / "f", files), tmp_path / "o", seed=0
        )


def test_a_fetch_of_another_set_is_named_as_such(tmp_path: Path) -> None:
    mirror = bare_mirror(tmp_path, raccoon_files(3))
    with pytest.raises(
        DataError, match=r"has no file train/_annotations\.coco\.json: is it a fetch"
    ):
        real_sets.prepare(real_sets.SETS["eggs"], mirror, tmp_path / "eggs", seed=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkout", "owner+set"]


def test_coco_per_split_export_is_copied_split_by_split_and_loads_as_a_users_coco_set(
    tmp_path: Path,
) -> None:
    out = tmp_path / "eggs"
    real_sets.prepare(real_sets.SETS["eggs"], bare_mirror(tmp_path, coco_files()), out, seed=0)

    assert sorted(p.name for p in out.iterdir()) == ["test", "train", "valid"]
    config = stock_config("eggs", out)
    assert config["data"]["val_annotations"].endswith("valid/_annotations.coco.json")
    names = loaded(config)
    assert names["train"] == [f"-train_{i}_jpg.rf.ab.jpg" for i in range(4)]
    assert names["val"] == [f"-valid_{i}_jpg.rf.ab.jpg" for i in range(2)]
    assert names["test"] == [f"-test_{i}_jpg.rf.ab.jpg" for i in range(2)]
    train, _ = load_splits(config)
    assert train.class_names == ["fertile", "infertile"]  # the super-category left out


def test_prepare_refuses_a_folder_that_already_holds_files(tmp_path: Path) -> None:
    out = tmp_path / "eggs"
    write_tree(out, {"mine.txt": "keep"})
    with pytest.raises(DataError, match="exists and is not empty"):
        real_sets.prepare(
            real_sets.SETS["eggs"], write_tree(tmp_path / "f", coco_files()), out, seed=0
        )
    assert (out / "mine.txt").read_text(encoding="utf-8") == "keep"


def test_measure_trains_the_users_file_over_the_photographs_presets_at_fixed_epochs(
    tmp_path: Path,
) -> None:
    train, evaluate = real_sets.commands(
        real_sets.SETS["rsod"], tmp_path / "rsod", 7, "bf16", tmp_path / "work"
    )
    files = train[train.index("--configfile") + 1 : train.index("--out")]
    assert files[:2] == [str(path) for path in real_sets.PRESETS]
    settings = [arg for arg in train if "=" in arg]
    config = load_config(files, settings)
    assert config["data"]["format"] == "voc"
    assert config["data"]["root"] == str((tmp_path / "rsod").resolve())
    assert config["data"]["image_size"] == real_sets.SETS["rsod"].image_size
    assert (config["train"]["epochs"], config["train"]["time_budget_s"]) == (7, None)
    assert config["precision"] == "bf16"
    assert config["data"]["augment"]["vflip"] == 0.0  # the photographs preset's
    assert config["train"]["batch_size"] == 4  # the five-minute preset's
    assert evaluate[evaluate.index("--checkpoint") + 1] == str(
        tmp_path / "work" / "run" / "best.pth"
    )


def test_measure_at_another_image_size_trains_the_users_file_at_that_size(
    tmp_path: Path,
) -> None:
    train, _ = real_sets.commands(
        real_sets.SETS["eggs"], tmp_path / "eggs", 3, "fp32", tmp_path / "work", image_size=128
    )
    files = train[train.index("--configfile") + 1 : train.index("--out")]
    config = load_config(files, [arg for arg in train if "=" in arg])
    assert real_sets.SETS["eggs"].image_size != 128
    assert config["data"]["image_size"] == 128


def test_measure_layers_trailing_settings_last_over_the_users_file(tmp_path: Path) -> None:
    options = ["--data", str(tmp_path / "eggs"), "--record", "r.json"]
    args = real_sets.parse_args(
        ["measure", "eggs", *options, "seed=1", "data.augment.scale_min=0.6667"]
    )
    assert args.overrides == ["seed=1", "data.augment.scale_min=0.6667"]
    train, _ = real_sets.commands(
        real_sets.SETS["eggs"], args.data, 3, "fp32", tmp_path / "work", overrides=args.overrides
    )
    assert train[-2:] == args.overrides
    config = real_sets.resolved_config(train)
    assert config["seed"] == 1
    assert config["data"]["augment"]["scale_min"] == 0.6667  # over the preset's own
    assert config["data"]["augment"]["scale_max"] == 1.5  # the preset's, untouched
    assert config["data"]["format"] == "coco"  # the user's file still under them


def test_a_bad_or_anything_but_a_setting_after_measures_options_is_refused() -> None:
    with pytest.raises(SystemExit):
        real_sets.parse_args(["measure", "eggs", "--record", "r.json", "--bogus=1"])
    with pytest.raises(SystemExit):
        real_sets.parse_args(["prepare", "eggs", "--source", "x", "seed=1"])


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ("train.epochs=3", "--epochs"),
        ("precision=bf16", "--precision"),
        ("data.image_size=128", "--image-size"),
        ("train={epochs: 3}", "--epochs"),
        ("data.augment.scale_min=-1", "scale_min"),
        ("seed", "key=value"),
    ],
)
def test_a_setting_measure_owns_or_cannot_take_stops_it_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str, says: str
) -> None:
    ran: list[list[str]] = []
    monkeypatch.setattr(real_sets.harness, "run_logged", lambda command, log: ran.append(command))
    with pytest.raises(ConfigError, match=says):
        real_sets.measure(
            real_sets.SETS["eggs"],
            tmp_path / "eggs",
            3,
            "fp32",
            tmp_path / "w",
            "1",
            None,
            [setting],
        )
    assert ran == []


def fake_run(command: list[str], log: Path) -> None:
    """Stands in for training and evaluation: writes the files measure reads back."""
    if "train" in command:
        run = Path(command[command.index("--out") + 1])
        run.mkdir(parents=True)
        summary = {"precision": "fp32", "batch_size": 4, "epochs": 3, "steps": 9, "best_epoch": 3}
        summary |= dict.fromkeys(("wall_time_s", "train_time_s", "median_step_time_s"), 1.0)
        (run / "train_summary.json").write_text(json.dumps(summary), encoding="utf-8")
        return
    metrics = dict.fromkeys(("ap50", "ap", "ap75", "f1", "precision", "recall"), 0.5)
    metrics |= dict.fromkeys(("ap50_interval", "ap_interval", "f1_interval"), None)
    metrics |= {"num_images": 2, "num_ground_truth": 2, "per_class": [], "score_threshold": 0.4}
    point = {"threshold": 0.3, "picked_on": "val", "f1": 0.5, "precision": 0.5, "recall": 0.5}
    evaluation = {"metrics_split": "test", "metrics": metrics, "operating_point": point}
    Path(command[command.index("--out") + 1]).write_text(json.dumps(evaluation), encoding="utf-8")


def test_the_record_keeps_the_settings_given_so_the_run_is_repeated_from_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(real_sets.harness, "run_logged", fake_run)
    overrides = ["seed=1", "data.augment.scale_min=0.6667"]
    record = real_sets.measure(
        real_sets.SETS["eggs"], tmp_path / "eggs", 3, "fp32", tmp_path / "w", "1", None, overrides
    )
    assert record["overrides"] == overrides
    assert record["commands"][0].endswith(" seed=1 data.augment.scale_min=0.6667")
    assert record["settings"]["seed"] == 1
    assert record["settings"]["data"]["augment"]["scale_min"] == 0.6667
    assert record["settings"]["train"]["epochs"] == 3
    row = real_sets.table([{**record, "created": "2026-12-05T00:00:00+00:00"}]).splitlines()[2]
    assert "| eggs | fp32, 3 epochs, 64 px, seed=1, data.augment.scale_min=0.6667 |" in row


def table_record(per_class: list[dict], interval: dict | None = None) -> dict:
    """A record of real_sets' format with the given per-class AP@.5 rows."""
    return {
        "set": "eggs",
        "precision": "fp32",
        "epochs": 15,
        "image_size": 64,
        "figures": {
            "split": "test",
            "ap50": 0.625,
            "ap50_interval": interval,
            "ap": 0.25,
            "ap_interval": None,
            "per_class": per_class,
            "at_score_threshold": {"threshold": 0.4, "f1": 0.375, "f1_interval": interval},
            "at_operating_point": {"threshold": 0.3125, "f1": 0.5, "f1_interval": None},
        },
        "training": {"wall_time_s": 600.0},
        "machine": {"cpu_model": "Some CPU"},
        "created": "2026-12-05T00:00:00+00:00",
        "commit": "0123456789abcdef",
    }


def test_the_table_shows_each_records_figures_with_their_intervals() -> None:
    per_class = [{"name": "fertile", "ap50": 0.5}, {"name": "infertile", "ap50": 0.75}]
    record = table_record(per_class, {"low": 0.5, "high": 0.75})
    row = real_sets.table([record]).splitlines()[2]
    assert row == (
        "| eggs | fp32, 15 epochs, 64 px | 0.625 (0.500-0.750) | fertile 0.500 / infertile 0.750 "
        "| 0.250 | 0.375 (0.500-0.750) at 0.40 | 0.500 at 0.31 | 10 min (Some CPU, 0123456) |"
    )


def test_the_table_names_a_class_without_objects_in_the_split_instead_of_an_ap() -> None:
    record = table_record([{"name": "fertile", "ap50": 0.5}, {"name": "infertile", "ap50": None}])
    row = real_sets.table([record]).splitlines()[2]
    assert "| fertile 0.500 / infertile n/a (no objects) |" in row
