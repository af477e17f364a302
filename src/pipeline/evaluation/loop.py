"""The evaluation loop: a model over a loader, timed apart from everything else, and its
detections turned into the metrics every stage reports (training's validation, `evaluate`)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from pipeline.data.geometry import has_area
from pipeline.device import DeviceLike, autocast, synchronize
from pipeline.errors import ConfigError
from pipeline.evaluation.coco import coco_ap, without_cyclic_gc
from pipeline.evaluation.image_level import image_level_f1
from pipeline.evaluation.matching import (
    FIGURE_PROTOCOLS,
    PROTOCOLS,
    precision_recall_f1,
    ratio,
    resolve_protocol,
)
from pipeline.evaluation.records import Record
from pipeline.evaluation.voc import voc_ap

LABEL_MODES = ("multilabel", "single")
TIMING_KEYS = (
    "model_s",
    "postprocess_s",
    "loader_s",
    "metrics_s",
    "images_per_s",
    "ms_per_image",
)


def _numpy(tensor: Any, dtype: torch.dtype) -> np.ndarray:
    # through the CPU in float32/int64 first: MPS has no float64, and metrics must not care
    return torch.as_tensor(tensor).detach().to(device="cpu", dtype=dtype).numpy()


_FIELDS = {
    "boxes": (torch.float32, (-1, 4)),
    "scores": (torch.float32, (-1,)),
    "labels": (torch.int64, (-1,)),
    "ignore_boxes": (torch.float32, (-1, 4)),
    "ignore_labels": (torch.int64, (-1,)),
    "region": (torch.float32, (-1, 4)),
}
IGNORE_KEYS = ("ignore_boxes", "ignore_labels")


def _joined(values: Sequence[Any], key: str) -> tuple[np.ndarray, np.ndarray]:
    """The images' `key` tensors as one numpy array, through one copy to the CPU for a batch
    (one per image and key cost more than the metrics they feed), and each image's rows."""
    dtype, shape = _FIELDS[key]
    # as_tensor only where a value is no tensor: per call it costs several times the check
    parts = [
        value if isinstance(value, torch.Tensor) else torch.as_tensor(value) for value in values
    ]
    rows = np.array([part.shape[0] for part in parts], dtype=np.int64)
    return _numpy(torch.cat(parts), dtype).reshape(shape), rows


def _slices(rows: np.ndarray) -> list[slice]:
    """Each image's rows of a batch's joined array."""
    ends = np.cumsum(rows).tolist()
    return [slice(start, end) for start, end in zip([0, *ends[:-1]], ends, strict=True)]


def _targets(image_ids: Sequence[int], targets: Sequence[Record]) -> list[dict[str, Any]]:
    """A batch's targets as the numpy records the metric functions take (each array a view
    of the batch's)."""
    records: list[dict[str, Any]] = [{"image_id": image_id} for image_id in image_ids]
    for key in ("boxes", "labels", *IGNORE_KEYS):
        having = [i for i, target in enumerate(targets) if key in target]
        if having:
            joined, rows = _joined([targets[i][key] for i in having], key)
            for i, rows_of in zip(having, _slices(rows), strict=True):
                records[i][key] = joined[rows_of]
    return records


_UNBOUNDED = (-np.inf, -np.inf, np.inf, np.inf)  # a target without a region: nothing clipped


def _detections(
    image_ids: Sequence[int], decoded: Sequence[Record], targets: Sequence[Record]
) -> list[dict[str, Any]]:
    """A batch's decoded detections as the numpy records the metric functions take, the
    boxes clipped to their images' own areas in the input frame (a target's `region`); a box
    the clip leaves without area is dropped (`has_area`).

    A letterboxed image fills only part of the square input; a detection reaching into the
    padding is scored as it maps back to the image's own pixels (what the predictions file
    holds): IoU is unchanged by the per-axis scaling between the two frames, not by padding.
    """
    boxes, rows = _joined([image["boxes"] for image in decoded], "boxes")
    scores, _ = _joined([image["scores"] for image in decoded], "scores")
    labels, _ = _joined([image["labels"] for image in decoded], "labels")
    regions, _ = _joined([target.get("region", _UNBOUNDED) for target in targets], "region")
    # each image's bounds repeated over its rows (indexing the regions by each row's image
    # cost several times the clip itself)
    lower = np.repeat(regions[:, [0, 1, 0, 1]], rows, axis=0)
    boxes = np.clip(boxes, lower, np.repeat(regions[:, [2, 3, 2, 3]], rows, axis=0))
    kept = has_area(boxes)
    if not kept.all():
        image_of = np.repeat(np.arange(rows.size), rows)[kept]
        boxes, scores, labels = boxes[kept], scores[kept], labels[kept]
        rows = np.bincount(image_of, minlength=rows.size)
    return [
        {"image_id": image_id, "boxes": boxes[of], "scores": scores[of], "labels": labels[of]}
        for image_id, of in zip(image_ids, _slices(rows), strict=True)
    ]


class Evaluator:
    """Runs a model over a loader and turns its detections into the metrics every stage reports."""

    def __init__(
        self,
        class_names: Sequence[str],
        *,
        label_mode: str,
        score_threshold: float | None = 0.3,
        iou_threshold: float = 0.5,
        max_detections: int = 100,
        image_threshold: float = 0.5,
        protocol: str = "coco",
        min_score: float = 0.0,
        flip_test: bool = False,
    ) -> None:
        if label_mode not in LABEL_MODES:
            raise ConfigError(
                f"label_mode={label_mode!r} is not understood: use one of {LABEL_MODES}."
            )
        if protocol not in PROTOCOLS:
            raise ConfigError(f"eval.protocol={protocol!r} is not one of {PROTOCOLS}.")
        if not class_names:
            raise ConfigError("The evaluator needs at least one class name.")
        if not 0.0 <= min_score < 1.0:
            raise ConfigError(f"eval.min_score={min_score!r} must be at least 0 and below 1.")
        self.class_names = list(class_names)
        self.label_mode = label_mode
        # None: each pass picks its own best-F1 threshold (see precision_recall_f1)
        self.score_threshold = None if score_threshold is None else float(score_threshold)
        self.iou_threshold = float(iou_threshold)
        self.max_detections = int(max_detections)
        self.image_threshold = float(image_threshold)
        self.protocol = protocol
        # detections scoring below it are dropped as decoded: no metric, no file sees them
        self.min_score = float(min_score)
        # the model's maps averaged over each image and its mirror (CenterNet.forward)
        self.flip_test = bool(flip_test)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], class_names: Sequence[str]) -> Evaluator:
        """The evaluator a resolved config describes (training's validation and `eval` agree)."""
        settings = config["eval"]
        return cls(
            class_names,
            label_mode=config["model"]["label_mode"],
            score_threshold=settings["score_threshold"],
            iou_threshold=settings["iou_threshold"],
            max_detections=settings["max_detections"],
            protocol=resolve_protocol(settings["protocol"], config["data"]["format"]),
            min_score=settings["min_score"],
            flip_test=settings["flip_test"],
        )

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def evaluate(
        self,
        model: torch.nn.Module,
        loader: Iterable[tuple[torch.Tensor, Sequence[Record]]],
        device: DeviceLike,
        precision: str = "fp32",
        chosen_threshold: float | None = None,
        ap_intervals: bool = False,
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Metrics and each image's detections (`image_id`; `boxes` [N, 4] float32 in the input
        frame, clipped to the image's own region, `scores`, `labels`: numpy, as the metrics
        read them; turned into lists only where they are written) for one pass over `loader`.

        `timing.model_s` is the synchronized forward pass alone (the first batch's warm-up
        included; with `flip_test`, both views' and their average); `images_per_s` and
        `ms_per_image` derive from it. Decoding and the copy to the CPU are `postprocess_s`;
        waiting for the loader's batches (images read or taken from its cache, collated, moved
        to the device) `loader_s`; matching, P/R/F1, AP and the intervals `metrics_s`: what
        the pass spends beside the forward pass, divided.
        `model` is run as given: its inference form (`for_inference`: eval mode, BatchNorm
        folded into the convs), made by the caller once for every pass over the same weights
        (`evaluate` runs validation and test on one); a model in training mode is refused.
        `chosen_threshold` (one picked on other images, say validation's best-F1 threshold)
        adds the micro P/R/F1 at it as `chosen_threshold`; the split's own best-F1 point,
        picked on the very images it is measured on, is optimistic. `ap_intervals` adds AP's
        intervals over the images (see `coco_ap`).
        """
        if model.training:
            raise ValueError(
                "Evaluator.evaluate runs the model as given, and this one is in training mode: "
                "pass its inference form, pipeline.models.inference.for_inference(model)."
            )
        device = torch.device(device)
        gts: list[dict[str, Any]] = []
        dets: list[dict[str, Any]] = []
        score_rows: list[np.ndarray] = []
        model_s = postprocess_s = loader_s = 0.0
        with torch.inference_mode():
            waited = time.perf_counter()  # for the loader's next batch
            for images, targets in loader:
                images = images.to(device, non_blocking=True)
                loader_s += time.perf_counter() - waited
                synchronize(device)
                start = time.perf_counter()
                with autocast(device, precision):
                    outputs = model(images, flip_test=self.flip_test)
                synchronize(device)
                model_s += time.perf_counter() - start

                start = time.perf_counter()
                # a detector's top K per image are mostly near-zero scores, nearly all false
                # positives ranked after its last true positive, where they change no AP figure
                # (the rare true positive adds a sliver of recall at a precision near nothing);
                # yet matching, COCO AP, the intervals and the predictions file would each pay
                # for every one, and decoding for its box
                decoded = model.decode(
                    outputs, max_detections=self.max_detections, min_score=self.min_score
                )
                if len(decoded) != len(targets) or len(targets) != images.shape[0]:
                    raise ValueError(
                        f"A batch of {images.shape[0]} images came with {len(targets)} targets "
                        f"and {len(decoded)} decoded predictions; they must match one to one."
                    )
                image_ids = [int(target["image_id"]) for target in targets]
                dets.extend(_detections(image_ids, decoded, targets))
                gts.extend(_targets(image_ids, targets))
                if self.label_mode == "multilabel":
                    score_rows.append(_numpy(model.image_scores(outputs), torch.float32))
                postprocess_s += time.perf_counter() - start
                waited = time.perf_counter()
            loader_s += time.perf_counter() - waited  # the wait that ended the loader
        start = time.perf_counter()
        metrics = self._metrics(gts, dets, score_rows, chosen_threshold, ap_intervals)
        timing = {"model_s": model_s, "postprocess_s": postprocess_s, "loader_s": loader_s}
        metrics["timing"] = {
            **timing,
            "metrics_s": time.perf_counter() - start,
            "images_per_s": ratio(metrics["num_images"], model_s),
            "ms_per_image": 1000.0 * ratio(model_s, metrics["num_images"]),
        }
        return metrics, dets

    @without_cyclic_gc()  # an object or several per detection, none in a cycle
    def _metrics(
        self,
        gts: list[dict[str, Any]],
        dets: list[dict[str, Any]],
        score_rows: list[np.ndarray],
        chosen_threshold: float | None = None,
        ap_intervals: bool = False,
    ) -> dict[str, Any]:
        threads = torch.get_num_threads()  # the CPUs this process was given

        def counting() -> dict[str, Any]:
            return precision_recall_f1(
                gts,
                dets,
                self.num_classes,
                self.score_threshold,
                self.iou_threshold,
                chosen_threshold,
                protocol=self.protocol,
            )

        def coco_at(score_threshold: float) -> dict[str, Any]:
            return coco_ap(
                gts,
                dets,
                self.num_classes,
                self.class_names,
                score_threshold,
                ap_intervals,
                threads=threads,
            )

        if self.score_threshold is None or threads < 2:  # COCO AP reads P/R/F1's threshold
            counts = counting()
            coco = coco_at(counts["score_threshold"])
        else:
            # P/R/F1 on a thread of its own beside COCO's matching, which AP's intervals wait
            # on and which keeps one CPU busy: not before it
            with ThreadPoolExecutor(1) as beside:
                counted = beside.submit(counting)
                try:
                    coco = coco_at(float(self.score_threshold))
                except Exception:
                    counted.result()  # P/R/F1's error first, as where it ran first
                    raise
                counts = counted.result()
        if self.protocol != "coco":
            found = voc_ap(
                gts,
                dets,
                self.num_classes,
                self.iou_threshold,
                ap_intervals,
                eleven_points=self.protocol == "voc2007",
            )
            coco = {
                **coco,
                "ap50": found["ap50"],
                "ap50_interval": found["ap50_interval"],
                "per_class": [
                    {**row, **mine}
                    for row, mine in zip(coco["per_class"], found["per_class"], strict=True)
                ],
            }
        image_level = None
        if self.label_mode == "multilabel":
            present = np.zeros((len(gts), self.num_classes), dtype=bool)
            for row, gt in enumerate(gts):
                present[row, gt["labels"]] = True
            scores = (
                np.concatenate(score_rows)
                if score_rows
                else np.zeros((0, self.num_classes), dtype=np.float32)
            )
            image_level = image_level_f1(scores, present, self.image_threshold)
        num_images = len(gts)
        per_class = [
            {
                "name": self.class_names[c],
                "num_gt": counts["per_class"][c]["num_gt"],
                "ap": coco["per_class"][c]["ap"],
                "ap_interval": coco["per_class"][c]["ap_interval"],
                "ap50": coco["per_class"][c]["ap50"],
                "ap50_interval": coco["per_class"][c]["ap50_interval"],
                "precision": counts["per_class"][c]["precision"],
                "recall": counts["per_class"][c]["recall"],
                "f1": counts["per_class"][c]["f1"],
                "tp": counts["per_class"][c]["tp"],
                "fp": counts["per_class"][c]["fp"],
                "fn": counts["per_class"][c]["fn"],
            }
            for c in range(self.num_classes)
        ]
        return {
            "f1": counts["micro"]["f1"],
            "f1_interval": counts["f1_interval"],
            "precision": counts["micro"]["precision"],
            "precision_interval": counts["precision_interval"],
            "recall": counts["micro"]["recall"],
            "recall_interval": counts["recall_interval"],
            "f1_macro": counts["macro"]["f1"],
            "best_f1": counts["best"]["f1"],
            "best_f1_threshold": counts["best"]["threshold"],
            "ap": coco["ap"],
            "ap_interval": coco["ap_interval"],
            "ap50": coco["ap50"],
            "ap50_interval": coco["ap50_interval"],
            "ap50_matches": coco["ap50_matches"],
            "ap75": coco["ap75"],
            "ap75_interval": coco["ap75_interval"],
            "per_class": per_class,
            "size_buckets": coco["size_buckets"],
            "micro": counts["micro"],
            "macro": counts["macro"],
            "best": counts["best"],
            "chosen_threshold": counts["chosen_threshold"],
            "image_level": image_level,
            "num_images": num_images,
            "num_ground_truth": counts["num_ground_truth"],
            "num_detections": counts["num_detections"],
            "num_ignored_detections": counts["num_ignored_detections"],
            "per_image": counts["per_image"],
            "score_threshold": counts["score_threshold"],
            "min_score": self.min_score,
            "flip_test": self.flip_test,
            "iou_threshold": self.iou_threshold,
            "protocol": self.protocol,
            "figure_protocols": FIGURE_PROTOCOLS[self.protocol],
        }
