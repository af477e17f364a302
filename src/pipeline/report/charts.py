"""The report's charts: each function draws one matplotlib figure and returns it as an inline PNG.

The images carry their alt text; captions belong to the page around them. PNGs are embedded
as data: URIs, so the report opens offline and prints as it shows.
"""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter

from pipeline.report.formatting import backend_label, number
from pipeline.summary.load import PRECISIONS, RunResults

PRECISION_COLORS = {"fp32": "#4c72b0", "fp16": "#dd8452", "bf16": "#55a868"}
RUN_COLORS = (
    "#4c72b0",
    "#dd8452",
    "#55a868",
    "#c44e52",
    "#8172b3",
    "#937860",
    "#da8bc3",
    "#8c8c8c",
    "#ccb974",
    "#64b5cd",
)
# Bars spanning more than this ratio get a log axis, or the fast ones vanish.
LOG_SCALE_SPREAD = 10.0
MAX_DRAWN_DETECTIONS = 25
PNG_DPI = 144


@dataclass(frozen=True)
class Image:
    """A PNG as a data: URI, with its alt text and the width it was designed for (CSS pixels)."""

    uri: str
    alt: str
    width_px: int


def figure_image(figure: Figure, alt: str, palette: bool = False) -> Image:
    """The figure as a PNG, shown at its design size (96 px per inch).

    `palette=True` reduces photos to 256 colours: noisy images barely compress otherwise,
    and eight of them would make the report megabytes long.
    """
    FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=PNG_DPI, bbox_inches="tight", facecolor="white")
    png = buffer.getvalue()
    if palette:
        from PIL import Image as PILImage

        reduced = io.BytesIO()
        PILImage.open(io.BytesIO(png)).convert("RGB").quantize(256).save(
            reduced, format="PNG", optimize=True
        )
        png = reduced.getvalue()
    return png_image(png, alt)


def png_image(png: bytes, alt: str) -> Image:
    width_px = int.from_bytes(png[16:20], "big") * 96 // PNG_DPI  # the IHDR width
    uri = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
    return Image(uri, alt, width_px)


def mpl_text(text: Any) -> str:
    """Matplotlib reads '$...$' as math: a '$' in a run or class name must stay a dollar."""
    return str(text).replace("$", r"\$")


def plain_log_labels(axis) -> None:
    """'30' rather than '3×10¹' on a log axis; minor ticks labelled only when under a decade is shown."""
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    axis.set_major_formatter(plain)
    low, high = axis.get_view_interval()
    axis.set_minor_formatter(plain if low > 0 and high / low < 10 else NullFormatter())


def run_colors(runs: list[RunResults]) -> dict[str, str]:
    """One colour per run, the same in every chart."""
    return {run.name: RUN_COLORS[index % len(RUN_COLORS)] for index, run in enumerate(runs)}


def bench_chart(benchmarks: list[dict[str, Any]]) -> Image | None:
    """Median ms per precision, grouped by model/backend/mode, with IQR error bars (the
    summary's benchmark records)."""
    frame = pd.DataFrame(benchmarks)
    ok = frame[(frame["status"] == "ok") & frame["median_ms"].notna()]
    if ok.empty:
        return None
    groups = list(dict.fromkeys(zip(frame["model"], frame["backend"], frame["mode"], strict=True)))
    medians = ok["median_ms"]
    log_scale = medians.max() / max(medians.min(), 1e-9) > LOG_SCALE_SPREAD
    figure = Figure(figsize=(max(6.0, 1.25 * len(groups) + 2), 3.8))
    axes = figure.add_subplot()
    width = 0.8 / len(PRECISIONS)
    for offset, precision in enumerate(PRECISIONS):
        xs, ys, errors = [], [], [[], []]
        for index, (model, backend, mode) in enumerate(groups):
            x = index + (offset - 1) * width
            match = frame[
                (frame["model"] == model)
                & (frame["backend"] == backend)
                & (frame["mode"] == mode)
                & (frame["precision"] == precision)
            ]
            if match.empty:
                continue
            row = match.iloc[0]
            if row["status"] != "ok" or pd.isna(row["median_ms"]):
                axes.text(
                    x,
                    0.02,
                    "skipped",
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    color="#777",
                    transform=axes.get_xaxis_transform(),
                )
                continue
            half = (number(row["iqr_ms"]) or 0.0) / 2
            xs.append(x)
            ys.append(row["median_ms"])
            errors[0].append(min(half, row["median_ms"] * 0.9) if log_scale else half)
            errors[1].append(half)
        if xs:
            axes.bar(
                xs,
                ys,
                width,
                yerr=errors,
                capsize=3,
                label=precision,
                color=PRECISION_COLORS[precision],
                error_kw={"elinewidth": 1},
            )
    axes.set_xticks(
        range(len(groups)),
        [mpl_text(f"{model}\n{backend_label(backend)} {mode}") for model, backend, mode in groups],
        fontsize=8,
    )
    if log_scale:
        axes.set_yscale("log")
        plain_log_labels(axes.yaxis)
    axes.set_ylabel("median ms per step" + (" (log scale)" if log_scale else ""))
    axes.grid(axis="y", alpha=0.3)
    axes.legend(title="precision", fontsize=8, title_fontsize=8)
    axes.set_title("Step time per precision (error bars: IQR)", fontsize=10)
    return figure_image(
        figure, "Bar chart of median milliseconds per step for each backend, mode and precision"
    )


def training_chart(runs: list[RunResults], colors: dict[str, str]) -> Image | None:
    """Loss per step and validation F1 / AP@.5 per epoch, one colour per run."""
    with_rows = [run for run in runs if run.metrics]
    if not with_rows:
        return None
    figure = Figure(figsize=(10, 3.6))
    loss_axes, val_axes = figure.subplots(1, 2)
    any_val = False
    for run in with_rows:
        steps = [
            (row.get("step"), number(row.get("loss")))
            for row in run.metrics
            if row.get("type") == "step"
        ]
        steps = [(s, v) for s, v in steps if number(s) is not None and v is not None]
        if steps:
            loss_axes.plot(
                *zip(*steps, strict=True),
                color=colors[run.name],
                label=mpl_text(run.name),
                linewidth=1.3,
            )
        vals = [
            (row.get("epoch"), row["val"])
            for row in run.metrics
            if row.get("type") == "epoch" and isinstance(row.get("val"), dict)
        ]
        for key, style in (("f1", "-"), ("ap50", "--")):
            points = [
                (epoch, number(val.get(key)))
                for epoch, val in vals
                if number(val.get(key)) is not None
            ]
            if points:
                any_val = True
                val_axes.plot(
                    *zip(*points, strict=True),
                    style,
                    marker="o",
                    markersize=3,
                    color=colors[run.name],
                    label=mpl_text(f"{run.name} {'F1' if key == 'f1' else 'AP@.5'}"),
                )
    loss_axes.set(xlabel="step", ylabel="training loss", title="Loss")
    for axes in (loss_axes, val_axes):
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    val_axes.set(
        xlabel="epoch",
        ylabel="score",
        title="Validation F1 (solid) and AP@.5 (dashed)",
        ylim=(-0.02, 1.02),
    )
    for axes in (loss_axes, val_axes):
        axes.grid(alpha=0.3)
        axes.title.set_fontsize(10)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=7)
    if not any_val:
        val_axes.text(
            0.5,
            0.5,
            "no validation rows yet",
            ha="center",
            va="center",
            transform=val_axes.transAxes,
            color="#777",
        )
    figure.tight_layout()
    return figure_image(
        figure, "Training loss per step and validation F1 and AP@.5 per epoch for each run"
    )


def accuracy_time_chart(runs: list[dict[str, Any]], colors: dict[str, str]) -> Image | None:
    """Each run of the summary as a point: training wall time against AP@.5 (circles) and the
    run's leading F1 (squares)."""
    points = [run for run in runs if run["wall_time_s"] is not None]
    if not points:
        return None
    figure = Figure(figsize=(6.4, 3.6))
    axes = figure.subplots()
    for run in points:
        wall, scores = run["wall_time_s"], run["scores"]
        for key, marker in (("ap50", "o"), ("f1", "s")):
            if scores[key] is not None:
                axes.scatter(wall, scores[key], marker=marker, color=colors[run["name"]], s=36)
        axes.annotate(
            mpl_text(run["name"]),
            (wall, scores["ap50"] or scores["f1"] or 0),
            fontsize=7,
            xytext=(4, 4),
            textcoords="offset points",
        )
    axes.set(
        xlabel="training wall time (s)",
        ylabel="score",
        title="Accuracy against training time",
        ylim=(-0.02, 1.02),
    )
    axes.title.set_fontsize(10)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    return figure_image(
        figure, "Training wall time against AP@.5 (circles) and F1 (squares) for each run"
    )


def latency_chart(runs: list[RunResults], colors: dict[str, str]) -> Image | None:
    """p50/p90/p99 latency against batch size, one colour per run, log-log."""
    profiled = [run for run in runs if run.profile and run.profile["latency"]]
    if not profiled:
        return None
    figure = Figure(figsize=(7, 3.8))
    axes = figure.add_subplot()
    batches: set[int] = set()
    for run in profiled:
        rows = sorted(
            (row for row in run.profile["latency"] if isinstance(row, dict)),
            key=lambda row: number(row.get("batch_size")) or 0,
        )
        for key, style in (("p50_ms", "-"), ("p90_ms", "--"), ("p99_ms", ":")):
            points = [
                (row.get("batch_size"), number((row.get("wall") or {}).get(key))) for row in rows
            ]
            points = [(b, v) for b, v in points if number(b) is not None and v is not None]
            if points:
                batches.update(int(b) for b, _ in points)
                axes.plot(
                    *zip(*points, strict=True),
                    style,
                    marker="o",
                    markersize=3,
                    color=colors[run.name],
                    label=mpl_text(f"{run.name} {key[:3]}"),
                )
    if not batches:
        return None
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    plain_log_labels(axes.yaxis)
    axes.set_xticks(sorted(batches), [str(b) for b in sorted(batches)])
    axes.set(
        xlabel="batch size",
        ylabel="latency ms (log scale)",
        title="Inference latency: p50 (solid), p90 (dashed), p99 (dotted)",
    )
    axes.title.set_fontsize(10)
    axes.grid(alpha=0.3, which="both")
    axes.legend(fontsize=7)
    return figure_image(
        figure, "Inference latency percentiles against batch size for each profiled run"
    )


def predictions_chart(
    run_name: str,
    shown: list[tuple[dict[str, Any], Any]],
    class_names: list[Any],
    threshold: float,
) -> Image:
    """Evaluated images in a grid, ground truth in green and detections above `threshold` in red."""
    columns = min(4, len(shown))
    rows = math.ceil(len(shown) / columns)
    figure = Figure(figsize=(2.6 * columns, 2.6 * rows))
    for index, (item, image) in enumerate(shown):
        axes = figure.add_subplot(rows, columns, index + 1)
        axes.imshow(image, interpolation="nearest")
        axes.set_axis_off()
        draw_boxes(axes, item.get("ground_truth") or {}, class_names, None, "#1a9641")
        drawn = draw_boxes(axes, item.get("detections") or {}, class_names, threshold, "#d7191c")
        axes.set_title(
            mpl_text(f"{Path(str(item.get('file'))).name}: {drawn} detection(s)"), fontsize=7
        )
    figure.tight_layout()
    return figure_image(
        figure,
        f"Evaluated images of {run_name} with ground-truth and detected boxes",
        palette=True,
    )


def draw_boxes(
    axes, group: dict[str, Any], class_names: list[Any], threshold: float | None, color: str
) -> int:
    """Boxes of one kind; with a threshold, only detections above it, labelled 'class score'."""
    boxes = group.get("boxes") or []
    labels = group.get("labels") or []
    scores = group.get("scores") or [None] * len(boxes)
    items = list(zip(boxes, labels, scores, strict=False))
    if threshold is not None:
        items = [item for item in items if number(item[2]) is not None and item[2] >= threshold]
        items = sorted(items, key=lambda item: -item[2])[:MAX_DRAWN_DETECTIONS]
    for box, label, score in items:
        if not isinstance(box, list) or len(box) != 4 or any(number(v) is None for v in box):
            continue
        x0, y0, x1, y1 = box
        axes.add_patch(
            Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, edgecolor=color, linewidth=1.2)
        )
        if threshold is not None:
            name = (
                class_names[label]
                if isinstance(label, int) and 0 <= label < len(class_names)
                else f"class {label}"
            )
            # Labels of boxes in the right half end at the box's right edge, so they stay inside.
            right_half = x0 > sum(axes.get_xlim()) / 2
            axes.text(
                x1 if right_half else x0,
                y0,
                mpl_text(f"{name} {score:.2f}"),
                fontsize=5.5,
                color="white",
                ha="right" if right_half else "left",
                va="bottom",
                clip_on=True,
                bbox={"facecolor": color, "edgecolor": "none", "pad": 0.6, "alpha": 0.85},
            )
    return len(items)
