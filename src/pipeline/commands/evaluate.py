"""`python -m pipeline evaluate`: evaluate a checkpoint on the test split (P/R/F1, COCO AP).

`best.pth` was chosen on the validation split, so figures measured there are optimistic.
Where the data set has a test split, the figures come from it, and the best-F1 score
threshold is picked on validation and then applied to test. Without one, they come from
validation and the JSON says so; beside test's, validation's figures (`val_metrics`) keep
their P/R/F1 intervals, not AP's. P/R/F1 count the detections at or above the checkpoint's
operating point (the best-F1 threshold training picked on validation), unless
eval.score_threshold names a threshold.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from pipeline import atomic
from pipeline.cli import add_precision_option, command_parser, refuse_writing_over
from pipeline.config import merge, parse_overrides
from pipeline.errors import ConfigError

if TYPE_CHECKING:
    from pipeline.data.sources import SplitAnnotations

log = logging.getLogger("pipeline")
FORMAT = "pipeline.eval/1"  # schemas/eval.schema.yaml
PREDICTIONS_FORMAT = "pipeline.predictions/1"  # schemas/predictions.schema.yaml
THRESHOLD_SOURCES = {
    "eval.score_threshold": "eval.score_threshold",
    "checkpoint": "the checkpoint's operating point",
    "validation": "picked on validation now: the checkpoint predates saved operating points",
}


def main(argv: list[str]) -> int:
    parser = command_parser("evaluate", __doc__)
    parser.add_argument(
        "--checkpoint", required=True, metavar="PATH", help="best.pth or last.pth of a run"
    )
    parser.add_argument(
        "--device", help="device to evaluate on (default: the checkpoint's config device)"
    )
    add_precision_option(
        parser, "default: the checkpoint's (a measured run's: the choice it trained in)"
    )
    parser.add_argument(
        "--data",
        metavar="ROOT",
        help="evaluate on the data set at this root instead of the checkpoint's (none of the "
        "split files the checkpoint's config names, unless named here as data.* settings too)",
    )
    parser.add_argument("--out", required=True, metavar="FILE.json", help="metrics JSON")
    parser.add_argument(
        "--predictions",
        metavar="FILE.json",
        help="per-image ground truth and detections in image pixels",
    )
    parser.add_argument(
        "settings",
        nargs="*",
        metavar="key=value",
        help="data and eval overrides, e.g. eval.score_threshold=0.4",
    )
    args = parser.parse_args(argv)
    refuse_writing_over(
        [("--checkpoint", args.checkpoint)],
        [("--out", args.out), ("--predictions", args.predictions)],
    )
    atomic.refuse_unwritable_output("--out", args.out)
    atomic.refuse_unwritable_output("--predictions", args.predictions)

    from pipeline import device as dev
    from pipeline.data import at_root, has_test_split, require_objects
    from pipeline.data.dataset import loader_for
    from pipeline.engine import checkpoint
    from pipeline.evaluation.coco import size_bucket_text, without_cyclic_gc
    from pipeline.evaluation.image_bootstrap import interval_text
    from pipeline.evaluation.loop import Evaluator
    from pipeline.models import memory_format
    from pipeline.models.inference import for_inference

    state = checkpoint.load(args.checkpoint)
    overrides = parse_overrides(args.settings)
    if set(overrides) - {"data", "eval"}:
        raise ConfigError(
            f"evaluate only takes data.* and eval.* settings, not {sorted(set(overrides) - {'data', 'eval'})}."
        )
    if args.data:  # the root's own files, not the checkpoint's, unless named here as well
        overrides = merge({"data": at_root(args.data)}, overrides)
    config = checkpoint.config_of(state, args.checkpoint, overrides)
    device = dev.resolve_device(args.device or config["device"])
    # a run of precision=measured keeps the precision its benchmarks chose (the checkpoint's)
    requested = args.precision or config["precision"]
    precision = dev.run_precision(requested, device, state.get("precision"), "evaluate")
    dev.require_precision(device, precision, "evaluation")

    class_names = state["class_names"]
    pin = dev.pin_memory_supported(device)
    # the splits' annotations and the files written below make objects per annotation and per
    # detection, none in a cycle: a full collection would walk them all, and all the rest.
    # Each split's loader comes right after its annotations, before any other work: its dataset
    # checks the image files (decoding them all, where it caches them), with loading's errors.
    with without_cyclic_gc():
        val = _split_with_the_checkpoints_classes(config, args.checkpoint, class_names, "val")
        val_loader = loader_for(val, config, train=False, pin_memory=pin)
        require_objects(val)
        test = (
            _split_with_the_checkpoints_classes(config, args.checkpoint, class_names, "test")
            if has_test_split(config)
            else None
        )
        test_loader = (
            loader_for(test, config, train=False, pin_memory=pin) if test is not None else None
        )
        if test is not None:
            require_objects(test, "test")
    model_cfg = config["model"]
    checkpoint.check_compatible(
        state,
        args.checkpoint,
        model_name=model_cfg["name"],
        num_classes=len(class_names),
        label_mode=model_cfg["label_mode"],
    )
    # one inference form for both splits' passes, made of the restored model itself
    model = for_inference(
        checkpoint.restore_model(
            state, device, memory_format(config["train"]["channels_last"]), args.checkpoint
        ),
        in_place=True,
    )
    # None (a checkpoint without a saved operating point): picked on validation below
    threshold, threshold_source = checkpoint.score_threshold(config, state)
    evaluator = Evaluator.from_config(config, class_names)
    evaluator.score_threshold = threshold
    memory = dev.PeakMemory(device)
    # validation's AP intervals only where its figures are the headline: beside test's they
    # would be seconds of resampling that nothing reads (its threshold comes from P/R/F1)
    val_metrics, detections = evaluator.evaluate(
        model, val_loader, device, precision, ap_intervals=test is None
    )
    val_threshold = val_metrics["best_f1_threshold"]
    if threshold is None:
        evaluator.score_threshold = val_threshold
    if test_loader is None:
        metrics, split, role, loader = val_metrics, val, "val", val_loader
        at_val_threshold = val_metrics["best"]
    else:
        metrics, detections = evaluator.evaluate(
            model, test_loader, device, precision, chosen_threshold=val_threshold, ap_intervals=True
        )
        split, role, loader = test, "test", test_loader
        at_val_threshold = metrics["chosen_threshold"]
    memory.update()
    result = {
        "format": FORMAT,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "checkpoint": str(args.checkpoint),
        "checkpoint_epoch": state["epoch"],
        "model": model_cfg["name"],
        "label_mode": model_cfg["label_mode"],
        "device": str(device),
        "backend": device.type,
        "device_description": dev.describe_device(device),
        "precision": precision,
        "data_root": config["data"]["root"],
        "split": config["data"][f"{role}_split"] or role,
        "metrics_split": role,
        "splits": {
            name: {
                "name": config["data"][f"{name}_split"] or name,
                "source": annotations.origin,
                "num_images": len(annotations.records),
            }
            for name, annotations in (("val", val), ("test", test))
            if annotations is not None
        },
        "score_threshold_source": threshold_source,
        "operating_point": {
            "threshold": val_threshold,
            "picked_on": "val",
            "applied_to": role,
            **{key: at_val_threshold[key] for key in ("precision", "recall", "f1")},
            "f1_interval": at_val_threshold.get("f1_interval"),
        },
        "class_names": class_names,
        "metrics": metrics,
        "val_metrics": val_metrics if test is not None else None,
        "peak_memory": memory.as_dict(),
        "host_peak_rss_mb": dev.host_peak_rss_mb(),
    }
    with without_cyclic_gc():
        if args.predictions:
            # compact: indented, every image's detections would make the file several times larger
            predictions = _predictions(loader.dataset, detections, class_names)
            atomic.write_json(args.predictions, predictions, indent=None, numpy_arrays=True)
        atomic.write_json(args.out, result)
    log.info(
        "%s on %s (%s split, %s): F1 %.3f (%s; P %.3f R %.3f) at score %.2f (%s); at validation's "
        "best-F1 threshold %.2f: F1 %.3f; AP@.5 %.3f (%s; %s protocol), AP %.3f (%s; COCO); "
        "AP@.5 by size %s -> %s",
        args.checkpoint,
        split.origin,
        role,
        precision,
        metrics["f1"],
        interval_text(metrics["f1_interval"]),
        metrics["precision"],
        metrics["recall"],
        metrics["score_threshold"],
        THRESHOLD_SOURCES[threshold_source],
        val_threshold,
        at_val_threshold["f1"],
        metrics["ap50"],
        interval_text(metrics["ap50_interval"]),
        metrics["protocol"].upper(),
        metrics["ap"],
        interval_text(metrics["ap_interval"]),
        size_bucket_text(metrics["size_buckets"]),
        args.out,
    )
    return 0


def _split_with_the_checkpoints_classes(
    config: dict, path: str, class_names: list[str], which: str
) -> SplitAnnotations:
    """A split in the checkpoint's label order, if the checkpoint knows all its objects' classes.

    Loading straight in the checkpoint's order would silently drop the objects of classes the
    checkpoint lacks, so a COCO split's own classes are read first and compared. Categories
    without objects (left out at training) do not count. A VOC split lists only the classes
    its objects use; loading it in the checkpoint's order refuses any other class (unless
    data.classes, the user's list, leaves it out), naming its XML file. The image files are
    left to the split's dataset to check (pipeline.data.sources.check_image_files).
    """
    from pipeline.data import load_split
    from pipeline.data.sources import with_classes
    from pipeline.errors import CheckpointError

    if config["data"]["format"] == "voc":
        return load_split(config, which, class_names, f"checkpoint {path}", check_images=False)
    own = load_split(config, which, check_images=False)
    lacking = set(class_names) - set(own.class_names)
    unknown = set(own.used_classes) - set(class_names)
    if lacking or unknown:
        raise CheckpointError(
            f"Checkpoint {path} was trained on {len(class_names)} classes {class_names}, but the "
            f"data it is evaluated on ({own.origin}) has {len(own.class_names)} classes "
            f"{own.class_names}. Evaluate it on data with the same classes (--data ROOT), or set "
            "data.classes to the checkpoint's list if the data defines them all."
        )
    return own if own.class_names == class_names else with_classes(own, class_names)


def _predictions(dataset, detections: list[dict], class_names: list[str]) -> dict:
    """Ground truth and detections per image, in the image's own pixels (what a viewer draws).

    Every image's numbers are mapped and rounded at once: per image, numpy's per-call cost
    would be most of the work. Scores are float32: times 10**4 exactly in float64, so numpy's
    rounding to 4 places is Python's round. Each image's numbers are a view of the arrays of
    all (float64 and int64), which the file's writer takes as they are (`numpy_arrays`)."""
    import numpy as np

    by_id = {d["image_id"]: d for d in detections}
    none_found = {
        "boxes": np.zeros((0, 4), np.float32),
        "scores": np.zeros(0, np.float32),
        "labels": np.zeros(0, np.int64),
    }
    records = dataset.records
    found = [by_id.get(record.image_id, none_found) for record in records]
    counts = [len(f["scores"]) for f in found]
    every_box = _rounded_rows([dataset.all_to_original([f["boxes"] for f in found])], 2, counts)
    every_score = _rounded_rows([np.asarray(f["scores"]) for f in found], 4, counts)
    every_label = _rows(np.concatenate([np.asarray(f["labels"]) for f in found]), counts)
    objects = [len(record.boxes) for record in records]
    regions = [len(record.ignore_boxes) for record in records]
    truth = _rounded_rows([record.boxes.reshape(-1, 4) for record in records], 2, objects)
    truth_labels = _rows(np.concatenate([record.labels for record in records]), objects)
    ignored = _rounded_rows([record.ignore_boxes.reshape(-1, 4) for record in records], 2, regions)
    ignored_labels = _rows(np.concatenate([record.ignore_labels for record in records]), regions)
    images = [
        {
            "image_id": record.image_id,
            "file": str(record.path),
            "width": record.width,
            "height": record.height,
            "ground_truth": {
                "boxes": truth[index],
                "labels": truth_labels[index],
                "ignore_boxes": ignored[index],
                "ignore_labels": ignored_labels[index],
            },
            "detections": {
                "boxes": every_box[index],
                "scores": every_score[index],
                "labels": every_label[index],
            },
        }
        for index, record in enumerate(records)
    ]
    return {"format": PREDICTIONS_FORMAT, "class_names": class_names, "images": images}


def _rounded_rows(parts: list, decimals: int, counts: list[int]) -> list:
    """The parts' rows (all images' together, in order) in float64 rounded to `decimals`, as
    one array per image, made in one go."""
    import numpy as np

    every = np.concatenate(parts, dtype=np.float64).round(decimals)  # float32 widened exactly
    return _rows(every, counts)


def _rows(every, counts: list[int]) -> list:
    """An array of all images' rows as one view of it per image (`counts` rows each)."""
    import numpy as np

    ends = np.cumsum(counts).tolist()
    return [every[end - count : end] for end, count in zip(ends, counts, strict=True)]
