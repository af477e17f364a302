"""benchmarks/harness.py's timing of two sides: warm-up, ABBA rounds and their run conditions."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from benchmark_modules import load

harness = load("harness")


def test_measure_warms_every_side_up_then_alternates_them_with_the_conditions_of_the_rounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []

    class Conditions:
        def __init__(self) -> None:
            calls.append("conditions start")

        def finish(self) -> dict[str, Any]:
            calls.append("conditions end")
            return {"high_load": False}

    monkeypatch.setattr(harness.timing, "RunConditions", Conditions)
    sides = {"A": lambda: calls.append("A"), "B": lambda: calls.append("B")}
    blocks, conditions = harness.measure(
        sides, torch.device("cpu"), warmup=2, rounds=2, block=1, skip=1
    )
    assert calls == [
        *("A", "A", "B", "B"),  # the warm-up, outside the conditions
        "conditions start",
        *("A", "B", "B", "A"),  # ABBA
        "conditions end",
    ]
    assert [(b["round"], b["side"], b["skip"]) for b in blocks] == [
        (0, "A", 1),
        (0, "B", 1),
        (1, "B", 1),
        (1, "A", 1),
    ]
    assert conditions == {"high_load": False}


def test_a_verdict_reads_the_point_figure_and_says_when_its_interval_crosses_the_target() -> None:
    harness = load("harness")
    passed, line = harness.verdict("else / forward", 0.95, 1.0, interval=(0.90, 1.04))
    assert passed and "PASS" in line and "95% interval 0.900-1.040" in line
    assert "crosses the target" in line
    passed, line = harness.verdict("else / forward", 1.02, 1.0, interval=(0.98, 1.10))
    assert not passed and "FAIL" in line and "crosses the target" in line
    passed, line = harness.verdict("else / forward", 0.95, 1.0, interval=(0.90, 0.99))
    assert passed and "crosses" not in line
    assert "interval" not in harness.verdict("else / forward", 0.95, 1.0)[1]
