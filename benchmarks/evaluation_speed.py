"""Evaluation speed: what evaluation costs per image as the work grows, and beside the model.

Two parts, one run.

COCO scale, no model: 80 classes; images of 1 to 15 objects (COCO's mean is about 7) from
4 to 400 px in a 640-px input; 100 detections per image, each a ground-truth box of its image
moved by noise (most far off: false positives; some of another class), scored higher the
nearer they are. Timed: what `evaluate` computes from detections (matching and P/R/F1 with
their intervals, COCO AP with the size buckets, every AP interval), at --small and
--large images (default 1,000 and 5,000). Target: time per image at the larger size at most
1.5 x that at the smaller (evaluation linear in its work).

Default size: the generated data set's validation and test splits (2,304 images of 128 px
by default) through `Evaluator.evaluate` as `python -m pipeline evaluate` runs it (validation
first, its best-F1 threshold applied to test, AP intervals on test), the default model's
forward pass timed apart from everything else: decoding the images, the model's own decoding
of its outputs, matching, COCO AP and the intervals. The model is untrained, so its
detections are replaced, after its decoding ran, by detections made from the ground truth as
above: a trained model's number of detections and matches, without training one here (made
before each split's evaluation, outside the timed work). Its decoding works out every top-K
box, without eval.min_score, under which an untrained model's scores sit: more than a trained
model's floor leaves. With --checkpoint (a default run's
best.pth, as `make report` or `report_time.py --keep` leave it), it is that run's own
evaluation instead: `python -m pipeline evaluate` as the evaluate rule runs it (predictions
written too), in this process after one untimed run that pays the imports, with the
checkpoint's precision and detections; the forward pass is the eval JSON's own timing of it.
Target: everything else at most as long as the forward pass.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import numpy as np
import torch

from pipeline import timing
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
COCO_CLASSES = 80
COCO_INPUT = 640
DETECTIONS = 100


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
    return args


def noisy_detections(
    boxes: np.ndarray, labels: np.ndarray, classes: int, size: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """DETECTIONS boxes made from an image's objects: each a copy of one of them moved by
    noise of a random scale (up to its own size: mostly false positives), of another class one
    time in five, scored higher the smaller the noise. Without objects: boxes anywhere."""
    if len(boxes) == 0:
        corners = rng.uniform(0, size * 0.8, (DETECTIONS, 2))
        found = np.concatenate([corners, corners + rng.uniform(4, size * 0.2, (DETECTIONS, 2))], 1)
        return {
            "boxes": found.astype(np.float32),
            "scores": rng.uniform(0, 0.5, DETECTIONS).astype(np.float32),
            "labels": rng.integers(0, classes, DETECTIONS),
        }
    pick = rng.integers(0, len(boxes), DETECTIONS)
    sides = np.repeat(boxes[pick, 2:] - boxes[pick, :2], 2, axis=0).reshape(-1, 4)
    noise = rng.exponential(0.25, (DETECTIONS, 1))
    moved = boxes[pick] + rng.normal(0, 1, (DETECTIONS, 4)) * noise * sides
    moved[:, 2:] = np.maximum(moved[:, 2:], moved[:, :2] + 1)
    other = rng.random(DETECTIONS) < 0.2
    found_labels = np.where(other, rng.integers(0, classes, DETECTIONS), labels[pick])
    scores = np.clip(1 - noise[:, 0] + rng.normal(0, 0.1, DETECTIONS), 0.01, 1)
    return {
        "boxes": np.clip(moved, 0, size).astype(np.float32),
        "scores": scores.astype(np.float32),
        "labels": found_labels,
    }


def coco_scale(images: int, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rng = np.random.default_rng(seed)
    gts, dets = [], []
    for image_id in range(1, images + 1):
        count = int(rng.integers(1, 16))
        sides = np.exp(rng.uniform(np.log(4), np.log(400), (count, 1))) * rng.uniform(
            0.6, 1.4, (count, 2)
        )
        sides = np.minimum(sides, COCO_INPUT - 1)
        corners = rng.uniform(0, COCO_INPUT - sides)
        boxes = np.concatenate([corners, corners + sides], axis=1)
        labels = rng.integers(0, COCO_CLASSES, count)
        gts.append({"image_id": image_id, "boxes": boxes.astype(np.float32), "labels": labels})
        found = noisy_detections(boxes, labels, COCO_CLASSES, COCO_INPUT, rng)
        dets.append({"image_id": image_id, **found})
    return gts, dets


def time_coco_scale(images: int) -> dict[str, Any]:
    """What evaluation computes from detections, at COCO scale, timed in its two halves."""
    gts, dets = coco_scale(images, seed=images)
    names = [f"class{c}" for c in range(COCO_CLASSES)]
    conditions = timing.RunConditions()
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
        "images": images,
        "p_r_f1_s": matched - start,
        "coco_ap_s": done - matched,
        "total_s": done - start,
        "ms_per_image": 1000 * (done - start) / images,
        "ap50": ap["ap50"],
        "ap50_interval": ap["ap50_interval"],
        "conditions": conditions.finish(),
    }


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
    conditions = timing.RunConditions()
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
        "conditions": conditions.finish(),
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
        for _run in range(2):  # the first pays the imports: report_time's evaluate stage has them
            conditions = timing.RunConditions()
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
        "conditions": conditions.finish(),
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    device = harness.setup_torch(args)
    started = time.perf_counter()
    coco = [time_coco_scale(images) for images in (args.small, args.large)]
    scale_ratio = coco[1]["ms_per_image"] / coco[0]["ms_per_image"]
    if args.checkpoint:
        default = time_evaluate_command(args, device)
    else:
        default = time_default_size(args, device)

    print(
        harness.table(
            ("COCO scale, no model", "images", "P/R/F1 s", "COCO AP + intervals s", "ms/image"),
            [
                [
                    f"{COCO_CLASSES} classes",
                    r["images"],
                    r["p_r_f1_s"],
                    r["coco_ap_s"],
                    harness.ms(r["ms_per_image"]),
                ]
                for r in coco
            ],
        )
    )
    passed_scale, line = harness.verdict(
        f"ms per image, {args.large} / {args.small} images", scale_ratio, SCALE_TARGET
    )
    print(line)
    print(
        harness.table(
            ("default size", "images", "forward s", "decoding images s", "else s", "total s"),
            [
                [
                    f"{default['model']} at {default['image_size']} px, {default['precision']}",
                    default["images"],
                    default["forward_s"],
                    "-" if default["decode_images_s"] is None else default["decode_images_s"],
                    default["else_s"],
                    default["total_s"],
                ]
            ],
        )
    )
    print(
        harness.table(
            ("everything else, divided", "s"),
            [[PART_LABELS[key], seconds] for key, seconds in default["parts"].items()],
        )
    )
    passed_else, line = harness.verdict(
        "everything but the forward pass / the forward pass", default["ratio"], ELSE_TARGET
    )
    print(line)
    print(f"took {time.perf_counter() - started:.0f} s")

    flags = []
    for row in coco:
        flags += harness.condition_flags(row["conditions"], f"the {row['images']}-image set")
    flags += harness.condition_flags(default["conditions"], "the default-size evaluation")
    for row in (*coco, default):
        harness.warn_if_loaded(row["conditions"], "a part of this run")
    figures = [
        *(
            harness.figure(
                f"coco_{row['images']}.ms_per_image",
                f"COCO scale, {row['images']} images: evaluation ms per image",
                row["ms_per_image"],
                "ms",
            )
            for row in coco
        ),
        harness.figure(
            "coco.scale_ratio",
            f"ms per image, {args.large} / {args.small} images",
            scale_ratio,
            "ratio",
            target=("<=", SCALE_TARGET),
        ),
        harness.figure(
            "default.forward_s", "default size: forward pass", default["forward_s"], "s"
        ),
        harness.figure(
            "default.else_s",
            "default size: everything but the forward pass",
            default["else_s"],
            "s",
        ),
        *(
            []
            if default["decode_images_s"] is None  # inside the command: not timed apart
            else [
                harness.figure(
                    "default.decode_images_s",
                    "default size: decoding the images (part of everything else)",
                    default["decode_images_s"],
                    "s",
                )
            ]
        ),
        *(
            harness.figure(
                f"default.{key}",
                f"default size: {PART_LABELS[key]} (part of everything else)",
                seconds,
                "s",
            )
            for key, seconds in default["parts"].items()
        ),
        harness.figure(
            "default.ratio",
            "default size: everything but the forward pass / the forward pass",
            default["ratio"],
            "ratio",
            target=("<=", ELSE_TARGET),
        ),
    ]
    settings = {
        "small": args.small,
        "large": args.large,
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
        "coco_scale": coco,
        "default_size": default,
        "settings": settings,
        "environment": harness.environment(device),
    }
    return harness.finish(args.out, record, passed_scale and passed_else, args.check)


if __name__ == "__main__":
    harness.run(main)
