"""eval.test_scales: the detector's maps of the images resized by each scale, brought to the
frame of data.image_size and averaged before decoding, in evaluation, training's validation and
predict (with or without the flip test)."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tiny_runs import (
    global_torch_state,
    make_data,
    one_cpu_thread,
    pipeline_logger_restored,
    tiny_config,
)

from pipeline import cli
from pipeline.engine.trainer import Trainer
from pipeline.errors import ConfigError
from pipeline.evaluation.loop import Evaluator
from pipeline.models import build_model, check_test_scales
from pipeline.models.centernet import STRIDE, CenterNet
from pipeline.models.test_time import inference_maps, resized

CLASSES = 3
SIZE = 64
# objects in the input frame of SIZE px: class, centre x, centre y, width, height
OBJECTS = ((0, 17.0, 21.5, 14.0, 9.0), (1, 44.3, 18.2, 10.0, 16.0), (2, 30.6, 46.9, 20.0, 12.0))


@pytest.fixture(scope="module", autouse=True)
def _torch_flags_threads_and_logger() -> Iterator[None]:
    with global_torch_state(), one_cpu_thread(), pipeline_logger_restored():
        yield


def random_model(label_mode: str, seed: int = 0) -> CenterNet:
    """A tiny_conv with every weight random, the box heads' included (they start at zero)."""
    torch.manual_seed(seed)
    model = build_model("tiny_conv", CLASSES, label_mode, True, width=8)
    with torch.no_grad():
        for head in (model.box_head, model.coarse_box_head):
            head[-1].weight.normal_(0.0, 0.3)
            head[-1].bias.normal_(0.0, 0.3)
    return model.eval()


def images(seed: int = 1, batch: int = 2) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, 3, SIZE, SIZE), dtype=torch.uint8, generator=generator)


class SeesTheObjects(CenterNet):
    """Maps that are scale-equivariant by construction: whatever the input's size, the maps a
    perfect detector of OBJECTS gives at that size (a Gaussian per object on its class's
    heatmap, every cell's box of a class the exact box of that class's object, in the input's
    own pixels), so that every scale sees the same objects."""

    def __init__(self, label_mode: str) -> None:
        model = random_model(label_mode)
        super().__init__(model.backbone, CLASSES, label_mode, 8, iou_score=True)

    def maps(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        batch, _, height, width = images.shape
        scale = width / SIZE
        rows = (torch.arange(height // STRIDE, dtype=torch.float32) + 0.5).view(-1, 1)
        cols = (torch.arange(width // STRIDE, dtype=torch.float32) + 0.5).view(1, -1)
        probs, box = [], []
        for _, cx, cy, w, h in OBJECTS:
            x, y = cx * scale / STRIDE, cy * scale / STRIDE  # in this input's cells
            sigma = min(w, h) * scale / STRIDE / 3
            probs.append(0.9 * torch.exp(-((cols - x) ** 2 + (rows - y) ** 2) / (2 * sigma**2)))
            size = (math.log(w * scale / STRIDE), math.log(h * scale / STRIDE))
            box += [(x - cols).expand_as(probs[-1]), (y - rows).expand_as(probs[-1])]
            box += [torch.full_like(probs[-1], value) for value in size]
        heat = torch.stack(probs)
        if self.label_mode == "single":
            heat = torch.cat([heat, (1 - heat.sum(0, keepdim=True)).clamp(min=1e-4)])
            logits = heat.log()
        else:
            logits = heat.log() - (1 - heat).log()
        outputs = {
            "heatmap": logits,
            "box": torch.stack(box),
            "iou": torch.zeros(CLASSES, height // STRIDE, width // STRIDE),
        }
        return {key: value.expand(batch, -1, -1, -1) for key, value in outputs.items()}


def best_per_class(found: dict[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Each class's highest-scoring box."""
    boxes = {}
    for index in found["scores"].argsort(descending=True).tolist():
        boxes.setdefault(int(found["labels"][index]), found["boxes"][index])
    return boxes


@pytest.mark.parametrize("label_mode", ["single", "multilabel"])
@pytest.mark.parametrize("scales", [(1.5,), (2.0,), (1.0, 1.5), (0.5, 1.0, 2.0)])
def test_a_scale_equivariant_model_decodes_the_same_boxes_at_every_scale(
    label_mode: str, scales: tuple[float, ...]
) -> None:
    """Sizes, offsets and heatmaps brought to the base frame: the larger (or smaller) view's
    boxes are the base view's, alone or averaged with it, with or without the flip test."""
    model = SeesTheObjects(label_mode).eval()
    x = images(batch=1)
    truth = {
        c: torch.tensor([x - w / 2, y - h / 2, x + w / 2, y + h / 2]) for c, x, y, w, h in OBJECTS
    }
    with torch.inference_mode():
        # (the stub's mirror view sees the objects unmirrored: its flip test's boxes are off
        # the truth, but they are the same at every scale)
        for flip_test in (False, True):
            base = best_per_class(model.decode(model(x, flip_test))[0])
            scaled = best_per_class(model.decode(model(x, flip_test, scales))[0])
            assert sorted(scaled) == sorted(base) == [0, 1, 2]
            for label, box in base.items():
                torch.testing.assert_close(scaled[label], box, atol=1e-3, rtol=0)
                if not flip_test:
                    torch.testing.assert_close(box, truth[label], atol=1e-3, rtol=0)


@pytest.mark.parametrize("flip_test", [False, True])
def test_the_data_sets_own_scale_alone_is_the_call_of_today_bit_for_bit(flip_test: bool) -> None:
    model = random_model("single")
    x = images()
    with torch.inference_mode():
        today = model(x, flip_test=True) if flip_test else model(x)
        for given in ((1.0,), [1.0]):
            maps = inference_maps(model, x, flip_test, given)
            assert set(maps) == set(today)
            for key in today:
                assert torch.equal(maps[key], today[key])
        # another scale beside it is averaged in
        scaled = inference_maps(model, x, flip_test, (1.0, 1.5))
    assert not torch.allclose(scaled["box"], today["box"].float(), atol=1e-3)


def test_scales_that_round_to_one_input_size_are_refused_naming_the_key_and_the_sizes() -> None:
    config = tiny_config(Path("unused"), "eval.test_scales=[1.0, 1.1]")
    with pytest.raises(ConfigError, match=r"eval\.test_scales=\[1\.0, 1\.1\].*both round to 64 px"):
        Evaluator.from_config(config, ["a"])
    check_test_scales(tiny_config(Path("unused"), "eval.test_scales=[1.0, 1.5, 2]"))
    # training refuses them before it reads any data (there is none at this root)
    with pytest.raises(ConfigError, match=r"eval\.test_scales"):
        Trainer(config, Path("unused-run"))


def test_a_scaled_input_is_rounded_to_a_multiple_of_the_backbones_stride() -> None:
    assert random_model("multilabel").backbone.total_stride == 32
    assert build_model("tiny_conv", 1, "single", width=8, max_stride=16).backbone.total_stride == 16
    assert resized(images(), 1.5, 32).shape[-2:] == (96, 96)
    assert resized(images(), 1.2, 32).shape[-2:] == (64, 64)  # 76.8 px: 64 is nearest
    assert resized(images(), 1.2, 16).shape[-2:] == (80, 80)
    assert resized(images(), 0.25, 32).shape[-2:] == (32, 32)  # at least one stride


# --- the key reaches validation, evaluate and predict -----------------------------------------


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("data") / "shapes")


@pytest.fixture
def views(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, ...]]:
    """The scales of every forward pass of a CenterNet, in order."""
    seen: list[tuple[float, ...]] = []
    forward = CenterNet.forward

    def spy(self: CenterNet, images: torch.Tensor, flip_test: bool = False, scales=(1.0,)):
        seen.append(tuple(scales))
        return forward(self, images, flip_test, scales)

    monkeypatch.setattr(CenterNet, "forward", spy)
    return seen


def test_the_key_reaches_the_evaluator_from_the_config() -> None:
    config = tiny_config(Path("unused"), "eval.test_scales=[1.0, 1.5]")
    assert Evaluator.from_config(config, ["a"]).test_scales == (1.0, 1.5)
    assert Evaluator.from_config(tiny_config(Path("unused")), ["a"]).test_scales == (1.0,)


def test_validation_evaluate_and_predict_decode_with_them_and_training_steps_never_do(
    data_root: Path,
    tmp_path: Path,
    views: list[tuple[float, ...]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    restore_pipeline_logger: None,
) -> None:
    config = tiny_config(data_root, "train.epochs=1", "eval.test_scales=[1.0, 1.5]")
    trainer = Trainer(config, tmp_path / "run")
    trainer.fit()
    assert (1.0,) in views and (1.0, 1.5) in views  # training steps, validation's passes
    best = trainer.paths["best"]
    monkeypatch.chdir(tmp_path)  # away from the repository's config/config.yaml

    boxes = {}
    for setting in ("[1.0, 1.5]", "[1.0]"):
        views.clear()
        out, predictions = tmp_path / "eval.json", tmp_path / f"pred-{len(setting)}.json"
        argv = ["--cpu-threads", "1", "evaluate", "--checkpoint", str(best), "--out", str(out)]
        argv += ["--predictions", str(predictions), f"eval.test_scales={setting}"]
        assert cli.main(argv) == 0
        expected = (1.0, 1.5) if "1.5" in setting else (1.0,)
        assert views and set(views) == {expected}
        assert tuple(json.loads(out.read_text())["metrics"]["test_scales"]) == expected
        boxes[setting] = [
            image["detections"]["boxes"] for image in json.loads(predictions.read_text())["images"]
        ]
    assert boxes["[1.0, 1.5]"] != boxes["[1.0]"]

    views.clear()
    argv = ["--cpu-threads", "1", "predict", "--checkpoint", str(best), str(data_root / "test")]
    assert cli.main([*argv, "--out", str(tmp_path / "predicted"), "--score-threshold", "0"]) == 0
    assert views and set(views) == {(1.0, 1.5)}  # the checkpoint's own eval.test_scales

    views.clear()
    refused = tmp_path / "refused.json"
    argv = ["--cpu-threads", "1", "evaluate", "--checkpoint", str(best), "--out", str(refused)]
    # refused before any data is read: the data root named does not exist
    argv += ["--data", str(tmp_path / "nowhere"), "eval.test_scales=[1.0, 1.1]"]
    capsys.readouterr()
    assert cli.main(argv) != 0
    assert "eval.test_scales=[1.0, 1.1]" in capsys.readouterr().err
    assert not refused.exists() and views == []


# --- benchmarks/test_scales.py ----------------------------------------------------------------


def test_the_benchmark_compares_the_sides_on_the_same_weights_and_records_them(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_pipeline_logger
) -> None:
    from benchmark_modules import load

    from pipeline import formats

    bench = load("test_scales")
    runs = []
    for seed in (0, 1):
        trainer = Trainer(
            tiny_config(data_root, "train.epochs=1", f"seed={seed}"), tmp_path / f"r{seed}"
        )
        trainer.fit()
        runs.append(str(trainer.paths["best"]))
    monkeypatch.chdir(tmp_path)
    record = tmp_path / "record.json"
    argv = ["--set", "shapes", "--scales", "1,1.5", "--native", *runs]
    assert bench.main([*argv, "--record", str(record), "--out", str(tmp_path / "raw.json")]) == 0
    document = json.loads(record.read_text())
    assert formats.problem(document, "benchmark_record") is None
    figures = {figure["key"]: figure["value"] for figure in document["figures"]}
    done = document["settings"]["runs"]
    for run in done:
        assert all(run[side]["model_s"] > 0 for side in ("base", "scaled", "native"))
    assert [run["first"] for run in done] == ["base", "scaled"]
    mean = sum(run["scaled"]["ap"] for run in done) / 2
    assert figures["scaled.ap"] == pytest.approx(mean)
    assert figures["change.ap"] == pytest.approx(figures["scaled.ap"] - figures["base.ap"])
    assert figures["native.change.ap"] == pytest.approx(figures["native.ap"] - figures["base.ap"])
    rose = sum(run["scaled"]["ap"] > run["base"]["ap"] for run in done)
    assert (figures["rose.ap"], figures["runs"]) == (rose, 2)
    assert figures["model_time_ratio"] == pytest.approx(
        statistics.median(run["model_time_ratio"] for run in done)
    )


def test_the_synthetic_default_and_the_photographs_preset_keep_the_data_sets_own_scale() -> None:
    """Off where it was measured: the trained detectors read objects smaller at other scales
    (benchmarks/records/test_scales/)."""
    from pipeline.config import load_config

    preset = Path(__file__).parents[1] / "config" / "presets" / "photographs.yaml"
    assert load_config(preset)["eval"]["test_scales"] == [1.0]
    assert load_config(None)["eval"]["test_scales"] == [1.0]


def test_box_limits_reads_the_maps_with_the_views_evaluation_would_average() -> None:
    """benchmarks/box_limits.py --flip-test --test-scales: its figures are of the averaged maps."""
    from benchmark_modules import load

    box_limits = load("box_limits")
    model = random_model("single")
    x = images()
    targets = [
        {
            "image_id": torch.tensor(i),
            **{key: torch.zeros(0, 4) for key in ("boxes", "ignore_boxes")},
            **{key: torch.zeros(0, dtype=torch.int64) for key in ("labels", "ignore_labels")},
        }
        for i in range(len(x))
    ]
    with torch.inference_mode():
        expected = inference_maps(model, x, True, (1.0, 1.5))
    outputs, truth = box_limits.forward_pass(model, [(x, targets)], True, (1.0, 1.5))
    assert [gt["image_id"] for gt in truth] == [0, 1]
    for key, value in expected.items():
        assert torch.equal(outputs[0][key], value.float())
    plain, _ = box_limits.forward_pass(model, [(x, targets)])
    assert not torch.allclose(plain[0]["box"], expected["box"], atol=1e-3)


def test_the_reports_latency_rows_flag_a_profile_timed_at_several_scales() -> None:
    from types import SimpleNamespace

    from pipeline.report.run_views import latency_row

    def flags(settings: dict) -> list[str]:
        run = SimpleNamespace(name="cpu-fp32", profile={"settings": settings})
        return latency_row(run, {"batch_size": 1, "wall": {}})["flags"]

    assert flags({"flip_test": True, "test_scales": [1.0, 1.5]}) == [
        "flip test: each image and its mirror",
        "test scales 1, 1.5",
    ]
    assert flags({"flip_test": False, "test_scales": [1.0]}) == []
    assert flags({"flip_test": False}) == []  # a profile from before the key
