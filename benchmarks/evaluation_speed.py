"""Evaluation speed: what evaluation costs per image as the work grows, and beside the model.

Two parts, one run.

COCO scale, no model: `detection_workload.coco_scale`'s 80 classes, 1 to 15 objects per image
and 100 detections each, made from the ground truth with noise. Timed: what `evaluate` computes
from detections (matching and P/R/F1 with their intervals, COCO AP with the size buckets, every
AP interval), at --small and --large images (default 1,000 and 5,000). Target: time per image
at the larger size at most 1.5 x that at the smaller (evaluation linear in its work).

Default size: the generated data set's validation and test splits (2,304 images of 128 px by
default) through `Evaluator.evaluate` as `python -m pipeline evaluate` runs it (validation
first, its best-F1 threshold applied to test, AP intervals on test), the default model's
forward pass timed apart from everything else: decoding the images, the model's own decoding of
its outputs, matching, COCO AP and the intervals. The model is untrained, so its detections are
replaced, after its decoding ran, by detections made from the ground truth as above
(`detection_workload.noisy_detections`): a trained model's number of detections and matches,
without training one here (made before each split's evaluation, outside the timed work). Its
decoding works out every top-K box, without eval.min_score, under which an untrained model's
scores sit: more than a trained model's floor leaves. With --checkpoint (a default run's
best.pth, as `make report` or `report_time.py --keep` leave it), it is that run's own
evaluation instead: `python -m pipeline evaluate` as the evaluate rule runs it (predictions
written too), in this process after one untimed run that pays the imports, with the
checkpoint's precision and detections; the forward pass is the eval JSON's own timing of it.
Target: everything else at most as long as the forward pass.

Repeated: one run's figures swing (the forward pass most: oneDNN's kernels, the machine), so
that one run may pass a target and the next fail it. Each part is timed --repeats times
(default 5): the default-size evaluation in N runs, the COCO scale in N rounds of one run of
each size, the first of them alternating (ABBA). Times are the medians of the runs, with
their smallest and largest; each ratio is the median of the per-run (per-round) ratios, both
halves of one taken in the same run, with its 95% bootstrap interval over the runs
(`stats.paired_speedup`). The verdict reads that median; its line shows the interval and
says where it crosses the target, where another N runs may well read the other way.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import numpy as np
import torch
from detection_workload import COCO_CLASSES, DETECTIONS, coco_scale, noisy_detections
from repeated_runs import Times, paired_ratio, ratio_figure, spread, spread_figures, with_spread

from pipeline import stats, timing
from pipeline.config import load_config, merge, parse_overrides
from pipeline.data import load_split
from pipeline.data.dataset import loader_for
from pipeline.engine import checkpoint
from pipeline.evaluation.coco import coco_ap
from pipeline.evaluation.loop import Evaluator
from pipeline.evaluation.matching import precision_recall_f1
from pipeline.models import build_from_config
from pipeline.models.inference import for_inference

NAME = "evaluation_speed"
SCALE_TARGET = 1.5  # time per image, larger / smaller set
ELSE_TARGET = 1.0  # everything but the forward pass / the forward pass


# how the passes divide what they spend beside the forward pass (the eval JSON's timing keys)
PASS_PARTS = {
    "postprocess_s": "the model's decoding of its outputs",
    "loader_s": "waiting for the loader's batches",
    "metrics_s": "matching, P/R/F1, COCO AP and the intervals",
}


def parts_of(passes: list[dict[str, Any]], else_s: float) -> dict[str, float]:
    """Everything but the forward pass, divided: each pass part summed over the passes (their
    eval JSON timing), and the rest outside the passes (loading the splits and decoding their
    images, the checkpoint and the model, writing the files)."""
    parts = {key: sum(metrics["timing"][key] for metrics in passes) for key in PASS_PARTS}
    return {**parts, "outside_passes_s": else_s - sum(parts.values())}


PART_LABELS = {
    **PASS_PARTS,
    "outside_passes_s": "outside the passes: the splits, their images, the model, the files",
}


def parse_args(argv: list[str]):
    parser = harness.parser(NAME, __doc__)
    harness.add_torch_options(parser)
    parser.add_argument("--small", type=int, default=1000, help="images, smaller COCO-scale set")
    parser.add_argument("--large", type=int, default=5000, help="images, larger COCO-scale set")
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="N: timed runs of the default-size evaluation, and rounds of the two COCO-scale "
        f"sets (at least {stats.MIN_ROUNDS_TO_PAIR}, what a ratio's interval pairs over)",
    )
    parser.add_argument(
        "--data-root", default=str(harness.DEFAULT_DATA_ROOT), help="the generated data set"
    )
    parser.add_argument(
        "--checkpoint",
        help="a default run's best.pth: time its own evaluation at the default size (see above)",
    )
    parser.add_argument(
        "settings", nargs="*", metavar="key=value", help="config overrides (default size part)"
    )
    args = parser.parse_args(argv)
    harness.check_positive(parser, args, "small", "large")
    if args.repeats < stats.MIN_ROUNDS_TO_PAIR:
        parser.error(
            f"--repeats must be at least {stats.MIN_ROUNDS_TO_PAIR}, got {args.repeats}: the "
            "intervals of the ratios are bootstrapped over the runs, and fewer hold far less "
            "than their confidence"
        )
    return args


def time_coco_scale(gts: list[dict[str, Any]], dets: list[dict[str, Any]]) -> dict[str, Any]:
    """What evaluation computes from detections, at COCO scale, timed in its two halves."""
    names = [f"class{c}" for c in range(COCO_CLASSES)]
    start = time.perf_counter()
    counts = precision_recall_f1(gts, dets, COCO_CLASSES, None)
    matched = time.perf_counter()
    ap = coco_ap(
        gts,
        dets,
        COCO_CLASSES,
        names,
        counts["score_threshold"],
        ap_intervals=True,
    )
    done = time.perf_counter()
    return {
        "images": len(gts),
        "p_r_f1_s": matched - start,
        "coco_ap_s": done - matched,
        "total_s": done - start,
        "ms_per_image": 1000 * (done - start) / len(gts),
        "ap50": ap["ap50"],
        "ap50_interval": ap["ap50_interval"],
    }


def coco_scale_rounds(small: int, large: int, repeats: int) -> dict[str, Any]:
    """`repeats` rounds, each timing the smaller and the larger set, the first of them
    alternating from round to round (ABBA): a machine that speeds up or slows down over the
    rounds favours neither size, and both halves of a round's ratio share its moment."""
    workloads = {"small": coco_scale(small, seed=small), "large": coco_scale(large, seed=large)}
    conditions = timing.RunConditions()
    rounds = []
    for index in range(repeats):
        order = timing.balanced_order(list(workloads), index)
        timed = {size: time_coco_scale(*workloads[size]) for size in order}
        rounds.append({"round": index, "order": order, **timed})
    return {"rounds": rounds, "conditions": conditions.finish()}


class GroundTruthDetections(torch.nn.Module):
    """The model's forward pass and its own decoding, its detections then replaced by ones made
    from the ground truth of the images, in the loader's order."""

    def __init__(self, model: torch.nn.Module, detections: list[dict[str, np.ndarray]]) -> None:
        super().__init__()
        self.model = model
        self.queue = list(detections)
        self.eval()  # `model` in its inference form: the wrapper as well

    def forward(self, images: torch.Tensor, flip_test: bool = False) -> Any:
        return self.model(images, flip_test=flip_test)

    def decode(
        self, outputs: Any, max_detections: int, min_score: float
    ) -> list[dict[str, torch.Tensor]]:
        # without the floor: an untrained model's scores sit about it, which would leave its
        # decoding next to nothing to do; a trained one keeps many (every box worked out, as
        # before the floor applied while decoding)
        decoded = self.model.decode(outputs, max_detections=max_detections, min_score=0.0)
        taken, self.queue = self.queue[: len(decoded)], self.queue[len(decoded) :]
        return [
            {
                key: torch.from_numpy(value[found["scores"] >= min_score])
                for key, value in found.items()
            }
            for found in taken
        ]

    def image_scores(self, outputs: Any) -> torch.Tensor:
        return self.model.image_scores(outputs)


def time_default_size(args, device: torch.device) -> dict[str, Any]:
    """`evaluate`'s work on validation then test: decoding, forward, the rest."""
    config = load_config(None, [f"data.root={args.data_root}", *args.settings])
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    decode_s = forward_s = made_s = 0.0
    threshold = None
    model = None
    evaluator = None
    images = 0
    passes = []
    for which in ("val", "test"):
        began = time.perf_counter()
        split = load_split(config, which, check_images=False)  # as evaluate loads them
        loader = loader_for(split, config, train=False, pin_memory=False)
        decode_s += time.perf_counter() - began
        if model is None:
            # in its inference form, as `evaluate` runs it
            model = for_inference(
                build_from_config(config["model"], len(split.class_names)).to(device)
            )
            evaluator = Evaluator.from_config(config, split.class_names)
        size = config["data"]["image_size"]
        began = time.perf_counter()
        made = [
            noisy_detections(
                loader.dataset[i][1]["boxes"].numpy(),
                record.labels,
                len(split.class_names),
                size,
                rng,
            )
            for i, record in enumerate(split.records)
        ]
        made_s += time.perf_counter() - began  # the benchmark's stand-in, not evaluation's work
        metrics, _ = evaluator.evaluate(
            GroundTruthDetections(model, made),
            loader,
            device,
            chosen_threshold=threshold,
            ap_intervals=which == "test",
        )
        threshold = metrics["best_f1_threshold"]
        passes.append(metrics)
        forward_s += metrics["timing"]["model_s"]
        images += metrics["num_images"]
    total_s = time.perf_counter() - start - made_s
    return {
        "images": images,
        "image_size": config["data"]["image_size"],
        "model": config["model"]["name"],
        "precision": "fp32",
        "total_s": total_s,
        "forward_s": forward_s,
        "decode_images_s": decode_s,
        "else_s": total_s - forward_s,
        "parts": parts_of(passes, total_s - forward_s),
        "ratio": (total_s - forward_s) / forward_s,
    }


def evaluated_config(args) -> dict[str, Any]:
    """The config `evaluate` ran the checkpoint with: the checkpoint's own with today's defaults
    filled in, the settings and --data-root on top (as `time_evaluate_command` passes them)."""
    overrides = merge(parse_overrides(args.settings), {"data": {"root": args.data_root}})
    return checkpoint.config_of(checkpoint.load(args.checkpoint), args.checkpoint, overrides)


def time_evaluate_command(args, device: torch.device) -> dict[str, Any]:
    """A trained run's own evaluation, as the evaluate rule runs it: the whole command, and
    the forward pass as the eval JSON times it (validation's and test's)."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "eval.json"
        argv = [
            "--cpu-threads", str(args.cpu_threads), "evaluate", "--checkpoint", args.checkpoint,
            "--device", str(device), "--data", args.data_root, "--out", str(out),
            "--predictions", str(Path(scratch) / "predictions.json"), *args.settings,
        ]  # fmt: skip
        result, total_s = harness.evaluate_in_process(argv, out)
    passes = [result["metrics"], *([result["val_metrics"]] if result["val_metrics"] else [])]
    forward_s = sum(metrics["timing"]["model_s"] for metrics in passes)
    return {
        "images": sum(metrics["num_images"] for metrics in passes),
        "image_size": evaluated_config(args)["data"]["image_size"],
        "model": result["model"],
        "precision": result["precision"],
        "total_s": total_s,
        "forward_s": forward_s,
        "decode_images_s": None,
        "else_s": total_s - forward_s,
        "parts": parts_of(passes, total_s - forward_s),
        "ratio": (total_s - forward_s) / forward_s,
    }


def default_size_runs(args, device: torch.device) -> dict[str, Any]:
    """--repeats timed runs of the default-size evaluation, with --checkpoint after one untimed
    run that pays the imports (report_time's evaluate stage has them paid): the forward pass
    swings from run to run (oneDNN's kernels, the machine), so one run's ratio says little."""
    if args.checkpoint:
        time_evaluate_command(args, device)
    time_run = time_evaluate_command if args.checkpoint else time_default_size
    conditions = timing.RunConditions()
    runs = [time_run(args, device) for _ in range(args.repeats)]
    return {"runs": runs, "conditions": conditions.finish()}


def coco_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per size the medians over rounds (with their range), and the median of the per-round
    ratios, larger over smaller set's ms per image, with its interval."""
    sizes = {
        size: {
            "images": rounds[0][size]["images"],
            **{
                key: spread([r[size][key] for r in rounds])
                for key in ("p_r_f1_s", "coco_ap_s", "ms_per_image")
            },
        }
        for size in ("small", "large")
    }
    scale_ratio = paired_ratio(
        [r["large"]["ms_per_image"] for r in rounds], [r["small"]["ms_per_image"] for r in rounds]
    )
    return {**sizes, "scale_ratio": scale_ratio}


def default_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians over runs (with their range) of the times and of each part of everything
    else, and the median of the per-run ratios, everything else over the forward pass, with
    its interval."""
    times = ("total_s", "forward_s", "else_s") + (
        () if runs[0]["decode_images_s"] is None else ("decode_images_s",)
    )
    return {
        **{key: runs[0][key] for key in ("images", "image_size", "model", "precision")},
        **{key: spread([run[key] for run in runs]) for key in times},
        "parts": {key: spread([run["parts"][key] for run in runs]) for key in runs[0]["parts"]},
        "ratio": paired_ratio([run["else_s"] for run in runs], [run["forward_s"] for run in runs]),
    }


def coco_times(coco: dict[str, Any]) -> Times:
    """(key, label, median and range, unit) of each COCO-scale time in the record."""
    return [
        (
            f"coco_{coco[size]['images']}.ms_per_image",
            f"COCO scale, {coco[size]['images']} images: evaluation ms per image",
            coco[size]["ms_per_image"],
            "ms",
        )
        for size in ("small", "large")
    ]


DEFAULT_TIMES = {
    "total_s": "the whole evaluation",
    "forward_s": "forward pass",
    "else_s": "everything but the forward pass",
    "decode_images_s": "decoding the images (part of everything else)",
}


def default_times(default: dict[str, Any]) -> Times:
    """(key, label, median and range, unit) of each default-size time in the record: the
    images' decoding only where it was timed apart (not inside the command)."""
    times = [
        (f"default.{key}", f"default size: {label}", default[key], "s")
        for key, label in DEFAULT_TIMES.items()
        if key in default
    ]
    return times + [
        (
            f"default.{key}",
            f"default size: {PART_LABELS[key]} (part of everything else)",
            value,
            "s",
        )
        for key, value in default["parts"].items()
    ]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    device = harness.setup_torch(args)
    started = time.perf_counter()
    coco_runs = coco_scale_rounds(args.small, args.large, args.repeats)
    coco = coco_summary(coco_runs["rounds"])
    default_runs = default_size_runs(args, device)
    default = default_summary(default_runs["runs"])
    runs = args.repeats

    print(
        harness.table(
            (
                f"COCO scale, no model, median of {runs} rounds (range)",
                "images",
                "P/R/F1 s",
                "COCO AP + intervals s",
                "ms/image",
            ),
            [
                [
                    f"{COCO_CLASSES} classes",
                    coco[size]["images"],
                    with_spread(coco[size]["p_r_f1_s"]),
                    with_spread(coco[size]["coco_ap_s"]),
                    with_spread(coco[size]["ms_per_image"], 2),
                ]
                for size in ("small", "large")
            ],
        )
    )
    passed_scale, line = harness.verdict(
        f"ms per image, {args.large} / {args.small} images, median of {runs} rounds' ratios",
        coco["scale_ratio"]["median"],
        SCALE_TARGET,
        interval=(coco["scale_ratio"]["low"], coco["scale_ratio"]["high"]),
    )
    print(line)
    print(
        harness.table(
            (
                f"{default['model']} at {default['image_size']} px, {default['precision']}, "
                f"{default['images']} images: median of {runs} runs (range)",
                "s",
            ),
            [
                [label.removeprefix("default size: "), with_spread(value)]
                for _key, label, value, _unit in default_times(default)
            ],
        )
    )
    print(
        "per-run everything else / forward pass: "
        + ", ".join(f"{run['ratio']:.3f}" for run in default_runs["runs"])
    )
    passed_else, line = harness.verdict(
        f"everything but the forward pass / the forward pass, median of {runs} runs' ratios",
        default["ratio"]["median"],
        ELSE_TARGET,
        interval=(default["ratio"]["low"], default["ratio"]["high"]),
    )
    print(line)
    print(f"took {time.perf_counter() - started:.0f} s")

    flags = [
        *harness.condition_flags(coco_runs["conditions"], "the COCO-scale rounds"),
        *harness.condition_flags(default_runs["conditions"], "the default-size runs"),
    ]
    for part in (coco_runs, default_runs):
        harness.warn_if_loaded(part["conditions"], "a part of this run")
    figures = [
        *spread_figures(coco_times(coco), runs),
        ratio_figure(
            "coco.scale_ratio",
            f"ms per image, {args.large} / {args.small} images",
            coco["scale_ratio"],
            SCALE_TARGET,
            f"{runs} rounds",
        ),
        *spread_figures(default_times(default), runs),
        ratio_figure(
            "default.ratio",
            "default size: everything but the forward pass / the forward pass",
            default["ratio"],
            ELSE_TARGET,
            f"{runs} runs",
        ),
    ]
    settings = {
        "small": args.small,
        "large": args.large,
        "repeats": args.repeats,
        "classes": COCO_CLASSES,
        "detections_per_image": DETECTIONS,
        "data_root": args.data_root,
        "checkpoint": args.checkpoint,
        "overrides": args.settings,
        "cpu_threads": args.cpu_threads,
    }
    harness.write_record(args, harness.record(NAME, figures, settings=settings, flags=flags))
    record = {
        "benchmark": NAME,
        "coco_scale": {**coco_runs, "summary": coco},
        "default_size": {**default_runs, "summary": default},
        "settings": settings,
        "environment": harness.environment(device),
    }
    return harness.finish(args.out, record, passed_scale and passed_else, args.check)


if __name__ == "__main__":
    harness.run(main)
