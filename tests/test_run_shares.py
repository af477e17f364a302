"""benchmarks/run_shares.py: where a run of the README path spends its wall time, as a record."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from benchmark_modules import load
from tiny_runs import global_torch_state, make_data, one_cpu_thread, pipeline_logger_restored

from pipeline import formats
from pipeline.engine import checkpoint

run_shares = load("run_shares")


def test_a_run_is_split_into_parts_that_add_up_to_its_wall_time_and_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = make_data(tmp_path / "shapes")
    monkeypatch.setattr(run_shares.harness, "RECORDS_DIR", tmp_path / "records")
    out = tmp_path / "raw.json"
    argv = ["shapes", "--epochs", "2", "--workers-rounds", "1", "--cpu-threads", "1"]
    argv += ["--out", str(out), f"data.root={data}"]
    argv += ["data.image_size=64", "model.width=8", "train.batch_size=8", "precision=fp32"]
    save = checkpoint.save
    with global_torch_state(), one_cpu_thread(), pipeline_logger_restored():
        assert run_shares.main(argv) == 0
    assert checkpoint.save is save  # the timing wrapper is taken off again
    # by default one record per set, size, precision and length: runs of a day do not overwrite
    (record,) = (tmp_path / "records" / "run_shares").glob("*-shapes-64px-fp32-2epochs.json")
    document = json.loads(record.read_text(encoding="utf-8"))
    assert formats.problem(document, "benchmark_record") is None
    shares = {
        figure["key"].removeprefix("share."): figure["value"]
        for figure in document["figures"]
        if figure["key"].startswith("share.")
    }
    assert set(shares) == {*run_shares.PARTS, "rest"}
    assert math.isclose(sum(shares.values()), 1.0)
    # the presets' run: it trains, augments in this process, averages, validates, checkpoints
    for part in run_shares.PARTS:
        assert shares[part] > 0, part
    assert shares["steps"] > shares["weight_average"]
    raw = json.loads(out.read_text(encoding="utf-8"))
    assert raw["summary"]["epochs"] == 2 and raw["summary"]["ema"] is True
    assert len(raw["workers"]["epoch_s"]["B"]) == 1
    keys = {figure["key"] for figure in document["figures"]}
    assert {"wall_s", "first_epoch_excess_s", "workers.ratio"} <= keys
    assert document["settings"]["set"] == "shapes" and document["settings"]["epochs"] == 2
