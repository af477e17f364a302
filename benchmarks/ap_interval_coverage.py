"""AP@.5's interval over images beside fresh sets of images: where it lies and what it holds.

detection_workload's COCO-scale workload, the one evaluation_speed times (80 classes; 100
detections per image made from the ground truth with noise, most of them false positives)
on --splits fresh sets of --images images (default 20 of 200), each scored as `evaluate` scores a split (pycocotools, AP's
intervals over images); and one set of --large images (default 4,000) for AP@.5 on many
images. Per set: AP@.5, its interval (centred on the figure) and the plain percentile interval
of the same resamples (the centred one moved back by its shift). Figures: the sets' mean AP@.5
and its spread, AP@.5 of the large set, the mean shift, and for each kind of interval the share
of sets whose interval holds its own figure and the share whose interval holds the sets' mean
AP@.5 (what the figure comes to on average at this many images). Target: every centred
interval holds its own figure. No timing: the machine's load does not matter.
"""

from __future__ import annotations

import contextlib
import io
import statistics
from typing import Any

import harness
from detection_workload import COCO_CLASSES, coco_scale

from pipeline.evaluation.coco import coco_ap

NAME = "ap_interval_coverage"
LARGE_SEED = 1_000_000  # the large set's images: none of the fresh sets' seeds


def parse_args(argv: list[str]):
    parser = harness.parser(NAME, __doc__)
    parser.add_argument("--images", type=int, default=200, help="images per fresh set")
    parser.add_argument("--splits", type=int, default=20, help="fresh sets")
    parser.add_argument("--large", type=int, default=4000, help="images of the large set")
    args = parser.parse_args(argv)
    harness.check_positive(parser, args, "images", "splits", "large")
    return args


def scored(images: int, seed: int, intervals: bool) -> dict[str, Any]:
    """AP@.5 of one set of the COCO-scale workload, with its interval where asked."""
    gts, dets = coco_scale(images, seed=seed)
    classes = COCO_CLASSES
    with contextlib.redirect_stdout(io.StringIO()):
        found = coco_ap(gts, dets, classes, [f"class{c}" for c in range(classes)], 0.5, intervals)
    return {"ap50": found["ap50"], "interval": found["ap50_interval"]}


def share(holds: list[bool]) -> float:
    return sum(holds) / len(holds)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    sets = [scored(args.images, seed, True) for seed in range(1, args.splits + 1)]
    large = scored(args.large, LARGE_SEED, False)["ap50"]
    figures = [found["ap50"] for found in sets]
    mean = statistics.fmean(figures)
    centred = [(s["interval"]["low"], s["interval"]["high"]) for s in sets]
    shifts = [s["interval"]["shift"] for s in sets]
    plain = [
        (low + shift, high + shift) for (low, high), shift in zip(centred, shifts, strict=True)
    ]
    rows = []
    results: dict[str, dict[str, float]] = {}
    for name, bounds in (("centred", centred), ("plain percentile", plain)):
        own = share([low <= f <= high for (low, high), f in zip(bounds, figures, strict=True)])
        of_mean = share([low <= mean <= high for low, high in bounds])
        width = statistics.median(high - low for low, high in bounds)
        results[name] = {"own": own, "mean": of_mean, "width": width}
        rows.append([name, f"{own:.2f}", f"{of_mean:.2f}", f"{width:.4f}"])
    print(
        f"COCO-scale workload, {args.splits} fresh sets of {args.images} images: AP@.5 mean "
        f"{mean:.4f} (sd {statistics.stdev(figures):.4f}); {args.large} images: {large:.4f}; "
        f"median shift {statistics.median(shifts):+.4f}"
    )
    print(harness.table(["interval", "holds its figure", "holds the sets' mean", "width"], rows))
    passed = results["centred"]["own"] >= 1.0
    print(
        f"sets whose centred interval holds their figure: {results['centred']['own']:.2f}   "
        f"target >= 1.00   {'PASS' if passed else 'FAIL'}"
    )
    record = [
        harness.figure("ap50.mean", f"mean AP@.5 of sets of {args.images}", mean, "AP"),
        harness.figure(
            "ap50.sd", "its standard deviation over sets", statistics.stdev(figures), "AP"
        ),
        harness.figure("ap50.large", f"AP@.5 of one set of {args.large}", large, "AP"),
        harness.figure(
            "shift.median",
            "median shift (resamples' median less the figure)",
            statistics.median(shifts),
            "AP",
        ),
    ]
    for name, key in (("centred", "centred"), ("plain percentile", "percentile")):
        found = results[name]
        record += [
            harness.figure(
                f"{key}.holds_own",
                f"{name} interval: share of sets it holds the figure of",
                found["own"],
                "fraction",
                target=(">=", 1.0) if key == "centred" else None,
            ),
            harness.figure(
                f"{key}.holds_mean",
                f"{name} interval: share of sets it holds the sets' mean AP@.5 of",
                found["mean"],
                "fraction",
            ),
            harness.figure(f"{key}.width", f"{name} interval: median width", found["width"], "AP"),
        ]
    document = harness.record(
        NAME,
        record,
        settings={"images": args.images, "splits": args.splits, "large": args.large},
    )
    harness.write_record(args, document)
    raw = {"sets": sets, "large_ap50": large, "settings": document["settings"]}
    return harness.finish(args.out, raw, passed, args.check)


if __name__ == "__main__":
    harness.run(main)
