"""The operating point travels with the model: training saves the best-F1 score threshold it
picked on validation in best.pth, and evaluation counts detections from it unless
eval.score_threshold names one; checkpoints written before it was saved still evaluate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_runs import make_data, tiny_config

from pipeline import cli
from pipeline.engine import checkpoint
from pipeline.engine.trainer import Trainer
from pipeline.evaluation.loop import Evaluator

pytestmark = pytest.mark.usefixtures("torch_flags_threads_and_logger")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trainer:
    data_root = make_data(tmp_path_factory.mktemp("data") / "shapes")
    trainer = Trainer(tiny_config(data_root), tmp_path_factory.mktemp("run"))
    trainer.fit()
    return trainer


def validations(trainer: Trainer) -> dict[int, dict[str, Any]]:
    rows = [json.loads(line) for line in trainer.paths["metrics"].read_text().splitlines()]
    return {row["epoch"]: row["val"] for row in rows if row["type"] == "epoch" and row["val"]}


def evaluate(here: Path, path: Path, *settings: str) -> dict[str, Any]:
    out = here / "eval.json"
    argv = ["--cpu-threads", "1", "evaluate", "--checkpoint", str(path), "--out", str(out)]
    assert cli.main([*argv, *settings]) == 0
    return json.loads(out.read_text())


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_pipeline_logger) -> Path:
    monkeypatch.chdir(tmp_path)  # away from the repository's config/config.yaml
    return tmp_path


def test_best_pth_saves_the_best_epochs_best_f1_threshold_on_validation(trained: Trainer) -> None:
    assert trained.config["eval"]["score_threshold"] is None  # the shipped default
    best = checkpoint.load(trained.paths["best"])
    val = validations(trained)[best["epoch"]]
    # with no threshold configured, validation counts F1 at its own best-F1 threshold
    assert val["f1"] == val["best_f1"]
    assert best["operating_point"] == {
        "score_threshold": val["score_threshold"],
        "f1": val["best_f1"],
        "picked_on": "val",
    }
    assert checkpoint.load(trained.paths["last"])["operating_point"] == best["operating_point"]


def test_evaluate_counts_detections_from_the_checkpoints_operating_point(
    trained: Trainer, here: Path
) -> None:
    saved = checkpoint.load(trained.paths["best"])["operating_point"]["score_threshold"]
    result = evaluate(here, trained.paths["best"])
    assert result["score_threshold_source"] == "checkpoint"
    assert result["metrics"]["score_threshold"] == saved
    assert result["metrics_split"] == "test"


def test_evaluate_runs_both_splits_on_one_inference_form_of_the_checkpoints_model(
    trained: Trainer, here: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    evaluated: list[torch.nn.Module] = []
    evaluate_pass = Evaluator.evaluate

    def recording(self: Evaluator, model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        evaluated.append(model)
        return evaluate_pass(self, model, *args, **kwargs)

    monkeypatch.setattr(Evaluator, "evaluate", recording)
    evaluate(here, trained.paths["best"])
    assert len(evaluated) == 2 and evaluated[0] is evaluated[1]
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in evaluated[0].modules())


def test_an_explicit_eval_score_threshold_overrides_the_operating_point(
    trained: Trainer, here: Path
) -> None:
    result = evaluate(here, trained.paths["best"], "eval.score_threshold=0.25")
    assert result["score_threshold_source"] == "eval.score_threshold"
    assert result["metrics"]["score_threshold"] == 0.25


def test_an_older_checkpoint_keeps_the_threshold_its_own_config_named(
    trained: Trainer, here: Path
) -> None:
    """Before the operating point was saved, eval.score_threshold was always a number (0.4 by
    default): such a checkpoint evaluates at it, as it did."""
    state = checkpoint.load(trained.paths["best"])
    del state["operating_point"]
    state["config"]["eval"]["score_threshold"] = 0.4
    older = checkpoint.save(here / "older.pth", state)
    result = evaluate(here, older)
    assert result["score_threshold_source"] == "eval.score_threshold"
    assert result["metrics"]["score_threshold"] == 0.4


def test_an_older_checkpoint_asked_for_its_operating_point_has_it_picked_on_validation_again(
    trained: Trainer, here: Path
) -> None:
    state = checkpoint.load(trained.paths["best"])
    del state["operating_point"]
    older = checkpoint.save(here / "older.pth", state)
    result = evaluate(here, older, "eval.score_threshold=null")
    assert result["score_threshold_source"] == "validation"
    picked = result["val_metrics"]["best_f1_threshold"]
    assert result["metrics"]["score_threshold"] == picked == result["operating_point"]["threshold"]


def test_a_checkpoint_from_before_precision_replaced_amp_and_amp_dtype_still_evaluates(
    trained: Trainer, here: Path
) -> None:
    state = checkpoint.load(trained.paths["best"])
    config = {k: v for k, v in state["config"].items() if k != "precision"}
    older = checkpoint.save(here / "older.pth", {**state, "config": {**config, "amp": False}})
    assert checkpoint.load(older)["config"]["precision"] == "fp32"
    assert evaluate(here, older)["precision"] == "fp32"
