"""benchmarks/detector_targets.py: the commands it runs are ones the pipeline's CLI reads."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
from benchmark_modules import load

from pipeline import cli

targets = load("detector_targets")


class _Stop(Exception):
    """Ends `measure` at its evaluate command, before it reads what training would write."""


def _parses(args: list[str]) -> int:
    """The CLI's exit status for `args` with --help after them: 0 once every word before
    --help parsed, 2 where one did not."""
    quiet = contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())
    with quiet[0], quiet[1], pytest.raises(SystemExit) as exited:
        cli.main([*args, "--help"])
    return exited.value.code


@pytest.mark.parametrize("training", targets.TRAININGS, ids=lambda training: training.name)
def test_every_command_of_a_training_parses_as_the_pipeline_cli_reads_it(
    training, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The default training layers no preset: a bare --configfile before --out was refused."""
    commands: list[list[str]] = []

    def run(args: list[str], log: Path) -> None:
        commands.append(args)
        if args[0] == "evaluate":
            raise _Stop

    monkeypatch.setattr(targets, "pipeline", run)
    with pytest.raises(_Stop):
        targets.measure(training, 0, tmp_path, ["train.epochs=1"], tmp_path / "choice.json")
    assert [args[0] for args in commands] == ["prepare-data", "train", "evaluate"]
    assert {" ".join(args): _parses(args) for args in commands} == {
        " ".join(args): 0 for args in commands
    }
