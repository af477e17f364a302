"""Evaluation scores detections as they map back to each image's own pixels: on non-square
images, `evaluate`'s AP equals pycocotools' on the predictions file (original pixels) against
the original annotation file, although the model sees letterboxed inputs."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_runs import tiny_config

from pipeline import cli
from pipeline.commands import evaluate as evaluate_command
from pipeline.data import load_split
from pipeline.data.dataset import DetectionDataset
from pipeline.engine import checkpoint
from pipeline.engine.trainer import Trainer

pytestmark = pytest.mark.usefixtures("torch_flags_threads_and_logger")

WIDTH, HEIGHT = 96, 56  # letterboxed to 64 x 64: the image fills rows 13 to 50
CLASSES = ("a", "b")
IOU_THRESHOLDS = np.linspace(0.5, 0.95, 10)


def _objects(rng: np.random.Generator) -> list[list[int]]:
    """Integer boxes, a third touching the top or bottom edge of the image."""
    boxes = []
    for _ in range(int(rng.integers(1, 4))):
        w, h = int(rng.integers(8, 30)), int(rng.integers(6, 20))
        x = int(rng.integers(0, WIDTH - w))
        y = [0, HEIGHT - h, int(rng.integers(0, HEIGHT - h))][int(rng.integers(3))]
        boxes.append([x, y, x + w, y + h])
    return boxes


def write_coco(root: Path, images_per_split: int = 12) -> Path:
    rng = np.random.default_rng(3)
    for split in ("train", "val", "test"):
        (root / split).mkdir(parents=True)
        images, annotations = [], []
        for index in range(images_per_split):
            pixels = rng.integers(0, 255, (HEIGHT, WIDTH, 3), dtype=np.uint8)
            name = f"{split}/{index:03d}.png"
            Image.fromarray(pixels).save(root / name)
            images.append({"id": index + 1, "file_name": name, "width": WIDTH, "height": HEIGHT})
            for x1, y1, x2, y2 in _objects(rng):
                annotations.append(
                    {
                        "id": len(annotations) + 1,
                        "image_id": index + 1,
                        "category_id": int(rng.integers(1, 3)),
                        "bbox": [x1, y1, x2 - x1, y2 - y1],
                        "area": (x2 - x1) * (y2 - y1),
                        "iscrowd": 0,
                    }
                )
        categories = [{"id": i + 1, "name": name} for i, name in enumerate(CLASSES)]
        document = {"images": images, "annotations": annotations, "categories": categories}
        (root / f"instances_{split}.json").write_text(json.dumps(document))
    return root


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    inter = np.prod(np.clip(np.minimum(a[2:], b[2:]) - np.maximum(a[:2], b[:2]), 0, None))
    return float(inter / (np.prod(a[2:] - a[:2]) + np.prod(b[2:] - b[:2]) - inter))


def _near(box: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """An integer box near `box` inside the image, keeping its edges on the image's border,
    whose IoU with it is not within a hair of a threshold (rounding could decide those)."""
    while True:
        moved = box + rng.integers(-2, 3, 4)
        moved[[0, 2]] = np.clip(moved[[0, 2]], 0, WIDTH)
        moved[[1, 3]] = np.clip(moved[[1, 3]], 0, HEIGHT)
        moved[1] = 0 if box[1] == 0 else moved[1]
        moved[3] = HEIGHT if box[3] == HEIGHT else moved[3]
        if (moved[2:] > moved[:2]).all():
            iou = _iou(moved.astype(float), box.astype(float))
            if np.abs(IOU_THRESHOLDS - iou).min() > 2e-3:
                return moved


class ReachesIntoThePadding(torch.nn.Module):
    """Finds each object near where it is, and stretches every detection on the image's
    border to the edge of the square input: into the letterbox padding; finds one more thing
    in the padding itself, above the image."""

    def __init__(self, splits: list[Any]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        rng = np.random.default_rng(5)
        self.found: dict[str, dict[str, torch.Tensor]] = {}
        for split in splits:
            dataset = DetectionDataset(split, 64, cache=False)
            for index, record in enumerate(split.records):
                image, _ = dataset[index]
                boxes = [_near(box.astype(np.int64), rng) for box in record.boxes]
                boxes.append(np.array([0, 0, 20, 12]))  # a false positive in the corner
                labels = [*record.labels.tolist(), 0]
                geometry = dataset.geometry(index)
                scale = np.array([geometry.resized[1] / WIDTH, geometry.resized[0] / HEIGHT] * 2)
                shift = np.array([geometry.left, geometry.top] * 2)
                frame = np.stack(boxes).astype(np.float64) * scale + shift
                on_border = np.stack(boxes) == np.array([0, 0, WIDTH, HEIGHT])
                frame[on_border] = np.array([0.0, 0.0, 64.0, 64.0])[on_border.nonzero()[1]]
                # and one in the padding above the image, the highest scored: clipped, no box
                frame = np.concatenate([frame, [[8.0, 1.0, 30.0, 9.0]]])
                scores = [*rng.uniform(0.05, 0.95, len(boxes)), 0.99]
                self.found[self._key(image)] = {
                    "boxes": torch.tensor(frame, dtype=torch.float32),
                    "scores": torch.tensor(scores, dtype=torch.float32),
                    "labels": torch.tensor([*labels, 1]),
                }

    @staticmethod
    def _key(image: torch.Tensor) -> str:
        return hashlib.sha1(image.contiguous().numpy().tobytes()).hexdigest()

    def forward(self, images: torch.Tensor, flip_test: bool = False) -> torch.Tensor:
        return images

    def decode(
        self, outputs: torch.Tensor, max_detections: int, min_score: float
    ) -> list[dict[str, torch.Tensor]]:
        """As CenterNet.decode: each image's detections scoring at least `min_score`."""
        found = [self.found[self._key(image.to(torch.uint8))] for image in outputs]
        return [{key: value[d["scores"] >= min_score] for key, value in d.items()} for d in found]

    def image_scores(self, outputs: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(outputs), len(CLASSES))


def pycocotools_ap(annotation_file: Path, predictions: dict[str, Any]) -> tuple[float, float]:
    """pycocotools' AP@[.5:.95] and AP@.5 of a predictions file against an annotation file."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        truth = COCO(str(annotation_file))
        category = {c["name"]: c["id"] for c in truth.dataset["categories"]}
        names = predictions["class_names"]
        results = [
            {
                "image_id": image["image_id"],
                "category_id": category[names[label]],
                "bbox": [x1, y1, x2 - x1, y2 - y1],
                "score": score,
            }
            for image in predictions["images"]
            for (x1, y1, x2, y2), score, label in zip(
                image["detections"]["boxes"],
                image["detections"]["scores"],
                image["detections"]["labels"],
                strict=True,
            )
        ]
        evaluation = COCOeval(truth, truth.loadRes(results), "bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    return float(evaluation.stats[0]), float(evaluation.stats[1])


def evaluate_argv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[str]]:
    """The COCO data written under `tmp_path` and the `evaluate` command line of a checkpoint
    trained on it, whose model is `ReachesIntoThePadding`."""
    root = write_coco(tmp_path / "coco")
    config = tiny_config(root, "data.format=coco", "train.epochs=1")
    Trainer(config, tmp_path / "run").fit()
    model = ReachesIntoThePadding([load_split(config, "val"), load_split(config, "test")])
    monkeypatch.setattr(checkpoint, "restore_model", lambda *args, **kwargs: model)
    monkeypatch.chdir(tmp_path)  # away from the repository's config/config.yaml
    return root, ["--cpu-threads", "1", "evaluate", "--checkpoint", str(tmp_path / "run/best.pth")]


def test_evaluate_on_non_square_images_gives_pycocotools_ap_in_the_images_own_pixels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, argv = evaluate_argv(tmp_path, monkeypatch)
    out, predictions = tmp_path / "eval.json", tmp_path / "predictions.json"
    assert cli.main([*argv, "--out", str(out), "--predictions", str(predictions)]) == 0

    metrics = json.loads(out.read_text())["metrics"]
    ap, ap50 = pycocotools_ap(root / "instances_test.json", json.loads(predictions.read_text()))
    assert ap50 > 0.5  # the objects were found: a figure that could differ
    assert metrics["ap50"] == pytest.approx(ap50, abs=1e-4)
    assert metrics["ap"] == pytest.approx(ap, abs=1e-4)


def test_evaluate_drops_detections_below_the_score_floor_from_its_figures_and_predictions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """eval.min_score applies where `evaluate` decodes: the predictions file holds no detection
    below it, and the figures are pycocotools' on exactly the detections the file holds."""
    root, argv = evaluate_argv(tmp_path, monkeypatch)
    written = {}
    for floor in (0.0, 0.5):
        out, predictions = tmp_path / f"eval-{floor}.json", tmp_path / f"predictions-{floor}.json"
        assert cli.main([*argv, "--out", str(out), "--predictions", str(predictions),
                         f"eval.min_score={floor}"]) == 0  # fmt: skip
        written[floor] = (
            json.loads(out.read_text())["metrics"],
            json.loads(predictions.read_text()),
        )
    scores = {
        floor: [s for image in found["images"] for s in image["detections"]["scores"]]
        for floor, (_, found) in written.items()
    }
    assert min(scores[0.0]) < 0.5 <= min(scores[0.5])  # the floor had something to drop
    assert sorted(scores[0.5]) == sorted(s for s in scores[0.0] if s >= 0.5)
    metrics, found = written[0.5]
    assert metrics["min_score"] == 0.5 and metrics["num_detections"] == len(scores[0.5])
    ap, ap50 = pycocotools_ap(root / "instances_test.json", found)
    assert metrics["ap50"] == pytest.approx(ap50, abs=1e-4)
    assert metrics["ap"] == pytest.approx(ap, abs=1e-4)


def test_the_predictions_files_numbers_are_each_rounded_as_pythons_round_rounds_them() -> None:
    """The file rounds every image's numbers at once (numpy): scores to 4 places and boxes to 2
    must come out as Python's round gives them, image by image, empty images included."""
    rng = np.random.default_rng(3)
    scores = [rng.random(n).astype(np.float32) for n in (5, 0, 17, 1)]
    scores[2][:4] = [0.00005, 0.12345, 0.99995, 0.5]  # float32 near decimal ties
    boxes = [rng.uniform(0, 640, (len(s), 4)).astype(np.float32) for s in scores]
    counts = [len(s) for s in scores]
    assert [rows.tolist() for rows in evaluate_command._rounded_rows(scores, 4, counts)] == [
        [round(v, 4) for v in s.tolist()] for s in scores
    ]
    assert [rows.tolist() for rows in evaluate_command._rounded_rows(boxes, 2, counts)] == [
        [[round(v, 2) for v in row] for row in b.astype(np.float64).tolist()] for b in boxes
    ]


def test_a_detection_the_clip_leaves_without_area_is_dropped_from_figures_and_predictions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A detection in the letterbox padding, clipped to its image, covers nothing: it is no
    false positive in AP's ranking (the top score here) and no line in the predictions file."""
    _, argv = evaluate_argv(tmp_path, monkeypatch)
    out, predictions = tmp_path / "eval.json", tmp_path / "predictions.json"
    assert cli.main([*argv, "--out", str(out), "--predictions", str(predictions)]) == 0

    images = json.loads(predictions.read_text())["images"]
    boxes = np.array([box for image in images for box in image["detections"]["boxes"]])
    assert ((boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])).all()
    scores = [score for image in images for score in image["detections"]["scores"]]
    assert max(scores) < 0.99  # the padding's detection, in every image, is gone
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics["num_detections"] == len(scores) == len(boxes)
