"""Anchor-free CenterNet-style detectors: a per-class heatmap at stride 4 plus, at every cell
and for every class, the offset to the object's centre and the object's size.

Boxes are regressed per class (as Faster R-CNN's box head does, unlike CenterNet's one box per
cell): an object inside another of another class (a nucleus in a cell, a shape in a ring's hole)
sits a cell or two from the outer one's centre, and with one box per cell the box head had to
jump from the inner box to the outer one between neighbouring cells; it blended them, and large
objects came out with their hole's box.

The box map is the stride-4 box head's output plus a coarse box head's, computed on the neck's
stride-16 features and upsampled: at a large object's centre the stride-4 features are
dominated by what lies there (a dot in a ring's hole made the ring's box the hole's), while a
stride-16 cell sees the object whole, for a small share of tiny_conv's training FLOPs
(docs/detector.md).

Decoding keeps heatmap peaks (3x3 max-pool test) and the top K: no NMS. Each peak's size is
read at its cell, its centre averaged over the cells around it, weighted by their scores: the
neighbours' centres agree with the peak's and average its error down, while their sizes come
out smaller than the peak's (benchmarks/box_limits.py measures both). The box branch is
trained densely around each centre (TTFNet-style), which converges far faster than
supervising the centre cell alone: on a CPU, training time is the budget.

With `iou_score` (config `model.iou_score`) an IoU branch, as in IoU-aware single-stage
detectors, predicts per class and cell the IoU of the box decoded there with its object, from
the box head's hidden features (one 1x1 conv); a detection's score becomes
heat^(1 - IOU_SCORE_ALPHA) * iou^IOU_SCORE_ALPHA, so that among peaks of about equal heat the
one with the better box ranks first. Without it the score is the heatmap's peak alone. The
branch reads those features detached, its weights come from a fork of the RNG and its gradient
is clipped apart (`clip_groups`), so the heatmap and boxes train bit for bit as without it and
only the scores differ: trained through the features, its loss reshaped those the heatmap
shares and cost AP@.5 (benchmarks/records/iou_score_alpha/eggs-15ep-b74b78c.json, alpha 0).

With `flip_test` (config `eval.flip_test`; evaluation, training's validation and prediction, never
the training step) the model also sees each image's left-right mirror and the two views' maps are
averaged in the image's frame before decoding, as in CenterNet's flip test: twice the forward
pass for two estimates of every object's size, centre and score (benchmarks/flip_test.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LABEL_MODES = ("multilabel", "single")
STRIDE = 4
# Input normalisation, alike for every channel: scalars, not [1, 3, 1, 1] tensors, since
# broadcasting a per-channel tensor over a channels-last batch runs far slower than a scalar op
# (it showed among the profile's top operators) for the same bits
_MEAN = 0.5
_STD = 0.25
_STRIDE_16_LEVEL = 2  # every backbone's features are at strides 4, 8, 16 (and 32)
CENTRE_WINDOW = 3  # cells: decode averages the centres of the peak's 3x3 window (docs/detector.md)
# The IoU branch's share of a detection's score: re-decoding the same weights at 0 to 0.7
# (benchmarks/iou_score_alpha.py, records/iou_score_alpha/) raised AP@[.5:.95] on eggs at every
# share; AP@.5 and F1 at the operating point held on average at 0.3 and fell at 0.5 and above.
IOU_SCORE_ALPHA = 0.3
_TINY = torch.finfo(torch.float32).tiny  # floors a probability before its log
_MAX_LOG_SIZE = 6.0  # exp(6) * stride = 1600 px: clamps the size branch so exp never overflows


def _corners(
    regression: torch.Tensor, col: torch.Tensor, row: torch.Tensor, stride: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(left, top, right, bottom) in input pixels, from the box head's (dx, dy, log w, log h),
    [..., 4], at cells (col, row): the one definition that decoding and the loss share."""
    dx, dy, log_w, log_h = regression.float().unbind(-1)
    cx = (col + 0.5 + dx) * stride
    cy = (row + 0.5 + dy) * stride
    half_w = log_w.clamp(max=_MAX_LOG_SIZE).exp() * stride / 2
    half_h = log_h.clamp(max=_MAX_LOG_SIZE).exp() * stride / 2
    return cx - half_w, cy - half_h, cx + half_w, cy + half_h


def _xyxy(
    regression: torch.Tensor, col: torch.Tensor, row: torch.Tensor, stride: int
) -> torch.Tensor:
    """xyxy boxes in input pixels, [..., 4]: `_corners` side by side."""
    return torch.stack(_corners(regression, col, row, stride), dim=-1)


def _largest_around(values: torch.Tensor) -> torch.Tensor:
    """Each cell's largest value in the 3x3 window around it [B,C,h,w] (cells outside the map
    left out): max_pool2d(values, 3, stride=1, padding=1), as the maximum of the three rows'
    maxima of three. On a CPU max_pool2d's kernel costs several times these four maxima
    (it keeps every maximum's index)."""
    padded = F.pad(values, (1, 1, 1, 1), value=float("-inf"))
    across = torch.maximum(padded[..., :-2], padded[..., 1:-1])
    across = torch.maximum(across, padded[..., 2:], out=across)  # in place: one tensor fewer
    largest = torch.maximum(across[..., :-2, :], across[..., 1:-1, :])
    return torch.maximum(largest, across[..., 2:, :], out=largest)


def _gather(
    values: torch.Tensor,
    image: torch.Tensor,
    channel: torch.Tensor,
    row: torch.Tensor,
    col: torch.Tensor,
) -> torch.Tensor:
    """values[image, channel, row, col] (indices broadcast together), read with index_select
    through one flat index into the values' own storage, at their own strides: four index
    tensors broadcast and read one by one cost several times that on a CPU, and copying a
    channels-last or sliced map to row-major first cost more than the read."""
    strides = values.stride()
    # the small index tensors summed first: one pass over the broadcast shape, not three
    place = (image * strides[0] + channel * strides[1]) + (row * strides[2] + col * strides[3])
    span = 1 + sum((size - 1) * stride for size, stride in zip(values.shape, strides, strict=True))
    flat = values.as_strided((span,), (1,))  # every element the strides reach, in storage order
    return flat.index_select(0, place.reshape(-1)).reshape(place.shape)


def decode_boxes(regression: torch.Tensor, stride: int) -> torch.Tensor:
    """xyxy boxes [B,h,w,4] at every cell of one box per cell, [B,4,h,w]."""
    _, _, h, w = regression.shape
    rows = torch.arange(h, device=regression.device, dtype=torch.float32).view(h, 1)
    cols = torch.arange(w, device=regression.device, dtype=torch.float32).view(1, w)
    return _xyxy(regression.permute(0, 2, 3, 1), cols, rows, stride)


def conv_bn(c_in: int, c_out: int, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, stride, 1, groups=groups, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class TinyBackbone(nn.Module):
    """A plain conv net giving features at strides 4, 8, 16 and (max_stride 32) 32; small and
    fast on a CPU."""

    def __init__(self, width: int = 32, max_stride: int = 32) -> None:
        super().__init__()
        w = width
        self.stem = nn.Sequential(conv_bn(3, w // 2, 2), conv_bn(w // 2, w // 2))
        self.stage4 = nn.Sequential(conv_bn(w // 2, w, 2), conv_bn(w, w))
        self.stage8 = nn.Sequential(conv_bn(w, 2 * w, 2), conv_bn(2 * w, 2 * w))
        self.stage16 = nn.Sequential(
            conv_bn(2 * w, 3 * w, 2), conv_bn(3 * w, 3 * w), conv_bn(3 * w, 3 * w)
        )
        self.channels: tuple[int, ...] = (w, 2 * w, 3 * w)
        self.stage32 = None
        if max_stride == 32:
            self.stage32 = nn.Sequential(
                conv_bn(3 * w, 4 * w, 2), conv_bn(4 * w, 4 * w), conv_bn(4 * w, 4 * w)
            )
            self.channels = (*self.channels, 4 * w)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        c4 = self.stage4(self.stem(x))
        c8 = self.stage8(c4)
        features = [c4, c8, self.stage16(c8)]
        if self.stage32 is not None:
            features.append(self.stage32(features[-1]))
        return features


class ResNetBackbone(nn.Module):
    """torchvision's resnet18 trunk (weights=None: nothing is downloaded), strides 4 to 32."""

    def __init__(self) -> None:
        super().__init__()
        from torchvision.models import resnet18

        net = resnet18(weights=None)
        self.stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
        self.layers = nn.ModuleList([net.layer1, net.layer2, net.layer3, net.layer4])
        self.channels = (64, 128, 256, 512)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        features = []
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
            features.append(x)
        return features


class TopDownNeck(nn.Module):
    """Brings the coarse, wide-context features back to stride 4 (an FPN top-down path); the
    path's stride-16 sum is returned too, for the coarse box head."""

    def __init__(self, channels: tuple[int, ...], out_channels: int) -> None:
        super().__init__()
        self.lateral = nn.ModuleList(nn.Conv2d(c, out_channels, 1) for c in channels)
        self.smooth = conv_bn(out_channels, out_channels)

    def forward(self, features: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(stride-4 features, the top-down path at stride 16)."""
        x = self.lateral[-1](features[-1])
        coarse = x
        for level in reversed(range(len(features) - 1)):
            feature = features[level]
            x = F.interpolate(x, size=feature.shape[-2:], mode="nearest") + self.lateral[level](
                feature
            )
            if level == _STRIDE_16_LEVEL:
                coarse = x
        return self.smooth(x), coarse


class CenterNet(nn.Module):
    """Backbone + neck + heads: class heatmap logits, and per class a box (dx, dy, log w,
    log h) per cell, the sum of a stride-4 and an upsampled stride-16 box head: box channels
    4c to 4c+3 are class c's. With `iou_score`, per class and cell the logit of the IoU of the
    box decoded there with its object ('iou')."""

    def __init__(
        self,
        backbone: nn.Module,
        num_classes: int,
        label_mode: str,
        neck_channels: int,
        iou_score: bool = False,
    ) -> None:
        super().__init__()
        if label_mode not in LABEL_MODES:
            raise ValueError(f"label_mode must be one of {LABEL_MODES}, got {label_mode!r}")
        self.num_classes = num_classes
        self.label_mode = label_mode
        self.stride = STRIDE
        self.backbone = backbone
        self.neck = TopDownNeck(backbone.channels, neck_channels)
        heat_channels = num_classes if label_mode == "multilabel" else num_classes + 1
        self.heatmap_head = nn.Sequential(
            conv_bn(neck_channels, neck_channels), nn.Conv2d(neck_channels, heat_channels, 1)
        )
        self.box_head = nn.Sequential(
            conv_bn(neck_channels, neck_channels), nn.Conv2d(neck_channels, 4 * num_classes, 1)
        )
        self.coarse_box_head = nn.Sequential(
            conv_bn(neck_channels, neck_channels), nn.Conv2d(neck_channels, 4 * num_classes, 1)
        )
        # off, the model is module for module (and its state dict key for key) the one without it
        self.iou_head = None
        if iou_score:
            # drawn from a fork of the RNG: every other weight and every later draw (shuffling,
            # augmentation) is as without the branch, so that (its features detached) the
            # heatmap and boxes train as they would without it and only the scores differ
            with torch.random.fork_rng(devices=[]):
                self.iou_head = nn.Conv2d(neck_channels, num_classes, 1)
        self._init_heads()

    def _init_heads(self) -> None:
        # Start the heatmap near 1% positives (focal-loss prior), so early training is stable.
        last = self.heatmap_head[-1]
        nn.init.constant_(last.bias, -4.6 if self.label_mode == "multilabel" else 0.0)
        if self.label_mode == "single":
            with torch.no_grad():
                last.bias[-1] = 4.6  # background starts likely
        for head in (self.box_head, self.coarse_box_head):
            nn.init.zeros_(head[-1].weight)
            nn.init.zeros_(head[-1].bias)

    def forward(self, images: torch.Tensor, flip_test: bool = False) -> dict[str, torch.Tensor]:
        """images: uint8 [B,3,H,W] (or float in [0, 1]); H and W divisible by the backbone's
        stride. `flip_test` (config `eval.flip_test`): the maps of the images and of their
        left-right mirrors averaged (`flip_averaged`), for evaluation and prediction only."""
        if not flip_test:
            return self.maps(images)
        # two passes of the batch's own shape, not one of twice the batch: no kernels to set
        # up for a new shape, half the peak memory, and no slower on a CPU
        mirror = self.mirrored(self.maps(images.flip(-1)))
        return self.flip_averaged(self.maps(images), mirror)

    def maps(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """The heads' outputs for one view of the images (see `forward`)."""
        # in place on the tensor made here, never on the caller's float images
        if images.dtype == torch.uint8:
            x = images.float().div_(255.0).sub_(_MEAN)
        else:
            x = images - _MEAN
        x = x.div_(_STD)
        features, coarse = self.neck(self.backbone(x))
        hidden = self.box_head[0](features)
        box = self.box_head[1](hidden) + F.interpolate(
            self.coarse_box_head(coarse), size=features.shape[-2:], mode="bilinear"
        )
        outputs = {"heatmap": self.heatmap_head(features), "box": box}
        if self.iou_head is not None:
            outputs["iou"] = self.iou_head(hidden.detach())
        return outputs

    @staticmethod
    def mirrored(outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The maps of a mirrored image in the frame of the image itself (and the other way
        round): every map flipped along its width, and each class's centre offset across (box
        channel 4c, dx) negated, since mirroring cell `col` of `w` to `w - 1 - col` maps the
        centre (col + 0.5 + dx) * stride to (w - 1 - col + 0.5 - dx) * stride. Sizes (log w,
        log h) and dy are unchanged; the heatmap and IoU maps only move."""
        flipped = {key: value.flip(-1) for key, value in outputs.items()}
        box = flipped["box"].clone()
        box[:, 0::4] = -box[:, 0::4]
        flipped["box"] = box
        return flipped

    def flip_averaged(
        self, outputs: dict[str, torch.Tensor], mirrored: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Two views' maps in one frame averaged, as CenterNet's flip test averages them: the
        class probabilities and predicted IoUs as probabilities (returned as the logits that
        give them back), the boxes' offsets and log sizes as they are. Each object's size,
        centre and score then come from two estimates whose errors partly cancel."""
        softmax = {"heatmap": self.label_mode == "single", "iou": False}
        averaged = {}
        for key, value in outputs.items():
            first, second = value.float(), mirrored[key].float()
            if key == "box":
                averaged[key] = (first + second) / 2
            elif softmax[key]:  # over the classes and background
                mean = (first.softmax(dim=1) + second.softmax(dim=1)) / 2
                averaged[key] = mean.clamp(min=_TINY).log()
            else:  # sigmoid: log p - log (1 - p), each side averaged on its own for accuracy
                yes = (first.sigmoid() + second.sigmoid()) / 2
                no = ((-first).sigmoid() + (-second).sigmoid()) / 2
                averaged[key] = yes.clamp(min=_TINY).log() - no.clamp(min=_TINY).log()
        return averaged

    def clip_groups(self) -> list[list[nn.Parameter]]:
        """Parameters whose gradients are clipped together: the detector's, and the IoU
        branch's apart, so that the branch's gradient never scales the detector's update."""
        if self.iou_head is None:
            return [list(self.parameters())]
        branch = {id(p) for p in self.iou_head.parameters()}
        detector = [p for p in self.parameters() if id(p) not in branch]
        return [detector, list(self.iou_head.parameters())]

    def class_probs(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-class probabilities [B,C,h,w]: sigmoid (multilabel) or softmax without background (single)."""
        # row-major in the same copy as the conversion: softmax would copy a channels-last map
        logits = outputs["heatmap"].float(memory_format=torch.contiguous_format)
        if self.label_mode == "multilabel":
            return logits.sigmoid()
        return logits.softmax(dim=1)[:, : self.num_classes]

    def detection_scores(
        self, outputs: dict[str, torch.Tensor], probs: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per class and cell the score a detection there gets [B,C,h,w]: the class probability,
        or with the IoU branch heat^(1 - IOU_SCORE_ALPHA) * iou^IOU_SCORE_ALPHA."""
        probs = self.class_probs(outputs) if probs is None else probs
        if self.iou_head is None:
            return probs
        iou = outputs["iou"].float().sigmoid()
        return probs.pow(1 - IOU_SCORE_ALPHA) * iou.pow(IOU_SCORE_ALPHA)

    def image_scores(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Image-level class scores [B,C]: the highest heatmap value of each class."""
        return self.class_probs(outputs).amax(dim=(2, 3))

    @torch.no_grad()
    def decode(
        self,
        outputs: dict[str, torch.Tensor],
        max_detections: int = 100,
        centre_window: int = CENTRE_WINDOW,
        min_score: float = 0.0,
    ) -> list[dict[str, torch.Tensor]]:
        """Peaks of the heatmap (3x3 max-pool test), top K over classes and cells by their
        `detection_scores`, with their boxes: each image's detections scoring above 0 and at
        least `min_score` (eval.min_score), best first.

        A detection's size is the one its class's box channels give at the peak cell; its centre
        is the average of the centres those channels give at the cells of a `centre_window` x
        `centre_window` window around the peak, weighted by the class's score at each cell
        (1: the peak cell's alone). Cells outside the map weigh nothing. Boxes are worked out
        only for the detections kept: most of the top K score below any useful `min_score`.
        """
        if centre_window < 1 or centre_window % 2 == 0:
            raise ValueError(f"centre_window must be an odd number >= 1, got {centre_window!r}")
        probs = self.class_probs(outputs)
        batch, classes, h, w = probs.shape
        # each cell's score where it is the largest of its 3x3 window, else 0: the window's
        # maxima, a tensor made here, turned into the mask and the product in place (a bool
        # mask times the scores cost about twice as much)
        peaks = _largest_around(probs).eq_(probs).mul_(self.detection_scores(outputs, probs))
        k = min(max_detections, classes * h * w)
        scores, flat = peaks.reshape(batch, -1).topk(k, dim=1)
        # the kept detections of the whole batch as one list, image by image in rank order (a
        # NaN score, ranked first by topk, is not kept), found by one nonzero for all three
        keep = (scores > 0) & (scores >= min_score)
        kept = keep.reshape(-1).nonzero().squeeze(1)
        image = (kept // k)[:, None]
        flat = flat.reshape(-1).index_select(0, kept)
        scores = scores.reshape(-1).index_select(0, kept)
        labels = (flat // (h * w))[:, None]
        cells = flat % (h * w)
        # each class's (dx, dy, log w, log h) at each cell as one row [B*h*w*C, 4]: a view of a
        # channels-last map (a row-major one is copied once), read a row per window cell
        class_boxes = outputs["box"].permute(0, 2, 3, 1).reshape(-1, 4)
        reach = torch.arange(centre_window, device=probs.device) - centre_window // 2
        rows_off, cols_off = (v.reshape(1, -1) for v in torch.meshgrid(reach, reach, indexing="ij"))
        middle = centre_window**2 // 2  # the peak's own position in the window
        size = torch.tensor([w, h, w, h], device=probs.device, dtype=probs.dtype) * self.stride
        # the window's cells [N, window**2], the peak at `middle`
        row = (cells // w)[:, None] + rows_off
        col = (cells % w)[:, None] + cols_off
        within_row, within_col = row.clamp(0, h - 1), col.clamp(0, w - 1)
        inside = (within_row == row) & (within_col == col)
        row, col = within_row, within_col
        weight = _gather(probs, image, labels, row, col) * inside
        # each cell's box from the detection's own class's box channels, as four planes in
        # float32 [4, N, window**2] (one copy, the conversion's): the box arithmetic on
        # contiguous values runs several times faster than on every fourth one of the rows
        place = ((image * h + row) * w + col) * classes + labels
        rows = class_boxes.index_select(0, place.reshape(-1)).t().reshape(4, *place.shape)
        values = torch.empty(rows.shape, dtype=torch.float32, device=probs.device)
        values = values.copy_(rows).movedim(0, -1)
        left, top, right, bottom = _corners(values, col.float(), row.float(), self.stride)
        # each cell's centre weighed, as [N, window**2, 2] (the layout the sum over the window
        # reads, and so its order of additions)
        weighted = torch.empty((*weight.shape, 2), dtype=weight.dtype, device=probs.device)
        weighted[..., 0] = (left + right) / 2 * weight
        weighted[..., 1] = (top + bottom) / 2 * weight
        centre = weighted.sum(1) / weight.sum(1, keepdim=True)
        width, height = right[:, middle] - left[:, middle], bottom[:, middle] - top[:, middle]
        half = torch.stack([width, height], dim=-1) / 2
        picked = torch.cat([centre - half, centre + half], dim=-1)
        picked = torch.minimum(picked.clamp(min=0), size)
        labels = labels.squeeze(1)
        counts = keep.sum(dim=1).tolist()
        return [
            {"boxes": boxes_of, "scores": scores_of, "labels": labels_of}
            for boxes_of, scores_of, labels_of in zip(
                picked.split(counts), scores.split(counts), labels.split(counts), strict=True
            )
        ]


def tiny_conv(
    num_classes: int,
    label_mode: str,
    width: int = 32,
    max_stride: int = 32,
    iou_score: bool = False,
) -> CenterNet:
    """max_stride 32: a stride-32 stage for objects up to most of the input; 16: the earlier
    tiny_conv's backbone and neck (objects up to about 50 px)."""
    if max_stride not in (16, 32):
        raise ValueError(f"tiny_conv's max_stride must be 16 or 32, got {max_stride!r}")
    return CenterNet(
        TinyBackbone(width, max_stride), num_classes, label_mode, width, iou_score=iou_score
    )


def resnet18(num_classes: int, label_mode: str, iou_score: bool = False) -> CenterNet:
    return CenterNet(ResNetBackbone(), num_classes, label_mode, 64, iou_score=iou_score)
