"""The form a trained model infers in: every eval-mode BatchNorm folded into the conv before it.

In eval mode a BatchNorm is a fixed per-channel scale and shift, so the conv before it can
carry it in its own weights and bias (`torch.nn.utils.fusion.fuse_conv_bn_eval`, the standard
deployment step): one op instead of two over every feature map, for the same maps up to float
rounding (benchmarks/inference_fusion.py measures both). Evaluation, training's validation,
prediction, the profile stage and the bench's `infer` mode all run this form; the training
model, its BatchNorm statistics, the weight average and checkpoints never change.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval

# torchvision's residual block (resnet18's) applies bn{i} right after conv{i} in its own
# forward, not in a Sequential: the attribute pairs that fold. Known by name, so that a model
# without one does not import torchvision (and with it torch's compiler, seconds)
_BLOCK_PAIRS = {"torchvision.models.resnet.BasicBlock": (("conv1", "bn1"), ("conv2", "bn2"))}


def for_inference(model: nn.Module, *, in_place: bool = False) -> nn.Module:
    """An eval-mode deep copy of `model` with each BatchNorm2d that directly follows a Conv2d
    (in a Sequential, or in a torchvision residual block) folded into that conv and replaced
    by an Identity; `model` itself is left as it was. Made once per set of weights and
    command (`evaluate`'s validation and test passes share one; training makes one per
    validation) and handed to the evaluator: the copy costs a fraction of one forward pass
    over a split (a profile and a prediction make their own). `in_place`: `model` itself
    becomes that form, for a caller with no other use for it (`evaluate`, which restored it
    for this), without the copy's cost."""
    inferred = (model if in_place else copy.deepcopy(model)).eval().requires_grad_(False)
    with torch.no_grad():
        for module in inferred.modules():
            if isinstance(module, nn.Sequential):
                for index in range(len(module) - 1):
                    _fold(module, str(index), str(index + 1))
            kind = type(module)
            for conv, bn in _BLOCK_PAIRS.get(f"{kind.__module__}.{kind.__qualname__}", ()):
                _fold(module, conv, bn)
    return inferred


def _fold(parent: nn.Module, conv_name: str, bn_name: str) -> None:
    """Fold `parent`'s child `bn_name` into its child `conv_name` where they are a Conv2d and
    a BatchNorm2d with running statistics; anything else stays as it is."""
    conv, bn = getattr(parent, conv_name), getattr(parent, bn_name)
    if not (isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d)):
        return
    if not bn.track_running_stats:
        return  # it normalises by each batch's own statistics, even in eval mode: no constant
    setattr(parent, conv_name, fuse_conv_bn_eval(conv, bn))
    setattr(parent, bn_name, nn.Identity())
