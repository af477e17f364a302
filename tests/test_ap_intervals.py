"""AP's intervals over images: resamples as an array dimension must keep the coverage of the
bootstrap they replace (one resample at a time, per class, IoU threshold and size range)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from pipeline.evaluation import intervals, weighted_ap
from pipeline.evaluation.coco import coco_ap

REFERENCE = Path(__file__).parent / "data" / "ap_intervals_reference.json"
CLASSES = ["a", "b", "c", "d"]


def interval_scene(images: int = 150, seed: int = 11) -> tuple[list[dict], list[dict]]:
    """Objects of four classes from 5 to 100 px (every size bucket), found with jitter, wrong
    classes, misses and clutter, some images with a crowd region: what the reference holds the
    intervals of."""
    rng = np.random.default_rng(seed)
    gts, dets = [], []
    for image_id in range(1, images + 1):
        count = int(rng.integers(0, 6))
        sides = np.exp(rng.uniform(np.log(5), np.log(100), size=(count, 1))) * [1, 1]
        sides *= rng.uniform(0.7, 1.3, size=(count, 2))
        corners = rng.uniform(0, 128 - sides)
        boxes = np.concatenate([corners, corners + sides], axis=1)
        labels = rng.integers(0, len(CLASSES), size=count)
        truth: dict[str, Any] = {"image_id": image_id, "boxes": boxes, "labels": labels}
        if rng.random() < 0.2:
            corner = rng.uniform(0, 80, size=2)
            truth["ignore_boxes"] = np.concatenate([corner, corner + 40])[None]
            truth["ignore_labels"] = rng.integers(0, len(CLASSES), size=1)
        gts.append(truth)
        found = rng.random(count) < 0.85
        noisy = boxes[found] + rng.normal(0, 0.08, size=(int(found.sum()), 4)) * np.repeat(
            sides[found], 2, axis=1
        )
        noisy_labels = np.where(
            rng.random(int(found.sum())) < 0.1, (labels[found] + 1) % len(CLASSES), labels[found]
        )
        clutter = int(rng.integers(0, 4))
        corners = rng.uniform(0, 100, size=(clutter, 2))
        clutter_boxes = np.concatenate([corners, corners + rng.uniform(5, 28, (clutter, 2))], 1)
        scores = np.concatenate(
            [rng.uniform(0.3, 1.0, int(found.sum())), rng.uniform(0.0, 0.7, clutter)]
        )
        dets.append(
            {
                "image_id": image_id,
                "boxes": np.concatenate([noisy, clutter_boxes]),
                "scores": scores,
                "labels": np.concatenate([noisy_labels, rng.integers(0, len(CLASSES), clutter)]),
            }
        )
    return gts, dets


def intervals_of(result: dict[str, Any]) -> dict[str, dict[str, float] | None]:
    """Every interval of a coco_ap result, by a flat name."""
    found = {name: result[f"{name}_interval"] for name in ("ap", "ap50", "ap75")}
    for row in result["per_class"]:
        for name in ("ap", "ap50"):
            found[f"class {row['name']} {name}"] = row[f"{name}_interval"]
    for bucket, row in result["size_buckets"].items():
        for name in ("ap", "ap50", "recall"):
            found[f"{bucket} {name}"] = row[f"{name}_interval"]
    return {
        key: None
        if value is None
        else {"low": value["low"], "high": value["high"], "shift": value.get("shift", 0.0)}
        for key, value in found.items()
    }


def test_every_ap_interval_matches_the_per_resample_bootstrap_within_a_point() -> None:
    """tests/data/ap_intervals_reference.json holds the intervals the per-resample bootstrap
    gave on this scene (commit named in the file), percentile intervals of its resamples:
    the array form's resamples must give the same coverage: every interval, moved back by the
    shift that centres it on its figure, within a point of it, on the same figures."""
    reference = json.loads(REFERENCE.read_text())
    gts, dets = interval_scene()
    result = coco_ap(gts, dets, len(CLASSES), CLASSES, 0.5, ap_intervals=True)
    assert {name: result[name] for name in ("ap", "ap50", "ap75")} == pytest.approx(
        reference["figures"], abs=1e-12
    )
    found = intervals_of(result)
    assert found.keys() == reference["intervals"].keys()
    assert sum(value is not None for value in found.values()) >= 18  # every bucket, class, IoU
    for name, expected in reference["intervals"].items():
        if expected is None:
            assert found[name] is None, name
        else:
            shift = found[name]["shift"]
            assert found[name]["low"] + shift == pytest.approx(expected["low"], abs=0.01), name
            assert found[name]["high"] + shift == pytest.approx(expected["high"], abs=0.01), name


def pycocotools_accumulate(ranking: Any, weights: np.ndarray, area: int, iou: int) -> float:
    """One class's AP in one area range at one IoU with every image counted `weights` times,
    as COCOeval.accumulate computes it on its own matches: tp and fp running sums, precision
    made monotone from the right, read at the first detection reaching each recall point."""
    drawn = weights[ranking.image_index]
    counted, is_tp = ranking.counted[area, iou], ranking.is_tp[area, iou]
    objects = int(ranking.gt_per_image[area] @ weights)
    if objects == 0:
        return float("nan")
    tps = np.cumsum(np.where(is_tp, drawn, 0)[counted]).astype(np.float64)
    fps = np.cumsum(np.where(is_tp, 0, drawn)[counted]).astype(np.float64)
    precision = np.maximum.accumulate((tps / (tps + fps + np.spacing(1)))[::-1])[::-1]
    reached = np.searchsorted(tps / objects, np.linspace(0.0, 1.0, 101), side="left")
    return float(np.mean([precision[i] if i < precision.size else 0.0 for i in reached]))


def voc_devkit_ap(matches: Any, weights: np.ndarray) -> float:
    """All-point AP (the VOC devkit's) of one class's matches with images counted `weights`
    times."""
    drawn = weights[matches.image_index]
    objects = int(matches.gt_per_image @ weights)
    if objects == 0:
        return float("nan")
    tps = np.cumsum(np.where(matches.is_tp, drawn, 0)).astype(np.float64)
    fps = np.cumsum(np.where(matches.is_tp, 0, drawn)).astype(np.float64)
    recall = np.concatenate([[0.0], tps / objects, [1.0]])
    precision = np.concatenate(
        [[0.0], tps / np.maximum(tps + fps, np.finfo(np.float64).eps), [0.0]]
    )
    precision = np.maximum.accumulate(precision[::-1])[::-1]
    steps = np.flatnonzero(recall[1:] != recall[:-1]) + 1
    return float(((recall[steps] - recall[steps - 1]) * precision[steps]).sum())


def captured_rankings(monkeypatch, images: int) -> list[Any]:
    """The class rankings coco_ap hands to the intervals, on interval_scene."""
    from pipeline.evaluation import coco

    seen: list[Any] = []

    def spy(rankings: list[Any], count: int, *args: Any, **kwargs: Any) -> Any:
        seen.extend(rankings)
        return intervals.resampled_ap(rankings, count, 4)

    monkeypatch.setattr(coco, "resampled_ap", spy)
    gts, dets = interval_scene(images, seed=5)
    coco_ap(gts, dets, len(CLASSES), CLASSES, 0.5, ap_intervals=True)
    return seen


def test_every_resamples_ap_is_cocoeval_accumulate_on_the_reweighed_matches(monkeypatch) -> None:
    """Each resample's AP, in every area range at every IoU, is what COCOeval.accumulate
    computes with the images drawn that often (draws of 0 to 3, as a bootstrap gives)."""
    rankings = captured_rankings(monkeypatch, 120)
    weights = np.random.default_rng(3).integers(0, 4, size=(120, 25))
    compared = 0
    for ranking in rankings:
        found = weighted_ap.ranked_ap(ranking, weights)
        areas, ious, _ = ranking.is_tp.shape
        for area in range(areas):
            for iou in range(ious):
                expected = [
                    pycocotools_accumulate(ranking, weights[:, r], area, iou) for r in range(25)
                ]
                assert found[area, iou] == pytest.approx(expected, abs=1e-12, nan_ok=True)
                compared += int(np.isfinite(expected).sum())
    assert compared > 3000  # classes x area ranges x IoUs x resamples with objects


def test_every_resamples_all_point_ap_is_the_voc_devkits_on_the_reweighed_matches(
    monkeypatch,
) -> None:
    rankings = captured_rankings(monkeypatch, 120)
    weights = np.random.default_rng(4).integers(0, 4, size=(120, 25))
    for ranking in rankings:
        matches = ranking.matches(0, 0)
        found = weighted_ap.ranked_ap(matches.ranking(), weights, None)[0, 0]
        expected = [voc_devkit_ap(matches, weights[:, r]) for r in range(25)]
        assert found == pytest.approx(expected, abs=1e-12, nan_ok=True)


def test_intervals_on_several_threads_are_those_on_one(monkeypatch) -> None:
    """Blocks of resamples computed side by side give every interval bit for bit."""
    monkeypatch.setattr(intervals, "_RESAMPLE_BLOCK", 1)  # ten blocks of the fewest resamples
    gts, dets = interval_scene(90, seed=8)
    one, two = (
        coco_ap(gts, dets, len(CLASSES), CLASSES, 0.5, True, threads=threads) for threads in (1, 2)
    )
    assert intervals_of(one) == intervals_of(two)
    assert sum(value is not None for value in intervals_of(one).values()) >= 18


def test_resamples_are_the_same_whether_classes_or_blocks_go_side_by_side(monkeypatch) -> None:
    """Every class's resampled AP, bit for bit, whether computed on one thread, with classes
    side by side (no more threads than classes), or with each class's blocks of resamples
    divided between threads (more threads than classes)."""
    rankings = captured_rankings(monkeypatch, 90)
    monkeypatch.setattr(intervals, "_RESAMPLE_BLOCK", 1)  # several blocks of the fewest resamples
    serial, *parallel = (
        intervals.resampled_ap(rankings, 90, resamples=400, threads=threads).by_class
        for threads in (1, 2, len(rankings) + 1)
    )
    assert serial.shape == (4, 10, len(rankings), 400) and np.isfinite(serial).sum() > 10_000
    for found in parallel:
        np.testing.assert_array_equal(found, serial)


def test_blocks_computed_side_by_side_share_the_cpus_with_blas_and_give_them_back(
    monkeypatch,
) -> None:
    """Two workers on two threads: BLAS (the sums' matrix products) runs one thread in each,
    not two more apiece (ten times slower where other work shares the machine), and its own
    setting is back afterwards."""
    rankings = captured_rankings(monkeypatch, 60)
    seen: list[int] = []
    ranked_ap = intervals.ranked_ap

    def watching(*args: Any, **kwargs: Any) -> np.ndarray:
        seen.extend(pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas")
        return ranked_ap(*args, **kwargs)

    monkeypatch.setattr(intervals, "ranked_ap", watching)
    monkeypatch.setattr(intervals, "_RESAMPLE_BLOCK", 1)  # blocks of the fewest resamples
    with threadpool_limits(2, user_api="blas"):
        intervals.resampled_ap(rankings, 60, resamples=400, threads=2)
        after = [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]
    assert seen and set(seen) == {1}
    assert after and set(after) == {2}


@pytest.mark.parametrize("float32_exact", [1 << 24, 8])  # 8: float64 from the first block
def test_weighted_sums_are_each_resamples_running_sums_at_the_positions(
    monkeypatch, float32_exact: int
) -> None:
    """The sums the intervals read: each resample's weight of the members ranked at or above
    each position, members of one image falling together between two positions included, and
    each resample's objects; the same integers whether summed in float32 or (where float32
    could round) float64."""
    from pipeline.evaluation import weighted_sums

    monkeypatch.setattr(weighted_sums, "_FLOAT32_EXACT", float32_exact)
    rng = np.random.default_rng(7)
    images = 30
    sums, weights, expected = _sums_at_random_positions(rng, images, 400, 0.6, 40, 17)
    found = sums(weighted_sums.Weights(weights))
    assert found.dtype == (np.float32 if float32_exact == 1 << 24 else np.float64)
    np.testing.assert_array_equal(found, expected)
    counts = rng.integers(0, 9, (4, images))  # objects by image, per area range
    weighed = weighted_sums.Weights(weights).weighed(counts)
    np.testing.assert_array_equal(weighed, counts.astype(np.int64) @ weights.astype(np.int64))


def test_weighted_sums_hold_under_torchs_kernel_without_mkl(monkeypatch) -> None:
    """Torch built without MKL (macOS) multiplies addmm's output by beta before adding the
    product, so with beta 0 an uninitialised buffer's NaN would survive: the sums must not
    depend on what memory held before (np.empty filled with NaN here, that kernel stood in)."""
    import torch

    from pipeline.evaluation import weighted_sums

    def without_mkl(input, mat1, mat2, *, beta=1, alpha=1, out):
        out.mul_(beta)  # as at::native addmm_out_sparse_csr_native_cpu does
        return out.add_(torch.mm(mat1, mat2), alpha=alpha)

    sums, weights, expected = _sums_at_random_positions(
        np.random.default_rng(3), 12, 90, 0.5, 15, 9
    )
    empty = np.empty
    monkeypatch.setattr(torch, "addmm", without_mkl)
    monkeypatch.setattr(np, "empty", lambda *a, **k: np.full_like(empty(*a, **k), np.nan))
    found = sums(weighted_sums.Weights(weights))
    monkeypatch.undo()
    np.testing.assert_array_equal(found, expected)


def _sums_at_random_positions(
    rng: np.random.Generator, images: int, ranked: int, share: float, positions: int, resamples: int
):
    """A ranking's `SumsAt` (members: about `share` of the ranks) at random positions, random
    image weights [images, resamples], and the sums they must give, counted rank by rank."""
    from pipeline.evaluation import weighted_sums

    image_index = rng.integers(0, images, ranked)
    members = np.flatnonzero(rng.random(ranked) < share)
    at = np.unique(rng.choice(ranked, positions, replace=False))
    weights = rng.integers(0, 5, (images, resamples)).astype(np.int32)
    drawn = np.zeros((ranked, resamples), dtype=np.int64)
    drawn[members] = weights[image_index[members]]
    sums = weighted_sums.SumsAt(image_index, members, at, images)
    return sums, weights, np.cumsum(drawn, axis=0)[at]


@pytest.mark.parametrize(
    "thresholds",
    [weighted_ap.RECALL_THRESHOLDS, np.linspace(0.0, 1.0, 11), np.array([-0.1, 1 / 3, 0.7, 1.5])],
)
def test_recall_point_tables_count_the_thresholds_each_recall_reaches(thresholds) -> None:
    """The tables of recall thresholds reached by n of N objects, made from the fewest n that
    reach each threshold: for every n of every N, how many thresholds n / N (in float64, as
    COCOeval.accumulate divides) reaches, ties and rounding included (COCO's 101 points,
    VOC's 11, thresholds below 0 and above 1)."""
    counts = np.concatenate([np.arange(0, 1500), [2047, 4099, 65537]])
    expected = [
        np.searchsorted(thresholds, np.arange(n + 1) / max(n, 1), side="right") for n in counts
    ]
    found = weighted_ap._tables(counts, thresholds)
    assert found.dtype == np.uint8
    np.testing.assert_array_equal(found, np.concatenate(expected))


def test_blocks_computed_side_by_side_run_torch_on_one_thread_each_and_give_them_back(
    monkeypatch,
) -> None:
    """The sums' sparse products are torch's: in each of two workers on two threads, torch
    runs one thread, not two more apiece, set in the worker itself before its first product
    (MKL's products take no count from another thread), and its own setting is back
    afterwards."""
    import threading

    import torch

    rankings = captured_rankings(monkeypatch, 60)
    seen: list[tuple[int, int | None]] = []
    ranked_ap = intervals.ranked_ap
    set_in: dict[int, int] = {}
    set_num_threads = torch.set_num_threads

    def setting(count: int) -> None:
        set_in[threading.get_ident()] = count
        set_num_threads(count)

    def watching(*args: Any, **kwargs: Any) -> np.ndarray:
        seen.append((torch.get_num_threads(), set_in.get(threading.get_ident())))
        return ranked_ap(*args, **kwargs)

    monkeypatch.setattr(torch, "set_num_threads", setting)

    monkeypatch.setattr(intervals, "ranked_ap", watching)
    monkeypatch.setattr(intervals, "_RESAMPLE_BLOCK", 1)  # blocks of the fewest resamples
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        intervals.resampled_ap(rankings, 60, resamples=400, threads=2)
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {(1, 1)}
    assert after == 2


def test_ap_intervals_hold_their_figures_where_resampling_raises_ap_beyond_its_spread() -> None:
    """detection_workload's COCO-scale workload (80 classes, a hundred detections per image,
    most of them false positives) on 100 images: a resample's AP lies above the figure by
    more than the resamples spread (the precision envelope is a running maximum, and images
    drawn twice lift it), so the plain percentile interval lay wholly above AP@.5. Every AP
    interval, COCO's and the VOC devkit's, holds its figure, with the spread kept."""
    from benchmark_modules import load

    from pipeline.evaluation.voc import voc_ap

    workload = load("detection_workload")
    gts, dets = workload.coco_scale(100, seed=100)
    names = [f"class{c}" for c in range(workload.COCO_CLASSES)]
    result = coco_ap(gts, dets, workload.COCO_CLASSES, names, 0.5, ap_intervals=True)
    figures = {name: result[name] for name in ("ap", "ap50", "ap75")}
    for row in result["per_class"]:
        figures.update({f"class {row['name']} {name}": row[name] for name in ("ap", "ap50")})
    for bucket, row in result["size_buckets"].items():
        figures.update({f"{bucket} {name}": row[name] for name in ("ap", "ap50")})
    found = intervals_of(result)
    voc = voc_ap(gts, dets, workload.COCO_CLASSES, intervals=True)
    figures["voc ap50"], found["voc ap50"] = voc["ap50"], voc["ap50_interval"]
    for label, row in enumerate(voc["per_class"]):
        figures[f"voc {label} ap50"], found[f"voc {label} ap50"] = row["ap50"], row["ap50_interval"]
    held = [name for name, value in figures.items() if value is not None]
    assert len(held) > 150  # the means, every class, the buckets, VOC's
    for name in held:
        assert found[name]["low"] <= figures[name] <= found[name]["high"], name
    # a workload where it matters: the resamples' median lay further above AP@.5 than their
    # 97.5th percentile above their median
    assert found["ap50"]["shift"] > found["ap50"]["high"] - result["ap50"] > 0
