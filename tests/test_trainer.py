"""The Trainer, its checkpoints and `python -m pipeline train`, on a seconds-long synthetic run."""

from __future__ import annotations

import errno
import io
import json
import logging
import math
import os
import pickle
import random
import shutil
import statistics
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from tiny_runs import InterruptedInEpoch2, make_data, tiny_config, tiny_settings

from pipeline import cli
from pipeline import device as dev
from pipeline.engine import checkpoint
from pipeline.engine.budget import BudgetTiming, steps_within_budget
from pipeline.engine.trainer import Trainer
from pipeline.errors import CheckpointError, OutputError, TrainingError
from pipeline.models.loss import DetectionLoss
from pipeline.setting_groups import SPEED_SETTINGS, VALIDATION_EVAL_KEYS

pytestmark = pytest.mark.usefixtures("torch_flags_threads_and_logger")

EPOCHS = 3
STEPS_PER_EPOCH = 2  # 16 training images, batch 8
# Fields of metrics rows that are measurements of time or memory, not results of training.
MEASURED = {"step_time_s", "epoch_time_s", "images_per_s", "memory", "host_peak_rss_mb"}


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("data") / "shapes")


@pytest.fixture(scope="module")
def config(data_root: Path) -> dict[str, Any]:
    return tiny_config(data_root, f"train.epochs={EPOCHS}")


@pytest.fixture(scope="module")
def trained(config: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Trainer:
    """One uninterrupted run of EPOCHS epochs; tests read it, and must not change its folder."""
    trainer = Trainer(config, tmp_path_factory.mktemp("run") / "uninterrupted")
    trainer.summary = trainer.fit()
    return trainer


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def without_measurements(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if k not in MEASURED} for row in rows]


def temp_files(folder: Path) -> list[Path]:
    return [path for path in folder.iterdir() if path.name.endswith(".tmp")]


def copy_of_last(trained: Trainer, folder: Path) -> Path:
    folder.mkdir(parents=True)
    shutil.copy(trained.paths["last"], folder / "last.pth")
    return folder


# --- what a run writes -----------------------------------------------------------------------


def test_fit_writes_checkpoints_metrics_config_and_summary_and_no_temp_files(
    trained: Trainer,
) -> None:
    for name in ("last.pth", "best.pth", "metrics.jsonl", "config.json", "train_summary.json"):
        assert (trained.run_dir / name).is_file(), name
    assert temp_files(trained.run_dir) == []
    assert json.loads(trained.paths["config"].read_text()) == trained.config


def test_metrics_jsonl_has_a_json_row_per_logged_step_and_per_epoch(trained: Trainer) -> None:
    rows = read_rows(trained.paths["metrics"])
    steps = [row for row in rows if row["type"] == "step"]
    epochs = [row for row in rows if row["type"] == "epoch"]
    assert len(steps) == EPOCHS * STEPS_PER_EPOCH  # log_interval=1
    assert [row["epoch"] for row in epochs] == list(range(1, EPOCHS + 1))
    assert [row["step"] for row in steps] == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
    assert [row["type"] for row in rows[:3]] == ["step", "step", "epoch"]  # epoch row closes it
    for row in steps:
        for key in ("loss", "heatmap", "box", "lr", "step_time_s", "images_per_s"):
            assert isinstance(row[key], float) and math.isfinite(row[key]), key
        assert row["memory"]["exact"] is True
    for row in epochs:
        assert row["step"] == row["epoch"] * STEPS_PER_EPOCH
        assert row["train_loss"] > 0 and row["epoch_time_s"] > 0
        assert set(row["val"]) == {
            *("f1", "score_threshold", "precision", "recall", "best_f1", "ap", "ap50", "ap75"),
            "size_buckets",
        }
        assert set(row["val"]["size_buckets"]) == {"small", "medium", "large"}


def test_train_summary_records_device_precision_times_memory_and_the_best_epoch(
    trained: Trainer,
) -> None:
    summary = json.loads(trained.paths["train_summary"].read_text())
    assert summary == json.loads(json.dumps(trained.summary))  # fit() returns what it writes
    assert summary["requested_device"] == "cpu"
    assert summary["device"] == "cpu" and summary["backend"] == "cpu"
    assert summary["device_description"] == "CPU"
    assert summary["amp"] is False and summary["precision"] == "fp32"
    assert summary["model"] == "tiny_conv" and summary["parameters"] > 0
    assert summary["class_names"] == ["circle", "square", "triangle", "cross"]
    assert summary["epochs"] == EPOCHS and summary["steps"] == EPOCHS * STEPS_PER_EPOCH
    assert summary["batch_size"] == 8
    assert len(summary["epoch_times_s"]) == EPOCHS and min(summary["epoch_times_s"]) > 0
    assert summary["train_time_s"] == pytest.approx(sum(summary["epoch_times_s"]))
    assert summary["wall_time_s"] >= summary["train_time_s"]
    assert summary["median_step_time_s"] > 0 and summary["images_per_s"] > 0
    assert summary["peak_memory"] == {
        "peak_mb": 0.0,
        "reserved_mb": 0.0,
        "exact": True,
        "label": "n/a (CPU: see host RSS)",
    }
    assert summary["host_peak_rss_mb"] > 0
    assert summary["monitor"] == "f1"
    assert summary["best_epoch"] in range(1, EPOCHS + 1)
    epochs = [row for row in read_rows(trained.paths["metrics"]) if row["type"] == "epoch"]
    assert summary["best_metric"] == max(row["val"]["f1"] for row in epochs)
    assert summary["final_val"] == epochs[-1]["val"]
    assert summary["paths"] == {key: str(path) for key, path in trained.paths.items()}


def test_checkpoints_load_with_weights_only_and_hold_the_whole_training_state(
    trained: Trainer, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict[str, Any]] = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    last = checkpoint.load(trained.paths["last"])
    best = checkpoint.load(trained.paths["best"])
    assert calls and all(kwargs.get("weights_only") is True for kwargs in calls)
    for key in ("model", "optimizer", "scheduler", "scaler", "epoch", "global_step"):
        assert key in last, key
    assert {"best_metric", "config", "rng", "class_names", "precision"} <= set(last)
    assert last["format"] == checkpoint.FORMAT
    assert last["epoch"] == EPOCHS and last["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert last["config"] == trained.config
    assert set(last["rng"]) == {"torch", "cuda", "numpy", "python"}
    assert last["scheduler"]["last_epoch"] == EPOCHS * STEPS_PER_EPOCH
    assert last["optimizer"]["state"]  # AdamW moments, not a fresh optimizer
    model = trained.model.state_dict()
    assert set(last["model"]) == set(model)
    assert all(torch.equal(last["model"][key], model[key]) for key in model)
    assert best["epoch"] == trained.best_epoch == best["best_epoch"]
    assert best["best_metric"] == trained.summary["best_metric"]


# --- resume ----------------------------------------------------------------------------------


def test_resumed_run_ends_bit_identical_to_an_uninterrupted_one(
    trained: Trainer, config: dict[str, Any], tmp_path: Path
) -> None:
    run_dir = tmp_path / "interrupted"
    with pytest.raises(KeyboardInterrupt):
        InterruptedInEpoch2(config, run_dir).fit()
    assert checkpoint.load(run_dir / "last.pth")["epoch"] == 1
    assert read_rows(run_dir / "metrics.jsonl")[-1]["epoch"] == 2  # the row the kill left

    resumed = Trainer(config, run_dir)
    assert resumed.resume(required=True) is True
    assert (resumed.epoch, resumed.global_step) == (1, STEPS_PER_EPOCH)
    summary = resumed.fit()

    expected, got = trained.model.state_dict(), resumed.model.state_dict()
    assert set(got) == set(expected)
    different = [key for key in expected if not torch.equal(got[key], expected[key])]
    assert different == []
    assert without_measurements(read_rows(run_dir / "metrics.jsonl")) == without_measurements(
        read_rows(trained.paths["metrics"])
    )
    assert summary["epochs"] == EPOCHS and summary["steps"] == EPOCHS * STEPS_PER_EPOCH
    assert summary["best_epoch"] == trained.summary["best_epoch"]
    assert summary["final_val"] == trained.summary["final_val"]
    assert len(summary["epoch_times_s"]) == EPOCHS  # epoch 1 comes from the kept rows
    optimizer = checkpoint.load(run_dir / "last.pth")["optimizer"]["state"]
    reference = checkpoint.load(trained.paths["last"])["optimizer"]["state"]
    assert all(
        torch.equal(optimizer[i][name], reference[i][name])
        for i in reference
        for name in reference[i]
    )


def test_one_seed_trains_one_model_whether_cached_loaded_by_workers_or_deterministic(
    data_root: Path, tmp_path: Path
) -> None:
    """data.cache and data.num_workers decide how fast samples come, and deterministic=true
    on a CPU only forbids kernels a CPU does not use: none of them may change the weights,
    with scale jitter and colour distortion (torch's RNG) as well as flips (numpy's)."""
    settings = (
        f"train.epochs={EPOCHS}",
        "seed=3",
        "data.augment.scale_min=0.5",
        "data.augment.scale_max=1.5",
        "data.augment.photometric=0.5",
    )
    variants = {
        "cached, in this process": ("data.cache=true", "data.num_workers=0", "deterministic=false"),
        "decoded by 2 workers": ("data.cache=false", "data.num_workers=2", "deterministic=false"),
        "cached, deterministic": ("data.cache=true", "data.num_workers=0", "deterministic=true"),
    }
    weights, losses = {}, {}
    for name, variant in variants.items():
        trainer = Trainer(
            tiny_config(data_root, *settings, *variant), tmp_path / name.replace(" ", "")
        )
        trainer.fit()
        weights[name] = trainer.model.state_dict()
        losses[name] = [row["loss"] for row in read_rows(trainer.paths["metrics"]) if "loss" in row]
    reference = next(iter(variants))
    assert len(losses[reference]) == EPOCHS * STEPS_PER_EPOCH
    for name in variants:
        assert losses[name] == losses[reference], name
        different = [
            k
            for k in weights[reference]
            if not torch.equal(weights[name][k], weights[reference][k])
        ]
        assert different == [], name


def test_a_resume_without_deterministic_kernels_ends_bit_identical_on_a_cpu(
    data_root: Path, tmp_path: Path
) -> None:
    """The shipped deterministic=false: on a CPU a resumed run still sees the batches and
    takes the steps an uninterrupted one does, scale jitter and colour distortion included."""
    config = tiny_config(
        data_root,
        f"train.epochs={EPOCHS}",
        "deterministic=false",
        "data.augment.scale_min=0.5",
        "data.augment.scale_max=1.5",
        "data.augment.photometric=0.5",
    )
    uninterrupted = Trainer(config, tmp_path / "uninterrupted")
    uninterrupted.fit()
    with pytest.raises(KeyboardInterrupt):
        InterruptedInEpoch2(config, tmp_path / "interrupted").fit()
    resumed = Trainer(config, tmp_path / "interrupted")
    assert resumed.resume(required=True) is True
    resumed.fit()
    expected, got = uninterrupted.model.state_dict(), resumed.model.state_dict()
    assert [key for key in expected if not torch.equal(got[key], expected[key])] == []
    assert without_measurements(read_rows(resumed.paths["metrics"])) == without_measurements(
        read_rows(uninterrupted.paths["metrics"])
    )


# --- time budget ------------------------------------------------------------------------------


def test_a_time_budget_that_fits_every_epoch_changes_nothing(
    trained: Trainer, data_root: Path, tmp_path: Path
) -> None:
    config = tiny_config(data_root, f"train.epochs={EPOCHS}", "train.time_budget_s=100000")
    summary = Trainer(config, tmp_path / "budget").fit()
    assert summary["epochs"] == EPOCHS and summary["time_budget_s"] == 100000
    assert summary["final_val"] == trained.summary["final_val"]


def fake_timing(epochs_s: list[float], validation_s: float):
    """A `Trainer._budget_timing` whose epoch `k` "took" `epochs_s[k - 1]` seconds and each
    validation `validation_s` (timed ones would make the tests depend on the machine)."""

    def timing(self: Trainer) -> BudgetTiming:
        taken = epochs_s[: self.epoch]
        validations = len(self.timings["validations_s"])
        return BudgetTiming(
            used_s=sum(taken) + validations * validation_s,
            epoch_s=statistics.median(taken),
            validation_s=validation_s,
        )

    return timing


def epoch_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [row for row in read_rows(run_dir / "metrics.jsonl") if row["type"] == "epoch"]


def test_a_time_budget_plans_the_steps_that_fit_and_the_schedule_ends_at_zero_in_them(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pipeline_log
) -> None:
    """Epochs of 2 steps and 10 s in a 25-s budget: after the first, 15 s are left for 3 more
    steps, so the third epoch stops after its first step, and the cosine ends there."""
    config = tiny_config(data_root, f"train.epochs={EPOCHS}", "train.time_budget_s=25")
    monkeypatch.setattr(Trainer, "_budget_timing", fake_timing([10.0] * EPOCHS, 0.0))
    run_dir = tmp_path / "budget"
    summary = Trainer(config, run_dir).fit()
    assert (summary["epochs"], summary["steps"]) == (3, 5)
    rows = epoch_rows(run_dir)
    assert [row["epoch"] for row in rows] == [1, 2, 3]
    assert rows[-1]["lr"] == pytest.approx(0.0, abs=1e-12)  # the cosine spans the 5 steps
    assert rows[-2]["lr"] > 0 and rows[-1]["val"] is not None
    assert "so 2.5 of at most 3 epochs fit (5 steps)" in pipeline_log.text
    # the plan is part of the run: a resume keeps it (here: the run is finished)
    state = checkpoint.load(run_dir / "last.pth")
    assert state["planned_steps"] == 5 and len(state["timings"]["epochs_s"]) == 3
    assert Trainer(config, run_dir).resume(required=False) is False


def test_a_time_budget_plans_again_after_every_epoch(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pipeline_log
) -> None:
    """Epochs of 2 steps. A slow first epoch (16 s) plans 2.5 epochs into 44 s; after the second
    (8 s) the median epoch is 12 s, 24 s are used, and 20 s make 3 more steps of 6 s: 3.5
    epochs; after the third, 8-s epochs fit all 4, and the cosine stretches to end in it. The
    log names the plans that moved by a whole epoch, not the last half-epoch step."""
    config = tiny_config(data_root, "train.epochs=4", "train.time_budget_s=44")
    monkeypatch.setattr(Trainer, "_budget_timing", fake_timing([16.0, 8.0, 8.0, 8.0], 0.0))
    run_dir = tmp_path / "budget"
    summary = Trainer(config, run_dir).fit()
    assert "so 2.5 of at most 4 epochs fit (5 steps)" in pipeline_log.text
    assert "24 s used after epoch 2" in pipeline_log.text
    assert "so 3.5 of at most 4 epochs fit (7 steps)" in pipeline_log.text
    assert "epochs fit (8 steps)" not in pipeline_log.text
    assert pipeline_log.text.count("time budget 44 s:") == 2
    assert (summary["epochs"], summary["steps"]) == (4, 8)
    rows = epoch_rows(run_dir)
    assert rows[-2]["lr"] > 0 and rows[-1]["lr"] == pytest.approx(0.0, abs=1e-12)


def test_a_resumed_budgeted_run_keeps_its_plan_and_the_times_it_came_from(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tiny_config(data_root, f"train.epochs={EPOCHS}", "train.time_budget_s=25")
    monkeypatch.setattr(Trainer, "_budget_timing", fake_timing([10.0] * EPOCHS, 0.0))
    run_dir = tmp_path / "budget"
    with pytest.raises(KeyboardInterrupt):
        InterruptedInEpoch2(config, run_dir).fit()
    resumed = Trainer(config, run_dir)
    assert resumed.resume(required=True) is True
    assert resumed.planned_steps == 5 and len(resumed.timings["epochs_s"]) == 1
    summary = resumed.fit()
    assert (summary["epochs"], summary["steps"]) == (3, 5)  # as the uninterrupted run above


def test_a_budgeted_run_that_trained_its_planned_last_epoch_ends_with_time_left(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20 s, then 4-s epochs, in 40 s: after epoch 1 two epochs fit; after epoch 2 a third
    would (24 s used), but the learning rate has annealed to zero, and the run does not
    warm it up again."""
    config = tiny_config(data_root, f"train.epochs={EPOCHS}", "train.time_budget_s=40")
    monkeypatch.setattr(Trainer, "_budget_timing", fake_timing([20.0, 4.0, 4.0], 0.0))
    assert Trainer(config, tmp_path / "budget").fit()["epochs"] == 2


@pytest.mark.parametrize(("validation_s", "steps"), [(0.0, 6), (2.0, 4)])
def test_a_time_budget_counts_the_validations_the_planned_epochs_run(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, validation_s, steps
) -> None:
    """8-s epochs of two 4-s steps in a 25-s budget, validating after every epoch: without
    validation time all 3 epochs fit (24 s); at 2 s a validation, one step of the third epoch
    and its validation would end at 26 s, so the run stops after the second (20 s)."""
    config = tiny_config(
        data_root, f"train.epochs={EPOCHS}", "train.time_budget_s=25", "train.val_interval=1"
    )
    monkeypatch.setattr(Trainer, "_budget_timing", fake_timing([8.0] * EPOCHS, validation_s))
    summary = Trainer(config, tmp_path / "budget").fit()
    assert summary["steps"] == steps


def every_second_and_the_last(epoch: int, last_epoch: int) -> bool:
    return epoch % 2 == 0 or epoch == last_epoch


@pytest.mark.parametrize(
    ("used_s", "done_steps", "validated", "most_epochs", "expected"),
    [
        # 10-s epochs of 10 steps, 1-s validations (after epochs 2, 4, ... and the last), 100 s:
        # 95 steps (9.5 epochs) and 5 validations (2, 4, 6, 8 and the last, 10) make 100 s
        (0.0, 0, True, 100, 95),
        # 5 s left after epoch 4: 3 steps and 2 validations (4, 5), or 4 steps if 4 validated
        (95.0, 40, False, 100, 43),
        (95.0, 40, True, 100, 44),
        (15.0, 10, True, 3, 30),  # room for more, but train.epochs caps the plan
        (500.0, 70, True, 100, 70),  # over budget already: never fewer steps than trained
    ],
)
def test_steps_within_budget_counts_what_is_left(
    used_s, done_steps, validated, most_epochs, expected
) -> None:
    timing = BudgetTiming(used_s=used_s, epoch_s=10.0, validation_s=1.0)
    fitting = steps_within_budget(
        timing,
        budget_s=100.0,
        done_steps=done_steps,
        steps_per_epoch=10,
        validated=validated,
        most_epochs=most_epochs,
        validates=every_second_and_the_last,
    )
    assert fitting == expected


def test_a_first_epoch_longer_than_the_budget_stops_after_it_validated(
    data_root: Path, tmp_path: Path, pipeline_log
) -> None:
    config = tiny_config(
        data_root, f"train.epochs={EPOCHS}", "train.time_budget_s=0.000001", "train.val_interval=5"
    )
    run_dir = tmp_path / "budget"
    summary = Trainer(config, run_dir).fit()
    assert summary["epochs"] == 1 and summary["final_val"] is not None
    assert "the first epoch alone took longer than train.time_budget_s" in pipeline_log.text


def test_resume_of_a_gpu_run_reads_the_checkpoint_onto_the_cpu(
    trained: Trainer, config: dict[str, Any], tmp_path: Path, fake_cuda
) -> None:
    """RNG states must stay CPU tensors: mapped onto the GPU, torch.set_rng_state raises
    'RNG state must be a torch.ByteTensor'. Model and optimizer copy their tensors over."""
    trainer = Trainer(config, copy_of_last(trained, tmp_path / "run"))
    trainer.device = torch.device("cuda", 0)  # a simulated GPU run: tensors cannot go there
    torch.manual_seed(12345)
    assert trainer.resume(required=True) is True
    state = checkpoint.load(trained.paths["last"])
    assert torch.equal(torch.get_rng_state(), state["rng"]["torch"])
    assert trainer.epoch == EPOCHS


def test_rng_state_round_trips_torch_numpy_and_python_streams(tmp_path: Path) -> None:
    state = {"model": {}, "config": {}, "class_names": [], "epoch": 0}
    path = checkpoint.save(tmp_path / "rng.pth", {**state, "rng": checkpoint.rng_state()})
    expected = (torch.rand(3), np.random.rand(3), random.random())
    checkpoint.restore_rng_state(checkpoint.load(path)["rng"])
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(again[0], expected[0])
    assert np.array_equal(again[1], expected[1])
    assert again[2] == expected[2]


def test_resume_required_without_a_checkpoint_says_it_does_not_exist(
    config: dict[str, Any], tmp_path: Path
) -> None:
    trainer = Trainer(config, tmp_path / "empty")
    with pytest.raises(CheckpointError, match=r"Cannot resume: .*last\.pth does not exist"):
        trainer.resume(required=True)
    assert trainer.resume(required=False) is False


@pytest.mark.parametrize(
    "setting",
    [
        "train.lr=0.001",
        "seed=1",
        "model.width=16",
        "data.augment.hflip=0.0",
        "precision=fp32",  # fp32 either way on this CPU, but a GPU would train auto in fp16
        "eval.score_threshold=0.5",  # validation picks best.pth by F1 at this threshold
        "eval.iou_threshold=0.6",
        "eval.max_detections=10",
    ],
)
def test_resume_required_with_other_settings_names_the_differing_key(
    trained: Trainer, data_root: Path, tmp_path: Path, setting: str
) -> None:
    run_dir = copy_of_last(trained, tmp_path / "run")
    trainer = Trainer(tiny_config(data_root, f"train.epochs={EPOCHS}", setting), run_dir)
    with pytest.raises(CheckpointError) as caught:
        trainer.resume(required=True)
    key = setting.partition("=")[0]
    assert f"different settings ({key})" in str(caught.value)
    assert "another --out folder" in str(caught.value)


@pytest.mark.parametrize(
    "setting",
    ["eval.batch_size=3", "data.num_workers=1", "data.cache=false", "data.cache_budget=0.1"],
)
def test_resume_goes_on_when_only_settings_of_speed_differ(
    trained: Trainer, data_root: Path, tmp_path: Path, setting: str
) -> None:
    run_dir = copy_of_last(trained, tmp_path / "run")
    trainer = Trainer(tiny_config(data_root, f"train.epochs={EPOCHS}", setting), run_dir)
    assert trainer.resume(required=True) is True


def test_resume_with_another_training_precision_names_both(
    trained: Trainer, config: dict[str, Any], tmp_path: Path
) -> None:
    """Same config, another device: precision=auto trains fp32 on a CPU, fp16 on a GPU."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    state = checkpoint.load(trained.paths["last"])
    checkpoint.save(run_dir / "last.pth", {**state, "precision": "fp16"})
    with pytest.raises(CheckpointError, match=r"different settings \(precision fp16, now fp32\)"):
        Trainer(config, run_dir).resume(required=True)


def test_the_eval_settings_training_reads_are_result_or_speed_settings(
    config: dict[str, Any], tmp_path: Path
) -> None:
    """result_settings lists the eval keys validation reads: a new one must join the list."""

    class Recording(dict):
        read: ClassVar[set[str]] = set()

        def __getitem__(self, key: str) -> Any:
            Recording.read.add(key)
            return super().__getitem__(key)

    Trainer({**config, "eval": Recording(config["eval"])}, tmp_path / "run")
    assert set(VALIDATION_EVAL_KEYS) <= Recording.read
    assert Recording.read <= set(VALIDATION_EVAL_KEYS) | set(SPEED_SETTINGS["eval"])


def test_resume_writes_best_pth_again_from_last_pth(trained: Trainer, tmp_path: Path) -> None:
    """Snakemake deletes a job's declared outputs, best.pth among them, before it reruns the
    job, also when training then resumes from last.pth."""
    run_dir = copy_of_last(trained, tmp_path / "run")
    assert not (run_dir / "best.pth").exists()
    assert Trainer(trained.config, run_dir).resume(required=True) is True
    got, expected = checkpoint.load(run_dir / "best.pth"), checkpoint.load(trained.paths["best"])
    assert got["epoch"] == expected["epoch"] == trained.best_epoch
    assert set(got["model"]) == set(expected["model"])
    assert all(torch.equal(got["model"][key], expected["model"][key]) for key in expected["model"])


def test_resume_auto_with_other_settings_warns_and_starts_fresh(
    trained: Trainer, data_root: Path, tmp_path: Path, pipeline_log: pytest.LogCaptureFixture
) -> None:
    run_dir = copy_of_last(trained, tmp_path / "run")
    trainer = Trainer(tiny_config(data_root, f"train.epochs={EPOCHS}", "train.lr=0.001"), run_dir)
    fresh = {key: value.clone() for key, value in trainer.model.state_dict().items()}
    assert trainer.resume(required=False) is False
    assert (trainer.epoch, trainer.global_step, trainer.best_epoch) == (0, 0, None)
    assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in fresh.items())
    warnings = [r.getMessage() for r in pipeline_log.records if r.levelno == logging.WARNING]
    assert any("different settings (train.lr)" in m and "starting a new run" in m for m in warnings)


def test_resume_auto_of_an_earlier_models_weights_warns_and_starts_fresh(
    trained: Trainer, tmp_path: Path, pipeline_log: pytest.LogCaptureFixture
) -> None:
    """An interrupted run of an earlier version (one box per cell: 4 box channels) meets the
    per-class box head: it cannot continue, and nothing of it may leak into the new run."""
    run_dir = copy_of_last(trained, tmp_path / "run")
    state = checkpoint.load(run_dir / "last.pth")
    state["global_step"] = 1  # interrupted, so not a finished run trained again
    for key in ("box_head.1.weight", "box_head.1.bias"):
        state["model"][key] = state["model"][key][:4].clone()
    checkpoint.save(run_dir / "last.pth", state)
    trainer = Trainer(trained.config, run_dir)
    fresh = {key: value.clone() for key, value in trainer.model.state_dict().items()}
    assert trainer.resume(required=False) is False
    assert (trainer.epoch, trainer.global_step, trainer.best_epoch) == (0, 0, None)
    assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in fresh.items())
    warnings = [r.getMessage() for r in pipeline_log.records if r.levelno == logging.WARNING]
    assert any("weights of another architecture" in m for m in warnings), warnings
    with pytest.raises(CheckpointError, match="does not fit model 'tiny_conv'"):
        Trainer(trained.config, run_dir).resume(required=True)


# --- failures --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "raised"),
    [(OSError(errno.ENOSPC, "No space left on device"), OutputError), (KeyboardInterrupt(), None)],
)
def test_a_save_that_fails_half_way_keeps_the_previous_checkpoint_and_no_temp_file(
    trained: Trainer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    error: BaseException,
    raised: type[BaseException] | None,
) -> None:
    run_dir = copy_of_last(trained, tmp_path / "run")
    before = (run_dir / "last.pth").read_bytes()
    real_save = torch.save

    def half_then_fail(obj, handle, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        handle.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        raise error

    monkeypatch.setattr(torch, "save", half_then_fail)
    state = checkpoint.load(run_dir / "last.pth")
    with pytest.raises(raised or type(error)):
        checkpoint.save(run_dir / "last.pth", {**state, "epoch": 99})
    assert (run_dir / "last.pth").read_bytes() == before
    assert checkpoint.load(run_dir / "last.pth")["epoch"] == EPOCHS
    assert sorted(path.name for path in run_dir.iterdir()) == ["last.pth"]


def nan_losses(monkeypatch: pytest.MonkeyPatch, bad_calls: set[int] | None = None) -> list[int]:
    """Make DetectionLoss return NaN (on the given 1-based calls, or always); returns the call count."""
    real_forward = DetectionLoss.forward
    calls: list[int] = []

    def forward(self, outputs, targets):
        losses = real_forward(self, outputs, targets)
        calls.append(1)
        if bad_calls is None or len(calls) in bad_calls:
            losses["total"] = losses["total"] * math.nan
        return losses

    monkeypatch.setattr(DetectionLoss, "forward", forward)
    return calls


def test_a_loss_that_stays_non_finite_stops_training_naming_train_lr(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nan_losses(monkeypatch)
    trainer = Trainer(tiny_config(data_root, "train.max_nonfinite_steps=2"), tmp_path / "run")
    before = {name: value.clone() for name, value in trainer.model.named_parameters()}
    with pytest.raises(TrainingError) as caught:
        trainer.fit()
    message = str(caught.value)
    assert "the loss was not finite for 2 consecutive steps" in message
    assert "train.lr (now 0.006)" in message
    assert "not written yet" in message
    assert not (tmp_path / "run" / "last.pth").exists()
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(after[name], before[name]) for name in before)  # no update was made


def test_a_single_non_finite_step_is_skipped_and_training_goes_on(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = nan_losses(monkeypatch, bad_calls={1})
    trainer = Trainer(
        tiny_config(data_root, "train.epochs=1", "train.max_nonfinite_steps=2"), tmp_path / "run"
    )
    summary = trainer.fit()
    assert len(calls) == STEPS_PER_EPOCH and summary["steps"] == STEPS_PER_EPOCH
    steps = [row for row in read_rows(trainer.paths["metrics"]) if row["type"] == "step"]
    assert [row["step"] for row in steps] == [2]  # the NaN step wrote no row
    assert math.isfinite(steps[0]["loss"])


def test_fp16_on_a_cpu_without_native_fp16_warns_and_trains_in_fp32(
    data_root: Path,
    tmp_path: Path,
    pipeline_log: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(dev.HIDE_CPU_NATIVE_ENV, "fp16")  # whatever this CPU has
    trainer = Trainer(tiny_config(data_root, "precision=fp16", "train.epochs=1"), tmp_path / "run")
    warnings = [r.getMessage() for r in pipeline_log.records if r.levelno == logging.WARNING]
    assert any("AMP was asked for" in m and "training in fp32" in m for m in warnings), warnings
    assert trainer.amp is False and trainer.precision == "fp32"
    assert trainer.scaler.is_enabled() is False
    summary = trainer.fit()
    assert summary["amp"] is False and summary["precision"] == "fp32"
    assert checkpoint.load(trainer.paths["last"])["precision"] == "fp32"


# --- checkpoint.load and check_compatible ----------------------------------------------------


class CustomObject:
    """Not a tensor or a container of them: weights_only loading must refuse it."""


class RunsCode:
    """Unpickling this calls os.system: it would create the file `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def test_loading_a_missing_checkpoint_says_it_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"missing\.pth does not exist"):
        checkpoint.load(tmp_path / "missing.pth")


def test_a_checkpoint_that_cannot_be_read_says_why(
    trained: Trainer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(checkpoint, "open", denied, raising=False)
    with pytest.raises(CheckpointError, match=r"last\.pth cannot be read: Permission denied\.$"):
        checkpoint.load(trained.paths["last"])


def test_loading_a_folder_says_it_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="is a directory"):
        checkpoint.load(tmp_path)


@pytest.mark.parametrize(
    ("keep", "said"),
    [
        (0.5, r"cut\.pth is damaged: .* its end is missing .* cut short"),
        (0.01, r"cut\.pth is damaged: .* its end is missing .* cut short"),
        (0.0, r"cut\.pth is empty \(0 bytes\)"),
    ],
)
def test_loading_a_truncated_checkpoint_says_it_is_cut_short_or_empty(
    trained: Trainer, tmp_path: Path, keep: float, said: str
) -> None:
    data = trained.paths["last"].read_bytes()
    path = tmp_path / "cut.pth"
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match=said):
        checkpoint.load(path)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize(
    "write",
    [
        lambda path, evil: path.write_bytes(pickle.dumps(evil)),
        lambda path, evil: path.write_bytes(pickle.dumps(evil, protocol=2)),
        lambda path, evil: torch.save({"format": checkpoint.FORMAT, "x": evil}, path),
        lambda path, evil: torch.save({"format": checkpoint.FORMAT, "x": CustomObject()}, path),
    ],
    ids=["raw-pickle", "raw-pickle-protocol-2", "torch-save-reduce", "torch-save-custom-class"],
)
def test_a_pickle_that_would_run_code_is_refused_by_weights_only(tmp_path: Path, write) -> None:
    marker = tmp_path / "code-ran"
    path = tmp_path / "evil.pth"
    write(path, RunsCode(marker))
    with pytest.raises(CheckpointError) as caught:
        checkpoint.load(path)
    message = str(caught.value)
    assert "evil.pth was refused" in message and "weights_only=True" in message
    assert not marker.exists()


def test_a_torch_file_without_the_format_tag_is_not_a_pipeline_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "plain.pth"
    torch.save({"model": {"w": torch.zeros(2)}}, path)
    with pytest.raises(CheckpointError, match="was not written by this pipeline"):
        checkpoint.load(path)


@pytest.mark.parametrize(
    ("wanted", "named"),
    [
        ({"model_name": "resnet18"}, "model 'tiny_conv' (expected 'resnet18')"),
        ({"num_classes": 2}, "number of classes 4 (expected 2)"),
        ({"label_mode": "multilabel"}, "label mode 'single' (expected 'multilabel')"),
    ],
)
def test_check_compatible_names_what_differs(
    trained: Trainer, wanted: dict[str, Any], named: str
) -> None:
    state = checkpoint.load(trained.paths["last"])
    fits = {"model_name": "tiny_conv", "num_classes": 4, "label_mode": "single"}
    checkpoint.check_compatible(state, "x.pth", **fits)  # the matching case passes
    with pytest.raises(CheckpointError) as caught:
        checkpoint.check_compatible(state, "x.pth", **{**fits, **wanted})
    assert str(caught.value) == f"Checkpoint x.pth does not fit: it holds {named}."


def test_restore_model_gives_the_trained_weights_in_eval_mode(trained: Trainer) -> None:
    state = checkpoint.load(trained.paths["last"])
    model = checkpoint.restore_model(state, torch.device("cpu"), torch.contiguous_format)
    assert model.training is False
    expected = trained.model.state_dict()
    assert all(torch.equal(value, expected[key]) for key, value in model.state_dict().items())


# --- the command -----------------------------------------------------------------------------


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_pipeline_logger) -> Path:
    """Run commands outside the repository, so its config/config.yaml is not picked up."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_train_command_trains_into_out(data_root: Path, elsewhere: Path) -> None:
    out = elsewhere / "cli-run"
    settings = tiny_settings(data_root, "train.epochs=1")
    assert cli.main(["train", "--cpu-threads", "1", "--out", str(out), *settings]) == 0
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["epochs"] == 1 and summary["requested_device"] == "cpu"
    assert checkpoint.load(out / "last.pth")["epoch"] == 1
    assert not (elsewhere / "results").exists()  # --out wins over the default folder


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train.epochs=0"], "train.epochs"),
        (["train.nonsense=1"], "Unknown config key train.nonsense"),
        (["--amp", "maybe"], "--amp maybe was replaced by --precision"),
        (["--device", "tpu"], "tpu"),
    ],
)
def test_train_command_with_a_bad_setting_exits_2_without_traceback(
    data_root: Path, elsewhere: Path, capsys: pytest.CaptureFixture, args: list[str], message: str
) -> None:
    out = elsewhere / "bad"
    argv = ["train", "--cpu-threads", "1", "--out", str(out), f"data.root={data_root}", *args]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
    assert not (out / "last.pth").exists()


def test_train_command_resume_without_a_checkpoint_exits_2(
    data_root: Path, elsewhere: Path, capsys: pytest.CaptureFixture
) -> None:
    settings = tiny_settings(data_root)
    argv = ["train", "--cpu-threads", "1", "--out", str(elsewhere / "new"), "--resume"]
    assert cli.main([*argv, *settings]) == 2
    assert "Cannot resume" in capsys.readouterr().err
