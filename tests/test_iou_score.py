"""The IoU branch (`model.iou_score`): it learns the IoU of each cell's decoded box with its
object, decoding scores detections by heat and predicted IoU together, and with the key off
(or absent, in a checkpoint from before it) the model is the one without it."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from test_loss import fixed_outputs, fixed_targets, record_ops
from tiny_runs import make_data, tiny_config
from torchvision.ops import box_iou

from pipeline import cli
from pipeline.engine import checkpoint
from pipeline.engine.trainer import Trainer
from pipeline.models import build_from_config, build_model, parameter_count
from pipeline.models.centernet import IOU_SCORE_ALPHA, STRIDE, decode_boxes
from pipeline.models.loss import DetectionLoss

pytestmark = pytest.mark.usefixtures("torch_flags_threads_and_logger")

CLASSES = 3
WIDTH = 8


def model_config(**extra) -> dict:
    return {"name": "tiny_conv", "label_mode": "single", "width": WIDTH, "max_stride": 32, **extra}


# --- the branch's target --------------------------------------------------------------------


def hand_made_case(label_mode: str) -> tuple[dict[str, torch.Tensor], list[dict], torch.Tensor]:
    """One object of class 1 in a 48-px image (12 x 12 cells), a box map that decodes at every
    cell to a 14 x 18 px box 1 px right of and 2 px above the cell's centre, and the IoU of each
    cell's decoded box with the object, computed by torchvision."""
    cells, label = 12, 1
    obj = torch.tensor([[13.0, 10.0, 35.0, 30.0]])
    box = torch.zeros(1, CLASSES, 4, cells, cells)
    box[:, :, 0] = 1.0 / STRIDE
    box[:, :, 1] = -2.0 / STRIDE
    box[:, :, 2] = math.log(14.0 / STRIDE)
    box[:, :, 3] = math.log(18.0 / STRIDE)
    box = box.reshape(1, 4 * CLASSES, cells, cells)
    decoded = decode_boxes(box[:, 4 * label : 4 * label + 4], STRIDE).reshape(-1, 4)
    expected = box_iou(decoded, obj)[:, 0].reshape(cells, cells)
    heat_channels = CLASSES + (label_mode == "single")
    outputs = {"heatmap": torch.zeros(1, heat_channels, cells, cells), "box": box}
    targets = [{"boxes": obj, "labels": torch.tensor([label])}]
    return outputs, targets, expected


def iou_logit_gradient(outputs: dict, targets: list[dict], logits: torch.Tensor, label_mode: str):
    logits = logits.clone().requires_grad_()
    loss = DetectionLoss(CLASSES, label_mode, STRIDE)({**outputs, "iou": logits}, targets)
    loss["total"].backward()  # only the branch's term reaches its logits
    return logits.grad


@pytest.mark.parametrize("label_mode", ["multilabel", "single"])
def test_the_iou_branchs_target_is_the_iou_of_each_cells_decoded_box_with_its_object(
    label_mode: str,
) -> None:
    """BCE's gradient is sigmoid(logit) - target: zero at every trained cell exactly when the
    branch predicts the IoU of the box decoded there with the object; other classes untrained."""
    outputs, targets, expected = hand_made_case(label_mode)
    logits = torch.zeros(1, CLASSES, 12, 12)
    logits[0, 1] = torch.logit(expected.clamp(1e-4, 1 - 1e-4))
    exact = iou_logit_gradient(outputs, targets, logits, label_mode)
    shifted = iou_logit_gradient(outputs, targets, logits + 0.5, label_mode)
    trained = shifted[0, 1] != 0
    assert trained.sum() >= 9  # the cells where the object's box is regressed, not its centre only
    assert expected[trained].min() > 0 and expected[trained].max() - expected[trained].min() > 0.3
    torch.testing.assert_close(exact[0, 1], torch.zeros(12, 12), atol=1e-7, rtol=0)
    assert bool((shifted[0, 1][trained] > 0).all())  # too high everywhere it is trained
    assert torch.count_nonzero(shifted[0, [0, 2]]) == 0


def test_the_iou_target_is_detached_so_the_branch_never_moves_the_boxes() -> None:
    outputs, targets, _ = hand_made_case("single")
    box = outputs["box"].clone().requires_grad_()
    # (at logit 0, BCE's gradient with respect to its target is zero whether detached or not)
    logits = torch.full((1, CLASSES, 12, 12), 1.5, requires_grad=True)
    loss = DetectionLoss(CLASSES, "single", STRIDE)
    with_branch = loss({**outputs, "box": box, "iou": logits}, targets)
    with_branch["total"].backward()
    assert torch.count_nonzero(logits.grad) > 0
    box_alone = outputs["box"].clone().requires_grad_()
    loss({**outputs, "box": box_alone}, targets)["total"].backward()
    assert torch.equal(box.grad, box_alone.grad)  # the branch's term adds nothing to it


def test_without_the_branchs_output_the_loss_has_no_iou_term() -> None:
    outputs, targets, _ = hand_made_case("single")
    loss = DetectionLoss(CLASSES, "single", STRIDE)(outputs, targets)
    assert set(loss) == {"total", "heatmap", "box"}
    torch.testing.assert_close(loss["total"], loss["heatmap"] + 2.0 * loss["box"])


def test_the_branchs_term_never_makes_the_host_wait_for_the_device() -> None:
    outputs = fixed_outputs(3, CLASSES + 1, 16, CLASSES)
    outputs["iou"] = torch.zeros(3, CLASSES, 16, 16, requires_grad=True)
    targets = fixed_targets((3, 0, 5), CLASSES, 64)
    loss = DetectionLoss(CLASSES, "single", STRIDE)
    plan = loss.plan(targets, 16, 16)
    recorder = record_ops(lambda: loss(outputs, plan)["total"].backward())
    assert recorder.syncing == []
    assert torch.count_nonzero(outputs["iou"].grad) > 0


# --- decoding -------------------------------------------------------------------------------


def two_peaks(model) -> dict[str, torch.Tensor]:
    """Class 0 peaks at (2, 2) with heat logit 3 and a poor predicted IoU, class 2 at (8, 8)
    with heat logit 2 and a good one."""
    heat = torch.full((1, CLASSES, 12, 12), -8.0)
    heat[0, 0, 2, 2], heat[0, 2, 8, 8] = 3.0, 2.0
    iou = torch.zeros(1, CLASSES, 12, 12)
    iou[0, 0, 2, 2], iou[0, 2, 8, 8] = -3.0, 3.0
    box = torch.zeros(1, 4 * CLASSES, 12, 12)
    return {"heatmap": heat, "box": box, "iou": iou}


def test_with_the_branch_a_detections_score_is_heat_and_predicted_iou_multiplied() -> None:
    model = build_model("tiny_conv", CLASSES, "multilabel", iou_score=True, width=WIDTH)
    (found,) = model.decode(two_peaks(model), max_detections=2)
    heat, iou = torch.tensor([2.0, 3.0]).sigmoid(), torch.tensor([3.0, -3.0]).sigmoid()
    expected = heat ** (1 - IOU_SCORE_ALPHA) * iou**IOU_SCORE_ALPHA
    # the better box ranks first although its heat is lower
    assert found["labels"].tolist() == [2, 0]
    torch.testing.assert_close(found["scores"], expected)


def test_without_the_branch_the_score_is_the_heatmaps_peak_alone() -> None:
    model = build_model("tiny_conv", CLASSES, "multilabel", width=WIDTH)
    (found,) = model.decode(two_peaks(model), max_detections=2)
    assert found["labels"].tolist() == [0, 2]
    torch.testing.assert_close(found["scores"], torch.tensor([3.0, 2.0]).sigmoid())


# --- the model with the key off, on and absent ----------------------------------------------


def test_iou_score_off_or_absent_builds_the_model_without_a_branch_weight_for_weight() -> None:
    torch.manual_seed(0)
    absent = build_from_config(model_config(), CLASSES)
    torch.manual_seed(0)
    off = build_from_config(model_config(iou_score=False), CLASSES)
    torch.manual_seed(0)
    on = build_from_config(model_config(iou_score=True), CLASSES)
    assert off.state_dict().keys() == absent.state_dict().keys()
    assert all(torch.equal(off.state_dict()[k], v) for k, v in absent.state_dict().items())
    assert not any("iou" in key for key in off.state_dict())
    # the branch adds one 1x1 conv, width -> one channel per class, and nothing else
    assert parameter_count(on) - parameter_count(off) == (WIDTH + 1) * CLASSES
    assert set(on.state_dict()) - set(off.state_dict()) == {"iou_head.weight", "iou_head.bias"}


def test_turning_the_branch_on_leaves_every_other_weight_and_later_draw_as_they_were() -> None:
    torch.manual_seed(0)
    off = build_from_config(model_config(), CLASSES).state_dict()
    after_off = torch.rand(4)
    torch.manual_seed(0)
    on = build_from_config(model_config(iou_score=True), CLASSES).state_dict()
    after_on = torch.rand(4)
    assert all(torch.equal(on[key], value) for key, value in off.items())
    assert torch.equal(after_on, after_off)  # the loader's shuffling, augmentation


def test_the_branch_changes_neither_the_heatmap_nor_the_boxes_of_the_same_weights() -> None:
    torch.manual_seed(0)
    off = build_from_config(model_config(), CLASSES).eval()
    on = build_from_config(model_config(iou_score=True), CLASSES).eval()
    on.load_state_dict(off.state_dict(), strict=False)
    images = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8)
    with torch.no_grad():
        without, with_branch = off(images), on(images)
    assert set(without) == {"heatmap", "box"}
    assert set(with_branch) == {"heatmap", "box", "iou"}
    assert with_branch["iou"].shape == (2, CLASSES, 16, 16)
    assert torch.equal(without["heatmap"], with_branch["heatmap"])
    assert torch.equal(without["box"], with_branch["box"])


def test_the_branchs_loss_trains_the_branch_alone_not_the_features_it_reads() -> None:
    """It judges the boxes without reshaping the features the heatmap and boxes share."""
    torch.manual_seed(0)
    model = build_from_config(model_config(iou_score=True), CLASSES).train()
    images = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8)
    targets = [
        {"boxes": torch.tensor([[8.0, 8.0, 30.0, 26.0]]), "labels": torch.tensor([1])},
        {"boxes": torch.tensor([[20.0, 30.0, 50.0, 60.0]]), "labels": torch.tensor([2])},
    ]
    outputs = model(images)
    loss = DetectionLoss.for_model(model)(outputs, targets)
    # the branch's term alone: the total less what it was without the IoU output
    rest = DetectionLoss.for_model(model)({k: outputs[k] for k in ("heatmap", "box")}, targets)
    (loss["total"] - rest["total"]).backward()
    reached = {name for name, p in model.named_parameters() if p.grad is not None and p.grad.any()}
    assert reached == {"iou_head.weight", "iou_head.bias"}


# --- training, evaluation and checkpoints ---------------------------------------------------


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("data") / "shapes")


def fitted(data_root: Path, run_dir: Path, *settings: str) -> Trainer:
    trainer = Trainer(tiny_config(data_root, *settings), run_dir)
    trainer.fit()
    return trainer


@pytest.fixture(scope="module")
def trained(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Trainer:
    return fitted(data_root, tmp_path_factory.mktemp("run"), "model.iou_score=true")


def test_with_the_branch_the_heatmap_and_boxes_train_bit_for_bit_as_without_it(
    trained: Trainer, data_root: Path, tmp_path: Path
) -> None:
    """Only the scores differ: the branch's features are detached, its weights drawn from a
    fork of the RNG, and its gradient clipped apart from the detector's (clipping is on)."""
    assert trained.config["train"]["grad_clip"]
    without = fitted(data_root, tmp_path / "run")
    off, on = (checkpoint.load(t.paths["last"])["model"] for t in (without, trained))
    assert set(on) - set(off) == {"iou_head.weight", "iou_head.bias"}
    assert [key for key, value in off.items() if not torch.equal(on[key], value)] == []


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_pipeline_logger) -> Path:
    monkeypatch.chdir(tmp_path)  # away from the repository's config/config.yaml
    return tmp_path


def evaluate(here: Path, path: Path) -> dict:
    out = here / "eval.json"
    argv = ["--cpu-threads", "1", "evaluate", "--checkpoint", str(path), "--out", str(out)]
    assert cli.main(argv) == 0
    return json.loads(out.read_text())


def test_training_with_the_branch_learns_it_and_its_checkpoint_rebuilds_it(
    trained: Trainer, here: Path
) -> None:
    rows = [json.loads(line) for line in trained.paths["metrics"].read_text().splitlines()]
    assert all(math.isfinite(row["loss"]) for row in rows if row["type"] == "step")
    best = checkpoint.load(trained.paths["best"])
    assert best["config"]["model"]["iou_score"] is True
    model = checkpoint.restore_model(best, torch.device("cpu"), torch.contiguous_format)
    assert model.iou_head is not None  # what evaluate and predict use
    assert torch.equal(model.iou_head.weight, best["model"]["iou_head.weight"])
    assert not torch.equal(
        best["model"]["iou_head.weight"], torch.zeros_like(model.iou_head.weight)
    )
    assert evaluate(here, trained.paths["best"])["metrics"]["num_images"] > 0


def test_a_checkpoint_from_before_iou_score_existed_still_evaluates(
    trained: Trainer, here: Path
) -> None:
    state = checkpoint.load(trained.paths["best"])
    state["model"] = {k: v for k, v in state["model"].items() if not k.startswith("iou_head.")}
    del state["config"]["model"]["iou_score"]
    older = checkpoint.save(here / "older.pth", state)
    model = checkpoint.restore_model(
        checkpoint.load(older), torch.device("cpu"), torch.contiguous_format
    )
    assert model.iou_head is None
    assert evaluate(here, older)["metrics"]["num_images"] > 0


def test_iou_score_alpha_decodes_at_each_alpha_and_puts_the_shipped_one_back(
    trained: Trainer, here: Path
) -> None:
    from benchmark_modules import load

    from pipeline.models import centernet

    bench = load("iou_score_alpha")
    shipped = centernet.IOU_SCORE_ALPHA
    at = {alpha: bench.evaluate_at(trained.paths["best"], alpha, 1, here) for alpha in (0.0, 1.0)}
    assert shipped == centernet.IOU_SCORE_ALPHA
    assert at[0.0] != at[1.0]  # the heatmap alone, the predicted IoU alone
    assert set(at[0.0]) == {"ap50", "ap", "f1", "score_threshold"}


def test_iou_score_alpha_refuses_a_run_trained_without_the_branch(
    trained: Trainer, here: Path
) -> None:
    from benchmark_modules import load

    from pipeline.errors import DataError

    state = checkpoint.load(trained.paths["best"])
    state["model"] = {k: v for k, v in state["model"].items() if not k.startswith("iou_head.")}
    state["config"]["model"]["iou_score"] = False
    without = checkpoint.save(here / "without.pth", state)
    with pytest.raises(DataError, match=r"without model\.iou_score"):
        load("iou_score_alpha").evaluate_at(without, 0.5, 1, here)


def test_iou_score_alpha_reads_the_checkpoints_config_as_evaluate_does(here: Path) -> None:
    """Through checkpoint.config_of, as evaluate reads it: a bad model.iou_score is named with
    its file and key before any evaluation (a key added later would have its default)."""
    from benchmark_modules import load

    from pipeline.errors import ConfigError

    config = tiny_config(here / "data")
    config["model"]["iou_score"] = 3
    state = {"model": {}, "config": config, "class_names": ["a"], "epoch": 1}
    path = checkpoint.save(here / "best.pth", state)
    message = rf"model\.iou_score = 3 in the config of {re.escape(str(path))} is not valid"
    with pytest.raises(ConfigError, match=message):
        load("iou_score_alpha").evaluate_at(path, 0.5, 1, here)
