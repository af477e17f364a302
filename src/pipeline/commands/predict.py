"""`python -m pipeline predict`: a trained checkpoint's detections on images, folders or globs.

Writes DIR/detections.json (the COCO results format, each box in its image's own pixels, EXIF
orientation applied as in training) and DIR/images.json (which file each image id is, its size,
the settings, and the files that could not be read, which are skipped); with --draw, each image
with its detections under DIR/annotated/. Detections count from the checkpoint's operating
point (the best-F1 threshold training picked on validation) unless --score-threshold is given.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path

from pipeline import atomic
from pipeline.cli import add_precision_option, command_parser
from pipeline.data.image_files import find_images
from pipeline.errors import CheckpointError, ConfigError, DataError

log = logging.getLogger("pipeline")


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise ConfigError(f"--score-threshold {text} must lie in [0, 1].")
    return value


def _workers(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit():
        raise ConfigError(f"--num-workers {text} must be a whole number >= 0, or auto.")
    return int(text)


def main(argv: list[str]) -> int:
    parser = command_parser("predict", __doc__)
    parser.add_argument("--checkpoint", required=True, metavar="PATH", help="best.pth of a run")
    parser.add_argument(
        "images", nargs="+", metavar="PATH", help="image files, folders or glob patterns"
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="folder to write into")
    parser.add_argument(
        "--score-threshold",
        type=_fraction,
        metavar="T",
        help="keep detections scoring at least T (default: the checkpoint's operating point)",
    )
    parser.add_argument("--device", help="device to run on (default: the checkpoint's)")
    add_precision_option(
        parser, "default: the checkpoint's (a measured run's: the choice it trained in)"
    )
    parser.add_argument(
        "--batch-size", type=int, metavar="N", help="images per batch (default: eval.batch_size)"
    )
    parser.add_argument(
        "--num-workers",
        type=_workers,
        metavar="N",
        help="worker processes that decode the images, or auto (default: the checkpoint's "
        "data.num_workers): 0 where workers cannot start, as in a container short of shared "
        "memory",
    )
    parser.add_argument(
        "--draw", action="store_true", help="also write each image with its detections drawn"
    )
    args = parser.parse_args(argv)
    atomic.refuse_unwritable_output("--out", args.out, folder=True)
    if args.batch_size is not None and args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}.")
    paths = find_images(args.images)

    from pipeline import device as dev
    from pipeline import prediction
    from pipeline.data.dataset import worker_count
    from pipeline.engine import checkpoint
    from pipeline.models import memory_format

    state = checkpoint.load(args.checkpoint)
    config = checkpoint.config_of(state, args.checkpoint)
    threshold, source = args.score_threshold, "--score-threshold"
    if threshold is None:
        threshold, source = checkpoint.score_threshold(config, state)
    if threshold is None:
        raise CheckpointError(
            f"Checkpoint {args.checkpoint} holds no operating point (it was saved before any "
            "validation, or by an older version) and its config names no eval.score_threshold: "
            "give --score-threshold T (python -m pipeline evaluate prints the best-F1 threshold "
            "on validation)."
        )
    device = dev.resolve_device(args.device or config["device"])
    requested = args.precision or config["precision"]
    precision = dev.run_precision(requested, device, state.get("precision"), "predict")
    dev.require_precision(device, precision, "prediction")
    model = checkpoint.restore_model(
        state, device, memory_format(config["train"]["channels_last"]), args.checkpoint
    )
    out = Path(args.out)
    log.info(
        "predicting on %d images with %s on %s (%s), score threshold %.3f (%s)",
        len(paths),
        args.checkpoint,
        dev.describe_device(device),
        precision,
        threshold,
        source,
    )
    results = prediction.predict(
        model,
        paths,
        device,
        precision,
        image_size=config["data"]["image_size"],
        resize=config["data"]["resize"],
        score_threshold=threshold,
        batch_size=args.batch_size or config["eval"]["batch_size"],
        max_detections=config["eval"]["max_detections"],
        workers=worker_count(
            config["data"]["num_workers"] if args.num_workers is None else args.num_workers,
            cached=False,
        ),
        keep_images=args.draw,
        flip_test=config["eval"]["flip_test"],
    )
    class_names = state["class_names"]
    images, unreadable, drawn = [], [], {}
    for result in results:
        if isinstance(result, prediction.Unreadable):
            log.warning("skipped %s: %s", result.path, result.reason)
            unreadable.append(result)
            continue
        images.append(result)
        if args.draw:
            drawn[result.index] = _free_name(result.path, set(drawn.values()))
            picture = prediction.drawn(result, class_names)
            atomic.write_with(
                out / drawn[result.index],
                lambda tmp, picture=picture: picture.save(tmp, format="JPEG", quality=90),
            )
    if not images:
        raise DataError(
            f"None of the {len(paths)} images could be read (the first: {unreadable[0].reason})."
        )
    detections = prediction.coco_results(images)
    atomic.write_json(out / "detections.json", detections, indent=None)
    atomic.write_json(
        out / "images.json",
        {
            "format": prediction.FORMAT,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "checkpoint": str(args.checkpoint),
            "device": str(device),
            "precision": precision,
            "score_threshold": threshold,
            "score_threshold_source": source,
            "categories": [{"id": i + 1, "name": name} for i, name in enumerate(class_names)],
            "images": [
                {
                    "id": image.index + 1,
                    "file": str(image.path),
                    "width": image.width,
                    "height": image.height,
                    "detections": len(image.scores),
                    "annotated": drawn.get(image.index),
                }
                for image in images
            ],
            "unreadable": [{"file": str(item.path), "reason": item.reason} for item in unreadable],
        },
    )
    skipped = (
        f"; {len(unreadable)} unreadable, skipped (listed in images.json)" if unreadable else ""
    )
    log.info("%d detections on %d images -> %s%s", len(detections), len(images), out, skipped)
    return 0


def _free_name(path: Path, taken: set[str]) -> str:
    """annotated/<stem>.jpg, numbered where another image (of another folder) took the name."""
    name, number = f"annotated/{path.stem}.jpg", 1
    while name in taken:
        number += 1
        name = f"annotated/{path.stem}-{number}.jpg"
    return name
