"""What limits AP@[.5:.95] of a trained detector: its boxes read several ways, and corrected
by the ground truth, on one split, all scored by the evaluation's own COCO AP.

  python benchmarks/box_limits.py --checkpoint RUN/best.pth --set NAME [--split train|val|test]

One forward pass over the split (in input pixels, as evaluation sees it), then:
  centre1, centre3     decode reading each box at the peak cell alone (centre_window 1), or
                       with its centre averaged over the peak's 3x3 window, weighted by the
                       class's scores there, and its size the peak's (3, the default)
  oracle_size          (on the default decode) each detection matched to an object (IoU >= 0.5,
                       greedy by score, as COCO matches) keeps its centre, takes its object's size
  oracle_centre        keeps its size and takes the object's centre
  oracle_box           takes the object's box: what is left are scores, misses and duplicates
  oracle_bias          every box resized by the median size bias of its size bucket on these
                       objects: the systematic part of the size error alone
  val_bias             every box resized by the median size bias of the matched detections on
                       the validation split (not an oracle: what a correction carried with the
                       model would do; only where the split measured is not validation itself)
An oracle that closes most of the gap to oracle_box names the error that limits AP@[.5:.95].
Beside them: AP@[.5:.95] per size bucket, the matched boxes' median centre error and size
error (relative to the object) and their size bias, the share of found objects with a second
detection above the checkpoint's score threshold (double peaks), the size bias that the box
channels give at each object's own centre cell (centre_cell: the regression alone, without the
heatmap's choice of peak), and the decode time per image of centre windows 1 and 3, alternated
side by side.
"""

from __future__ import annotations

from typing import Any

import harness
import numpy as np
import torch
from torchvision.ops import box_iou

from pipeline.commands.evaluate import _split_with_the_checkpoints_classes
from pipeline.data import has_test_split
from pipeline.data.dataset import loader_for
from pipeline.engine import checkpoint
from pipeline.evaluation.coco import SIZE_BUCKETS, coco_ap
from pipeline.evaluation.matching import matched_objects
from pipeline.models import memory_format
from pipeline.models.centernet import CENTRE_WINDOW
from pipeline.models.inference import for_inference

NAME = "box_limits"
WINDOWS = (1, 3)  # decode's centre_window
ORACLES = ("oracle_size", "oracle_centre", "oracle_box")


def forward_pass(
    model, loader, flip_test: bool = False
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, Any]]]:
    """The model's raw outputs per batch (with `flip_test`, the two views' averaged maps, as
    evaluation reads them under eval.flip_test) and the ground truth per image, in input
    pixels."""
    outputs, truth = [], []
    with torch.inference_mode():
        for images, targets in loader:
            maps = model(images, flip_test=flip_test)
            outputs.append({k: v.float() for k, v in maps.items()})
            truth += [
                {
                    "image_id": int(t["image_id"]),
                    "boxes": t["boxes"].numpy(),
                    "labels": t["labels"].numpy(),
                    "ignore_boxes": t["ignore_boxes"].numpy(),
                    "ignore_labels": t["ignore_labels"].numpy(),
                }
                for t in targets
            ]
    return outputs, truth


def decoded(model, outputs, truth, window: int, max_detections: int) -> list[dict[str, Any]]:
    found = [d for batch in outputs for d in model.decode(batch, max_detections, window)]
    return _numpy(found, truth)


def _numpy(found: list[dict[str, torch.Tensor]], truth: list[dict[str, Any]]) -> list[dict]:
    return [
        {"image_id": gt["image_id"], **{k: v.numpy() for k, v in d.items()}}
        for gt, d in zip(truth, found, strict=True)
    ]


def matches(det: dict[str, Any], gt: dict[str, Any], iou_threshold: float = 0.5) -> np.ndarray:
    """Per detection, the index of the object it matches (-1: none), by the evaluator's rule."""
    return matched_objects(
        det["boxes"], det["scores"], det["labels"], gt["boxes"], gt["labels"], iou_threshold
    )


def _centre_size(boxes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return (boxes[:, :2] + boxes[:, 2:]) / 2, boxes[:, 2:] - boxes[:, :2]


def oracle(dets: list[dict[str, Any]], truth: list[dict[str, Any]], kind: str) -> list[dict]:
    """Detections with the matched ones' centre, size or box replaced by their object's."""
    fixed = []
    for det, gt in zip(dets, truth, strict=True):
        boxes, matched = det["boxes"].copy(), matches(det, gt)
        hit = matched >= 0
        if hit.any():
            own_centre, own_size = _centre_size(boxes[hit])
            true_centre, true_size = _centre_size(gt["boxes"][matched[hit]])
            centre = true_centre if kind in ("oracle_centre", "oracle_box") else own_centre
            size = true_size if kind in ("oracle_size", "oracle_box") else own_size
            boxes[hit] = np.concatenate([centre - size / 2, centre + size / 2], axis=1)
        fixed.append({**det, "boxes": boxes})
    return fixed


def errors(dets: list[dict[str, Any]], truth: list[dict[str, Any]], threshold: float) -> dict:
    """Matched boxes' errors relative to their object, and double peaks above `threshold`."""
    centre_err, size_err, size_bias, ious, sides = [], [], [], [], []
    found = doubled = 0
    for det, gt in zip(dets, truth, strict=True):
        matched = matches(det, gt)
        hit = matched >= 0
        if hit.any():
            own_centre, own_size = _centre_size(det["boxes"][hit])
            true_centre, true_size = _centre_size(gt["boxes"][matched[hit]])
            true_size = np.maximum(true_size, 1e-3)
            centre_err.append(np.abs(own_centre - true_centre) / true_size)
            ratio = np.log(np.maximum(own_size, 1e-3) / true_size)
            size_err.append(np.abs(ratio))
            size_bias.append(ratio)
            sides.append(np.sqrt(true_size.prod(axis=1)))
            pairs = box_iou(torch.as_tensor(det["boxes"][hit]), torch.as_tensor(gt["boxes"]))
            ious.append(pairs[np.arange(hit.sum()), matched[hit]].numpy())
        confident = det["scores"] >= threshold
        if confident.any() and len(gt["labels"]):
            iou = box_iou(torch.as_tensor(det["boxes"][confident]), torch.as_tensor(gt["boxes"]))
            same = det["labels"][confident][:, None] == gt["labels"][None, :]
            per_object = ((iou.numpy() >= 0.5) & same).sum(axis=0)
            found += int((per_object >= 1).sum())
            doubled += int((per_object >= 2).sum())

    def median(parts: list[np.ndarray]) -> float | None:
        return float(np.median(np.concatenate(parts))) if parts else None

    by_bucket = {}
    if sides:
        side, bias = np.concatenate(sides), np.concatenate(size_bias).mean(axis=1)
        for name, (lower, upper) in SIZE_BUCKETS.items():
            inside = (side >= lower) & (side < (np.inf if upper is None else upper))
            by_bucket[f"size_bias_{name}"] = (
                float(np.median(bias[inside])) if inside.any() else None
            )
    return {
        **by_bucket,
        "centre_error": median(centre_err),
        "size_error": median(size_err),
        "size_bias": median(size_bias),
        "iou": median(ious),
        "double_peaks": doubled / found if found else None,
    }


def unbiased(dets: list[dict[str, Any]], err: dict[str, Any]) -> list[dict[str, Any]]:
    """Every box resized by its size bucket's median size bias (measured on these very objects,
    so an oracle): what the systematic part of the size error costs, apart from its spread."""
    fixed = []
    for det in dets:
        centre, size = _centre_size(det["boxes"])
        side = np.sqrt(np.maximum(size, 0).prod(axis=1))
        scale = np.ones(len(side))
        for name, (lower, upper) in SIZE_BUCKETS.items():
            bias = err.get(f"size_bias_{name}")
            inside = (side >= lower) & (side < (np.inf if upper is None else upper))
            scale[inside] = np.exp(-bias) if bias is not None else 1.0
        size = size * scale[:, None]
        fixed.append({**det, "boxes": np.concatenate([centre - size / 2, centre + size / 2], 1)})
    return fixed


def centre_cell_bias(
    outputs: list[dict[str, torch.Tensor]], truth: list[dict[str, Any]], stride: int
) -> dict[str, float | None]:
    """Median log(size / object size) of the box its class's channels give at each object's own
    centre cell (the cell the loss's targets centre it in), overall and per size bucket."""
    ratios, sides = [], []
    gts = iter(truth)
    for batch in outputs:
        regression = batch["box"]
        _, _, h, w = regression.shape
        for image in regression:
            gt = next(gts)
            if not len(gt["labels"]):
                continue
            boxes = torch.as_tensor(gt["boxes"], dtype=torch.float32)
            centre = ((boxes[:, :2] + boxes[:, 2:]) / 2 / stride).floor().long()
            col, row = centre[:, 0].clamp(0, w - 1), centre[:, 1].clamp(0, h - 1)
            labels = torch.as_tensor(gt["labels"]).long()
            log_size = image[labels[:, None] * 4 + torch.tensor([2, 3]), row[:, None], col[:, None]]
            true = (boxes[:, 2:] - boxes[:, :2]).clamp(min=1e-3)
            ratios.append((log_size.exp() * stride / true).log().numpy())
            sides.append(true.prod(dim=1).sqrt().numpy())
    found: dict[str, float | None] = {"size_bias": None}
    if ratios:
        ratio, side = np.concatenate(ratios), np.concatenate(sides)
        found["size_bias"] = float(np.median(ratio))
        for name, (lower, upper) in SIZE_BUCKETS.items():
            inside = (side >= lower) & (side < (np.inf if upper is None else upper))
            found[f"size_bias_{name}"] = float(np.median(ratio[inside])) if inside.any() else None
    return found


def rescaled(dets: list[dict[str, Any]], log_scale: float) -> list[dict[str, Any]]:
    """Every box's width and height times exp(log_scale), about its centre."""
    fixed = []
    for det in dets:
        centre, size = _centre_size(det["boxes"])
        size = size * np.exp(log_scale)
        fixed.append({**det, "boxes": np.concatenate([centre - size / 2, centre + size / 2], 1)})
    return fixed


def decode_times(model, outputs, max_detections: int, rounds: int) -> dict[int, float]:
    """Median decode time per image of each centre window, alternated (ABBA)."""
    images = sum(len(batch["heatmap"]) for batch in outputs)
    sides = {
        str(window): (
            lambda window=window: [model.decode(b, max_detections, window) for b in outputs]
        )
        for window in WINDOWS
    }
    cpu = torch.device("cpu")
    blocks, _ = harness.measure(sides, cpu, warmup=2, rounds=rounds, block=3)
    return {int(name): harness.median_s(harness.counted(blocks, name)) / images for name in sides}


def main(argv: list[str]) -> int:
    parser = harness.parser(NAME, __doc__)
    harness.add_torch_options(parser)
    parser.add_argument("--checkpoint", required=True, help="best.pth of a trained run")
    parser.add_argument("--set", required=True, help="the data set's name, for the record")
    parser.add_argument(
        "--split",
        choices=("train", "val", "test"),
        default="test",
        help="train: the training images without augmentation (does the fit itself hold the error?)",
    )
    parser.add_argument("--rounds", type=int, default=10, help="decode-time rounds (ABBA)")
    parser.add_argument(
        "--flip-test", action="store_true", help="read the maps as eval.flip_test=true does"
    )
    args = parser.parse_args(argv)
    harness.setup_torch(args)

    state = checkpoint.load(args.checkpoint)
    config = checkpoint.config_of(state, args.checkpoint)
    class_names = state["class_names"]
    split = args.split if args.split != "test" or has_test_split(config) else "val"
    annotations = _split_with_the_checkpoints_classes(config, args.checkpoint, class_names, split)
    model = for_inference(  # the form evaluation runs
        checkpoint.restore_model(
            state,
            torch.device("cpu"),
            memory_format(config["train"]["channels_last"]),
            args.checkpoint,
        )
    )
    threshold = checkpoint.score_threshold(config, state)[0]
    threshold = 0.4 if threshold is None else threshold  # a checkpoint without an operating point
    max_detections = config["eval"]["max_detections"]
    image_size = config["data"]["image_size"]
    outputs, truth = forward_pass(
        model, loader_for(annotations, config, train=False, pin_memory=False), args.flip_test
    )
    val_size_bias, val_measured = None, False
    if split != "val":
        val_split = _split_with_the_checkpoints_classes(config, args.checkpoint, class_names, "val")
        val_outputs, val_truth = forward_pass(
            model, loader_for(val_split, config, train=False, pin_memory=False), args.flip_test
        )
        val_dets = decoded(model, val_outputs, val_truth, CENTRE_WINDOW, max_detections)
        val_size_bias = errors(val_dets, val_truth, 1.0)["size_bias"]
        val_measured = val_size_bias is not None
        val_size_bias = val_size_bias or 0.0  # nothing matched on validation: no correction

    def ap(dets: list[dict[str, Any]]) -> dict[str, Any]:
        return coco_ap(truth, dets, len(class_names), class_names)

    figures, rows = [], []
    variants: dict[str, list[dict[str, Any]]] = {
        f"centre{w}": decoded(model, outputs, truth, w, max_detections) for w in WINDOWS
    }
    default = variants[f"centre{CENTRE_WINDOW}"]
    for kind in ORACLES:
        variants[kind] = oracle(default, truth, kind)
    variants["oracle_bias"] = unbiased(default, errors(default, truth, 1.0))
    if val_size_bias is not None:
        variants["val_bias"] = rescaled(default, -val_size_bias)
    for name, dets in variants.items():
        found = ap(dets)
        buckets = {b: found["size_buckets"][b]["ap"] for b in SIZE_BUCKETS}
        figures += [
            harness.figure(f"{name}.ap", f"{name}: AP@[.5:.95]", found["ap"], "AP"),
            harness.figure(f"{name}.ap75", f"{name}: AP@.75", found["ap75"], "AP"),
            harness.figure(f"{name}.ap50", f"{name}: AP@.5", found["ap50"], "AP"),
        ]
        figures += [
            harness.figure(f"{name}.ap_{b}", f"{name}: AP@[.5:.95], {b} objects", v, "AP")
            for b, v in buckets.items()
            if v is not None
        ]
        rows.append([name, found["ap"], found["ap75"], found["ap50"], *buckets.values()])
        if name.startswith("centre"):
            err = errors(dets, truth, threshold)
            figures += [
                harness.figure(
                    f"{name}.{key}",
                    f"{name}: {label}",
                    err[key],
                    {"iou": "IoU", "double_peaks": "fraction"}.get(key, "ratio"),
                )
                for key, label in (
                    ("centre_error", "median |centre error| / object size (matched at IoU .5)"),
                    ("size_error", "median |log(size / object size)| (matched)"),
                    ("size_bias", "median log(size / object size) (matched)"),
                    ("iou", "median IoU with the matched object"),
                    ("double_peaks", "share of found objects with a second detection"),
                    *(
                        (f"size_bias_{b}", f"median log(size / object size), {b} objects")
                        for b in SIZE_BUCKETS
                    ),
                )
                if err.get(key) is not None
            ]
            print(name, {k: None if v is None else round(v, 4) for k, v in err.items()})
    cell = centre_cell_bias(outputs, truth, model.stride)
    figures += [
        harness.figure(
            f"centre_cell.{key}",
            "centre_cell: median log(size / object size) at the object's own centre cell"
            + (f", {key[len('size_bias_') :]} objects" if key != "size_bias" else ""),
            value,
            "ratio",
        )
        for key, value in cell.items()
        if value is not None
    ]
    if val_measured:
        figures.append(
            harness.figure(
                "val_bias.val_size_bias",
                "val_bias: median log(size / object size) on validation (matched), undone",
                val_size_bias,
                "ratio",
            )
        )
    print("centre_cell", {k: None if v is None else round(v, 4) for k, v in cell.items()})
    times = decode_times(model, outputs, max_detections, args.rounds)
    figures += [
        harness.figure(
            f"centre{w}.decode_ms", f"decode per image, centre window {w}", t * 1000, "ms"
        )
        for w, t in times.items()
    ]
    figures.append(
        harness.figure(
            "decode_ratio", "decode time, centre window 3 / 1", times[3] / times[1], "ratio"
        )
    )
    print(harness.table(["variant", "AP", "AP75", "AP50", *SIZE_BUCKETS], rows))
    print({f"centre{w}": f"{t * 1000:.3f} ms/image" for w, t in times.items()})
    settings = {
        "set": args.set,
        "split": split,
        "checkpoint": str(args.checkpoint),
        "epoch": state["epoch"],
        "image_size": image_size,
        "flip_test": args.flip_test,
        "score_threshold": threshold,
        "images": len(truth),
    }
    harness.write_record(args, harness.record(NAME, figures, settings=settings))
    return 0


if __name__ == "__main__":
    harness.run(main)
