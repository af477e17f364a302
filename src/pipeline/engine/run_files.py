"""The files of a run's folder: their paths, the metrics file's rows (kept and cut back on
resume), and what an interrupted or failed write leaves."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from pipeline import atomic
from pipeline.engine.trackers import Trackers

log = logging.getLogger("pipeline")


class RunFolder:
    """The part of `engine.trainer.Trainer` that reads and writes its run folder's files, mixed
    into it."""

    # what it reads of the Trainer (set in Trainer.__init__, the loop and resume)
    run_dir: Path
    epoch: int
    global_step: int
    epoch_rows: list[dict[str, Any]]
    step_times: list[float]
    trackers: Trackers

    @property
    def paths(self) -> dict[str, Path]:
        names = ("last.pth", "best.pth", "metrics.jsonl", "train_summary.json", "config.json")
        return {name.split(".")[0]: self.run_dir / name for name in names}

    def _truncate_metrics(self) -> None:
        """Drop metric rows of the epoch that was interrupted; it is about to run again."""
        path = self.paths["metrics"]
        if not path.exists():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by the kill
            if row["epoch"] <= self.epoch:
                kept.append(line)
                if row["type"] == "epoch":
                    self.epoch_rows.append(row)
                else:
                    self.step_times.append(row["step_time_s"])
        atomic.write_text(path, "".join(line + "\n" for line in kept))

    def _write_row(self, row: dict[str, Any]) -> None:
        line = json.dumps(atomic.jsonable(row))
        atomic.append_line(self.paths["metrics"], line, self._after_a_failed_write())
        self.trackers.log(row, self.global_step)

    def _after_a_failed_write(self) -> str:
        """What a failed write of a checkpoint or metrics row leaves to continue from."""
        last = self.paths["last"]
        if not last.exists():
            return "No epoch was checkpointed yet: training starts from the beginning again."
        return (
            f"{last} holds the last epoch saved, and metrics.jsonl its rows: add --resume (the "
            "workflow passes --resume-if-possible) to continue from there."
        )

    def _remove_unfinished_start(self, created: bool) -> None:
        """Bad data found before the first epoch ended leaves no folder holding only
        config.json and step rows: the folder goes if this run made it, else those files."""
        if created:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        else:
            for path in (self.paths["config"], self.paths["metrics"]):
                path.unlink(missing_ok=True)

    def _remove_stale_temp_files(self) -> None:
        """A SIGKILL during an atomic write leaves its `.<name>.<random>.tmp` file behind."""
        for stale in sorted(self.run_dir.glob(".*.tmp")):
            if stale.is_file():
                stale.unlink(missing_ok=True)
                log.info("removed %s, left behind by an interrupted write", stale)
