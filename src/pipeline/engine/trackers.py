"""Optional experiment trackers (TensorBoard, SwanLab): used only when installed and enabled.

metrics.jsonl is always written; trackers are a convenience on top and never required.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("pipeline")


def _scalars(row: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Flatten a metrics row to the numeric scalars a tracker plots."""
    flat: dict[str, float] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_scalars(value, f"{name}/"))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            flat[name] = float(value)
    return flat


class Trackers:
    def __init__(self, sinks: list[Any]) -> None:
        self.sinks = sinks

    def log(self, row: dict[str, Any], step: int) -> None:
        if not self.sinks:
            return
        prefix = f"{row.get('type', 'row')}/"
        scalars = _scalars({k: v for k, v in row.items() if k != "type"}, prefix)
        for sink in self.sinks:
            sink.log(scalars, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class _TensorBoard:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class _SwanLab:
    def __init__(self, run_dir: Path, config: dict[str, Any]) -> None:
        import swanlab

        self.swanlab = swanlab
        swanlab.init(
            project="pipeline",
            experiment_name=run_dir.name,
            config=config,
            logdir=str(run_dir / "swanlab"),
        )

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.swanlab.log(scalars, step=step)

    def close(self) -> None:
        self.swanlab.finish()


def open_trackers(train: dict[str, Any], run_dir: Path, config: dict[str, Any]) -> Trackers:
    sinks: list[Any] = []
    if train["tensorboard"]:
        if importlib.util.find_spec("tensorboard") is None:
            log.warning(
                "train.tensorboard is on, but the tensorboard package is not installed: skipping it."
            )
        else:
            sinks.append(_TensorBoard(run_dir / "tensorboard"))
    if train["swanlab"]:
        if importlib.util.find_spec("swanlab") is None:
            log.warning(
                "train.swanlab is on, but the swanlab package is not installed: skipping it."
            )
        else:
            sinks.append(_SwanLab(run_dir, config))
    return Trackers(sinks)
