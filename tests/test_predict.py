"""`python -m pipeline predict`: a trained checkpoint on a folder of images, through the CLI."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from pycocotools.coco import COCO
from tiny_runs import make_data, tiny_config

from pipeline import cli, prediction
from pipeline.data.dataset import worker_count
from pipeline.data.image_files import find_images
from pipeline.engine import checkpoint
from pipeline.engine.trainer import Trainer
from pipeline.errors import DataError

pytestmark = pytest.mark.usefixtures("torch_flags_threads_and_logger")

EXIF_ORIENTATION = 0x0112
ROTATED_90_CW = 6  # shown after turning the stored pixels 90 degrees clockwise


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trainer:
    data_root = make_data(tmp_path_factory.mktemp("data") / "shapes")
    trainer = Trainer(tiny_config(data_root, "train.epochs=1"), tmp_path_factory.mktemp("run"))
    trainer.fit()
    return trainer


@pytest.fixture(scope="module")
def photos(trained: Trainer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the data set whose test folder also holds a photo stored on its side (EXIF
    orientation 6, 40 x 64 as stored, 64 x 40 as shown), listed in the test annotations, and
    a file that is no image, listed nowhere."""
    root = tmp_path_factory.mktemp("photos") / "shapes"
    shutil.copytree(trained.config["data"]["root"], root)
    upright = Image.open(root / "test" / "000000.png").convert("RGB").crop((0, 0, 64, 40))
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = ROTATED_90_CW
    upright.transpose(Image.Transpose.ROTATE_90).save(
        root / "test" / "rotated.jpg", quality=95, exif=exif
    )
    (root / "test" / "broken.jpg").write_bytes(b"not an image at all")
    annotations = json.loads((root / "instances_test.json").read_text())
    annotations["images"].append(
        {"id": 1000, "file_name": "test/rotated.jpg", "width": 64, "height": 40}
    )
    (root / "instances_test.json").write_text(json.dumps(annotations))
    return root


def run(*argv: str) -> int:
    return cli.main(["--cpu-threads", "1", *argv])


@pytest.fixture(scope="module")
def predicted(trained: Trainer, photos: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("predicted")
    best = str(trained.paths["best"])
    argv = ["predict", "--checkpoint", best, str(photos / "test"), "--out", str(out)]
    assert run(*argv, "--score-threshold", "0", "--draw") == 0
    return out


def by_file(images: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {Path(image["file"]).name: image for image in images}


def test_predict_on_a_folder_matches_evaluations_predictions_in_each_images_own_pixels(
    trained: Trainer,
    photos: Path,
    predicted: Path,
    tmp_path: Path,
    restore_pipeline_logger: None,
) -> None:
    evaluated = tmp_path / "predictions.json"
    argv = ["evaluate", "--checkpoint", str(trained.paths["best"]), "--data", str(photos)]
    # every detection kept, as predict --score-threshold 0 keeps them
    out = ["--out", str(tmp_path / "eval.json"), "--predictions", str(evaluated)]
    assert run(*argv, *out, "eval.min_score=0") == 0
    expected = by_file(json.loads(evaluated.read_text())["images"])
    index = json.loads((predicted / "images.json").read_text())
    detections = json.loads((predicted / "detections.json").read_text())
    images = by_file(index["images"])
    assert set(images) == set(expected) == {f"{i:06d}.png" for i in range(8)} | {"rotated.jpg"}
    assert (images["rotated.jpg"]["width"], images["rotated.jpg"]["height"]) == (64, 40)
    for name, image in images.items():
        found = [d for d in detections if d["image_id"] == image["id"]]
        wanted = expected[name]["detections"]
        assert (image["width"], image["height"]) == (
            expected[name]["width"],
            expected[name]["height"],
        )
        assert image["detections"] == len(found) == len(wanted["scores"]) > 0
        xyxy = [[x, y, x + w, y + h] for x, y, w, h in (d["bbox"] for d in found)]
        np.testing.assert_allclose(xyxy, wanted["boxes"], atol=0.02)
        np.testing.assert_allclose([d["score"] for d in found], wanted["scores"], atol=2e-4)
        assert [d["category_id"] - 1 for d in found] == wanted["labels"]
        assert max(box[2] for box in xyxy) <= image["width"]
        assert max(box[3] for box in xyxy) <= image["height"]


def test_an_unreadable_file_is_reported_and_skipped_and_the_others_are_predicted(
    predicted: Path, photos: Path
) -> None:
    index = json.loads((predicted / "images.json").read_text())
    (skipped,) = index["unreadable"]
    assert Path(skipped["file"]) == photos / "test" / "broken.jpg"
    assert "not an image" in skipped["reason"]
    assert len(index["images"]) == 9


def test_detections_are_a_coco_results_file_that_pycocotools_reads(predicted: Path) -> None:
    index = json.loads((predicted / "images.json").read_text())
    truth = COCO()
    truth.dataset = {
        "images": [
            {"id": i["id"], "width": i["width"], "height": i["height"]} for i in index["images"]
        ],
        "categories": index["categories"],
        "annotations": [],
    }
    truth.createIndex()
    results = truth.loadRes(str(predicted / "detections.json"))
    assert len(results.getAnnIds()) == sum(image["detections"] for image in index["images"])


def test_draw_writes_each_readable_image_upright_with_its_detections(predicted: Path) -> None:
    images = by_file(json.loads((predicted / "images.json").read_text())["images"])
    for image in images.values():
        with Image.open(predicted / image["annotated"]) as drawn:
            assert drawn.size == (image["width"], image["height"])
    assert sorted(path.name for path in (predicted / "annotated").iterdir()) == sorted(
        f"{Path(name).stem}.jpg" for name in images
    )


def test_by_default_detections_count_from_the_checkpoints_operating_point(
    trained: Trainer, photos: Path, tmp_path: Path, restore_pipeline_logger: None
) -> None:
    best = trained.paths["best"]
    assert (
        run("predict", "--checkpoint", str(best), str(photos / "test"), "--out", str(tmp_path)) == 0
    )
    index = json.loads((tmp_path / "images.json").read_text())
    saved = checkpoint.load(best)["operating_point"]["score_threshold"]
    assert (index["score_threshold"], index["score_threshold_source"]) == (saved, "checkpoint")
    scores = [d["score"] for d in json.loads((tmp_path / "detections.json").read_text())]
    assert min(scores) >= round(saved, 4)


def test_a_checkpoint_without_an_operating_point_asks_for_a_threshold(
    trained: Trainer,
    photos: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    restore_pipeline_logger: None,
) -> None:
    state = checkpoint.load(trained.paths["best"])
    state["operating_point"] = None
    unvalidated = checkpoint.save(tmp_path / "last.pth", state)
    argv = ["predict", "--checkpoint", str(unvalidated), str(photos / "test")]
    assert run(*argv, "--out", str(tmp_path / "out")) == 2
    assert "give --score-threshold T" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_images_are_decoded_by_the_workers_asked_for_else_by_the_checkpoints_setting(
    trained: Trainer,
    photos: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    restore_pipeline_logger: None,
) -> None:
    asked: list[int] = []
    predict = prediction.predict

    def recording(*args: Any, workers: int, **kwargs: Any) -> Any:
        asked.append(workers)
        return predict(*args, workers=workers, **kwargs)

    monkeypatch.setattr(prediction, "predict", recording)
    argv = ["predict", "--checkpoint", str(trained.paths["best"]), str(photos / "test")]
    assert run(*argv, "--out", str(tmp_path / "a"), "--num-workers", "0") == 0
    assert run(*argv, "--out", str(tmp_path / "b"), "--num-workers", "1") == 0
    assert run(*argv, "--out", str(tmp_path / "c")) == 0
    best = trained.paths["best"]
    setting = checkpoint.config_of(checkpoint.load(best), best)["data"]["num_workers"]
    assert asked == [0, 1, worker_count(setting, cached=False)]
    assert run(*argv, "--out", str(tmp_path / "d"), "--num-workers", "two") == 2
    assert "--num-workers two must be a whole number >= 0, or auto" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_a_long_run_logs_how_far_it_is_how_fast_and_how_long_is_left(
    trained: Trainer,
    photos: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    restore_pipeline_logger: None,
) -> None:
    monkeypatch.setattr(prediction, "PROGRESS_INTERVAL_S", 0.0)  # every batch counts as long
    argv = ["predict", "--checkpoint", str(trained.paths["best"]), str(photos / "test")]
    assert run(*argv, "--out", str(tmp_path), "--batch-size", "4") == 0
    err = capsys.readouterr().err
    assert re.search(r"predicted 4 of 10 images \(40%\), [\d.]+ images/s, about \d+ s left", err)
    assert "skipped " in err and "1 unreadable, skipped (listed in images.json)" in err


def test_images_are_named_by_files_folders_and_patterns_each_once(tmp_path: Path) -> None:
    for name in ("b.png", "a.JPG", "notes.txt", "sub/c.png"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    found = find_images([str(tmp_path), str(tmp_path / "notes.txt"), f"{tmp_path}/**/*.png"])
    assert [path.relative_to(tmp_path).as_posix() for path in found] == [
        "a.JPG",
        "b.png",
        "notes.txt",
        "sub/c.png",
    ]


def test_a_file_whose_name_holds_pattern_characters_is_taken_as_named_not_as_a_pattern(
    tmp_path: Path,
) -> None:
    """As a pattern, shot[1].png would match shot1.png: another photo, predicted silently."""
    for name in ("shot[1].png", "shot1.png"):
        (tmp_path / name).write_bytes(b"")
    assert find_images([str(tmp_path / "shot[1].png")]) == [tmp_path / "shot[1].png"]
    assert find_images([str(tmp_path / "shot[12].png")]) == [tmp_path / "shot1.png"]


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("missing", "does not exist: name an image file, a folder or a glob pattern"),
        ("empty", "holds no image file"),
        ("*.gif", "matches no image file"),
    ],
)
def test_a_path_that_names_no_image_is_an_error_naming_it(
    tmp_path: Path, item: str, message: str
) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=message):
        find_images([str(tmp_path / item)])


def test_a_detection_the_clip_leaves_without_area_is_not_predicted() -> None:
    """As evaluation drops it: a detection in the letterbox padding covers none of the image."""
    sample = prediction._Sample(0, None, None, height=32, width=64, error=None)
    found = {  # a 64 x 32 image letterboxed into 64 x 64 fills rows 16 to 48
        "boxes": torch.tensor([[4.0, 20.0, 20.0, 30.0], [4.0, 2.0, 20.0, 10.0]]),
        "scores": torch.tensor([0.6, 0.9]),
        "labels": torch.tensor([0, 1]),
    }
    kept = prediction._in_image_pixels(sample, [Path("a.png")], found, 64, "letterbox")
    assert kept.boxes.tolist() == [[4.0, 4.0, 20.0, 14.0]]
    assert kept.scores.tolist() == pytest.approx([0.6]) and kept.labels.tolist() == [0]
