"""BatchNorm folded into the convs (the inference form every inference path runs,
`pipeline.models.inference.for_inference`) against the model as trained, side by side.

Speed: a trained checkpoint's model, restored as `evaluate` restores it (its config's memory
format), and its inference form run the forward pass evaluation runs (`inference_mode`, each
precision's autocast, one view) on the same random uint8 batch, for each precision and batch
size at the checkpoint's image size; blocks of N forward passes alternate ABBA for R rounds
after a warm-up. The figure is unfused / fused: the median of the per-round ratios with its
95% interval resampled over rounds (`stats.speedup`); beside it, the largest absolute
difference of any output map between the two sides on that batch.

Accuracy: `python -m pipeline evaluate` of the checkpoint (validation and test, the
checkpoint's operating point, the run's device and each precision given), once as it runs
(fused) and once with the folding turned off (the evaluator handed an unfolded eval-mode copy
instead): AP@.5, AP@[.5:.95] and F1 of the test split (validation's where the set has none).
No target: a comparison.

    python benchmarks/inference_fusion.py --checkpoint results/train/cpu-bf16/best.pth \\
        --data resources/data/shapes --cpu-threads 2 --record benchmarks/records/inference_fusion/NAME.json
"""

from __future__ import annotations

import contextlib
import copy
import io
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import harness
import torch

from pipeline import device as dev
from pipeline import stats
from pipeline.engine import checkpoint
from pipeline.errors import DataError
from pipeline.models import inference, memory_format
from pipeline.models.inference import for_inference

NAME = "inference_fusion"
SIDES = ("unfused", "fused")
ACCURACY = (("ap50", "AP@.5", "AP"), ("ap", "AP@[.5:.95]", "AP"), ("f1", "F1", "F1"))
DEFAULT_CHECKPOINTS = sorted(harness.REPO.glob("results/train/*/best.pth"))


def parse_args(argv: list[str]):
    parser = harness.parser(NAME, __doc__)
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=DEFAULT_CHECKPOINTS[0] if DEFAULT_CHECKPOINTS else None,
        help="a trained run's best.pth (default: the first of results/train/*/best.pth)",
    )
    parser.add_argument("--data", help="data root (default: the checkpoint's own)")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[16, 64])
    harness.add_torch_options(parser)
    harness.add_alternation_options(parser, warmup=5, block=5, rounds=8)
    args = parser.parse_args(argv)
    harness.check_positive(parser, args, "warmup", "block", "rounds")
    if args.checkpoint is None or not args.checkpoint.is_file():
        parser.error(f"--checkpoint {args.checkpoint}: pass a trained run's best.pth")
    return args


def _forward(model: torch.nn.Module, images: torch.Tensor, device, precision: str):
    def run() -> dict[str, torch.Tensor]:
        with torch.inference_mode(), dev.autocast(device, precision):
            return model(images)

    return run


def max_difference(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two forward passes' maps, over every map."""
    return max((first[key].float() - second[key].float()).abs().max().item() for key in first)


def speed_row(
    models: dict[str, torch.nn.Module],
    device: torch.device,
    precision: str,
    batch_size: int,
    image_size: int,
    layout: torch.memory_format,
    args,
) -> dict[str, Any]:
    """Both sides' forward passes at one precision and batch size, ABBA."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(
        0, 256, (batch_size, 3, image_size, image_size), dtype=torch.uint8, generator=generator
    )
    images = images.to(device).contiguous(memory_format=layout)
    sides = {side: _forward(models[side], images, device, precision) for side in SIDES}
    difference = max_difference(sides["unfused"](), sides["fused"]())
    blocks, conditions = harness.measure(
        sides, device, warmup=args.warmup, rounds=args.rounds, block=args.block
    )
    harness.warn_if_loaded(conditions, f"{precision} batch {batch_size}")
    samples = {side: harness.counted(blocks, side) for side in SIDES}
    rounds = {
        side: [b["round"] for b in blocks if b["side"] == side for _ in b["samples_s"]]
        for side in SIDES
    }
    speedup = stats.speedup(
        samples["unfused"], samples["fused"], rounds=(rounds["unfused"], rounds["fused"])
    )
    return {
        "precision": precision,
        "batch_size": batch_size,
        "median_ms": {side: harness.median_s(samples[side]) * 1000 for side in SIDES},
        "speedup": speedup.as_dict(),
        "speedup_text": speedup.text,
        "max_abs_difference": difference,
        "conditions": conditions,
        "blocks": blocks,
    }


def unfolded(model: torch.nn.Module, *, in_place: bool = False) -> torch.nn.Module:
    """The model as trained, in eval mode: what evaluation ran before the folding."""
    return (model if in_place else copy.deepcopy(model)).eval()


def evaluation(
    best: Path, data: str | None, precision: str, fused: bool, threads: int, folder: Path
):
    """The evaluate command's figures of one side (test split, else validation)."""
    out = folder / "eval.json"
    argv = ["--cpu-threads", str(threads), "evaluate", "--checkpoint", str(best)]
    argv += [*(("--data", data) if data else ()), "--precision", precision, "--out", str(out)]
    folding = (
        contextlib.nullcontext()
        if fused
        else mock.patch.object(inference, "for_inference", unfolded)
    )
    with folding, contextlib.redirect_stdout(io.StringIO()):
        result, _ = harness.evaluate_in_process(argv, out)
    metrics = result["metrics"]
    return {"split": result["metrics_split"], **{key: metrics[key] for key, _, _ in ACCURACY}}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    device = harness.setup_torch(args)
    state = checkpoint.load(args.checkpoint)
    config = checkpoint.config_of(state, args.checkpoint)
    layout = memory_format(config["train"]["channels_last"])
    image_size = config["data"]["image_size"]
    model = checkpoint.restore_model(state, device, layout, args.checkpoint)
    models = {"unfused": model, "fused": for_inference(model)}
    for precision in args.precisions:
        reason = dev.autocast_unsupported_reason(device, precision)
        if reason:
            raise DataError(f"--precisions {precision}: {reason}")
    print(
        f"{NAME}: {config['model']['name']} from {args.checkpoint} on "
        f"{dev.describe_device(device)}, {image_size} px, {torch.get_num_threads()} torch "
        f"threads; warm-up {args.warmup}, {args.rounds} rounds x {args.block} forward passes "
        f"per side (ABBA)",
        flush=True,
    )
    rows = []
    for precision in args.precisions:
        for batch_size in args.batch_sizes:
            row = speed_row(models, device, precision, batch_size, image_size, layout, args)
            rows.append(row)
            print(
                f"{precision} batch {batch_size}: unfused {harness.ms(row['median_ms']['unfused'])} ms, "
                f"fused {harness.ms(row['median_ms']['fused'])} ms; fused {row['speedup_text']}; "
                f"max output difference {row['max_abs_difference']:.2e}",
                flush=True,
            )
    threads = torch.get_num_threads()
    accuracy = {}
    with tempfile.TemporaryDirectory() as folder:
        for index, precision in enumerate(args.precisions):
            order = SIDES if index % 2 == 0 else SIDES[::-1]
            accuracy[precision] = {
                side: evaluation(
                    args.checkpoint, args.data, precision, side == "fused", threads, Path(folder)
                )
                for side in order
            }
    split = accuracy[args.precisions[0]]["fused"]["split"]
    print(harness.table(
        ["precision", "side", *(title for _, title, _ in ACCURACY)],
        [[p, side, *(accuracy[p][side][key] for key, _, _ in ACCURACY)]
         for p in args.precisions for side in SIDES],
    ))  # fmt: skip
    print(f"evaluation figures: the {split} split at the checkpoint's operating point")
    figures = []
    for row in rows:
        tag, words = (
            f"{row['precision']}.b{row['batch_size']}",
            f"{row['precision']}, batch {row['batch_size']}",
        )
        speedup = row["speedup"]
        figures += [
            harness.figure(f"{tag}.speedup", f"forward pass, unfused / fused median, {words}",
                           speedup["ratio"], "speed-up", interval=(speedup["low"], speedup["high"])),
            harness.figure(f"{tag}.unfused_ms", f"forward pass unfused, median, {words}",
                           row["median_ms"]["unfused"], "ms"),
            harness.figure(f"{tag}.fused_ms", f"forward pass fused, median, {words}",
                           row["median_ms"]["fused"], "ms"),
            harness.figure(f"{tag}.max_abs_difference",
                           f"largest absolute difference of an output map, {words}",
                           row["max_abs_difference"], "map"),
        ]  # fmt: skip
    for precision, sides in accuracy.items():
        for side in SIDES:
            figures += [
                harness.figure(f"eval.{precision}.{side}.{key}",
                               f"{title} of the {split} split, {side}, {precision}",
                               sides[side][key], unit)
                for key, title, unit in ACCURACY
            ]  # fmt: skip
    flags = [
        flag
        for row in rows
        for flag in harness.condition_flags(
            row["conditions"], f"{row['precision']} batch {row['batch_size']}"
        )
    ]
    settings = {
        "checkpoint": str(args.checkpoint),
        "data": args.data,
        "model": config["model"]["name"],
        "image_size": image_size,
        "channels_last": config["train"]["channels_last"],
        "precisions": args.precisions,
        "batch_sizes": args.batch_sizes,
        "warmup": args.warmup,
        "block": args.block,
        "rounds": args.rounds,
        "cpu_threads": threads,
        "device": str(device),
        "split": split,
    }
    harness.write_record(args, harness.record(NAME, figures, settings=settings, flags=flags))
    raw = {
        "benchmark": NAME,
        "settings": settings,
        "environment": harness.environment(device),
        "rows": rows,
        "accuracy": accuracy,
    }
    return harness.finish(args.out, raw, True, False)


if __name__ == "__main__":
    harness.run(main)
