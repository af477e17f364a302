"""CenterNet detectors, their decoding and loss, and the model registry."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.models import (
    FIXED_STRIDE,
    MODELS,
    build_from_config,
    build_model,
    check_input_size,
    input_multiple,
)
from pipeline.models.centernet import STRIDE, CenterNet
from pipeline.models.loss import DetectionLoss

pytestmark = pytest.mark.usefixtures("torch_flags_threads_and_logger")

NUM_CLASSES = 3


def tiny(label_mode: str = "multilabel") -> CenterNet:
    torch.manual_seed(0)
    return build_model("tiny_conv", NUM_CLASSES, label_mode, width=8)


def images(batch: int, size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=generator)


def empty_target() -> dict[str, torch.Tensor]:
    return {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long)}


def two_targets() -> list[dict[str, torch.Tensor]]:
    """Targets of a 2-image batch at 32 px: two objects, then one."""
    return [
        {
            "boxes": torch.tensor([[2.0, 2.0, 14.0, 12.0], [18.0, 20.0, 30.0, 30.0]]),
            "labels": torch.tensor([0, 2]),
        },
        {"boxes": torch.tensor([[10.0, 5.0, 22.0, 25.0]]), "labels": torch.tensor([1])},
    ]


@pytest.fixture
def no_downloads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if anything tries to fetch weights."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"a download was attempted: {args}")

    import torchvision.models._api as api

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", refuse)
    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)
    monkeypatch.setattr(api, "load_state_dict_from_url", refuse, raising=False)


# --- output shapes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("label_mode", "heat_channels"), [("multilabel", NUM_CLASSES), ("single", NUM_CLASSES + 1)]
)
def test_tiny_conv_outputs_a_stride_4_heatmap_with_c_or_c_plus_1_channels_and_4_box_channels_per_class(
    label_mode: str, heat_channels: int
) -> None:
    model = tiny(label_mode).eval()
    with torch.no_grad():
        outputs = model(images(2, 64))
    assert set(outputs) == {"heatmap", "box"}
    assert outputs["heatmap"].shape == (2, heat_channels, 64 // STRIDE, 64 // STRIDE)
    assert outputs["box"].shape == (2, 4 * NUM_CLASSES, 64 // STRIDE, 64 // STRIDE)


@pytest.mark.parametrize(
    ("label_mode", "heat_channels"), [("multilabel", NUM_CLASSES), ("single", NUM_CLASSES + 1)]
)
def test_resnet18_builds_without_downloading_and_outputs_stride_4_maps(
    no_downloads: None, label_mode: str, heat_channels: int
) -> None:
    model = build_model("resnet18", NUM_CLASSES, label_mode).eval()
    with torch.no_grad():
        outputs = model(images(1, 64))
    assert outputs["heatmap"].shape == (1, heat_channels, 16, 16)
    assert outputs["box"].shape == (1, 4 * NUM_CLASSES, 16, 16)


@pytest.mark.parametrize("name", ["tiny_conv", "resnet18"])
def test_the_box_map_adds_the_coarse_box_heads_stride_16_output_upsampled_to_stride_4(
    no_downloads: None, name: str
) -> None:
    """The coarse head is part of every box the model gives: decoding and the loss read its
    sum with the stride-4 head, not the stride-4 head alone."""
    model = build_model(name, NUM_CLASSES, "single").eval()
    batch = images(1, 64)
    with torch.no_grad():
        before = model(batch)["box"]
        model.coarse_box_head[-1].bias.fill_(0.25)  # a constant shift of every cell's coarse box
        after = model(batch)["box"]
    torch.testing.assert_close(after - before, torch.full_like(before, 0.25))


def test_uint8_and_unit_float_images_give_the_same_outputs_and_leave_the_input_alone() -> None:
    model = tiny().eval()
    batch = images(1, 32)
    with torch.no_grad():
        from_uint8 = model(batch)
        unit_float = batch.float() / 255.0
        kept = unit_float.clone()
        from_float = model(unit_float)
    for key in from_uint8:
        assert torch.equal(from_uint8[key], from_float[key]), key
    assert torch.equal(unit_float, kept)  # normalised in place on a copy, never the caller's


def test_a_fresh_model_starts_near_1_percent_positives_in_both_label_modes() -> None:
    for label_mode in ("multilabel", "single"):
        model = tiny(label_mode).eval()
        with torch.no_grad():
            probs = model.class_probs(model(images(1, 32)))
        assert probs.shape[1] == NUM_CLASSES  # single mode drops the background channel
        assert probs.mean().item() < 0.05, label_mode


# --- decoding --------------------------------------------------------------------------------


@pytest.mark.parametrize("label_mode", ["multilabel", "single"])
def test_decode_returns_at_most_max_detections_inside_the_image_with_valid_labels_and_scores(
    label_mode: str,
) -> None:
    model = tiny(label_mode).eval()
    size = 64
    with torch.no_grad():
        outputs = model(images(2, size))
    outputs["box"] = torch.randn(outputs["box"].shape, generator=torch.Generator().manual_seed(1))
    sizes = outputs["box"].view(2, NUM_CLASSES, 4, *outputs["box"].shape[-2:])[:, :, 2:]
    sizes += 3.0  # boxes of ~80 px, so that many would cross the border
    detections = model.decode(outputs, max_detections=7)
    assert len(detections) == 2
    for found in detections:
        count = len(found["scores"])
        assert 0 < count <= 7
        assert found["boxes"].shape == (count, 4)
        assert found["labels"].shape == (count,)
        assert (found["boxes"] >= 0).all() and (found["boxes"] <= size).all()
        assert (found["boxes"][:, 2:] >= found["boxes"][:, :2]).all()
        assert ((found["labels"] >= 0) & (found["labels"] < NUM_CLASSES)).all()
        assert ((found["scores"] > 0) & (found["scores"] <= 1)).all()
        assert (found["scores"][:-1] >= found["scores"][1:]).all()  # best first


@pytest.mark.parametrize("window", [1, 3])
def test_a_batch_decodes_to_each_images_own_decoding_exactly(window: int) -> None:
    """The batch is decoded at once: each image's detections are those it gets alone, bit for
    bit, images with fewer peaks than max_detections (a blank one) included."""
    model = tiny("multilabel").eval()
    with torch.no_grad():
        outputs = model(images(3, 64))
    generator = torch.Generator().manual_seed(2)
    outputs["box"] = torch.randn(outputs["box"].shape, generator=generator)
    outputs["heatmap"] = torch.randn(outputs["heatmap"].shape, generator=generator) * 3
    outputs["heatmap"][1] = -1000.0  # sigmoid underflows to 0: no detection at all
    together = model.decode(outputs, max_detections=40, centre_window=window)
    assert len(together[0]["scores"]) == 40 and len(together[1]["scores"]) == 0
    for i, found in enumerate(together):
        alone = model.decode(
            {key: value[i : i + 1] for key, value in outputs.items()}, 40, centre_window=window
        )[0]
        for key in ("boxes", "scores", "labels"):
            assert torch.equal(found[key], alone[key]), (i, key)


@pytest.mark.parametrize("label_mode", ["multilabel", "single"])
@pytest.mark.parametrize("window", [1, 3])
def test_a_score_floor_keeps_exactly_the_detections_at_or_above_it_bit_for_bit(
    label_mode: str, window: int
) -> None:
    """min_score (eval.min_score) drops detections before their boxes are worked out: what is
    left is, image by image and in order, what decoding without it gives at or above it."""
    model = tiny(label_mode).eval()
    with torch.no_grad():
        outputs = model(images(3, 64))
    generator = torch.Generator().manual_seed(6)
    outputs["box"] = torch.randn(outputs["box"].shape, generator=generator)
    outputs["heatmap"] = torch.randn(outputs["heatmap"].shape, generator=generator) * 3
    every = model.decode(outputs, max_detections=200, centre_window=window)
    floored = model.decode(outputs, max_detections=200, centre_window=window, min_score=0.5)
    assert 0 < sum(len(f["scores"]) for f in floored) < sum(len(f["scores"]) for f in every)
    for found, all_of_them in zip(floored, every, strict=True):
        kept = all_of_them["scores"] >= 0.5
        for key in ("boxes", "scores", "labels"):
            assert torch.equal(found[key], all_of_them[key][kept]), key


def test_the_peak_test_is_max_pool2ds_3x3_window_at_every_cell() -> None:
    """Decoding's 3x3 maximum (four elementwise maxima, not max_pool2d's slower kernel) is
    max_pool2d's, ties, -inf and NaN included, on a channels-last map too."""
    from pipeline.models.centernet import _largest_around

    generator = torch.Generator().manual_seed(4)
    values = torch.randint(0, 4, (2, 3, 9, 7), generator=generator).float()  # many ties
    values[0, 0, 0, 0] = float("-inf")
    values[1, 2, 4, 4] = float("nan")
    for case in (values, values.to(memory_format=torch.channels_last)):
        expected = torch.nn.functional.max_pool2d(case, 3, stride=1, padding=1)
        assert torch.equal(_largest_around(case).isnan(), expected.isnan())
        assert torch.equal(_largest_around(case).nan_to_num(), expected.nan_to_num())


def test_decodings_gather_reads_what_indexing_reads_in_any_layout() -> None:
    """values[image, channel, row, col] through one flat index: row-major, channels-last and
    strided views alike, a view that starts inside its storage too (a softmax's classes
    without the background)."""
    from pipeline.models.centernet import _gather

    generator = torch.Generator().manual_seed(5)
    values = torch.randn(3, 8, 6, 5, generator=generator)
    index = [torch.randint(0, n, (3, 4, 1), generator=generator) for n in values.shape]
    index[1] = index[1] % 7 + torch.arange(2)  # broadcast along the last dimension, as boxes'
    for case in (
        values,
        values.to(memory_format=torch.channels_last),
        values[:, ::2].repeat(1, 2, 1, 1)[:, :, :, :5],
        torch.randn(3, 8, 6, 10, generator=generator)[..., ::2],
        torch.randn(3, 9, 6, 5, generator=generator)[:, 1:],
        torch.randn(3, 9, 6, 5, generator=generator).to(memory_format=torch.channels_last)[:, 1:],
    ):
        assert torch.equal(_gather(case, *index), case[index[0], index[1], index[2], index[3]])


def test_a_nan_score_leaves_the_other_detections_of_its_image_as_they_were() -> None:
    """topk ranks a NaN first: the detections above 0 are then not the first ones, and each
    image still keeps exactly its detections scoring above 0."""
    model = tiny("multilabel").eval()
    outputs = one_peak_outputs("multilabel")
    outputs["heatmap"][0, 0, 10, 10] = float("nan")
    (found,) = model.decode(outputs, max_detections=100)
    assert found["labels"].tolist() == [2]
    assert found["scores"].tolist() == [torch.tensor(5.0).sigmoid().item()]


def one_peak_outputs(label_mode: str) -> dict[str, torch.Tensor]:
    """A 16x16 map with one object of class 2 at cell (y=5, x=7): box centre (31, 21), 12x8 px."""
    h = w = 16
    if label_mode == "multilabel":
        heatmap = torch.full((1, NUM_CLASSES, h, w), -1000.0)  # sigmoid underflows to exactly 0
        heatmap[0, 2, 5, 7] = 5.0
    else:
        heatmap = torch.full((1, NUM_CLASSES + 1, h, w), -1000.0)
        heatmap[0, -1] = 10.0  # background everywhere
        heatmap[0, 2, 5, 7] = 30.0
    box = torch.zeros(1, NUM_CLASSES, 4, h, w)
    box[0, 2, :, 5, 7] = torch.tensor([0.25, -0.25, math.log(3.0), math.log(2.0)])
    box[0, 1, :, 5, 7] = torch.tensor([0.0, 0.0, math.log(20.0), math.log(20.0)])  # not class 2's
    return {"heatmap": heatmap, "box": box.view(1, 4 * NUM_CLASSES, h, w)}


@pytest.mark.parametrize("label_mode", ["multilabel", "single"])
def test_one_heatmap_peak_decodes_to_exactly_its_box_label_and_score(label_mode: str) -> None:
    model = tiny(label_mode)
    outputs = one_peak_outputs(label_mode)
    (found,) = model.decode(outputs, max_detections=100)
    # centre ((7 + 0.5 + 0.25) * 4, (5 + 0.5 - 0.25) * 4) = (31, 21); size (3 * 4, 2 * 4) = (12, 8)
    torch.testing.assert_close(found["boxes"], torch.tensor([[25.0, 17.0, 37.0, 25.0]]))
    assert found["labels"].tolist() == [2]
    expected = torch.sigmoid(torch.tensor(5.0)) if label_mode == "multilabel" else torch.tensor(1.0)
    torch.testing.assert_close(found["scores"], expected.view(1))


def test_two_classes_peaking_at_one_cell_decode_each_to_its_own_classs_box() -> None:
    """A small object inside a large one of another class (a nucleus in a cell, a shape in a
    ring's hole) can share its centre cell: each class has box channels of its own there."""
    model = tiny("multilabel")
    outputs = one_peak_outputs("multilabel")
    outputs["heatmap"][0, 1, 5, 7] = 4.0  # class 1 peaks at class 2's cell, with a lower score
    (found,) = model.decode(outputs, max_detections=100)
    assert found["labels"].tolist() == [2, 1]
    # class 1's box: centre (30, 22), 80 x 80 px, clipped to the 64-px input
    torch.testing.assert_close(
        found["boxes"], torch.tensor([[25.0, 17.0, 37.0, 25.0], [0.0, 0.0, 64.0, 62.0]])
    )


def window_outputs() -> dict[str, torch.Tensor]:
    """One object of class 2, 12 x 8 px with its centre at (31.5, 21): the peak cell (5, 7)
    reads its size exactly but its centre 2 px too far right; its right neighbour (5, 8), at
    half the peak's probability, reads the centre 4 px too far left and a box too small (8 x
    4 px); every other cell of class 2 reads a far-off 36-px box at probability 0 (logit -1000),
    and class 1 peaks beside it with a box of its own."""
    outputs = one_peak_outputs("multilabel")
    heatmap, box = outputs["heatmap"], outputs["box"].view(1, NUM_CLASSES, 4, 16, 16)
    heatmap[0, 2, 5, 7] = 0.0  # probability 1/2
    heatmap[0, 2, 5, 8] = -math.log(3.0)  # probability 1/4
    box[0, 2, 2:] = torch.tensor([math.log(9.0), math.log(9.0)]).view(2, 1, 1)
    # offsets from each cell's centre, in cells: peak (7.5, 5.5) -> (7.875 + 0.5, 5.25)
    box[0, 2, :, 5, 7] = torch.tensor([0.875, -0.25, math.log(3.0), math.log(2.0)])
    # right neighbour (8.5, 5.5) -> (7.875 - 1, 5.25)
    box[0, 2, :, 5, 8] = torch.tensor([-1.625, -0.25, math.log(2.0), math.log(1.0)])
    heatmap[0, 1, 4, 8] = 0.0  # another class beside the peak: its box must not count
    box[0, 1, :, 4, 8] = torch.tensor([0.0, 0.0, math.log(20.0), math.log(20.0)])
    return outputs


def test_a_3x3_window_averages_centres_by_score_to_a_sub_cell_centre_and_keeps_the_peaks_size() -> (
    None
):
    model = tiny("multilabel")
    (peak,) = model.decode(window_outputs(), max_detections=100, centre_window=1)
    (window,) = model.decode(window_outputs(), max_detections=100, centre_window=3)
    assert peak["labels"].tolist() == window["labels"].tolist() == [2, 1]
    torch.testing.assert_close(peak["scores"], window["scores"])
    # the peak cell alone: centre x (7.5 + 0.875) * 4 = 33.5, 2 px right of the object's 31.5
    torch.testing.assert_close(peak["boxes"][0], torch.tensor([27.5, 17.0, 39.5, 25.0]))
    # weighted: (1/2 * 33.5 + 1/4 * 27.5) / (3/4) = 31.5, the object's own centre, at the
    # peak's size (12 x 8), not the neighbour's
    torch.testing.assert_close(window["boxes"][0], torch.tensor([25.5, 17.0, 37.5, 25.0]))
    # the default decode is the window's
    (default,) = model.decode(window_outputs(), max_detections=100)
    torch.testing.assert_close(default["boxes"], window["boxes"])


def test_a_window_at_the_maps_corner_weighs_only_the_cells_inside_it() -> None:
    model = tiny("multilabel")
    outputs = {key: value.clone() for key, value in one_peak_outputs("multilabel").items()}
    heatmap, box = outputs["heatmap"], outputs["box"].view(1, NUM_CLASSES, 4, 16, 16)
    heatmap[0, 2, 5, 7] = -1000.0  # only the corner's object
    heatmap[0, 2, 0, 0] = 0.0  # probability 1/2, 8 x 8 px, centre (6, 2)
    box[0, 2, :, 0, 0] = torch.tensor([1.0, 0.0, math.log(2.0), math.log(2.0)])
    heatmap[0, 2, 0, 1] = -math.log(3.0)  # probability 1/4, centre (0, 2)
    box[0, 2, :, 0, 1] = torch.tensor([-1.5, 0.0, math.log(2.0), math.log(2.0)])
    (found,) = model.decode(outputs, max_detections=100, centre_window=3)
    assert found["labels"].tolist() == [2]
    # centre x (1/2 * 6 + 1/4 * 0) / (3/4) = 4, 8 px wide: 0 to 8; cells outside the map, read
    # at the nearest cell inside, would count the corner 4 times (centre x 4.8)
    torch.testing.assert_close(found["boxes"], torch.tensor([[0.0, 0.0, 8.0, 6.0]]))


@pytest.mark.parametrize("window", [0, 2, -1])
def test_decode_refuses_a_centre_window_that_is_not_an_odd_positive_number(window: int) -> None:
    with pytest.raises(ValueError, match="centre_window"):
        tiny().decode(one_peak_outputs("multilabel"), centre_window=window)


def test_image_scores_are_the_highest_class_probability_per_image() -> None:
    model = tiny()
    outputs = one_peak_outputs("multilabel")
    outputs = {key: value.repeat(2, 1, 1, 1) for key, value in outputs.items()}
    outputs["heatmap"][1, 0, 0, 0] = 0.0  # image 1 also has class 0 at probability 0.5
    scores = model.image_scores(outputs)
    assert scores.shape == (2, NUM_CLASSES)
    peak = torch.sigmoid(torch.tensor(5.0)).item()
    torch.testing.assert_close(scores, torch.tensor([[0.0, 0.0, peak], [0.5, 0.0, peak]]))


def test_image_scores_of_a_real_forward_have_shape_batch_by_classes() -> None:
    model = tiny("single").eval()
    with torch.no_grad():
        scores = model.image_scores(model(images(3, 32)))
    assert scores.shape == (3, NUM_CLASSES)
    assert ((scores >= 0) & (scores <= 1)).all()


# --- loss ------------------------------------------------------------------------------------


@pytest.mark.parametrize("label_mode", ["multilabel", "single"])
def test_loss_returns_finite_total_heatmap_and_box_terms(label_mode: str) -> None:
    model = tiny(label_mode)
    losses = DetectionLoss.for_model(model)(model(images(2, 32)), two_targets())
    assert set(losses) == {"total", "heatmap", "box"}
    for key, value in losses.items():
        assert value.dim() == 0 and math.isfinite(value.item()), key
    assert losses["total"].requires_grad
    torch.testing.assert_close(
        losses["total"].detach(), losses["heatmap"] + 2.0 * losses["box"]
    )  # default box_weight


@pytest.mark.parametrize("label_mode", ["multilabel", "single"])
def test_loss_is_finite_and_backpropagates_for_images_without_objects(label_mode: str) -> None:
    model = tiny(label_mode)
    loss_fn = DetectionLoss.for_model(model)
    for targets in ([empty_target(), empty_target()], [two_targets()[1], empty_target()]):
        losses = loss_fn(model(images(2, 32)), targets)
        assert all(math.isfinite(value.item()) for value in losses.values())
        model.zero_grad()
        losses["total"].backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
    all_empty = loss_fn(model(images(2, 32)), [empty_target(), empty_target()])
    assert all_empty["box"].item() == 0.0


def test_loss_falls_to_under_half_in_30_steps_on_a_fixed_batch() -> None:
    model = tiny()
    loss_fn = DetectionLoss.for_model(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch, targets = images(2, 32), two_targets()
    values = []
    for _ in range(30):
        total = loss_fn(model(batch), targets)["total"]
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
        values.append(total.item())
    assert all(math.isfinite(v) for v in values)
    assert values[-1] < 0.5 * values[0], values


@pytest.mark.parametrize("label_mode", ["multilabel", "single"])
def test_loss_reads_the_heatmap_in_the_models_label_mode(label_mode: str) -> None:
    assert DetectionLoss.for_model(tiny(label_mode)).label_mode == label_mode


# --- registry --------------------------------------------------------------------------------


def test_registry_lists_both_models_with_their_input_multiples() -> None:
    assert set(MODELS) == {"tiny_conv", "resnet18"}
    assert FIXED_STRIDE == {"resnet18": 32}
    assert input_multiple({"name": "tiny_conv"}) == 32  # the default max_stride


@pytest.mark.parametrize(("max_stride", "multiple"), [(32, 32), (16, 16)])
def test_tiny_conv_input_multiple_follows_max_stride(max_stride: int, multiple: int) -> None:
    config = {"name": "tiny_conv", "max_stride": max_stride}
    assert input_multiple(config) == multiple
    check_input_size(config, 48 if multiple == 16 else 64)
    with pytest.raises(ConfigError, match=f"multiple of {multiple}"):
        check_input_size(config, multiple + 8)


def test_build_model_rejects_an_unknown_name_listing_the_choices() -> None:
    with pytest.raises(
        ConfigError, match=r"Unknown model 'yolo'.*tiny_conv, resnet18.*model\.name"
    ):
        build_model("yolo", NUM_CLASSES)


def test_build_model_rejects_an_unknown_label_mode_listing_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"Unknown label_mode 'softmax'.*multilabel, single"):
        build_model("tiny_conv", NUM_CLASSES, "softmax")


def test_build_model_needs_at_least_one_class() -> None:
    with pytest.raises(ConfigError, match="num_classes=0"):
        build_model("tiny_conv", 0)


TINY_OPTIONS = {"width": 8, "max_stride": 32}


def test_build_from_config_passes_the_tiny_conv_options_to_tiny_conv_only(
    no_downloads: None,
) -> None:
    small = build_from_config({"name": "tiny_conv", "label_mode": "single", **TINY_OPTIONS}, 2)
    assert small.neck.smooth[0].out_channels == 8
    assert small.label_mode == "single" and small.num_classes == 2
    assert len(small.backbone.channels) == 4  # strides 4 to 32
    shallow = build_from_config(
        {"name": "tiny_conv", "label_mode": "single", **TINY_OPTIONS, "max_stride": 16}, 2
    )
    assert len(shallow.backbone.channels) == 3
    resnet = build_from_config(
        {"name": "resnet18", "label_mode": "multilabel", **TINY_OPTIONS, "max_stride": 16}, 2
    )
    assert resnet.neck.smooth[0].out_channels == 64
    assert len(resnet.backbone.channels) == 4


def test_max_stride_16_builds_the_earlier_tiny_conv_module_for_module() -> None:
    """The backbone and neck before max_stride existed: strides 4 to 16, nothing else."""
    names = set(build_model("tiny_conv", NUM_CLASSES, width=8, max_stride=16).state_dict())
    stages = {name.split(".")[1] for name in names if name.startswith("backbone.")}
    assert stages == {"stem", "stage4", "stage8", "stage16"}
    assert {name.split(".")[2] for name in names if name.startswith("neck.lateral.")} == {
        "0",
        "1",
        "2",
    }
    default = set(build_model("tiny_conv", NUM_CLASSES, width=8).state_dict())
    assert names < default  # the default only adds (the stride-32 stage and its lateral)
    assert {name.split(".")[1] for name in default - names} <= {"stage32", "lateral"}


def _reach_px(model: CenterNet, size: int = 256) -> float:
    """How far from the centre cell's own pixels an input pixel still changes that cell's output."""
    model.eval()
    image = torch.rand(1, 3, size, size, requires_grad=True)
    outputs = model(image)
    cell = size // STRIDE // 2
    (outputs["heatmap"][0, :, cell, cell].sum() + outputs["box"][0, :, cell, cell].sum()).backward()
    ys, xs = torch.nonzero(image.grad.abs().sum(dim=(0, 1)) > 0, as_tuple=True)
    centre = (cell + 0.5) * STRIDE
    return float(torch.maximum((xs + 0.5 - centre).abs(), (ys + 0.5 - centre).abs()).max())


def test_the_stride_4_head_sees_stride_32_context_far_beyond_the_stride_16_reach() -> None:
    """Large objects need the head's features to span them: 100 px from the centre at least."""
    torch.manual_seed(0)
    deep = build_model("tiny_conv", NUM_CLASSES, width=8)
    shallow = build_model("tiny_conv", NUM_CLASSES, width=8, max_stride=16)
    assert _reach_px(shallow) < 100 <= _reach_px(deep)


@pytest.mark.parametrize(
    ("name", "size", "multiple", "examples"),
    [
        ("tiny_conv", 50, 32, "32 or 64"),
        ("resnet18", 48, 32, "32 or 64"),
        ("tiny_conv", 8, 32, "32 or 64"),
    ],
)
def test_check_input_size_names_the_size_and_the_multiple(
    name: str, size: int, multiple: int, examples: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        check_input_size({"name": name}, size)
    message = str(caught.value)
    assert f"data.image_size={size}" in message
    assert f"multiple of {multiple}" in message
    assert f"for example {examples}" in message
    assert repr(name) in message


@pytest.mark.parametrize(("name", "size"), [("tiny_conv", 32), ("tiny_conv", 96), ("resnet18", 64)])
def test_check_input_size_accepts_multiples_of_the_stride(name: str, size: int) -> None:
    check_input_size({"name": name}, size)
