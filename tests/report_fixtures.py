"""A small results tree for the report tests, shaped like the real files each stage writes.

The benchmarks make CUDA fp16 the fastest setting with acceptable numerics, and CUDA bf16
faster still but with a loss 5% off fp32, so the answer must skip it. One class name is a
script tag, one predicted image file is missing, one benchmark is skipped, MPS memory is a
sampled lower bound, and the cuda-fp16 run has no profile yet.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

from pipeline.evaluation.image_bootstrap import micro_intervals

SCRIPT_CLASS = "<script>alert(1)</script>"
CLASS_NAMES = ["circle", SCRIPT_CLASS]
CREATED = "2026-11-29T17:22:52+00:00"


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return path


def write_png(path: Path, size: int = 32, colour: tuple[int, int, int] = (40, 120, 200)) -> Path:
    """A valid RGB PNG written by hand, so the fixture needs nothing beyond the standard library."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return len(data).to_bytes(4, "big") + body + zlib.crc32(body).to_bytes(4, "big")

    header = size.to_bytes(4, "big") * 2 + bytes([8, 2, 0, 0, 0])
    rows = b"".join(b"\x00" + bytes(colour) * size for _ in range(size))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )
    return path


def backend_entry(available: bool, amp_auto: bool, reason: str | None = None) -> dict[str, Any]:
    return {
        "available": available,
        "reason": reason,
        "description": "NVIDIA Fake H100" if amp_auto else "Apple M3 (MPS)",
        "amp_default": amp_auto,
        "amp_supported": True,
        "resolved_amp": {"auto": amp_auto, "true": True, "false": False},
        "precisions": {"auto": "fp16" if amp_auto else "fp32", "fp32": "fp32"}
        | {"fp16": "fp16", "bf16": "bf16"},
        "pin_memory": amp_auto,
        "measured_refused": {"bf16": None, "fp16": None},
        "error": None,
    }


def env_json() -> dict[str, Any]:
    cpu = backend_entry(True, False)
    cpu.update(
        description="CPU",
        amp_supported=False,
        resolved_amp={"auto": False, "true": False, "false": False},
        precisions={"auto": "fp32", "fp32": "fp32", "fp16": "fp32", "bf16": "fp32"},
        measured_refused={
            p: f"this CPU has no native {p} instructions (torch.cpu.get_capabilities(): "
            f"avx512_{p}=no, amx_{p}=no)"
            for p in ("bf16", "fp16")
        },
    )
    return {
        "format": "pipeline.env/1",
        "created": "2026-11-29T17:22:36+00:00",
        "versions": {
            "python": "3.11.7",
            "torch": "2.14.1+cu130",
            "torchvision": "0.29.1",
            "snakemake": "9.27.1",
            "pipeline": "0.1.0",
        },
        "platform": {
            "os": "Linux-test",
            "system": "Linux",
            "machine": "x86_64",
            "cpu_model": "AMD EPYC",
            "cpu_count": 2,
            "memory_gib": 31.3,
            "torch_threads": 2,
        },
        "backends": {
            "cuda": backend_entry(True, True),
            "mps": backend_entry(True, False),
            "cpu": cpu,
        },
        "cpu_native": {
            p: {
                "native": False,
                "evidence": f"torch.cpu.get_capabilities(): avx512_{p}=no, amx_{p}=no",
                "hidden": False,
            }
            for p in ("bf16", "fp16")
        },
        "available": ["cuda", "mps", "cpu"],
        "auto": "cuda",
        "cuda": {
            "built": True,
            "version": "13.0",
            "cudnn": 91000,
            "devices": [
                {
                    "index": 0,
                    "name": "NVIDIA Fake H100",
                    "total_memory_gib": 79.6,
                    "capability": "9.0",
                    "multiprocessors": 132,
                }
            ],
            "visible_devices_env": None,
        },
        "mps": {"built": True, "available": True, "macos": "15.1"},
    }


def numerics(loss_rel_diff: float) -> dict[str, Any]:
    acceptable = loss_rel_diff <= 0.02
    return {
        "reference": "fp32",
        "trained_steps": 10,
        "loss_fp32": 9.2,
        "loss": 9.2 * (1 + loss_rel_diff),
        "loss_abs_diff": 9.2 * loss_rel_diff,
        "loss_rel_diff": loss_rel_diff,
        "grad_cosine": 0.998,
        "grad_rel_diff": 0.06,
        "output_max_abs_diff": 0.0035,
        "output_max_rel_diff": None,  # an fp32 output that is all zero leaves it undefined
        "outputs": {
            "heatmap": {"max_abs_diff": 0.0035, "max_rel_diff": 0.00076},
            "box": {"max_abs_diff": 0.0, "max_rel_diff": None},
        },
        "finite": True,
        "acceptable": acceptable,
        "problem": None if acceptable else f"the loss is {loss_rel_diff:.1%} off fp32's",
        "acceptable_rule": "finite, relative loss difference <= 0.02 and gradient cosine >= 0.99, after 10 fp32 training steps",
    }


def step_samples(median_ms: float, count: int = 20) -> list[float]:
    """Timed steps spread +-5% around the median, in an order without drift."""
    spread = [median_ms * (0.95 + 0.1 * i / (count - 1)) for i in range(count)]
    return [spread[(7 * i) % count] for i in range(count)]


def bench_record(
    backend: str,
    precision: str,
    mode: str,
    median_ms: float | None,
    loss_rel_diff: float = 0.001,
    skipped: str | None = None,
    memory: dict[str, Any] | None = None,
    high_load: bool = False,
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "format": "pipeline.bench/2",
        "status": "skipped" if skipped else "ok",
        "reason": skipped,
        "created": CREATED,
        "backend": backend,
        "device": backend,
        "device_description": {"cuda": "NVIDIA Fake H100", "mps": "Apple M3 (MPS)", "cpu": "CPU"}[
            backend
        ],
        "precision": precision,
        "mode": mode,
        "model": "tiny_conv",
        "parameters": None if skipped else 328408,
        "batch_size": 16,
        "image_size": 128,
        "channels_last": False,
        "compile": False,
        "configuration": {
            "source": "training config",
            "overridden": [],
            "model": {"name": "tiny_conv", "label_mode": "single", "width": 32},
            "num_classes": 2,
            "batch_size": 16,
            "image_size": 128,
            "channels_last": False,
            "grad_clip": 10.0,
            "optimizer": "adamw",
            "deterministic": False,
            "compile": False,
        },
        "settings": {
            "torch_threads": 2,
            "cudnn_benchmark": False,
            "tf32_matmul": False,
            "tf32_cudnn": True,
            "float32_matmul_precision": "highest",
            "warmup_steps": 5,
            "warmup_budget_s": 5.0,
            "max_steps": 20,
            "time_budget_s": 3.0,
        },
        "environment": {
            "torch": "2.14.1+cu130",
            "python": "3.11.7",
            "cpu_model": "AMD EPYC",
            "cpu_native": {"bf16": False, "fp16": False} if backend == "cpu" else None,
        },
        "timing": None,
        "throughput_images_per_s": None,
        "numerics": None,
        "memory": None,
        "host_peak_rss_mb": None,
        "conditions": None,
    }
    if skipped:
        return record
    iqr = median_ms * 0.05
    record.update(
        timing={
            "count": 20,
            "median_ms": median_ms,
            "mean_ms": median_ms,
            "iqr_ms": iqr,
            "iqr_ratio": 0.05,
            "p10_ms": median_ms * 0.97,
            "p50_ms": median_ms,
            "p90_ms": median_ms * 1.03,
            "p99_ms": median_ms * 1.05,
            "min_ms": median_ms * 0.95,
            "max_ms": median_ms * 1.1,
            "noisy": False,
            "drift_ratio": 1.0,
            "drifting": False,
            "warmup_steps": 10,
            "warmup_s": median_ms * 10 / 1000,
            "warmup_settled": True,
            "total_s": median_ms * 30 / 1000,
            "budget_limited": False,
            "samples_ms": step_samples(median_ms),
        },
        throughput_images_per_s=16 / (median_ms / 1000),
        numerics=None if precision == "fp32" else numerics(loss_rel_diff),
        memory=memory
        or {"peak_mb": 0.0, "reserved_mb": 0.0, "exact": True, "label": "n/a (CPU: see host RSS)"},
        host_peak_rss_mb=715.5,
        conditions={
            "started": "2026-11-29T10:00:00.000+00:00",
            "finished": "2026-11-29T10:00:02.000+00:00",
            "load_1m_start": 2.3 if high_load else 0.1,
            "load_1m_end": 0.2,
            "cpu_count": 2,
            "foreign_cpu_share": 0.66 if high_load else 0.01,
            "high_load": high_load,
        },
    )
    return record


CUDA_MEMORY = {"peak_mb": 812.4, "reserved_mb": 1024.0, "exact": True, "label": "exact"}
MPS_MEMORY = {
    "peak_mb": 123.0,
    "reserved_mb": 256.0,
    "exact": False,
    "label": "lower bound (sampled)",
}
BENCH = [
    bench_record("cuda", "fp32", "train", 10.0, memory=CUDA_MEMORY),
    bench_record("cuda", "fp16", "train", 4.0, memory=CUDA_MEMORY),
    bench_record(
        "cuda", "bf16", "train", 3.0, loss_rel_diff=0.05, memory=CUDA_MEMORY
    ),  # faster, not acceptable
    bench_record("mps", "fp32", "train", 20.0, memory=MPS_MEMORY),
    bench_record("mps", "fp16", "train", 15.0, memory=MPS_MEMORY),
    bench_record("mps", "bf16", "train", None, skipped="bf16 autocast on MPS needs torch >= 2.6"),
    bench_record("cpu", "fp32", "train", 100.0, high_load=True),
    bench_record("cpu", "fp32", "infer", 30.0),
]


def ap_interval(ap: float, half_width: float) -> dict[str, Any]:
    """An AP interval as the evaluate stage writes it, over the 1,000 images of the fixtures."""
    return {
        "low": ap - half_width,
        "high": min(1.0, ap + half_width),
        "confidence": 0.95,
        "images": 1000,
        "method": "percentile bootstrap over images, 2000 resamples, pycocotools' matches reweighed",
    }


def size_buckets(f1: float, intervals: bool = False) -> dict[str, Any]:
    """The evaluator's figures by object size: small and medium objects, no large ones; with
    `intervals` as the evaluate stage writes them, else as validation in training does."""

    def bucket(
        range_px: list[float | None],
        counts: list[int],
        ap50: float | None,
        ap: float | None,
        recall: float | None,
    ) -> dict[str, Any]:
        return {
            "range_px": range_px,
            "num_gt": sum(counts),
            "ap50": ap50,
            "ap50_interval": ap_interval(ap50, 0.04) if intervals and ap50 is not None else None,
            "ap": ap,
            "ap_interval": ap_interval(ap, 0.03) if intervals and ap is not None else None,
            "recall": recall,
            "recall_interval": ap_interval(recall, 0.05)
            if intervals and recall is not None
            else None,
            "per_class": [
                {"label": label, "name": name, "num_gt": count, "ap50": ap50 if count else None}
                for label, (name, count) in enumerate(zip(CLASS_NAMES, counts, strict=True))
            ],
        }

    return {
        "small": bucket([0.0, 16.0], [30, 20], f1 * 0.8, f1 / 3, f1 * 0.7),
        "medium": bucket([16.0, 64.0], [12, 10], f1, f1 / 2, f1),
        "large": bucket([64.0, None], [0, 0], None, None, None),
    }


def validation_summary(f1: float) -> dict[str, Any]:
    """What an epoch row and the training summary keep of a validation."""
    return {
        "f1": f1,
        "score_threshold": 0.3,
        "precision": f1,
        "recall": f1,
        "best_f1": f1,
        "ap": f1 / 2,
        "ap50": f1 * 0.9,
        "ap75": f1 / 3,
        "size_buckets": size_buckets(f1),
    }


def metrics_rows(losses: list[float], f1s: list[float]) -> list[dict[str, Any]]:
    rows, memory = (
        [],
        {"peak_mb": 0.0, "reserved_mb": 0.0, "exact": True, "label": "n/a (CPU: see host RSS)"},
    )
    for index, loss in enumerate(losses, start=1):
        epoch = (index + 1) // 2
        rows.append(
            {
                "type": "step",
                "epoch": epoch,
                "step": index,
                "loss": loss,
                "heatmap": loss / 2,
                "box": 0.9,
                "lr": 0.006,
                "step_time_s": 0.1,
                "images_per_s": 160.0,
                "memory": memory,
            }
        )
        if index % 2 == 0:
            f1 = f1s[epoch - 1]
            val = validation_summary(f1)
            rows.append(
                {
                    "epoch": epoch,
                    "train_loss": loss,
                    "train_heatmap": loss / 2,
                    "train_box": 0.9,
                    "epoch_time_s": 0.4,
                    "images_per_s": 150.0,
                    "type": "epoch",
                    "step": index,
                    "lr": 0.006,
                    "memory": memory,
                    "host_peak_rss_mb": 700.0,
                    "val": val if epoch > 1 else None,
                }
            )
    return rows


def train_summary(backend: str, precision: str, best: float) -> dict[str, Any]:
    run = f"results/train/{backend}-{precision}"
    return {
        "format": "pipeline.train_summary/1",
        "created": "2026-11-29T17:22:59+00:00",
        "requested_device": backend,
        "device": backend,
        "backend": backend,
        "device_description": "NVIDIA Fake H100" if backend == "cuda" else "CPU",
        "amp": precision != "fp32",
        "precision": precision,
        "precision_choice": None,
        "model": "tiny_conv",
        "parameters": 20908,
        "class_names": CLASS_NAMES,
        "epochs": 3,
        "time_budget_s": None,
        "ema": backend == "cuda",  # one run of each kind
        "steps": 6,
        "batch_size": 16,
        "wall_time_s": 12.5,
        "resumed_after_s": 0.0,
        "train_time_s": 1.2,
        "epoch_times_s": [0.4, 0.4, 0.4],
        "median_step_time_s": 0.1,
        "images_per_s": 150.0,
        "peak_memory": CUDA_MEMORY
        if backend == "cuda"
        else {
            "peak_mb": 0.0,
            "reserved_mb": 0.0,
            "exact": True,
            "label": "n/a (CPU: see host RSS)",
        },
        "host_peak_rss_mb": 687.2,
        "monitor": "f1",
        "best_metric": best,
        "best_epoch": 3,
        "final_val": validation_summary(best),
        "paths": {
            "last": f"{run}/last.pth",
            "best": f"{run}/best.pth",
            "metrics": f"{run}/metrics.jsonl",
            "train_summary": f"{run}/train_summary.json",
            "config": f"{run}/config.json",
        },
    }


def per_image_counts(f1: float, images: int = 1000, objects: int = 4) -> dict[str, list[int]]:
    """Per-image TP/FP/FN whose micro F1 is `f1` (to 1 / (images x objects)): every image holds
    `objects` objects, and each miss comes with a wrong box (FP = FN, so F1 = TP / GT), one per
    image from the last image back, then a second round. Two such runs miss in nested sets, as
    two runs of one model mostly do: the lower F1 misses the same objects and a few more."""
    misses = round((1 - f1) * images * objects)
    per_image = [misses // images + (images - 1 - i < misses % images) for i in range(images)]
    return {
        "image_ids": list(range(images)),
        "tp": [objects - missed for missed in per_image],
        "fp": per_image,
        "fn": per_image,
    }


def ap50_matches(counts: dict[str, list[int]], classes: int = 2) -> dict[str, Any]:
    """pycocotools' matches as the evaluate stage keeps them, for per-image counts: every object
    is class 0's, and every true positive outranks every false positive, so the false positives
    fall after the last true positive (left out) and AP@.5 is the recall, TP / objects."""
    detections = [i for i, tp in enumerate(counts["tp"]) for _ in range(tp)]
    objects = [
        i
        for i, (tp, fn) in enumerate(zip(counts["tp"], counts["fn"], strict=True))
        for _ in range(tp + fn)
    ]
    return {
        "image_ids": list(counts["image_ids"]),
        "classes": [
            {
                "label": 0,
                "detections": detections,
                "true_positive": [1] * len(detections),
                "objects": objects,
            },
            *(
                {"label": label, "detections": [], "true_positive": [], "objects": []}
                for label in range(1, classes)
            ),
        ],
    }


def evaluation(backend: str, precision: str, f1: float) -> dict[str, Any]:
    per_class = [
        {
            "name": name,
            "num_gt": 7,
            "ap": f1 / 2,
            "ap_interval": ap_interval(f1 / 2, 0.03),
            "ap50": f1 * 0.9,
            "ap50_interval": ap_interval(f1 * 0.9, 0.03),
            "precision": f1,
            "recall": f1,
            "f1": f1,
            "tp": 3,
            "fp": 1,
            "fn": 4,
        }
        for name in CLASS_NAMES
    ]
    per_image = per_image_counts(f1)
    micro = micro_intervals(per_image)
    return {
        "format": "pipeline.eval/1",
        "created": "2026-11-29T17:24:23+00:00",
        "checkpoint": f"results/train/{backend}-{precision}/best.pth",
        "checkpoint_epoch": 3,
        "model": "tiny_conv",
        "label_mode": "multilabel",
        "device": backend,
        "backend": backend,
        "device_description": "CPU",
        "precision": precision,
        "data_root": "resources/data/ci",
        "split": "val",
        "metrics_split": "val",
        "splits": {
            "val": {
                "name": "val",
                "source": "resources/data/ci/instances_val.json",
                "num_images": 1000,
            }
        },
        "score_threshold_source": "eval.score_threshold",
        "operating_point": {
            "threshold": 0.25,
            "picked_on": "val",
            "applied_to": "val",
            "precision": f1,
            "recall": f1,
            "f1": f1 + 0.05,
            "f1_interval": None,
        },
        "class_names": CLASS_NAMES,
        "metrics": {
            "f1": f1,
            "f1_interval": micro["f1"],
            "precision": f1,
            "precision_interval": micro["precision"],
            "recall": f1,
            "recall_interval": micro["recall"],
            "f1_macro": f1,
            "best_f1": f1 + 0.05,
            "best_f1_threshold": 0.25,
            "ap": f1 / 2,
            "ap_interval": ap_interval(f1 / 2, 0.02),
            "ap50": f1 * 0.9,
            "ap50_interval": ap_interval(f1 * 0.9, 0.02),
            "ap50_matches": ap50_matches(per_image),
            "ap75": f1 / 3,
            "ap75_interval": ap_interval(f1 / 3, 0.02),
            "per_class": per_class,
            "size_buckets": size_buckets(f1, intervals=True),
            "micro": {"precision": f1, "recall": f1, "f1": f1, "tp": 6, "fp": 2, "fn": 8},
            "macro": {"precision": f1, "recall": f1, "f1": f1, "num_classes": 2},
            "best": {"threshold": 0.25, "precision": f1, "recall": f1, "f1": f1 + 0.05},
            "chosen_threshold": None,
            "image_level": {
                "threshold": 0.5,
                "num_images": 1000,
                "f1": f1,
                "precision": f1,
                "recall": f1,
                "f1_macro": f1,
                "micro": {"precision": f1, "recall": f1, "f1": f1, "tp": 6, "fp": 2, "fn": 8},
                "macro": {"precision": f1, "recall": f1, "f1": f1, "num_classes": 2},
            },
            "num_images": 1000,
            "num_ground_truth": 14,
            "num_detections": 40,
            "num_ignored_detections": 0,
            "per_image": per_image,
            "score_threshold": 0.3,
            "iou_threshold": 0.5,
            "timing": {
                "model_s": 2.5,
                "postprocess_s": 0.4,
                "images_per_s": 400.0,
                "ms_per_image": 2.5,
            },
        },
        "val_metrics": None,
        "peak_memory": {
            "peak_mb": 0.0,
            "reserved_mb": 0.0,
            "exact": True,
            "label": "n/a (CPU: see host RSS)",
        },
        "host_peak_rss_mb": 712.5,
    }


def predictions(image_files: list[str]) -> dict[str, Any]:
    images = []
    for index, file in enumerate(image_files):
        images.append(
            {
                "image_id": index + 1,
                "file": file,
                "width": 32,
                "height": 32,
                "ground_truth": {
                    "boxes": [[4.0, 4.0, 16.0, 16.0], [18.0, 18.0, 30.0, 30.0]],
                    "labels": [0, 1],
                    "ignore_boxes": [],
                    "ignore_labels": [],
                },
                "detections": {
                    "boxes": [
                        [5.0, 5.0, 15.0, 15.0],
                        [17.0, 19.0, 29.0, 31.0],
                        [1.0, 1.0, 3.0, 3.0],
                    ],
                    "scores": [0.91, 0.55, 0.05],
                    "labels": [0, 1, 0],
                },
            }
        )
    return {"format": "pipeline.predictions/1", "class_names": CLASS_NAMES, "images": images}


def profile(backend: str, precision: str) -> dict[str, Any]:
    latency = []
    for batch, median in ((1, 2.9), (4, 6.3), (16, 20.1)):
        wall = {
            "count": 20,
            "median_ms": median,
            "mean_ms": median,
            "iqr_ms": 0.1,
            "iqr_ratio": 0.03,
            "p10_ms": median * 0.98,
            "p50_ms": median,
            "p90_ms": median * 1.04,
            "p99_ms": median * 1.1,
            "min_ms": median * 0.97,
            "max_ms": median * 1.2,
            "noisy": False,
            "drift_ratio": 1.0,
            "drifting": False,
            "warmup_steps": 3,
            "warmup_s": 0.01,
            "warmup_settled": True,
            "total_s": 0.1,
            "budget_limited": batch == 16,
            "samples_ms": step_samples(median),
        }
        latency.append(
            {
                "batch_size": batch,
                "wall": wall,
                "device_events": None,
                "throughput_images_per_s": batch / (median / 1000),
                "memory": {
                    "peak_mb": 0.0,
                    "reserved_mb": 0.0,
                    "exact": True,
                    "label": "n/a (CPU: see host RSS)",
                },
            }
        )
    operators = [
        {
            "name": f"aten::op{index}",
            "kind": "operator",
            "calls": 12,
            "self_cpu_ms": 2.0 / index,
            "cpu_total_ms": 2.0,
            "self_device_ms": 0.0,
            "share": 0.3 / index,
        }
        for index in range(1, 15)
    ]
    return {
        "format": "pipeline.profile/1",
        "created": "2026-11-29T17:23:06+00:00",
        "checkpoint": f"results/train/{backend}-{precision}/best.pth",
        "model": "tiny_conv",
        "device": backend,
        "backend": backend,
        "device_description": "CPU",
        "precision": precision,
        "image_size": 128,
        "settings": {
            "batch_sizes": [1, 4, 16],
            "warmup": 3,
            "repeats": 20,
            "time_budget_s": 2.0,
            "trace_steps": 3,
            "flip_test": False,
        },
        "latency": latency,
        "profiler": {
            "activities": ["CPU"],
            "batch_size": 4,
            "steps": 3,
            "sorted_by": "self_cpu_ms",
            "top_operators": operators,
            "trace": "trace.json",
            "note": None,
        },
    }


def write_results_tree(root: Path) -> Path:
    """The results folder under `root` (and the images its predictions point to); returns it."""
    results = root / "results"
    write_json(results / "env.json", env_json())
    for record in BENCH:
        write_json(
            results / "bench" / f"{record['backend']}-{record['precision']}-{record['mode']}.json",
            {"format": "pipeline.bench/2", "records": [record]},
        )
    runs = {
        "cuda-fp16": ([9.0, 8.5, 8.0, 7.2, 6.9, 6.5], [0.2, 0.45, 0.61]),
        "cpu-fp32": ([9.1, 8.8, 8.4, 8.0, 7.7, 7.5], [0.1, 0.3, 0.42]),
    }
    for name, (losses, f1s) in runs.items():
        backend, precision = name.split("-")
        run_dir = results / "train" / name
        write_json(run_dir / "train_summary.json", train_summary(backend, precision, max(f1s)))
        (run_dir / "metrics.jsonl").write_text(
            "".join(json.dumps(row) + "\n" for row in metrics_rows(losses, f1s)), encoding="utf-8"
        )
        write_json(run_dir / "config.json", {"device": backend, "model": {"name": "tiny_conv"}})
        write_json(results / "eval" / f"{name}.json", evaluation(backend, precision, f1s[-1]))
    images = [
        str(write_png(root / "images" / f"val_{index}.png", colour=(40 * index, 120, 200)))
        for index in range(3)
    ]
    images.insert(1, str(root / "images" / "missing.png"))
    write_json(results / "eval" / "cpu-fp32_predictions.json", predictions(images))
    write_json(results / "profile" / "cpu-fp32" / "profile.json", profile("cpu", "fp32"))
    write_json(
        results / "profile" / "cpu-fp32" / "operators.json", profile("cpu", "fp32")["profiler"]
    )
    write_json(results / "profile" / "cpu-fp32" / "trace.json", {"traceEvents": []})
    stats = results / "job_stats" / "train" / "cpu-fp32.tsv"
    stats.parent.mkdir(parents=True, exist_ok=True)
    stats.write_text(
        "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n6.40\t0:00:06\t798.37\t3453.06\t445.16\t597.22\t0.06\t0.03\t60.00\t4.22\n"
    )
    return results


def native_bf16_cpu(tmp_path: Path) -> Path:
    """Results of a CPU-only machine with native bf16, where bf16 trains faster than fp32."""
    results = tmp_path / "results"
    env = env_json()
    env["backends"] = {"cpu": env["backends"]["cpu"]}
    env["backends"]["cpu"]["measured_refused"]["bf16"] = None
    env["cpu_native"]["bf16"] = {"native": True, "evidence": "avx512_bf16=yes", "hidden": False}
    env.update(available=["cpu"], auto="cpu")
    write_json(results / "env.json", env)
    for precision, ms in (("fp32", 50.0), ("bf16", 34.0)):
        record = bench_record("cpu", precision, "train", ms)
        record["environment"]["cpu_native"]["bf16"] = True  # timed where env.json was made
        write_json(
            results / "bench" / f"cpu-{precision}-train.json",
            {"format": "pipeline.bench/2", "records": [record]},
        )
    return results
