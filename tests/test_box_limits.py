"""benchmarks/box_limits.py: the ground-truth oracles that tell centre error from size error."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from benchmark_modules import load
from tiny_runs import (
    global_torch_state,
    make_data,
    one_cpu_thread,
    pipeline_logger_restored,
    tiny_config,
)

from pipeline import formats
from pipeline.engine.trainer import Trainer
from pipeline.models import build_model

box_limits = load("box_limits")


def image(boxes, scores, labels) -> dict:
    return {
        "image_id": 1,
        "boxes": np.asarray(boxes, np.float32).reshape(-1, 4),
        "scores": np.asarray(scores, np.float32),
        "labels": np.asarray(labels, np.int64),
    }


TRUTH = [image([[10, 10, 30, 20], [50, 50, 90, 90]], [1, 1], [0, 1])]
# the first object found 2 px right and 20% too wide; a second, weaker detection of it; a
# detection of the second object of the wrong class; a miss far away
DETS = [
    image(
        [[10, 10, 34, 20], [11, 10, 31, 20], [50, 50, 90, 90], [0, 0, 5, 5]],
        [0.9, 0.5, 0.8, 0.7],
        [0, 0, 0, 0],
    )
]


def test_matches_are_greedy_by_score_within_a_class_at_iou_one_half() -> None:
    assert box_limits.matches(DETS[0], TRUTH[0]).tolist() == [0, -1, -1, -1]


def test_each_oracle_replaces_only_what_it_names_and_only_for_matched_detections() -> None:
    (size,) = box_limits.oracle(DETS, TRUTH, "oracle_size")
    (centre,) = box_limits.oracle(DETS, TRUTH, "oracle_centre")
    (box,) = box_limits.oracle(DETS, TRUTH, "oracle_box")
    # the matched detection: centre (22, 15), 24 x 10; its object: centre (20, 15), 20 x 10
    np.testing.assert_allclose(size["boxes"][0], [12, 10, 32, 20])
    np.testing.assert_allclose(centre["boxes"][0], [8, 10, 32, 20])
    np.testing.assert_allclose(box["boxes"][0], TRUTH[0]["boxes"][0])
    for fixed in (size, centre, box):
        np.testing.assert_array_equal(fixed["boxes"][1:], DETS[0]["boxes"][1:])
        np.testing.assert_array_equal(fixed["scores"], DETS[0]["scores"])


def test_errors_measure_the_matched_boxes_bias_and_the_double_peaks_above_the_threshold() -> None:
    found = box_limits.errors(DETS, TRUTH, threshold=0.4)
    # one match: centre off by 2 px of a 20-px width (0.1) and 0 of 10 px; width log(1.2)
    np.testing.assert_allclose(found["centre_error"], 0.05, rtol=1e-5)
    np.testing.assert_allclose(found["size_bias"], np.log(1.2) / 2, rtol=1e-5)
    assert found["double_peaks"] == 1.0  # the one object found is found twice above 0.4
    assert box_limits.errors(DETS, TRUTH, threshold=0.6)["double_peaks"] == 0.0


def test_the_centre_cell_bias_reads_each_objects_own_class_channels_at_its_own_centre_cell() -> (
    None
):
    """The regression's size bias apart from the heatmap: the box its class's channels give at
    the cell the targets centre it in, whatever the other cells and classes say."""
    import torch

    regression = torch.zeros(1, 8, 16, 16)  # 2 classes, stride 4: a 64-px input
    regression[0, 6:8] = 5.0  # class 1's sizes everywhere: far off
    # object of class 1, 20 x 10 px centred at (30, 15): cell (7, 3); 10% wider, as tall
    regression[0, 6, 3, 7] = np.log(20 * 1.1 / 4)
    regression[0, 7, 3, 7] = np.log(10 / 4)
    regression[0, 2:4, 3, 7] = 3.0  # class 0's channels at that cell: not this object's
    truth = [{"boxes": np.array([[20.0, 10.0, 40.0, 20.0]], np.float32), "labels": np.array([1])}]
    found = box_limits.centre_cell_bias([{"box": regression}], truth, stride=4)
    # its width and height: log(1.1) and 0, median of the two
    np.testing.assert_allclose(found["size_bias"], np.log(1.1) / 2, rtol=1e-4)
    np.testing.assert_allclose(found["size_bias_small"], np.log(1.1) / 2, rtol=1e-4)
    assert found["size_bias_large"] is None


def test_val_bias_rescales_every_box_about_its_centre() -> None:
    (fixed,) = box_limits.rescaled(DETS, np.log(2.0))
    np.testing.assert_allclose(fixed["boxes"][0], [-2, 5, 46, 25])  # 24 x 10 at (22, 15), doubled
    np.testing.assert_array_equal(fixed["scores"], DETS[0]["scores"])


def test_a_trained_checkpoint_gets_a_record_of_every_variant_and_both_decode_times(
    tmp_path: Path,
) -> None:
    with global_torch_state(), one_cpu_thread(), pipeline_logger_restored():
        trainer = Trainer(tiny_config(make_data(tmp_path / "shapes")), tmp_path / "run")
        trainer.fit()
        record = tmp_path / "box_limits.json"
        argv = ["--checkpoint", str(trainer.paths["best"]), "--set", "shapes", "--rounds", "1"]
        argv += ["--cpu-threads", "1", "--record", str(record), "--out", str(tmp_path / "o.json")]
        assert box_limits.main(argv) == 0
    document = json.loads(record.read_text(encoding="utf-8"))
    assert formats.problem(document, "benchmark_record") is None
    keys = {figure["key"] for figure in document["figures"]}
    for variant in ("centre1", "centre3", *box_limits.ORACLES, "oracle_bias", "val_bias"):
        assert f"{variant}.ap" in keys
    assert "centre_cell.size_bias" in keys
    assert {"centre1.decode_ms", "centre3.decode_ms", "decode_ratio"} <= keys
    assert document["settings"]["set"] == "shapes" and document["settings"]["split"] == "test"


def test_flip_test_reads_the_maps_as_evaluation_does_with_eval_flip_test() -> None:
    with global_torch_state(), one_cpu_thread():
        torch.manual_seed(0)
        model = build_model("tiny_conv", 2, width=8).eval()
        images = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8)
        empty = torch.zeros((0, 4))
        target = {"image_id": 1, "boxes": empty, "labels": torch.zeros(0, dtype=torch.int64)}
        target |= {"ignore_boxes": empty, "ignore_labels": torch.zeros(0, dtype=torch.int64)}
        loader = [(images, [target, target | {"image_id": 2}])]
        with torch.inference_mode():
            both, plain = model(images, flip_test=True), model(images)
        for flip_test, expected in ((True, both), (False, plain)):
            (outputs,), truth = box_limits.forward_pass(model, loader, flip_test)
            assert [t["image_id"] for t in truth] == [1, 2]
            for key, value in expected.items():
                assert torch.equal(outputs[key], value.float()), (flip_test, key)
