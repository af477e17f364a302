"""An exponential moving average of a model's weights, the weights that are validated and saved.

Short CPU runs end with weights that still carry the last few hundred steps' noise (batches of 4
images, BatchNorm statistics of those batches); their average is a better model than any one
of them, as in YOLOX and timm. The average's horizon grows with the run (`decay_at`), so a run
of 2,000 steps averages its last few hundred and is not held back by its first, random weights.

Written out instead of torch.optim.swa_utils.AveragedModel: that one tests its step count, a
device tensor, on the host at every update, which makes the host wait for the device at every
training step on a GPU. Here the count lives on the host and the update only queues kernels.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

_POWER = 0.75  # timm's ModelEmaV3 warm-up: the horizon 1 / (1 - decay) grows as steps**0.75


def decay_at(updates: int) -> float:
    """The weight of the average so far at update `updates` (1-based): its horizon
    1 / (1 - decay) is 1.7 steps at the first update, 32 at the 100th, 300 at the 2,000th."""
    return 1.0 - (1.0 + updates) ** -_POWER


class WeightAverage:
    """The average of `model`'s weights: `update()` after every optimizer step; `module` is the
    averaged model (eval mode), with BatchNorm's statistics averaged too."""

    def __init__(self, model: nn.Module) -> None:
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self.updates = 0
        # the tensors' pairs, once: walking state_dict() at every update took four times as
        # long as the update's own kernels (110 small tensors for tiny_conv)
        pairs = list(
            zip(self.module.state_dict().values(), model.state_dict().values(), strict=True)
        )
        self._averaged = [mine for mine, theirs in pairs if mine.is_floating_point()]
        self._current = [theirs.detach() for mine, theirs in pairs if mine.is_floating_point()]
        # BatchNorm's num_batches_tracked: copied
        self._copied = [mine for mine, theirs in pairs if not mine.is_floating_point()]
        self._sources = [theirs for mine, theirs in pairs if not mine.is_floating_point()]

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        torch._foreach_lerp_(self._averaged, self._current, 1.0 - decay_at(self.updates))
        torch._foreach_copy_(self._copied, self._sources)
