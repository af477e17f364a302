"""Optional experiment trackers: used only when switched on and installed, never required."""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from pathlib import Path

import pytest

from pipeline.engine import trackers

OFF = {"tensorboard": False, "swanlab": False}


def test_no_tracker_is_opened_by_default(tmp_path: Path) -> None:
    opened = trackers.open_trackers(OFF, tmp_path, {})
    assert opened.sinks == []
    opened.log({"type": "step", "loss": 1.0}, step=1)  # a no-op, not an error
    opened.close()


@pytest.mark.parametrize("name", ["tensorboard", "swanlab"])
def test_a_tracker_that_is_switched_on_but_not_installed_is_skipped_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda module: None if module == name else real_find_spec(module),
    )
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        opened = trackers.open_trackers({**OFF, name: True}, tmp_path, {})
    assert opened.sinks == []
    assert f"train.{name} is on, but the {name} package is not installed" in caplog.text


def test_an_installed_tracker_gets_numeric_scalars_per_row_and_is_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple] = []
    fake = types.ModuleType("swanlab")
    fake.init = lambda **kwargs: calls.append(("init", kwargs["experiment_name"]))
    fake.log = lambda scalars, step: calls.append(("log", scalars, step))
    fake.finish = lambda: calls.append(("finish",))
    monkeypatch.setitem(sys.modules, "swanlab", fake)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda module: object() if module == "swanlab" else real_find_spec(module),
    )
    opened = trackers.open_trackers({**OFF, "swanlab": True}, tmp_path / "cpu-fp32", {"seed": 0})
    row = {"type": "epoch", "epoch": 3, "val": {"f1": 0.9, "ap50": None}, "memory": {"exact": True}}
    opened.log(row, step=42)
    opened.close()
    assert calls == [
        ("init", "cpu-fp32"),
        ("log", {"epoch/epoch": 3.0, "epoch/val/f1": 0.9}, 42),  # no None, no bool, no text
        ("finish",),
    ]
