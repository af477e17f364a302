"""The training step and the loop around it never wait for the device between log steps.

On CUDA and MPS every read of a device value (`.item()`, `.tolist()`, `bool(tensor)`, a
synchronize) makes the host wait until the queued work is done, so the next step cannot be
queued meanwhile. Here every such call is counted, on the CPU, where the same code runs.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from tiny_runs import SPEC, tiny_config

from pipeline import device as dev
from pipeline.data.synthetic import generate
from pipeline.engine.step import TrainStep, build_optimizer
from pipeline.engine.trainer import Trainer
from pipeline.models import build_model
from pipeline.models import loss as loss_module
from pipeline.models.loss import DetectionLoss

pytestmark = pytest.mark.usefixtures("torch_flags_threads_and_logger")

# Python-level ways to read a tensor's value onto the host: each one is a synchronisation.
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")


class Reads(list):
    """Names of the reads seen, in order; none is recorded while `paused`."""

    paused = False


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Reads:
    """Every read of a tensor value and every device synchronisation, in order."""
    calls = Reads()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            if not calls.paused:
                calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    synchronize = dev.synchronize
    monkeypatch.setattr(
        dev, "synchronize", lambda device: (calls.append("synchronize"), synchronize(device))
    )
    # the loss's target plan is host work on the loader's host tensors (numpy views of them
    # included), which is no read of the device: see `pipeline.models.targets`
    plan_targets = loss_module.plan_targets

    def host_plan(*args, **kwargs):
        paused, calls.paused = calls.paused, True
        try:
            return plan_targets(*args, **kwargs)
        finally:
            calls.paused = paused

    monkeypatch.setattr(loss_module, "plan_targets", host_plan)
    return calls


def tiny_step(precision: str, fused: bool) -> tuple[TrainStep, torch.Tensor, list[dict]]:
    torch.manual_seed(0)
    model = build_model("tiny_conv", 2, "single", width=8)
    train = {"optimizer": "adamw", "lr": 1e-3, "weight_decay": 1e-4}
    optimizer = (
        build_optimizer(model.parameters(), train)
        if fused
        else torch.optim.AdamW(model.parameters(), lr=1e-3)
    )
    step = TrainStep(
        model,
        DetectionLoss.for_model(model),
        optimizer,
        torch.device("cpu"),
        precision,
        grad_clip=10.0,
        memory_format=torch.contiguous_format,
    )
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    targets = [
        {"boxes": torch.tensor([[4.0, 4.0, 20.0, 18.0]]), "labels": torch.tensor([1])},
        {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long)},
    ]
    return step, images, targets


@pytest.mark.parametrize("precision", ["fp32", "fp16"])  # fp16: through a GradScaler
def test_a_step_with_a_fused_optimizer_reads_nothing_from_the_device(
    host_reads: list[str], precision: str
) -> None:
    step, images, targets = tiny_step(precision, fused=True)
    assert step.skips_on_device
    step(images, targets)  # the first step creates the optimizer state
    host_reads.clear()
    for _ in range(3):
        result = step(images, targets)
    assert host_reads == []
    assert bool(result.finite)


def test_without_a_fused_optimizer_a_step_reads_the_device_once(host_reads: list[str]) -> None:
    step, images, targets = tiny_step("fp32", fused=False)
    assert not step.skips_on_device
    step(images, targets)
    host_reads.clear()
    step(images, targets)
    # the loss's finite flag; torch's own non-fused AdamW also reads its step counters, which
    # live on the host (capturable=False), so those are no device synchronisation
    assert host_reads.count("__bool__") == 1
    assert set(host_reads) <= {"__bool__", "item"}


def test_a_non_finite_loss_is_skipped_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    step, images, targets = tiny_step("fp32", fused=True)
    step(images, targets)
    before = {name: value.clone() for name, value in step.model.named_parameters()}
    forward = DetectionLoss.forward

    def nan_loss(self, outputs, targets):
        losses = forward(self, outputs, targets)
        return {**losses, "total": losses["total"] * float("nan")}

    monkeypatch.setattr(DetectionLoss, "forward", nan_loss)
    result = step(images, targets)
    assert not bool(result.finite)
    after = dict(step.model.named_parameters())
    assert all(torch.equal(after[name], before[name]) for name in before)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("step-data")
    generate(SPEC, root)
    return root


class HostLoader:
    """The trainer's loader, its batches made with `reads` paused: a loader without workers
    prepares host tensors in this process (numpy views of them included), which is no read
    of the device; with workers that happens in other processes, where nothing is counted."""

    def __init__(self, loader, reads: Reads) -> None:
        self.loader, self.sampler, self.reads = loader, loader.sampler, reads

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        batches = iter(self.loader)
        while True:
            self.reads.paused = True
            try:
                batch = next(batches, None)
            finally:
                self.reads.paused = False
            if batch is None:
                return
            yield batch


def test_the_trainer_reads_the_device_once_per_log_step_and_never_between(
    data_root: Path, tmp_path: Path, host_reads: Reads
) -> None:
    trainer = Trainer(
        tiny_config(data_root, "train.batch_size=2", "train.log_interval=4", "train.epochs=1"),
        tmp_path / "run",
    )
    trainer.run_dir.mkdir(parents=True)
    trainer.trackers = type("NoTrackers", (), {"log": lambda *args: None})()
    assert trainer.steps_per_epoch == 8 and trainer.step.skips_on_device
    marks: list[int] = []
    step = trainer.step

    def marked(images, targets):
        marks.append(len(host_reads))
        return step(images, targets)

    trainer.step = marked
    assert trainer.train_loader.num_workers == 0  # the batches are made in this process
    trainer.train_loader = HostLoader(trainer.train_loader, host_reads)
    trainer._train_epoch()
    marks.append(len(host_reads))
    per_step = [after - before for before, after in itertools.pairwise(marks)]
    assert per_step == [0, 0, 0, 1, 0, 0, 0, 1]  # log steps 4 and 8 (the epoch's end)


SGD = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}


# fp16: the GradScaler hands the skip to the fused kernel (unless clipping unscaled first)
@pytest.mark.parametrize(("precision", "grad_clip"), [("fp32", 10.0), ("fp16", None)])
def test_sgd_whose_first_step_is_skipped_trains_as_if_it_started_at_the_second(
    monkeypatch: pytest.MonkeyPatch, precision: str, grad_clip: float | None
) -> None:
    """Fused SGD creates its momentum buffers uninitialised on the first step: were that step
    skipped (a non-finite loss, fp16's first scale overflowing), the next would read garbage.
    Uninitialised memory is poisoned with NaN here, so that read cannot pass by luck."""
    empty_like = torch.empty_like

    def poisoned(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        new = empty_like(tensor, *args, **kwargs)
        return new.fill_(float("nan")) if new.is_floating_point() else new

    monkeypatch.setattr(torch, "empty_like", poisoned)

    def two_steps(optimizer_of) -> dict[str, torch.Tensor]:
        step, images, targets = tiny_step(precision, fused=False)
        step.optimizer = optimizer_of(step.model.parameters())
        step.skips_on_device = bool(step.optimizer.defaults.get("fused"))
        step.grad_clip = grad_clip
        if step.scaler.is_enabled():  # a scale low enough that only the NaN step overflows
            step.scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
        initial = {name: value.detach().clone() for name, value in step.model.named_parameters()}
        forward = DetectionLoss.forward
        with monkeypatch.context() as patch:
            patch.setattr(
                DetectionLoss,
                "forward",
                lambda self, o, t: {k: v * float("nan") for k, v in forward(self, o, t).items()},
            )
            assert not bool(step(images, targets).finite)
        assert bool(step(images, targets).finite)
        trained = {name: value.detach().clone() for name, value in step.model.named_parameters()}
        assert any(not torch.equal(trained[name], initial[name]) for name in initial)
        return trained

    ours = two_steps(lambda params: build_optimizer(params, SGD))
    reference = two_steps(
        lambda params: torch.optim.SGD(
            params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4, foreach=False
        )
    )
    for name, value in reference.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_sgd_without_momentum_is_plain_sgd_not_a_nesterov_error() -> None:
    """train.momentum: 0 is a valid setting (the schema's minimum): Nesterov needs momentum, so
    without it the optimizer is plain SGD, one step being `weight -= lr * grad`."""
    weight = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    optimizer = build_optimizer([weight], {**SGD, "momentum": 0.0, "weight_decay": 0.0})
    assert optimizer.defaults["nesterov"] is False
    weight.grad = torch.tensor([0.5, 0.5, -1.0])
    optimizer.step()
    torch.testing.assert_close(
        weight.detach(), torch.tensor([1.0, -2.0, 3.0]) - SGD["lr"] * weight.grad
    )
