"""Every command refuses an output place it cannot write before any work: a folder named as the
file to write, a file where a folder must be (or above it), a folder this user may not write in.
Left to the write at the end, each failed only after the whole evaluation, training or timing.

Before any work: each command is given inputs that do not exist (a checkpoint, a data root, a
results folder, a summary), so work started first would end in their error, not the output's;
where it has none to give (check-env, bench, prepare-data), a spy on its work fails the test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline import atomic, cli
from pipeline.errors import OutputError

# command and option -> its arguments around the output place P; inputs that exist nowhere (see
# the module's docstring)
FILE_OUTPUTS = {
    "evaluate --out": "evaluate --checkpoint missing.pth --out P",
    "evaluate --predictions": "evaluate --checkpoint missing.pth --out eval.json --predictions P",
    "check-env --out": "check-env --out P",
    "choose-precision --out": "choose-precision --device cpu --bench no-bench --out P",
    "summarize --out": "summarize --results no-results --out P",
    "report --out": "report --results no-results --out P",
    "compare --out": "compare missing.json --out P",
    "compare --markdown": "compare missing.json --markdown P",
    "bench --out": "bench --device cpu --precision fp32 --out P",
}
FOLDER_OUTPUTS = {
    "train --out": "train --device cpu --precision fp32 --out P data.root=no-data",
    "profile --out": "profile --checkpoint missing.pth --out P",
    "predict --out": "predict --checkpoint missing.pth missing.png --out P",
    "prepare-data --out": "prepare-data --out P",
    "bench --out-dir": "bench --device cpu --precision fp32 --out-dir P",
}


@pytest.fixture
def place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_pipeline_logger: None) -> Path:
    """A working folder holding a file (`notes`) and a folder (`folder`); the work of the
    commands that are given no input to miss fails the test if it starts."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes").write_text("my notes\n")
    (tmp_path / "folder").mkdir()
    from pipeline import bench, environment
    from pipeline.commands import prepare_data

    def work_started(*args: object, **kwargs: object) -> None:
        pytest.fail("the command started its work before refusing its output place")

    monkeypatch.setattr(environment, "collect", work_started)
    monkeypatch.setattr(bench, "run_backend", work_started)
    monkeypatch.setattr(prepare_data, "generate", work_started)
    return tmp_path


def refused(capsys: pytest.CaptureFixture, command: str, output: str, root: Path) -> str:
    """The one error line of `command` with P replaced by `output`: exit 2, no traceback,
    nothing written (the folder holds what it held)."""
    before = sorted(root.rglob("*"))
    argv = [output if word == "P" else word for word in command.split()]
    code = cli.main(["--cpu-threads", "1", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if " ERROR " in line]
    assert errors == err.rstrip().splitlines()[-1:], err
    assert sorted(root.rglob("*")) == before
    assert (root / "notes").read_text() == "my notes\n"
    return errors[0].split(" ERROR ", 1)[1]


@pytest.mark.parametrize("command", list(FILE_OUTPUTS))
def test_a_folder_named_as_the_file_to_write_is_refused_before_any_work(
    command: str, place: Path, capsys: pytest.CaptureFixture
) -> None:
    option = command.split()[1]
    message = refused(capsys, FILE_OUTPUTS[command], "folder", place)
    assert message.startswith(
        f"{option} folder is a folder: give {option} the path of a file to write (in that "
        "folder, say). Nothing was written."
    )


@pytest.mark.parametrize("command", list(FILE_OUTPUTS))
def test_a_file_to_write_under_a_file_is_refused_before_any_work(
    command: str, place: Path, capsys: pytest.CaptureFixture
) -> None:
    option = command.split()[1]
    message = refused(capsys, FILE_OUTPUTS[command], "notes/out.json", place)
    assert message == (
        f"Could not create the folder notes for {option} notes/out.json: notes is a file, not a "
        f"folder. Nothing was written. Move that file away, or give {option} a path elsewhere."
    )


@pytest.mark.parametrize("output", ["notes", "notes/run"])
@pytest.mark.parametrize("command", list(FOLDER_OUTPUTS))
def test_an_output_folder_that_is_a_file_or_under_one_is_refused_before_any_work(
    command: str, output: str, place: Path, capsys: pytest.CaptureFixture
) -> None:
    option = command.split()[1]
    message = refused(capsys, FOLDER_OUTPUTS[command], output, place)
    assert message == (
        f"Could not create the folder {output} ({option}): notes is a file, not a folder. "
        f"Nothing was written. Move that file away, or give {option} a path elsewhere."
    )


@pytest.mark.skipif(
    os.geteuid() == 0, reason="root may write into a folder whatever its mode (os.access agrees)"
)
@pytest.mark.parametrize(
    ("command", "output"),
    [(command, "read-only/out.json") for command in FILE_OUTPUTS]
    + [(command, "read-only/run") for command in FOLDER_OUTPUTS],
)
def test_an_output_in_a_folder_that_cannot_be_written_names_that_folder_before_any_work(
    command: str, output: str, place: Path, capsys: pytest.CaptureFixture
) -> None:
    option = command.split()[1]
    (place / "read-only").mkdir(mode=0o555)
    try:
        message = refused(capsys, {**FILE_OUTPUTS, **FOLDER_OUTPUTS}[command], output, place)
    finally:
        (place / "read-only").chmod(0o755)
    what = output if command in FILE_OUTPUTS else f"into the folder {output}"
    assert message == (
        f"Could not write {what} ({option}): the folder read-only is not writable by this user. "
        f"Nothing was written. Give {option} a path in a folder that can be written."
    )


def test_the_default_output_of_summarize_in_a_results_folder_that_is_a_file_is_refused(
    place: Path, capsys: pytest.CaptureFixture
) -> None:
    """Without --out, summarize writes <results>/summary.json: its place is checked as well."""
    message = refused(capsys, "summarize --results notes", "", place)
    assert message.startswith(
        "Could not create the folder notes for --out notes/summary.json: notes is a file"
    )


@pytest.mark.parametrize("folder", [False, True])
def test_a_writable_place_passes_and_nothing_is_created(tmp_path: Path, folder: bool) -> None:
    (tmp_path / "existing").mkdir()
    for path in (tmp_path / "new" / "deeper" / "out", tmp_path / "existing" / "out"):
        atomic.refuse_unwritable_output("--out", path, folder=folder)
    atomic.refuse_unwritable_output("--out", None, folder=folder)
    assert sorted(tmp_path.iterdir()) == [tmp_path / "existing"]
    assert not any((tmp_path / "existing").iterdir())


def test_an_existing_output_folder_is_a_place_for_a_folder_not_for_a_file(tmp_path: Path) -> None:
    atomic.refuse_unwritable_output("--out", tmp_path, folder=True)
    with pytest.raises(OutputError, match="is a folder: give --out the path of a file"):
        atomic.refuse_unwritable_output("--out", tmp_path)
