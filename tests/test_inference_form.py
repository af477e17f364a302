"""The inference form of every registered model: BatchNorm folded into its convs, the same maps,
the trained model untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.models import MODELS, build_model
from pipeline.models.inference import for_inference
from pipeline.models.loss import DetectionLoss

pytestmark = pytest.mark.usefixtures("torch_flags_threads_and_logger")

SIZE = 64
VARIANTS = [
    ("tiny_conv", {"width": 8}),
    ("tiny_conv", {"width": 8, "max_stride": 16, "iou_score": True}),
    ("resnet18", {}),
]


def trained_statistics(name: str, options: dict) -> nn.Module:
    """A model whose BatchNorms hold statistics and affine weights far from their defaults, so
    that folding them wrongly would show in the maps."""
    torch.manual_seed(0)
    model = build_model(name, 3, "multilabel", **options)
    generator = torch.Generator().manual_seed(1)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            channels = module.num_features
            module.running_mean.copy_(torch.randn(channels, generator=generator) * 0.3)
            module.running_var.copy_(torch.rand(channels, generator=generator) + 0.5)
            with torch.no_grad():
                module.weight.copy_(torch.rand(channels, generator=generator) + 0.5)
                module.bias.copy_(torch.randn(channels, generator=generator) * 0.1)
    return model


def images(batch: int = 2) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (batch, 3, SIZE, SIZE), dtype=torch.uint8, generator=generator)


def test_every_registered_model_is_covered() -> None:
    assert {name for name, _ in VARIANTS} == set(MODELS)


@pytest.mark.parametrize(("name", "options"), VARIANTS)
def test_the_inference_form_has_no_batchnorm_and_gives_the_models_maps(
    name: str, options: dict
) -> None:
    model = trained_statistics(name, options).eval()
    inferred = for_inference(model)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in inferred.modules())
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert not inferred.training
    with torch.inference_mode():
        for flip_test in (False, True):
            expected = model(images(), flip_test=flip_test)
            found = inferred(images(), flip_test=flip_test)
            assert found.keys() == expected.keys()
            for key in expected:
                torch.testing.assert_close(found[key], expected[key], rtol=1e-4, atol=1e-4)


def test_a_channels_last_model_keeps_channels_last_weights_in_its_inference_form() -> None:
    model = trained_statistics("tiny_conv", {"width": 8}).to(memory_format=torch.channels_last)
    convs = [m for m in for_inference(model).modules() if isinstance(m, nn.Conv2d)]
    assert all(c.weight.is_contiguous(memory_format=torch.channels_last) for c in convs)


def test_making_the_inference_form_leaves_the_training_model_as_it_was_and_able_to_train() -> None:
    model = trained_statistics("tiny_conv", {"width": 8}).train()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    modules = list(model.modules())
    for_inference(model)
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[key], before[key]) for key in before)
    assert model.training and all(p.requires_grad for p in model.parameters())
    assert list(model.modules()) == modules  # the same modules, none folded or replaced

    # still trains: a step moves its weights and its BatchNorm statistics
    loss_fn = DetectionLoss.for_model(model, 1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    target = {"boxes": torch.tensor([[8.0, 8.0, 40.0, 40.0]]), "labels": torch.tensor([1])}
    loss = loss_fn(model(images()), [target, target])["total"]
    loss.backward()
    optimizer.step()
    moved = model.state_dict()
    assert not torch.equal(moved["backbone.stem.0.0.weight"], before["backbone.stem.0.0.weight"])
    assert not torch.equal(
        moved["backbone.stem.0.1.running_mean"], before["backbone.stem.0.1.running_mean"]
    )


def test_in_place_the_model_itself_becomes_the_same_inference_form_as_the_copy() -> None:
    model = trained_statistics("tiny_conv", {"width": 8}).train()
    copied = for_inference(model)
    inferred = for_inference(model, in_place=True)
    assert inferred is model and not model.training
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert not any(p.requires_grad for p in model.parameters())
    found, expected = inferred.state_dict(), copied.state_dict()
    assert found.keys() == expected.keys()
    assert all(torch.equal(found[key], expected[key]) for key in expected)
