"""eval.protocol: VOC data is scored by the VOC devkit's rules (highest-IoU object without
fallback, IoU > 0.5, difficult objects neither TP nor FP, all-point AP), COCO data by
pycocotools'; the metrics name which protocol each figure follows. Cases computed by hand."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tiny_runs import (
    global_torch_state,
    make_data,
    one_cpu_thread,
    pipeline_logger_restored,
    tiny_config,
)

from pipeline import cli, formats
from pipeline.config import load_config
from pipeline.engine.trainer import Trainer
from pipeline.errors import ConfigError
from pipeline.evaluation.coco import coco_ap
from pipeline.evaluation.loop import Evaluator
from pipeline.evaluation.matching import match_voc, matched_objects, precision_recall_f1
from pipeline.evaluation.voc import voc_ap


def gt(image_id: int, boxes: list, labels: list, difficult: list | None = None) -> dict[str, Any]:
    record = {
        "image_id": image_id,
        "boxes": np.asarray(boxes, dtype=np.float32).reshape(-1, 4),
        "labels": np.asarray(labels, dtype=np.int64),
    }
    if difficult:
        record["ignore_boxes"] = np.asarray(difficult, dtype=np.float32).reshape(-1, 4)
        record["ignore_labels"] = np.zeros(len(difficult), dtype=np.int64)
    return record


def det(image_id: int, boxes: list, scores: list, labels: list) -> dict[str, Any]:
    return {
        "image_id": image_id,
        "boxes": np.asarray(boxes, dtype=np.float32).reshape(-1, 4),
        "scores": np.asarray(scores, dtype=np.float32),
        "labels": np.asarray(labels, dtype=np.int64),
    }


# Objects A [0,0,10,10] and B [1,0,11,10]; two detections on A exactly. The second one's best
# object, A (IoU 1), is taken; B (IoU 9/11 = 0.82) is free.
NO_FALLBACK_GT = gt(1, [[0, 0, 10, 10], [1, 0, 11, 10]], [0, 0])
NO_FALLBACK_DET = det(1, [[0, 0, 10, 10], [0, 0, 10, 10]], [0.9, 0.8], [0, 0])


def test_voc_matches_only_the_highest_iou_object_while_coco_falls_back_to_the_next() -> None:
    args = [NO_FALLBACK_DET[k] for k in ("boxes", "scores", "labels")]
    truth = [NO_FALLBACK_GT["boxes"], NO_FALLBACK_GT["labels"]]
    is_tp, ignored = match_voc(*args, *truth, np.zeros((0, 4)), np.zeros(0))
    assert is_tp.tolist() == [True, False] and not ignored.any()  # A is taken: a duplicate
    assert (matched_objects(*args, *truth) >= 0).tolist() == [True, True]  # COCO takes B (IoU 0.82)
    voc = precision_recall_f1([NO_FALLBACK_GT], [NO_FALLBACK_DET], 1, 0.5, protocol="voc")
    coco = precision_recall_f1([NO_FALLBACK_GT], [NO_FALLBACK_DET], 1, 0.5, protocol="coco")
    assert (voc["micro"]["tp"], voc["micro"]["fp"], voc["micro"]["fn"]) == (1, 1, 1)
    assert (coco["micro"]["tp"], coco["micro"]["fp"], coco["micro"]["fn"]) == (2, 0, 0)


def test_voc_needs_an_iou_above_the_threshold_where_coco_takes_it_at_the_threshold() -> None:
    # [0,0,10,10] against [0,0,10,20]: IoU exactly 100/200 = 0.5
    args = (np.array([[0, 0, 10, 10]]), np.array([0.9]), np.array([0]))
    truth = (np.array([[0, 0, 10, 20]]), np.array([0]))
    assert match_voc(*args, *truth, np.zeros((0, 4)), np.zeros(0))[0].tolist() == [False]
    assert (matched_objects(*args, *truth) >= 0).tolist() == [True]


def test_a_detection_whose_best_object_is_difficult_counts_neither_way_even_beside_a_free_one() -> (
    None
):
    # difficult D [0,0,10,10]; normal N [0,0,10,12] (IoU 10/12 with the detection, below D's 1.0)
    truth = gt(1, [[0, 0, 10, 12]], [0], difficult=[[0, 0, 10, 10]])
    found = det(1, [[0, 0, 10, 10], [30, 30, 40, 40]], [0.9, 0.8], [0, 0])
    is_tp, ignored = match_voc(
        found["boxes"], found["scores"], found["labels"], truth["boxes"], truth["labels"],
        truth["ignore_boxes"], truth["ignore_labels"],
    )  # fmt: skip
    assert is_tp.tolist() == [False, False] and ignored.tolist() == [True, False]
    counts = precision_recall_f1([truth], [found], 1, 0.5, protocol="voc")
    # the difficult object is not counted: one object (N) missed, one false positive
    assert (counts["micro"]["tp"], counts["micro"]["fp"], counts["micro"]["fn"]) == (0, 1, 1)
    assert counts["num_ignored_detections"] == 1


# Three objects over two images, four detections ranked TP, FP, TP, FP (one object missed):
# recall 1/3, 1/3, 2/3, 2/3 and precision 1, 1/2, 2/3, 1/2. All-point AP (VOC2010+):
# 1/3 * 1 + 1/3 * 2/3 = 5/9. COCO's 101 points: recall <= 0.33 (34 points) at 1, then
# 0.34..0.66 (33 points) at 2/3: (34 + 33 * 2/3) / 101.
RANKED_GTS = [gt(1, [[0, 0, 10, 10], [20, 20, 30, 30]], [0, 0]), gt(2, [[0, 0, 20, 20]], [0])]
RANKED_DETS = [
    det(1, [[0, 0, 10, 10], [50, 50, 60, 60]], [0.9, 0.8], [0, 0]),
    det(2, [[0, 0, 20, 20], [40, 40, 60, 60]], [0.7, 0.6], [0, 0]),
]


def test_voc_ap_is_the_all_point_area_under_the_precision_envelope() -> None:
    found = voc_ap(RANKED_GTS, RANKED_DETS, 1, intervals=True)
    assert found["ap50"] == pytest.approx(5 / 9, abs=1e-12)
    assert found["per_class"][0]["ap50"] == pytest.approx(5 / 9, abs=1e-12)
    interval = found["ap50_interval"]
    assert interval["low"] <= 5 / 9 <= interval["high"] and interval["images"] == 2
    coco = coco_ap(RANKED_GTS, RANKED_DETS, 1, ["a"])
    assert coco["ap50"] == pytest.approx((34 + 33 * 2 / 3) / 101, abs=1e-6)


def test_voc2007_interpolates_at_eleven_recall_points() -> None:
    # recall 1/3 at precision 1 reaches 0, .1, .2, .3; recall 2/3 at 2/3 reaches .4, .5, .6
    found = voc_ap(RANKED_GTS, RANKED_DETS, 1, eleven_points=True)
    assert found["ap50"] == pytest.approx((4 + 3 * 2 / 3) / 11, abs=1e-12)
    evaluator = Evaluator(["a"], label_mode="single", protocol="voc2007")
    metrics = evaluator._metrics(RANKED_GTS, RANKED_DETS, [])
    assert metrics["figure_protocols"]["ap50"] == "voc2007"
    assert metrics["figure_protocols"]["f1"] == "voc"
    assert metrics["ap50"] == pytest.approx((4 + 3 * 2 / 3) / 11, abs=1e-12)


def test_a_class_without_objects_has_no_voc_ap_and_the_mean_leaves_it_out() -> None:
    found = voc_ap(RANKED_GTS, [*RANKED_DETS[:1], det(2, [[0, 0, 5, 5]], [0.5], [1])], 2)
    assert found["per_class"][1]["ap50"] is None
    assert found["ap50"] == found["per_class"][0]["ap50"]


def test_the_evaluator_names_the_protocol_of_each_figure() -> None:
    voc = Evaluator(["a"], label_mode="single", protocol="voc")
    metrics = voc._metrics(RANKED_GTS, RANKED_DETS, [], ap_intervals=True)
    assert metrics["protocol"] == "voc"
    assert metrics["figure_protocols"]["f1"] == metrics["figure_protocols"]["ap50"] == "voc"
    assert metrics["figure_protocols"]["ap"] == metrics["figure_protocols"]["ap75"] == "coco"
    assert metrics["ap50"] == pytest.approx(5 / 9) and metrics["per_class"][0]["ap50"] == (
        pytest.approx(5 / 9)
    )
    coco = Evaluator(["a"], label_mode="single")
    plain = coco._metrics(RANKED_GTS, RANKED_DETS, [])
    assert plain["protocol"] == "coco" and set(plain["figure_protocols"].values()) == {"coco"}
    assert plain["ap50"] == pytest.approx((34 + 33 * 2 / 3) / 101, abs=1e-6)
    assert plain["ap"] == metrics["ap"]  # AP@[.5:.95] is COCO's under either


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (["data.format=voc"], "voc"),
        (["data.format=coco"], "coco"),
        ([], "coco"),  # the synthetic set is COCO-format
        (["data.format=voc", "eval.protocol=coco"], "coco"),
        (["eval.protocol=voc"], "voc"),
        (["eval.protocol=voc2007"], "voc2007"),
    ],
)
def test_eval_protocol_auto_is_the_data_sets_own_format(settings, expected, tmp_path) -> None:
    config = load_config(None, [f"data.root={tmp_path}", *settings])
    assert Evaluator.from_config(config, ["a"]).protocol == expected


def test_an_unknown_protocol_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="protocol"):
        load_config(None, ["eval.protocol=kitti"])


def voc_copy(coco_root: Path, folder: Path) -> Path:
    """The tiny synthetic set as Pascal VOC (1-based inclusive pixel boxes), every third object
    of the test split marked difficult."""
    (folder / "JPEGImages").mkdir(parents=True)
    (folder / "Annotations").mkdir()
    (folder / "ImageSets" / "Main").mkdir(parents=True)
    for split in ("train", "val", "test"):
        document = json.loads((coco_root / f"instances_{split}.json").read_text())
        names = {c["id"]: c["name"] for c in document["categories"]}
        listed = []
        for image in document["images"]:
            name = f"{split}_{image['id']:04d}"
            listed.append(name)
            shutil.copy(coco_root / image["file_name"], folder / "JPEGImages" / f"{name}.png")
            objects = [a for a in document["annotations"] if a["image_id"] == image["id"]]
            xml = "".join(
                f"<object><name>{names[a['category_id']]}</name>"
                f"<difficult>{int(split == 'test' and index % 3 == 2)}</difficult><bndbox>"
                f"<xmin>{a['bbox'][0] + 1}</xmin><ymin>{a['bbox'][1] + 1}</ymin>"
                f"<xmax>{a['bbox'][0] + a['bbox'][2]}</xmax>"
                f"<ymax>{a['bbox'][1] + a['bbox'][3]}</ymax></bndbox></object>"
                for index, a in enumerate(objects)
            )
            (folder / "Annotations" / f"{name}.xml").write_text(
                f"<annotation><filename>{name}.png</filename><size><width>{image['width']}"
                f"</width><height>{image['height']}</height></size>{xml}</annotation>"
            )
        (folder / "ImageSets" / "Main" / f"{split}.txt").write_text("\n".join(listed) + "\n")
    return folder


def test_evaluate_on_voc_data_follows_the_voc_protocol_and_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_pipeline_logger
) -> None:
    root = voc_copy(make_data(tmp_path / "shapes"), tmp_path / "voc")
    with global_torch_state(), one_cpu_thread(), pipeline_logger_restored():
        Trainer(tiny_config(root, "data.format=voc", "train.epochs=1"), tmp_path / "run").fit()
        monkeypatch.chdir(tmp_path)  # away from the repository's config/config.yaml
        found = {}
        for protocol in ("auto", "coco"):
            out = tmp_path / f"{protocol}.json"
            argv = [
                "--cpu-threads",
                "1",
                "evaluate",
                "--checkpoint",
                str(tmp_path / "run/best.pth"),
            ]
            assert cli.main([*argv, "--out", str(out), f"eval.protocol={protocol}"]) == 0
            found[protocol] = json.loads(out.read_text())
    voc, coco = found["auto"], found["coco"]
    assert formats.problem(voc, "eval") is None and formats.problem(coco, "eval") is None
    assert voc["metrics"]["protocol"] == "voc" and coco["metrics"]["protocol"] == "coco"
    assert voc["metrics"]["figure_protocols"]["ap50"] == "voc"
    assert voc["metrics"]["figure_protocols"]["ap"] == "coco"
    assert voc["metrics"]["ap"] == coco["metrics"]["ap"]  # COCO's AP@[.5:.95] under either
