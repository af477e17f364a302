"""`python -m pipeline check-env` and the CLI around it: table, JSON, exit codes, tracebacks.

Each subprocess test pays for a torch import (seconds), so only the entry point itself runs
in a subprocess; everything else calls `pipeline.cli.main` in this process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import pipeline
from pipeline import cli, environment
from pipeline.config import load_config
from pipeline.device import DeviceNotAvailableError, available_backends

pytestmark = pytest.mark.usefixtures("no_backend_env", "restore_pipeline_logger")

COMMANDS = [
    *("check-env", "prepare-data", "train", "evaluate", "bench", "choose-precision"),
    *("profile", "summarize", "predict", "report", "compare", "config"),
]


def _missing_backend() -> str:
    """A backend this machine lacks, for the error paths; skips on a machine with both."""
    missing = [name for name in ("mps", "cuda") if name not in available_backends()]
    if not missing:
        pytest.skip("this machine has both CUDA and MPS")
    return missing[0]


def _run_pipeline(*args: str) -> subprocess.CompletedProcess[str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("CUDA_VISIBLE_DEVICES", "PIPELINE_DISABLE_BACKENDS")
    }
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def _table_row(table: str, backend: str) -> str:
    rows = [line for line in table.splitlines() if line.split(" ", 1)[0] == backend]
    assert len(rows) == 1, table
    return rows[0]


# --- subprocess: the real entry point --------------------------------------------------------


def test_check_env_prints_the_table_and_writes_the_same_facts_as_json(tmp_path: Path) -> None:
    output = tmp_path / "env" / "environment.json"
    result = _run_pipeline("check-env", "--out", str(output))
    assert result.returncode == 0, result.stderr
    info = json.loads(output.read_text())
    expected = available_backends()

    assert info["format"] == "pipeline.env/1"
    assert info["available"] == expected
    assert info["auto"] == expected[0]
    assert info["versions"]["torch"] == torch.__version__
    assert info["versions"]["python"]
    assert info["platform"]["cpu_count"] == os.cpu_count()
    assert info["platform"]["memory_gib"] > 0  # Linux and macOS say; compare names machines by it
    assert info["backends"]["cpu"]["available"] is True
    assert info["backends"]["cpu"]["reason"] is None
    assert f"auto resolves to: {expected[0]}" in result.stdout
    assert f"written: {output}" in result.stdout
    assert _table_row(result.stdout, "cpu").split()[1] == "yes"
    for name in ("cuda", "mps"):
        entry = info["backends"][name]
        assert entry["available"] is (name in expected)
        row = _table_row(result.stdout, name)
        if not entry["available"]:
            assert entry["reason"]
            assert row.split()[1] == "no"
            assert f"missing: {entry['reason']}" in row
            assert "not available" in entry["error"]
    if expected == ["cpu"]:
        assert info["auto"] == "cpu"
        assert "auto resolves to: cpu" in result.stdout


def test_check_env_with_a_missing_device_exits_2_with_the_reason_and_no_traceback() -> None:
    missing = _missing_backend()
    result = _run_pipeline("check-env", "--device", missing)
    assert result.returncode == 2
    assert f"Device '{missing}' is not available" in result.stderr
    assert "Traceback" not in result.stderr


def test_debug_flag_shows_the_traceback_of_a_user_error() -> None:
    missing = _missing_backend()
    result = _run_pipeline("--debug", "check-env", "--device", missing)
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert "DeviceNotAvailableError" in result.stderr


# --- in process: CLI behaviour ---------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_command_and_exits_0(capsys, flag) -> None:
    assert cli.main([flag]) == 0
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert command in out


def test_no_command_prints_help_and_exits_2(capsys) -> None:
    assert cli.main([]) == 2
    assert "check-env" in capsys.readouterr().out


def test_unknown_command_exits_2_and_names_the_choices(capsys) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(["frobnicate"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "unknown command 'frobnicate'" in err
    assert ", ".join(COMMANDS) in err


def test_version_prints_the_packages_version_and_exits_0(capsys) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(["--version"])
    assert caught.value.code == 0
    assert capsys.readouterr().out == f"pipeline {pipeline.__version__}\n"


def test_eval_is_an_alias_of_evaluate(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["eval", "--help"])
    assert capsys.readouterr().out.startswith("usage: python -m pipeline evaluate ")


def test_config_prints_the_merged_config_with_where_each_value_came_from(
    capsys, tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text("seed: 4\ntrain: {lr: 0.5}\n")
    (tmp_path / "mine.yaml").write_text("train: {epochs: 2}\n")
    assert cli.main(["config", "--configfile", "mine.yaml", "--config", "data.image_size=96"]) == 0
    out = capsys.readouterr().out
    lines: dict[str, str] = {}  # each key's first line (seed is also data.synthetic.seed)
    for line in out.splitlines()[1:]:
        lines.setdefault(line.split(":")[0].strip(), line)
    assert re.fullmatch(r"seed: 4 +# config/config\.yaml", lines["seed"])
    assert re.fullmatch(r"  lr: 0\.5 +# config/config\.yaml", lines["lr"])
    assert re.fullmatch(r"  epochs: 2 +# mine\.yaml", lines["epochs"])
    assert re.fullmatch(r"  image_size: 96 +# command line", lines["image_size"])
    assert re.fullmatch(r"  batch_size: \d+ +# default", lines["batch_size"])
    assert out.splitlines()[0].startswith(
        "# merged from: config/config.yaml, mine.yaml, command line"
    )
    assert yaml.safe_load(out) == load_config(
        ["config/config.yaml", "mine.yaml"], ["data.image_size=96"]
    )


def test_check_env_in_process_prints_the_table_and_exits_0(capsys, tmp_path) -> None:
    output = tmp_path / "env.json"
    assert cli.main(["check-env", "--out", str(output)]) == 0
    out = capsys.readouterr().out
    assert f"auto resolves to: {available_backends()[0]}" in out
    assert json.loads(output.read_text())["available"] == available_backends()


def test_check_env_resolves_a_requested_available_device(capsys) -> None:
    assert cli.main(["check-env", "--device", "cpu"]) == 0
    assert "requested 'cpu' resolves to cpu: CPU" in capsys.readouterr().out


def test_missing_device_is_reported_on_stderr_with_exit_2(capsys) -> None:
    missing = _missing_backend()
    assert cli.main(["check-env", "--device", missing]) == 2
    err = capsys.readouterr().err
    assert f"Device '{missing}' is not available" in err
    assert str(available_backends()) in err
    assert "Traceback" not in err


def test_debug_flag_reraises_the_user_error() -> None:
    missing = _missing_backend()
    with pytest.raises(DeviceNotAvailableError, match="not available"):
        cli.main(["check-env", "--debug", "--device", missing])


def test_unknown_device_spec_exits_2(capsys) -> None:
    assert cli.main(["check-env", "--device", "tpu"]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err.lower()


def test_unwritable_output_exits_2_naming_the_path(capsys, tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    target = blocker / "environment.json"  # its parent is a file: fails even for root
    assert cli.main(["check-env", "--out", str(target)]) == 2
    err = capsys.readouterr().err
    assert (
        f"ERROR Could not create the folder {blocker} for --out {target}: {blocker} is a file, "
        "not a folder." in err
    )
    assert "Traceback" not in err
    assert blocker.read_text() == "not a directory\n"


def test_log_option_before_the_command_writes_errors_to_the_log_file(capsys, tmp_path) -> None:
    missing = _missing_backend()
    log_file = tmp_path / "logs" / "check_env.log"
    assert cli.main(["--log", str(log_file), "check-env", "--device", missing]) == 2
    assert f"Device '{missing}' is not available" in log_file.read_text()
    assert f"Device '{missing}' is not available" in capsys.readouterr().err


def test_bad_disable_switch_exits_2_with_the_config_error(capsys, monkeypatch) -> None:
    monkeypatch.setenv("PIPELINE_DISABLE_BACKENDS", "cpu")
    assert cli.main(["check-env"]) == 2
    err = capsys.readouterr().err
    assert "PIPELINE_DISABLE_BACKENDS='cpu'" in err
    assert "Traceback" not in err


# --- in process: collect() and the table with simulated hardware ----------------------------


def test_collect_reports_simulated_gpus_and_picks_cuda(fake_cuda, fake_mps) -> None:
    info = environment.collect("cuda:1")
    assert info["available"] == ["cuda", "mps", "cpu"]
    assert info["auto"] == "cuda"
    assert info["requested"] == {
        "device": "cuda:1",
        "resolved": "cuda:1",
        "description": "CUDA: NVIDIA Fake H100, 80 GiB, sm_90",
    }
    assert [gpu["name"] for gpu in info["cuda"]["devices"]] == fake_cuda.names
    assert info["cuda"]["devices"][1] == {
        "index": 1,
        "name": "NVIDIA Fake H100",
        "total_memory_gib": 80.0,
        "capability": "9.0",
        "multiprocessors": 132,
    }
    assert info["backends"]["cuda"]["resolved_amp"] == {"auto": True, "true": True, "false": False}
    assert info["backends"]["mps"]["resolved_amp"] == {"auto": False, "true": True, "false": False}
    assert info["backends"]["cpu"]["resolved_amp"] == {"auto": False, "true": False, "false": False}
    assert info["backends"]["cuda"]["pin_memory"] is True
    assert all(entry["error"] is None for entry in info["backends"].values())

    table = environment.format_table(info)
    assert "auto resolves to: cuda" in table
    assert "cuda:1 NVIDIA Fake H100, 80.0 GiB, sm 9.0, 132 SMs" in table
    assert _table_row(table, "cuda").split()[1:6] == ["yes", "on", "yes", "yes", "CUDA:"]
    assert _table_row(table, "mps").split()[1:5] == ["yes", "off", "yes", "no"]
    assert "requested 'cuda:1' resolves to cuda:1" in table


def test_collect_records_why_disabled_backends_are_missing(
    fake_cuda, fake_mps, monkeypatch
) -> None:
    monkeypatch.setenv("PIPELINE_DISABLE_BACKENDS", "cuda,mps")
    info = environment.collect()
    assert info["available"] == ["cpu"]
    assert info["auto"] == "cpu"
    assert info["cuda"]["devices"] == []
    for name in ("cuda", "mps"):
        entry = info["backends"][name]
        assert entry["available"] is False
        assert "PIPELINE_DISABLE_BACKENDS" in entry["reason"]
        assert "not available" in entry["error"]
        assert f"missing: {entry['reason']}" in _table_row(environment.format_table(info), name)


def test_collect_with_a_missing_requested_device_raises(no_cuda, no_mps) -> None:
    with pytest.raises(DeviceNotAvailableError, match=r"Available backends: \['cpu'\]"):
        environment.collect("mps")


def test_collect_is_json_serialisable_as_written(tmp_path) -> None:
    info = environment.collect("cpu")
    assert json.loads(json.dumps(info, allow_nan=False)) == info
