"""Model registry: `build_model(name, num_classes, label_mode)`; nothing is ever downloaded."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from pipeline.errors import ConfigError
from pipeline.models import centernet

MODELS: dict[str, Callable[..., centernet.CenterNet]] = {
    "tiny_conv": centernet.tiny_conv,
    "resnet18": centernet.resnet18,
}
LABEL_MODES = centernet.LABEL_MODES
TINY_CONV_OPTIONS = ("width", "max_stride")  # config keys of model.*


def build_model(
    name: str,
    num_classes: int,
    label_mode: str = "multilabel",
    iou_score: bool = False,
    **options,
) -> centernet.CenterNet:
    """Build a registered detector with fresh weights (weights=None for torchvision parts)."""
    if name not in MODELS:
        raise ConfigError(
            f"Unknown model {name!r}: choose one of {', '.join(MODELS)} (config key model.name)."
        )
    if label_mode not in LABEL_MODES:
        raise ConfigError(
            f"Unknown label_mode {label_mode!r}: choose one of {', '.join(LABEL_MODES)}."
        )
    if num_classes < 1:
        raise ConfigError(f"A detector needs at least one class, got num_classes={num_classes}.")
    return MODELS[name](num_classes, label_mode, iou_score=iou_score, **options)


def memory_format(channels_last: bool) -> torch.memory_format:
    """channels-last speeds up convolutions on CPU (oneDNN) and CUDA tensor cores."""
    return torch.channels_last if channels_last else torch.contiguous_format


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# The total stride of the models without a max_stride option: inputs must be multiples of it.
FIXED_STRIDE = {"resnet18": 32}


def input_multiple(model_config: Mapping[str, Any]) -> int:
    """The total stride of the model a config's `model` section describes."""
    if model_config["name"] == "tiny_conv":
        return int(model_config.get("max_stride", 32))
    return FIXED_STRIDE[model_config["name"]]


def check_input_size(model_config: Mapping[str, Any], image_size: int) -> None:
    """Refuse an input size the model's strides do not divide, naming sizes that fit."""
    name, multiple = model_config["name"], input_multiple(model_config)
    if image_size % multiple:
        lower = max(multiple, image_size // multiple * multiple)
        raise ConfigError(
            f"data.image_size={image_size} does not fit model {name!r}: its total stride is {multiple}, so the "
            f"input size must be a multiple of {multiple} (for example {lower} or {lower + multiple})."
        )


def build_from_config(model_config: Mapping[str, Any], num_classes: int) -> centernet.CenterNet:
    """The model a config's `model` section describes (the trainer, eval and profile agree).

    A checkpoint's config written before `model.iou_score` existed has no such key: its model
    had no IoU branch."""
    options = (
        {key: model_config[key] for key in TINY_CONV_OPTIONS}
        if model_config["name"] == "tiny_conv"
        else {}
    )
    return build_model(
        model_config["name"],
        num_classes,
        model_config["label_mode"],
        iou_score=bool(model_config.get("iou_score", False)),
        **options,
    )
