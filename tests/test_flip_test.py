"""eval.flip_test: the detector's maps averaged over each image and its left-right mirror before
decoding, in evaluation, training's validation and predict (CenterNet's flip test)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from tiny_runs import make_data, tiny_config

from pipeline import cli
from pipeline.engine import checkpoint
from pipeline.engine.trainer import Trainer
from pipeline.evaluation.loop import Evaluator
from pipeline.models import build_model
from pipeline.models.centernet import STRIDE, CenterNet, decode_boxes

pytestmark = pytest.mark.usefixtures("torch_flags_threads_and_logger")

CLASSES = 3
SIZE = 64


def random_model(label_mode: str, iou_score: bool = True, seed: int = 0) -> CenterNet:
    """A tiny_conv with every weight random, the box heads' included (they start at zero)."""
    torch.manual_seed(seed)
    model = build_model("tiny_conv", CLASSES, label_mode, iou_score, width=8)
    with torch.no_grad():
        for head in (model.box_head, model.coarse_box_head):
            head[-1].weight.normal_(0.0, 0.3)
            head[-1].bias.normal_(0.0, 0.3)
    return model.eval()


def images(seed: int = 1, batch: int = 2) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, 3, SIZE, SIZE), dtype=torch.uint8, generator=generator)


def mirrored_boxes(boxes: torch.Tensor) -> torch.Tensor:
    x1, y1, x2, y2 = boxes.unbind(-1)
    return torch.stack([SIZE - x2, y1, SIZE - x1, y2], dim=-1)


def by_score(found: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    order = found["scores"].argsort(descending=True)
    return found["boxes"][order], found["scores"][order], found["labels"][order]


def test_a_mirrored_box_map_decodes_to_the_mirrored_boxes_at_the_mirrored_cells() -> None:
    """The encoding's mirror: every cell's box of `mirrored(maps)` is the mirror of the box at
    the mirrored cell, so that the two views' boxes agree before they are averaged."""
    generator = torch.Generator().manual_seed(0)
    box = torch.randn(2, 4 * CLASSES, SIZE // STRIDE, SIZE // STRIDE, generator=generator)
    mirrored = CenterNet.mirrored({"box": box})["box"]
    for c in range(CLASSES):
        plain = decode_boxes(box[:, 4 * c : 4 * c + 4], STRIDE)  # [B, h, w, 4]
        other = decode_boxes(mirrored[:, 4 * c : 4 * c + 4], STRIDE)
        torch.testing.assert_close(other, mirrored_boxes(plain).flip(2), atol=1e-4, rtol=0)


@pytest.mark.parametrize("label_mode", ["single", "multilabel"])
def test_the_flip_tests_maps_of_a_mirrored_image_are_the_mirror_of_the_images_own(
    label_mode: str,
) -> None:
    """On a random model (no symmetry of its own): the flip test of mirror(x) is the mirror of
    the flip test of x, map for map, and decodes to the mirrored detections."""
    model = random_model(label_mode)
    x = images()
    with torch.inference_mode():
        plain = model(x, flip_test=True)
        of_mirror = model(x.flip(-1), flip_test=True)
        single_view = model(x)
    assert set(plain) == {"heatmap", "box", "iou"}
    back = model.mirrored(of_mirror)
    for key in plain:
        torch.testing.assert_close(back[key], plain[key], atol=1e-4, rtol=1e-4)
    # not the single view's maps: the mirror's view was averaged in
    assert not torch.allclose(plain["box"], single_view["box"].float(), atol=1e-3)
    for found, other in zip(model.decode(plain), model.decode(of_mirror), strict=True):
        boxes, scores, labels = by_score(found)
        other_boxes, other_scores, other_labels = by_score(other)
        assert len(scores) > 0
        torch.testing.assert_close(other_scores, scores, atol=1e-5, rtol=1e-4)
        assert torch.equal(other_labels, labels)
        torch.testing.assert_close(mirrored_boxes(other_boxes), boxes, atol=1e-3, rtol=0)


class SymmetricMaps(CenterNet):
    """Maps that are their own mirror whatever the image: heatmap, sizes, dy and IoU symmetric
    across, the centre offsets across antisymmetric (a mirrored object's offset flips sign)."""

    def __init__(self, label_mode: str) -> None:
        model = random_model(label_mode)
        super().__init__(model.backbone, CLASSES, label_mode, 8, iou_score=True)
        generator = torch.Generator().manual_seed(3)
        cells = SIZE // STRIDE
        heat = CLASSES if label_mode == "multilabel" else CLASSES + 1
        raw = {
            "heatmap": torch.randn(1, heat, cells, cells, generator=generator) * 3,
            "box": torch.randn(1, 4 * CLASSES, cells, cells, generator=generator),
            "iou": torch.randn(1, CLASSES, cells, cells, generator=generator),
        }
        self.fixed = {key: (value + value.flip(-1)) / 2 for key, value in raw.items()}
        across = raw["box"][:, 0::4]
        self.fixed["box"][:, 0::4] = (across - across.flip(-1)) / 2

    def maps(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        batch = images.shape[0]
        return {key: value.expand(batch, -1, -1, -1) for key, value in self.fixed.items()}


@pytest.mark.parametrize("label_mode", ["single", "multilabel"])
def test_maps_that_are_their_own_mirror_give_the_same_detections_with_and_without_it(
    label_mode: str,
) -> None:
    model = SymmetricMaps(label_mode).eval()
    x = images(batch=1)
    with torch.inference_mode():
        without = model.decode(model(x))[0]
        with_it = model.decode(model(x, flip_test=True))[0]
    assert len(without["scores"]) > 10
    for a, b in zip(by_score(without), by_score(with_it), strict=True):
        torch.testing.assert_close(b.float(), a.float(), atol=1e-4, rtol=1e-4)


# --- the key reaches validation, evaluate and predict -----------------------------------------


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("data") / "shapes")


@pytest.fixture
def views(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The flip_test of every forward pass of a CenterNet, in order."""
    seen: list[bool] = []
    forward = CenterNet.forward

    def spy(self: CenterNet, images: torch.Tensor, flip_test: bool = False):
        seen.append(flip_test)
        return forward(self, images, flip_test)

    monkeypatch.setattr(CenterNet, "forward", spy)
    return seen


def test_the_key_reaches_the_evaluator_from_the_config() -> None:
    config = tiny_config(Path("unused"), "eval.flip_test=true")
    assert Evaluator.from_config(config, ["a"]).flip_test is True
    assert Evaluator.from_config(tiny_config(Path("unused")), ["a"]).flip_test is False


def test_validation_evaluate_and_predict_decode_with_it_and_training_steps_never_do(
    data_root: Path,
    tmp_path: Path,
    views: list[bool],
    monkeypatch: pytest.MonkeyPatch,
    restore_pipeline_logger: None,
) -> None:
    config = tiny_config(data_root, "train.epochs=1", "eval.flip_test=true")
    trainer = Trainer(config, tmp_path / "run")
    trainer.fit()
    steps = len(
        [r for r in map(json.loads, trainer.paths["metrics"].open()) if r["type"] == "step"]
    )
    assert views.count(False) == steps and views.count(True) >= 1  # validation's passes
    best = trainer.paths["best"]
    assert checkpoint.load(best)["config"]["eval"]["flip_test"] is True
    monkeypatch.chdir(tmp_path)  # away from the repository's config/config.yaml

    figures = {}
    for setting in ("true", "false"):
        views.clear()
        out, predictions = tmp_path / f"eval-{setting}.json", tmp_path / f"pred-{setting}.json"
        argv = ["--cpu-threads", "1", "evaluate", "--checkpoint", str(best), "--out", str(out)]
        argv += ["--predictions", str(predictions), f"eval.flip_test={setting}"]
        assert cli.main(argv) == 0
        assert views and set(views) == {setting == "true"}
        figures[setting] = json.loads(out.read_text())["metrics"]
        assert figures[setting]["flip_test"] is (setting == "true")
    boxes = {
        setting: [
            image["detections"]["boxes"]
            for image in json.loads((tmp_path / f"pred-{setting}.json").read_text())["images"]
        ]
        for setting in figures
    }
    assert boxes["true"] != boxes["false"]

    views.clear()
    argv = ["--cpu-threads", "1", "predict", "--checkpoint", str(best), str(data_root / "test")]
    assert cli.main([*argv, "--out", str(tmp_path / "predicted"), "--score-threshold", "0"]) == 0
    assert views and set(views) == {True}  # the checkpoint's own eval.flip_test


# --- benchmarks/flip_test.py ------------------------------------------------------------------


def test_the_benchmark_compares_both_sides_on_the_same_weights_and_records_them(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_pipeline_logger
) -> None:
    from benchmark_modules import load

    from pipeline import formats

    bench = load("flip_test")
    runs = []
    for seed in (0, 1):
        trainer = Trainer(
            tiny_config(data_root, "train.epochs=1", f"seed={seed}"), tmp_path / f"r{seed}"
        )
        trainer.fit()
        runs.append(str(trainer.paths["best"]))
    monkeypatch.chdir(tmp_path)
    record = tmp_path / "record.json"
    argv = ["--set", "shapes", *runs, "--record", str(record), "--out", str(tmp_path / "raw.json")]
    assert bench.main(argv) == 0
    document = json.loads(record.read_text())
    assert formats.problem(document, "benchmark_record") is None
    figures = {figure["key"]: figure["value"] for figure in document["figures"]}
    for run in document["settings"]["runs"]:
        assert run["plain"]["model_s"] > 0 and run["flip"]["model_s"] > 0
    assert [run["first"] for run in document["settings"]["runs"]] == ["plain", "flip"]
    mean = sum(run["flip"]["ap"] for run in document["settings"]["runs"]) / 2
    assert figures["flip.ap"] == pytest.approx(mean)
    assert figures["change.ap"] == pytest.approx(figures["flip.ap"] - figures["plain.ap"])
    rose = sum(run["flip"]["ap"] > run["plain"]["ap"] for run in document["settings"]["runs"])
    assert (figures["rose.ap"], figures["runs"]) == (rose, 2)


def test_the_benchmark_reads_each_checkpoints_config_before_evaluating_any(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through checkpoint.config_of, as evaluate reads it: a bad value is named with its file
    and key before any evaluation, and nothing is written."""
    from benchmark_modules import load

    from pipeline.errors import ConfigError

    config = tiny_config(tmp_path / "data")
    config["seed"] = -1
    state = {"model": {}, "config": config, "class_names": ["a"], "epoch": 1}
    best = checkpoint.save(tmp_path / "best.pth", state)
    monkeypatch.chdir(tmp_path)
    raw, record = tmp_path / "raw.json", tmp_path / "record.json"
    argv = ["--set", "shapes", str(best), "--record", str(record), "--out", str(raw)]
    message = rf"seed = -1 in the config of {re.escape(str(best))} is not valid"
    with pytest.raises(ConfigError, match=message):
        load("flip_test").main(argv)
    assert not raw.exists() and not record.exists()


def test_the_photographs_preset_turns_it_on_and_the_synthetic_default_leaves_it_off() -> None:
    """Photographs mirror into photographs; the default's evaluation cost is left as it is."""
    from pipeline.config import load_config

    preset = Path(__file__).parents[1] / "config" / "presets" / "photographs.yaml"
    assert load_config(preset)["eval"]["flip_test"] is True
    assert load_config(None)["eval"]["flip_test"] is False
