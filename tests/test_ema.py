"""train.ema: the weight average, what is validated and saved with it, and resuming it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_runs import InterruptedInEpoch2, make_data, tiny_config
from torch import nn

from pipeline.engine import checkpoint
from pipeline.engine.ema import WeightAverage, decay_at
from pipeline.engine.trainer import Trainer

pytestmark = pytest.mark.usefixtures("torch_flags_threads_and_logger")

EPOCHS = 3


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    data_root = make_data(tmp_path_factory.mktemp("data") / "shapes")
    # validating only the last epoch makes it the best: best.pth then holds the final average
    return tiny_config(
        data_root, f"train.epochs={EPOCHS}", "train.ema=true", f"train.val_interval={EPOCHS}"
    )


@pytest.fixture(scope="module")
def trained(config: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Trainer:
    trainer = Trainer(config, tmp_path_factory.mktemp("run") / "ema")
    trainer.fit()
    return trainer


def equal_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """The keys whose tensors differ (or are missing)."""
    return [key for key in expected if key not in got or not torch.equal(got[key], expected[key])]


def test_the_average_horizon_grows_as_steps_to_the_three_quarters() -> None:
    for updates in (1, 10, 100, 2000, 100_000):
        assert 1 / (1 - decay_at(updates)) == pytest.approx((1 + updates) ** 0.75)
    assert 250 < 1 / (1 - decay_at(2000)) < 350  # the figure the train.ema schema description names


def test_an_update_moves_the_average_by_the_step_weight_and_copies_integer_buffers() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2))
    average = WeightAverage(model)
    assert average.module.training is False
    assert not any(p.requires_grad for p in average.module.parameters())
    before = {key: value.clone() for key, value in average.module.state_dict().items()}
    with torch.no_grad():
        model[0].weight.add_(1.0)
        model[1].running_mean.add_(2.0)
        model[1].num_batches_tracked.add_(5)
    trained = {key: value.clone() for key, value in model.state_dict().items()}
    average.update()
    weight = 1 - decay_at(1)
    got = average.module.state_dict()
    assert torch.allclose(got["0.weight"], before["0.weight"] + weight * 1.0)
    assert torch.allclose(got["1.running_mean"], before["1.running_mean"] + weight * 2.0)
    assert int(got["1.num_batches_tracked"]) == 5
    assert equal_weights(model.state_dict(), trained) == []  # the model is left alone
    assert average.updates == 1


def test_validation_and_both_checkpoints_hold_the_average_and_last_pth_the_trained_weights(
    trained: Trainer,
) -> None:
    averaged = trained.weight_average.module.state_dict()
    raw = trained.model.state_dict()
    assert equal_weights(averaged, raw) != []  # the two differ after training
    last = checkpoint.load(trained.paths["last"])
    assert equal_weights(last["model"], averaged) == []
    assert equal_weights(last["training_model"], raw) == []
    assert last["ema_updates"] == trained.global_step
    best = checkpoint.load(trained.paths["best"])
    assert trained.best_epoch == EPOCHS
    assert equal_weights(best["model"], averaged) == []
    restored = checkpoint.restore_model(last, torch.device("cpu"), torch.contiguous_format)
    assert equal_weights(restored.state_dict(), averaged) == []


def test_without_ema_last_pth_keeps_no_second_copy(config: dict[str, Any], tmp_path: Path) -> None:
    plain = dict(config, train=dict(config["train"], ema=False, epochs=1))
    trainer = Trainer(plain, tmp_path / "plain")
    trainer.fit()
    assert trainer.weight_average is None
    last = checkpoint.load(trainer.paths["last"])
    assert last["training_model"] is None and last["ema_updates"] is None
    assert equal_weights(last["model"], trainer.model.state_dict()) == []


def test_a_resumed_run_ends_with_the_average_and_weights_of_an_uninterrupted_one(
    trained: Trainer, config: dict[str, Any], tmp_path: Path
) -> None:
    run_dir = tmp_path / "interrupted"
    with pytest.raises(KeyboardInterrupt):
        InterruptedInEpoch2(config, run_dir).fit()
    resumed = Trainer(config, run_dir)
    assert resumed.resume(required=True) is True
    assert resumed.weight_average.updates == resumed.global_step
    summary = resumed.fit()
    assert summary["ema"] is True
    assert equal_weights(resumed.model.state_dict(), trained.model.state_dict()) == []
    assert (
        equal_weights(
            resumed.weight_average.module.state_dict(), trained.weight_average.module.state_dict()
        )
        == []
    )
