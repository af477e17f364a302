"""The Snakemake workflow, run for real in a temporary copy of the repository.

Dry runs check the main targets and the schema. One end-to-end run of the tiny test config
(`tests/config/ci.yaml`) with a sweep of two learning rates and `--cores 2`, inside a
network namespace of its own where that is permitted (`unshare --net`: not even loopback),
checks every output, the report's sections and its two runs side by side, that benchmark
jobs never overlapped, that nothing needed the network, and what a code edit reruns; it
starts in the background as the module does, and the dry runs run beside it.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from PIL import Image
from report_page import SECTION_IDS, Page, assert_self_contained
from results_schemas import check_results
from test_voc_layouts import make_roboflow_export

from pipeline import cli, formats

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CI_CONFIG = "tests/config/ci.yaml"
# Two runs, as few as a sweep has: every check of the end-to-end run holds for each of them.
SWEPT = {"seed": [0], "lr": [0.003, 0.006]}
SWEEP = "sweep=" + json.dumps(SWEPT)


def sweep_runs(root: Path) -> set[str]:
    """The swept runs, named after the precision precision=measured chose (tests/config/ci.yaml)
    on the backend auto picked: fp32 on most CPUs, bf16 where it measured faster natively."""
    backend = json.loads((root / "results" / "env.json").read_text())["auto"]
    (choice,) = json.loads((root / "results" / "choice" / f"{backend}.json").read_text())["choices"]
    return {
        f"{backend}-{choice['precision']}+seed={seed}+lr={lr}"
        for seed in SWEPT["seed"]
        for lr in SWEPT["lr"]
    }


# every end-to-end invocation names the same config, so nothing reruns for a changed setting
E2E_CONFIG = ("--configfile", CI_CONFIG, "--config", SWEEP)
REQUIRE_ISOLATION = "PIPELINE_REQUIRE_NETWORK_ISOLATION"
pytestmark = pytest.mark.slow


def copy_repository(target: Path) -> Path:
    """The tracked and untracked-but-not-ignored files, as a fresh clone would have them."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    for name in listed:
        source = REPO / name
        if source.is_file() or source.is_symlink():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name, follow_symlinks=False)
    return target


def copy_checked_env(
    checked_env: tuple[Path, subprocess.CompletedProcess[str]], target: Path
) -> Path:
    """A copy of checked_env's repository at `target` (its environment check must have passed)."""
    root, result = checked_env
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return Path(shutil.copytree(root, target, symlinks=True))


def isolation_unavailable() -> str | None:
    """Why `unshare --net` cannot run here, or None."""
    if shutil.which("unshare") is None:
        return "the unshare command (util-linux) is not installed"
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"'unshare --net true' is not permitted here: {probe.stderr.strip()}"
    return None


def snakemake(
    cwd: Path,
    *args: str,
    timeout: int = 600,
    prefix: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """The venv's snakemake, called by path as a user may call it: the venv need not be on PATH."""
    return subprocess.run(
        [*prefix, str(BIN / "snakemake"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def job_counts(result: subprocess.CompletedProcess[str]) -> dict[str, int]:
    """Rule name -> job count, from a dry run's job-stats table."""
    counts, table = {}, False
    for line in result.stdout.splitlines():
        words = line.split()
        if words[:2] == ["job", "count"]:
            table = True
        elif table and words and words[0] == "total":
            break
        elif table and len(words) == 2 and words[1].isdigit():
            counts[words[0]] = int(words[1])
    return counts


def planned_jobs(result: subprocess.CompletedProcess[str]) -> set[str]:
    """Rule names of the jobs a dry run lists in its job-stats table."""
    return set(job_counts(result))


def ran_jobs(result: subprocess.CompletedProcess[str]) -> set[str]:
    """Rule names of the jobs a real run started, from the rule headers of its log (stderr)."""
    log = result.stdout + result.stderr
    return set(re.findall(r"^\s*(?:local)?(?:rule|checkpoint) (\w+):", log, re.MULTILINE))


def edit(path: Path) -> None:
    """A real edit: Snakemake compares checksums, so touching a file alone reruns nothing."""
    path.write_text(path.read_text() + "\n# edited by a test\n")


@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_repository(tmp_path_factory.mktemp("repo"))


@pytest.fixture(scope="module")
def report_dry_run(repo_copy: Path) -> subprocess.CompletedProcess[str]:
    """A dry run of the report with a config file and a setting, printing the commands."""
    (repo_copy / "mine.yaml").write_text("train:\n  epochs: 2\n")
    return snakemake(
        repo_copy,
        "-n",
        "-p",
        "results/report.html",
        "--configfile",
        "mine.yaml",
        "--config",
        "device=cpu",
    )


def test_dry_run_of_the_report_starts_with_the_environment_check(
    report_dry_run: subprocess.CompletedProcess[str],
) -> None:
    assert report_dry_run.returncode == 0, report_dry_run.stderr
    assert "check_env" in report_dry_run.stdout


def test_the_report_job_is_told_the_config_files_and_settings_of_the_call(
    report_dry_run: subprocess.CompletedProcess[str],
) -> None:
    """The report's commands repeat them (tests/test_report.py), so it must be given them."""
    assert report_dry_run.returncode == 0, report_dry_run.stderr
    assert (
        """--invocation-json '{"config": {"device": "cpu"}, "configfiles": ["mine.yaml"]}'"""
        in report_dry_run.stdout
    )


@pytest.fixture(scope="module")
def train_dry_run(repo_copy: Path) -> subprocess.CompletedProcess[str]:
    """A dry run of the train target with a device and a precision from the command line."""
    return snakemake(repo_copy, "-n", "train", "--config", "device=cpu", "precision=bf16")


def test_dry_run_of_train_on_cpu_succeeds(train_dry_run: subprocess.CompletedProcess[str]) -> None:
    assert train_dry_run.returncode == 0, train_dry_run.stderr


def test_a_data_root_under_home_is_where_the_data_commands_write(repo_copy: Path) -> None:
    """No shell expands `~` in a config value: the generated files' paths must expand it as
    pipeline.data does, or Snakemake waits for `./~/...` while the command writes to the home."""
    (repo_copy / "home.yaml").write_text("data:\n  root: ~/shapes-test\n")
    generated = os.path.join(os.path.expanduser("~"), "shapes-test", "instances_train.json")
    result = snakemake(repo_copy, "-n", "-p", generated, "--configfile", "home.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rule prepare_data:" in result.stdout
    assert "~/shapes-test" not in result.stdout


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("precision=maybe", "'maybe' is not one of"),
        ("device=tpu", "'tpu' does not match"),
        ("seed=-1", "-1 is less than the minimum of 0"),
        ("no_such_key=1", "Unknown config key no_such_key in the command line."),
    ],
)
def test_a_bad_config_value_fails_on_the_schema(
    repo_copy: Path, setting: str, message: str
) -> None:
    result = snakemake(repo_copy, "-n", "results/report.html", "--config", setting)
    assert result.returncode != 0
    assert message in result.stdout + result.stderr


def test_a_misspelt_key_in_a_configfile_is_one_short_paragraph_naming_the_file_and_a_suggestion(
    repo_copy: Path,
) -> None:
    (repo_copy / "preset.yaml").write_text("data:\n  image_size: 256\n")
    (repo_copy / "mine.yaml").write_text("data:\n  image_sise: 256\n")
    result = snakemake(
        repo_copy, "-n", "results/report.html", "--configfile", "preset.yaml", "mine.yaml"
    )
    assert result.returncode == 1
    output = (result.stdout + result.stderr).strip().splitlines()
    assert len(output) <= 5, output
    message = output[-1]
    assert message.startswith("Unknown config key data.image_sise in mine.yaml. ")
    assert "Did you mean data.image_size?" in message and "Valid keys in data: " in message
    assert "check_env" not in result.stdout  # no job was planned, let alone started


def workflow_config(cwd: Path, *args: str) -> dict:
    """The config the workflow resolved, as its report job is given it (a dry run prints it)."""
    result = snakemake(cwd, "-n", "-p", "results/report.html", *args)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if "--config-json" in line)
    words = shlex.split(line)
    return json.loads(words[words.index("--config-json") + 1])


class ConfigRead(Exception):
    """Stops a command once it has its config (see the test below)."""


LAYERED_FILES = ("base.yaml", "over.yaml")


@pytest.fixture(scope="module")
def layered_configs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A copy of the repository with two config files and an edited config/config.yaml (as a
    user edits it), and the config the workflow resolves from them: one dry run for every
    command compared with it below."""
    root = copy_repository(tmp_path_factory.mktemp("layered"))
    (root / "base.yaml").write_text(
        "train: {epochs: 3, lr: 0.01}\ndata: {synthetic: {num_train: 64, classes: [star]}}\n"
    )
    (root / "over.yaml").write_text("train: {epochs: 5}\ndata: {synthetic: {num_val: 16}}\n")
    shipped = root / "config" / "config.yaml"
    shipped.write_text(shipped.read_text().replace("weight_decay: 0.0001", "weight_decay: 0.0002"))
    return root, workflow_config(root, "--configfile", *LAYERED_FILES, "--config", "seed=3")


@pytest.mark.parametrize(
    ("command", "options"),
    [
        ("train", ()),
        ("bench", ("--precision", "fp32", "--out", "bench.json")),
        ("prepare-data", ()),
        ("choose-precision", ()),
        ("summarize", ()),
        ("report", ()),
        ("config", ()),
    ],
)
def test_the_same_config_files_give_the_same_config_in_snakemake_and_in_the_command(
    layered_configs: tuple[Path, dict],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    restore_pipeline_logger: None,
    command: str,
    options: tuple[str, ...],
) -> None:
    """Both layer the files over config/config.yaml (edited, as a user edits it), later ones
    winning, and the settings last. The report job is told every key but the compare list,
    which neither it nor summarize reads."""
    root, expected = layered_configs
    assert expected["train"]["weight_decay"] == 0.0002  # the edit is layered under the files
    assert expected["train"]["epochs"] == 5 and expected["train"]["lr"] == 0.01
    seen = config_of_command(root, monkeypatch, capsys, command, options, LAYERED_FILES)
    assert seen.pop("compare") == [] and "compare" not in expected
    assert seen == expected


def config_of_command(
    root: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    command: str,
    options: tuple[str, ...],
    files: tuple[str, ...],
) -> dict:
    """The config `python -m pipeline <command>` resolves from the files, run in `root`."""
    monkeypatch.chdir(root)
    argv = [command, *options, "--configfile", *files, "--config", "seed=3"]
    if command == "config":
        assert cli.main(argv) == 0
        return yaml.safe_load(capsys.readouterr().out)
    module = importlib.import_module(cli.COMMANDS[command][0])
    real = cli.config_from_args
    seen = []

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        raise ConfigRead

    monkeypatch.setattr(cli, "config_from_args", spy)  # what cli.resolved_config calls
    if hasattr(module, "config_from_args"):
        monkeypatch.setattr(module, "config_from_args", spy)
    with pytest.raises(ConfigRead):
        cli.main(argv)
    (config,) = seen
    return config


def test_the_replaced_amp_keys_are_refused_naming_the_precision_that_replaces_them(
    repo_copy: Path,
) -> None:
    result = snakemake(repo_copy, "-n", "train", "--config", "amp=true", "amp_dtype=bf16")
    assert result.returncode == 1
    assert "amp and amp_dtype were replaced by one key, precision" in result.stderr
    assert "write precision: bf16 " in result.stderr


def test_precision_from_the_command_line_is_accepted(
    train_dry_run: subprocess.CompletedProcess[str],
) -> None:
    assert train_dry_run.returncode == 0, train_dry_run.stderr


def test_jobs_run_with_the_python_that_runs_snakemake_not_the_one_on_path(
    checked_env: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    """The venv's snakemake called by path, the venv not activated: the `python` that PATH
    finds (conftest's checked_env puts a stand-in that fails there) must not run the jobs."""
    root, result = checked_env
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    snakemakes_python = (BIN / "snakemake").read_text().splitlines()[0].removeprefix("#!")
    assert f"{snakemakes_python} -m pipeline" in result.stdout + result.stderr
    assert "cpu" in json.loads((root / "results" / "env.json").read_text())["available"]


# MPS hidden wherever the tests run (a Mac has it), as a user's machine without it would be
WITHOUT_MPS = {**os.environ, "PIPELINE_DISABLE_BACKENDS": "mps"}


@pytest.fixture(scope="module")
def absent_backend_runs(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, list[subprocess.CompletedProcess[str]]]:
    """`snakemake train --config device=mps` (the README's example) without MPS, twice in a
    fresh copy: first where this run's check_env job writes env.json (the device is found
    missing after it), then with env.json there (found missing before any job)."""
    root = copy_repository(tmp_path_factory.mktemp("absent"))
    args = ("--cores", "1", "train", "--configfile", CI_CONFIG, "--config", "device=mps")
    results = [snakemake(root, *args, timeout=300, env=WITHOUT_MPS) for _ in range(2)]
    return root, results


def test_an_absent_backend_stops_the_workflow_with_its_paragraph_and_no_traceback(
    absent_backend_runs: tuple[Path, list[subprocess.CompletedProcess[str]]],
) -> None:
    root, results = absent_backend_runs
    assert (root / "results" / "env.json").exists()  # the first run's check_env job ran
    for result in results:
        output = result.stdout + result.stderr
        assert result.returncode == 1, output[-3000:]
        assert (
            "Device 'mps' is not available: disabled by the environment variable "
            "PIPELINE_DISABLE_BACKENDS. Available backends: ['cpu']." in output
        )
        assert "Traceback" not in output and "InputFunctionException" not in output
        assert not (root / "results" / "train").exists()
    assert ran_jobs(results[1]) == set()  # the second stopped before any job


def test_a_device_in_capitals_names_its_runs_in_lower_case(
    absent_backend_runs: tuple[Path, list[subprocess.CompletedProcess[str]]],
) -> None:
    """`--device CPU` works on the command line, so `--config device=' CPU '` does too, and the
    run is the cpu run every stage names in lower case."""
    root, _ = absent_backend_runs
    result = snakemake(
        root, "-n", "train", "--configfile", CI_CONFIG, "--config", "device= CPU ", "precision=fp32"
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "results/train/cpu-fp32/best.pth" in result.stdout
    assert "CPU-" not in result.stdout


def test_a_voc_split_given_as_a_folder_gives_training_its_xml_files_as_inputs(
    repo_copy: Path, tmp_path: Path
) -> None:
    """Editing one annotation must rerun training, as the folder's own time would not say;
    the folder's other files (a hidden `._name.xml`, the exporter's readme) are no inputs."""
    export = tmp_path / "export"
    make_roboflow_export(export)
    result = snakemake(
        repo_copy,
        "-n",
        "results/train/cpu-fp32/best.pth",
        "--configfile",
        CI_CONFIG,
        "--config",
        "device=cpu",
        "precision=fp32",
        f"data={{format: voc, train_annotations: '{export / 'train'}', "
        f"val_annotations: '{export / 'valid'}'}}",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    train_job = result.stdout.split("rule train_run:", 1)[1]
    inputs = train_job.split("input: ", 1)[1].splitlines()[0].split(", ")
    expected = [
        str(path)
        for folder in ("train", "valid")
        for path in sorted((export / folder).glob("[!.]*.xml"))
    ]
    assert len(expected) == 12
    assert [name for name in inputs if str(export) in name] == expected


def test_an_edited_annotation_reruns_no_benchmark(
    checked_env: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    """The benchmarks read the training and validation splits for their class count alone: an
    edited box moves no timing, so it does not cost the minutes of benchmarks again (training,
    whose inputs the same files are, reruns)."""
    root = copy_checked_env(checked_env, tmp_path / "repo")
    export = tmp_path / "export"
    make_roboflow_export(export)
    config = [
        "--configfile",
        CI_CONFIG,
        "--config",
        "device=cpu",
        f"data={{format: voc, train_annotations: '{export / 'train'}', "
        f"val_annotations: '{export / 'valid'}'}}",
    ]
    target = "results/bench/cpu-fp32-train.json"
    planned = snakemake(root, "-n", target, *config)
    bench_job = planned.stdout.split("rule bench_backend:", 1)[1]
    outputs = bench_job.split("output: ", 1)[1].splitlines()[0].split(", ")
    assert target in outputs
    for name in outputs:  # as if the benchmarks had run
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("{}")
    xml = sorted((export / "train").glob("[!.]*.xml"))[0]
    xml.write_text(xml.read_text() + "\n")
    later = time.time() + 60
    os.utime(xml, (later, later))
    result = snakemake(root, "-n", target, *config)
    assert result.returncode == 0, result.stderr
    assert planned_jobs(result) == set(), result.stdout[-3000:]


def planned_commands(
    root: Path, targets: tuple[str, ...], *settings: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, list[str]]]:
    """A dry run of `targets` on the CI config with a CPU fp32 run and `settings` (--config),
    and the words of each `python -m pipeline COMMAND --checkpoint ...` line it prints, by
    command (one line each)."""
    result = snakemake(
        root, "-n", "-p", *targets, "--configfile", CI_CONFIG, "--config", "device=cpu",
        "precision=fp32", *settings,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    commands: dict[str, list[str]] = {}
    for line in result.stdout.splitlines():
        match = re.search(r" -m pipeline .* ([a-z-]+) --checkpoint", line)
        if match:
            assert match.group(1) not in commands, result.stdout
            commands[match.group(1)] = shlex.split(line)
    return result, commands


@pytest.fixture(scope="module")
def evaluation_and_prediction_commands(
    repo_copy: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, list[str]]]:
    """One dry run of a CPU fp32 run's evaluation and prediction, whose config names a VOC
    export's test split, data loading settings, an evaluation batch size and images to predict
    on: the export and the `evaluate` and `predict` commands' words (each test below reads what
    its setting must reach)."""
    folder = tmp_path_factory.mktemp("planned")
    export, photos = folder / "export", folder / "photos"
    make_roboflow_export(export)
    photos.mkdir()
    Image.new("RGB", (32, 32)).save(photos / "photo.png")
    _, commands = planned_commands(
        repo_copy,
        ("results/eval/cpu-fp32.json", "results/predict/cpu-fp32/images.json"),
        f"data={{format: voc, train_annotations: '{export / 'train'}', "
        f"val_annotations: '{export / 'valid'}', test_annotations: '{export / 'test'}', "
        "cache: false, num_workers: 0}",
        "eval={batch_size: 3}",
        f"predict={{images: [{photos}]}}",
    )
    return export, commands


def test_the_evaluation_job_is_told_the_test_split_that_training_leaves_out_of_its_checkpoint(
    evaluation_and_prediction_commands: tuple[Path, dict[str, list[str]]],
) -> None:
    """Training's checkpoint keeps no test split keys (a new test file retrains nothing), so
    the evaluation job must name them: without them it reported on validation, though the
    user's config named a test split."""
    export, commands = evaluation_and_prediction_commands
    assert f"data.test_annotations={json.dumps(str(export / 'test'))}" in commands["evaluate"]
    # that the test split still retrains nothing is test_runs.py's to check: in a dry run before
    # check_env has run, the training job's settings are printed as <TBD>


def test_the_evaluation_job_is_told_a_generated_set_has_no_test_split(repo_copy: Path) -> None:
    """Training's checkpoint keeps no data.synthetic.num_test, so its config has the default
    test split: without num_test: 0 passed, the evaluation reported on whatever test file an
    earlier run had left (or failed for want of one) though the config asks for none."""
    result, commands = planned_commands(
        repo_copy, ("results/eval/cpu-fp32.json",), "data={synthetic: {num_test: 0}}"
    )
    assert "prepare_test_data" not in result.stdout
    assert "data.synthetic.num_test=0" in commands["evaluate"]


def test_the_evaluation_job_is_told_the_loading_settings_the_checkpoint_keeps_from_training(
    evaluation_and_prediction_commands: tuple[Path, dict[str, list[str]]],
) -> None:
    """The checkpoint's config keeps the data loading settings training ran with, and changing
    them reruns no training: without them passed, data.cache: false set after an evaluation
    ran out of memory left it caching again on its rerun."""
    _, commands = evaluation_and_prediction_commands
    expected = {"data.cache=false", "data.num_workers=0", "eval.batch_size=3"}
    assert expected <= set(commands["evaluate"])


def test_the_prediction_job_is_told_the_configs_evaluation_batch_size(
    evaluation_and_prediction_commands: tuple[Path, dict[str, list[str]]],
) -> None:
    """predict batches images by eval.batch_size, which the checkpoint keeps as training ran
    with it: a smaller one set since (a GPU out of memory) must reach the prediction job."""
    _, commands = evaluation_and_prediction_commands
    words = commands["predict"]
    assert words[words.index("--batch-size") + 1] == "3"


def test_the_prediction_job_is_told_the_configs_data_loading_workers(
    evaluation_and_prediction_commands: tuple[Path, dict[str, list[str]]],
) -> None:
    """predict decodes images in worker processes, which a container short of shared memory
    cannot start: a data.num_workers of 0 set since training must reach the prediction job."""
    _, commands = evaluation_and_prediction_commands
    words = commands["predict"]
    assert words[words.index("--num-workers") + 1] == "0"


def test_the_comparison_target_without_summaries_to_compare_says_how_to_name_them(
    repo_copy: Path,
) -> None:
    result = snakemake(repo_copy, "-n", "results/compare.html")
    assert result.returncode != 0
    assert "the config's compare list, and it is empty: set it" in result.stdout + result.stderr


# ---- the real workflow ------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def end_to_end_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, subprocess.Popen, tuple[Path, Path]]]:
    """The whole workflow (`finished`), started in the background as the module starts, in a
    copy of its own: the tests before the first that reads it (dry runs, a few short runs, each
    in a copy of its own) run beside it, for its jobs leave much of a second core idle (the
    workflow gives each training or timing job every core, one at a time, and starting a job
    is one core's work). Stopped with its jobs at the module's end if no test waited for it."""
    folder = tmp_path_factory.mktemp("end-to-end")
    root = copy_repository(folder / "repo")
    offline = () if isolation_unavailable() else ("unshare", "--net", "--")
    output = (folder / "stdout.txt", folder / "stderr.txt")
    # targets first: --configfile and --config take every word after them
    command = [*offline, str(BIN / "snakemake"), "results/report.html", "--cores", "2", *E2E_CONFIG]
    with open(output[0], "w") as stdout, open(output[1], "w") as stderr:
        process = subprocess.Popen(
            command, cwd=root, stdout=stdout, stderr=stderr, text=True, start_new_session=True
        )
    try:
        yield root, process, output
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def finished(
    end_to_end_run: tuple[Path, subprocess.Popen, tuple[Path, Path]],
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The whole workflow, offline where the machine allows it (see test_it_ran_offline), once
    it has finished."""
    root, process, (stdout, stderr) = end_to_end_run
    returncode = process.wait(timeout=600)
    result = subprocess.CompletedProcess(
        process.args, returncode, stdout.read_text(), stderr.read_text()
    )
    assert returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root, result


def test_the_namespace_really_has_no_network() -> None:
    reason = isolation_unavailable()
    if reason:
        pytest.skip(reason)
    code = "import socket; socket.create_connection(('192.0.2.1', 53), timeout=5)"
    prefix = ["unshare", "--net", "--"]
    result = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
    assert "Network is unreachable" in result.stderr


def test_it_ran_offline(finished: tuple[Path, subprocess.CompletedProcess]) -> None:
    """Nothing is downloaded at run time: the end-to-end run above had no network at all."""
    reason = isolation_unavailable()
    if reason and os.environ.get(REQUIRE_ISOLATION) == "1":
        pytest.fail(f"{REQUIRE_ISOLATION}=1, but {reason}")
    if reason:
        pytest.skip(f"the run had the network: {reason} (set {REQUIRE_ISOLATION}=1 to fail)")
    assert (finished[0] / "results" / "report.html").is_file()


def test_every_stage_writes_its_outputs(finished: tuple[Path, subprocess.CompletedProcess]) -> None:
    root, _ = finished
    results = root / "results"
    env = json.loads((results / "env.json").read_text())
    assert env["auto"] in env["available"]
    bench_files = sorted((results / "bench").glob("*.json"))
    expected = {
        f"{backend}-{precision}-{mode}.json"
        for backend in env["available"]
        for precision in ("fp32", "fp16", "bf16")
        for mode in ("train", "infer")
    }
    assert {path.name for path in bench_files} == expected
    runs = {p.parent.name for p in (results / "train").glob("*/train_summary.json")}
    assert runs == sweep_runs(root)
    for name in runs:
        summary = json.loads((results / "train" / name / "train_summary.json").read_text())
        assert summary["epochs"] == 2 and summary["final_val"] is not None
        assert (results / "train" / name / "best.pth").is_file()
        evaluation = json.loads((results / "eval" / f"{name}.json").read_text())
        assert 0.0 <= evaluation["metrics"]["ap50"] <= 1.0
        assert evaluation["metrics_split"] == "test"  # the generated test split, held out
        assert evaluation["splits"]["test"]["num_images"] == 16
        predictions = json.loads((results / "eval" / f"{name}_predictions.json").read_text())
        assert len(predictions["images"]) == 16
        assert all("/test/" in image["file"] for image in predictions["images"])
        profile = json.loads((results / "profile" / name / "profile.json").read_text())
        assert [row["batch_size"] for row in profile["latency"]] == [1, 4]
        trace = json.loads((results / "profile" / name / "trace.json").read_text())
        assert isinstance(trace["traceEvents"], list)
    stats = {path.stem for path in (results / "job_stats").rglob("*.tsv")}
    assert {"check_env", "prepare_data", "summarize", "report"} <= stats


def test_every_results_file_matches_the_schema_of_its_format(
    finished: tuple[Path, subprocess.CompletedProcess],
) -> None:
    checked = check_results(finished[0] / "results")
    # every format of the results folder, each file; prediction has a target and a test of its
    # own (below); benchmark records belong to the benchmark scripts, not to the workflow
    not_results = {"common", "predict", "benchmark_record"}
    assert set(checked) - {"predict"} == set(formats.names()) - not_results
    runs = len(sweep_runs(finished[0]))
    assert checked["train_summary"] == checked["eval"] == checked["profile"] == runs
    assert checked["summary"] == 1


def test_the_predict_target_writes_every_runs_detections_on_the_configured_folder(
    finished: tuple[Path, subprocess.CompletedProcess],
) -> None:
    """Before the tests below edit code, which would retrain."""
    root, _ = finished
    folder = "resources/data/ci/test"
    setting = f"predict={{images: {folder}, draw: true}}"
    result = snakemake(root, "predict", "--cores", "2", *E2E_CONFIG, setting)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "rule train_run" not in result.stdout + result.stderr  # the runs' best.pth as they are
    runs = sweep_runs(root)
    assert {
        path.parent.name for path in (root / "results" / "predict").glob("*/images.json")
    } == runs
    assert check_results(root / "results")["predict"] == len(runs)
    for run in runs:
        index = json.loads((root / "results" / "predict" / run / "images.json").read_text())
        assert len(index["images"]) == 16 and index["unreadable"] == []
        assert index["score_threshold_source"] == "checkpoint"
        assert all(
            (root / "results" / "predict" / run / i["annotated"]).is_file() for i in index["images"]
        )
    again = snakemake(root, "predict", "-n", *E2E_CONFIG, setting)
    assert "Nothing to be done" in again.stdout + again.stderr


def test_training_ran_in_the_precision_the_benchmarks_chose(
    finished: tuple[Path, subprocess.CompletedProcess],
) -> None:
    """precision: measured (tests/config/ci.yaml): benchmarks, then the choice, then training with it."""
    root, result = finished
    output = result.stdout + result.stderr
    assert output.index("checkpoint choose_precision:") < output.index("rule train_run:")
    backend = json.loads((root / "results" / "env.json").read_text())["auto"]
    (choice,) = json.loads((root / "results" / "choice" / f"{backend}.json").read_text())["choices"]
    assert choice["reference"] == f"results/bench/{backend}-fp32-train.json"
    assert {candidate["precision"] for candidate in choice["candidates"]} == {"bf16", "fp16"}
    for name in sweep_runs(root):
        summary = json.loads((root / "results" / "train" / name / "train_summary.json").read_text())
        assert summary["precision"] == choice["precision"]
        assert summary["precision_choice"] == choice


def test_the_report_has_every_section_and_is_self_contained(
    finished: tuple[Path, subprocess.CompletedProcess],
) -> None:
    root, _ = finished
    source = (root / "results" / "report.html").read_text()
    page = Page()
    page.feed(source)
    assert [attrs.get("id") for tag, attrs in page.tags if tag == "section"] == SECTION_IDS
    assert_self_contained(source, page, min_images=4)
    assert "On this machine, train with" in page.text("answer")
    for run in sweep_runs(root):  # the runs side by side
        assert run in page.text("training") and run in page.text("evaluation")
    assert "Runs compared" in page.text("training")


def test_two_cores_never_run_two_benchmarks_at_once(
    finished: tuple[Path, subprocess.CompletedProcess],
) -> None:
    """The precisions of one model and mode are timed interleaved in one schedule, so their
    records' spans overlap by design; two schedules (two modes, two models, two jobs) never do."""
    root, _ = finished
    schedules: dict[str, list[datetime]] = {}
    for path in (root / "results" / "bench").glob("*.json"):
        for record in json.loads(path.read_text())["records"]:
            if record["conditions"]:
                conditions = record["conditions"]
                schedules.setdefault(record["timing"]["schedule_id"], []).extend(
                    datetime.fromisoformat(conditions[key]) for key in ("started", "finished")
                )
    spans = sorted((min(times), max(times)) for times in schedules.values())
    assert len(spans) >= 2
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start


def test_a_second_run_has_nothing_to_do(finished: tuple[Path, subprocess.CompletedProcess]) -> None:
    root, _ = finished
    result = snakemake(root, "results/report.html", "--cores", "1", *E2E_CONFIG)
    assert result.returncode == 0
    assert "Nothing to be done" in result.stdout + result.stderr


def test_a_missing_precision_choice_is_made_again_though_the_report_exists(
    finished: tuple[Path, subprocess.CompletedProcess],
) -> None:
    """As after a plain run followed by --config precision=measured: the report exists, the choice
    does not. Snakemake 9 skips a checkpoint whose output is missing when what reads it exists,
    so the workflow declares the choice as a plain input (choice_files)."""
    root, _ = finished
    choices = root / "results" / "choice"
    kept = root / "choice-kept"
    choices.rename(kept)
    try:
        result = snakemake(root, "-n", "results/report.html", *E2E_CONFIG)
        assert result.returncode == 0, result.stderr
        assert "Nothing to be done" not in result.stdout + result.stderr
        assert {"choose_precision", "report"} <= planned_jobs(result)
    finally:
        kept.rename(choices)


def test_the_same_venv_at_another_path_reruns_nothing(
    finished: tuple[Path, subprocess.CompletedProcess], tmp_path: Path
) -> None:
    """Jobs run with the interpreter's path on their command line, yet another spelling of it
    (a moved checkout, a symlinked venv) is no params change that reruns them."""
    root, _ = finished
    elsewhere = tmp_path / "venv-elsewhere"
    elsewhere.symlink_to(BIN.parent, target_is_directory=True)
    command = [str(elsewhere / "bin" / "python"), "-m", "snakemake", "results/report.html", "-n"]
    result = subprocess.run(
        [*command, *E2E_CONFIG], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Nothing to be done" in result.stdout + result.stderr, result.stdout[-3000:]


TRAINING_AND_AFTER = {"train_run", "evaluate_run", "profile_run", "summarize", "report"}


# setting -> the jobs a dry run of the report plans after it
CHANGED_SETTINGS = {
    "eval={batch_size: 7}": {"evaluate_run", "summarize", "report"},
    # a larger test split, for narrower intervals: only it is made again, nothing retrains
    "data={synthetic: {num_test: 24}}": {
        "prepare_test_data",
        "evaluate_run",
        "summarize",
        "report",
    },
    "train={weight_decay: 0.001}": TRAINING_AND_AFTER,
    # how images are fitted to the input changes what trains, not the step the benchmarks time
    "data={resize: stretch}": TRAINING_AND_AFTER,
    "eval={score_threshold: 0.3}": TRAINING_AND_AFTER,  # validation picks best.pth by it
    # the summary records the config (its comparison settings), the report shows it
    "data={num_workers: 1, cache: false}": {"summarize", "report"},
    "train={lr: 0.01}": {"summarize", "report"},  # every run's lr comes from the sweep
    # the summaries results/compare.html sets beside this run's are no part of it
    "compare=[elsewhere/summary.json, results/summary.json]": set(),
}


@pytest.fixture(scope="module")
def changed_setting_dry_runs(
    finished: tuple[Path, subprocess.CompletedProcess],
) -> dict[str, subprocess.CompletedProcess[str]]:
    """A dry run of the report after each of CHANGED_SETTINGS, two at a time: each is a
    Snakemake start (one core's work) that writes nothing. Before the edits below, which rerun
    training whatever the settings."""
    root, _ = finished
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = {
            setting: pool.submit(snakemake, root, "results/report.html", "-n", *E2E_CONFIG, setting)
            for setting in CHANGED_SETTINGS
        }
    return {setting: run.result() for setting, run in runs.items()}


@pytest.mark.parametrize(("setting", "jobs"), CHANGED_SETTINGS.items())
def test_a_changed_setting_reruns_the_jobs_whose_result_depends_on_it(
    changed_setting_dry_runs: dict[str, subprocess.CompletedProcess[str]],
    setting: str,
    jobs: set[str],
) -> None:
    result = changed_setting_dry_runs[setting]
    assert result.returncode == 0, result.stderr
    assert planned_jobs(result) == jobs, result.stdout[-3000:]


def test_best_pth_is_an_output_of_training_that_evaluation_and_profiling_read(
    finished: tuple[Path, subprocess.CompletedProcess],
) -> None:
    root, _ = finished
    best = sorted((root / "results" / "train").glob("*/best.pth"))[0]
    original = best.read_bytes()
    best.write_bytes(original + b"changed")
    try:
        changed = snakemake(root, "results/report.html", "-n", *E2E_CONFIG)
    finally:
        best.write_bytes(original)  # the same checksum again: nothing reruns for it
    assert changed.returncode == 0, changed.stderr
    assert planned_jobs(changed) == {"evaluate_run", "profile_run", "summarize", "report"}

    aside = best.with_name("best.pth.aside")
    best.rename(aside)
    try:
        remade = snakemake(root, str(best.relative_to(root)), "-n", *E2E_CONFIG)
    finally:
        aside.rename(best)
    assert remade.returncode == 0, remade.stderr
    assert planned_jobs(remade) == {"train_run"}


@pytest.mark.parametrize(
    ("changed", "jobs"),
    [
        ("src/pipeline/summary/decisions.py", {"summarize", "report"}),
        ("src/pipeline/report/templates/sections/answer.html.j2", {"report"}),
        ("src/pipeline/report/static/report.css", {"report"}),
    ],
)
def test_editing_the_decisions_a_template_or_the_stylesheet_reruns_only_the_summary_and_report(
    finished: tuple[Path, subprocess.CompletedProcess], changed: str, jobs: set[str]
) -> None:
    root, _ = finished
    original = (root / changed).read_text()
    edit(root / changed)
    try:
        result = snakemake(root, "results/report.html", "-n", *E2E_CONFIG)
    finally:  # the same content again: the next edit is the only change its dry run sees
        (root / changed).write_text(original)
    assert result.returncode == 0, result.stderr
    assert planned_jobs(result) == jobs
    reasons = [line for line in result.stdout.splitlines() if "Updated input files" in line]
    assert reasons and changed in reasons[0]


def test_editing_the_trainer_reruns_training_and_what_depends_on_it(
    finished: tuple[Path, subprocess.CompletedProcess],
) -> None:
    root, _ = finished
    trainer = root / "src/pipeline/engine/trainer.py"
    original = trainer.read_text()
    edit(trainer)
    try:
        result = snakemake(root, "results/report.html", "-n", *E2E_CONFIG)
    finally:  # the same content again: the tests after it see the finished run up to date
        trainer.write_text(original)
    assert result.returncode == 0, result.stderr
    assert planned_jobs(result) == TRAINING_AND_AFTER


def test_an_absent_backend_fails_fast_with_the_device_message_and_leaves_nothing(
    finished: tuple[Path, subprocess.CompletedProcess],
) -> None:
    root, _ = finished
    env = json.loads((root / "results" / "env.json").read_text())
    if env["backends"]["mps"]["available"]:
        pytest.skip("this machine has MPS")
    before = sorted(p.name for p in (root / "results" / "train").iterdir())
    result = snakemake(
        root, "train", "--configfile", CI_CONFIG, "--config", "device=mps", timeout=120
    )
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "Device 'mps' is not available" in output and "Available backends" in output
    assert "Traceback" not in output
    assert sorted(p.name for p in (root / "results" / "train").iterdir()) == before


def test_snakemakes_own_report_bundles_the_marked_outputs(
    finished: tuple[Path, subprocess.CompletedProcess],
) -> None:
    root, _ = finished
    result = snakemake(root, "--report", "results/snakemake_report.zip", *E2E_CONFIG)
    assert result.returncode == 0, result.stderr[-3000:]
    with zipfile.ZipFile(root / "results" / "snakemake_report.zip") as bundle:
        names = bundle.namelist()
    for marked in ("report.html", "cpu-fp32-train.json", "train_summary.json"):
        assert any(name.endswith(marked) for name in names), marked


def test_the_benchmark_job_is_told_the_training_settings_its_numerics_check_reads(
    finished: tuple[Path, subprocess.CompletedProcess],
) -> None:
    """The numerics check trains a few steps before it compares the precisions' loss and
    gradients: it trained at the working folder's config/config.yaml, whatever the user's
    --configfile said (that a change of them reruns no benchmark is pinned above)."""
    root, _ = finished
    settings = {"lr": 0.0123, "box_weight": 2.5, "momentum": 0.8, "weight_decay": 0.002}
    result = snakemake(
        root, "-n", "-p", "--forcerun", "bench_backend", "results/bench/cpu-fp32-train.json",
        *E2E_CONFIG, "train=" + json.dumps(settings),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = [line for line in result.stdout.splitlines() if " bench --device" in line]
    words = shlex.split(line)
    for key, value in settings.items():
        assert f"train.{key}={value}" in words
    # and the data keys it times nothing of, which it reads to count the classes as training does
    assert 'data.resize="letterbox"' in words and 'data.root="resources/data/ci"' in words


def test_missing_coco_annotations_stop_the_run_instead_of_being_generated(
    finished: tuple[Path, subprocess.CompletedProcess], tmp_path: Path
) -> None:
    root, _ = finished
    coco = tmp_path / "my-coco"
    result = snakemake(
        root,
        "train",
        "-n",
        "--configfile",
        CI_CONFIG,
        "--config",
        f"data={{format: coco, root: {coco}}}",
    )
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "MissingInputException" in output and f"{coco}/instances_train.json" in output
    assert "prepare_data" not in result.stdout


def test_two_runs_of_different_settings_end_in_one_comparison_page(
    finished: tuple[Path, subprocess.CompletedProcess], tmp_path: Path
) -> None:
    """Two "machines": the run above, its machine description replaced by another, and a
    second run of other settings in a copy of it, which builds results/compare.html from the
    config's compare list: speed side by side, accuracy not, and the page says what differs.
    The other setting is train.lr, which the sweep overrides: only the summary is made again
    (what a setting reruns has its own test above)."""
    root, _ = finished
    summary = json.loads((root / "results" / "summary.json").read_text())
    summary["machine"].update(cpu_model="Another CPU (described by the test)", gpus=[])
    elsewhere = tmp_path / "elsewhere" / "summary.json"
    elsewhere.parent.mkdir()
    elsewhere.write_text(json.dumps(summary))
    second = tmp_path / "second"
    shutil.copytree(root, second, symlinks=True)
    settings = ("train={lr: 0.01}", f"compare=[{elsewhere}, results/summary.json]")
    result = snakemake(second, "results/compare.html", "--cores", "2", *E2E_CONFIG, *settings)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert ran_jobs(result) == {"summarize", "compare"}
    page = Page()
    page.feed((second / "results" / "compare.html").read_text())
    assert "Another CPU (described by the test)" in page.text("machines")
    assert "Not compared" not in page.text("speed")  # the same configuration was timed
    assert "they ran different settings (train.lr: " in page.text("training")
    command = ["compare", str(elsewhere), "results/summary.json", "--markdown"]
    markdown = subprocess.run(
        [sys.executable, "-m", "pipeline", *command],
        cwd=second,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "| Machine | Train with |" in markdown and "Not compared" in markdown
