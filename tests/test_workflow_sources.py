"""What a code edit reruns: each rule's source inputs are its command's imports (pipeline.import_graph).

The rules are read through Snakemake's API; what a command imports is found independently by
the standard library's `modulefinder` (which reads bytecode, function bodies included), so the
check does not trust the module it tests. One dry run in a copy of the repository shows the
effect: editing the weight average (engine/ema.py) puts training out of date.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from modulefinder import ModuleFinder
from pathlib import Path

import pytest
from test_workflow import copy_checked_env, edit, job_counts, planned_jobs, snakemake

from pipeline import cli, import_graph

REPO = Path(__file__).resolve().parents[1]
SOURCES = REPO / "src" / "pipeline"

# The rules as Snakemake reads them: name, shell text and code inputs, in a process of its own
# (the API changes the working directory and logging of the process that loads a workflow).
READ_RULES = """
import json, sys
from pathlib import Path
from snakemake.api import SnakemakeApi
from snakemake.settings.types import ConfigSettings, OutputSettings, ResourceSettings

with SnakemakeApi(OutputSettings()) as api:
    workflow = api.workflow(
        resource_settings=ResourceSettings(),
        config_settings=ConfigSettings(),
        snakefile=Path("workflow/Snakefile"),
        workdir=Path("."),
    )._workflow
    rules = {
        rule.name: {"shell": rule.shellcmd, "code": list(getattr(rule.input, "code", []))}
        for rule in workflow.rules
    }
print("RULES " + json.dumps(rules))
"""


@pytest.fixture(scope="module")
def rules() -> dict[str, dict]:
    result = subprocess.run(
        [sys.executable, "-c", READ_RULES],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RULES ")]
    return json.loads(line.removeprefix("RULES "))


def command_of(shell: str) -> str | None:
    """The `python -m pipeline` command a rule's shell text runs, or None (an aggregator)."""
    words = shlex.split(shell.replace("{", "").replace("}", ""))
    if "pipeline" not in words or words[words.index("pipeline") - 1] != "-m":
        return None
    rest = words[words.index("pipeline") + 1 :]
    position = cli._command_position(rest)
    return None if position is None else cli.ALIASES.get(rest[position], rest[position])


def imported_files(command: str) -> set[str]:
    """The package's files `python -m pipeline COMMAND` runs, by modulefinder: __main__ (and
    through it cli), the command's module, and the packages each of them sits in."""
    names: set[str] = set()
    for module in (import_graph.ENTRY_POINT, cli.COMMANDS[command][0]):
        finder = ModuleFinder(path=[str(SOURCES.parent)])  # only the package: fast, no torch
        finder.run_script(str(SOURCES.parent / (module.replace(".", "/") + ".py")))
        found = {name for name in finder.modules if name.split(".")[0] == "pipeline"}
        parts = module.split(".")
        names |= found | {".".join(parts[:end]) for end in range(1, len(parts) + 1)}
    files = set()
    for name in names:
        path = SOURCES.parent / name.replace(".", "/")
        module_file = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        files.add(str(module_file.relative_to(REPO)))
    return files


def test_every_rule_running_a_command_has_every_module_it_imports_as_an_input(
    rules: dict[str, dict],
) -> None:
    commands = {name: command_of(rule["shell"] or "") for name, rule in rules.items()}
    checked = {name: command for name, command in commands.items() if command}
    assert {
        "train_run",
        "evaluate_run",
        "profile_run",
        "predict_run",
        "summarize",
        "report",
    } <= set(checked)
    assert "compare" in checked and "bench_backend" in checked
    for name, command in checked.items():
        missing = imported_files(command) - set(rules[name]["code"])
        assert not missing, f"rule {name} (command {command}) lacks its imports {sorted(missing)}"
    # the modules the issue found missing, by name
    assert "src/pipeline/engine/ema.py" in rules["train_run"]["code"]
    assert "src/pipeline/stats.py" in rules["evaluate_run"]["code"]
    for name in ("evaluate_run", "profile_run"):
        for module in ("engine/checkpoint.py", "models/centernet.py"):
            assert f"src/pipeline/{module}" in rules[name]["code"]
    assert "src/pipeline/data/dataset.py" in rules["evaluate_run"]["code"]


def test_a_stage_does_not_depend_on_modules_its_command_never_imports(
    rules: dict[str, dict],
) -> None:
    """Derived, not everything: the report's charts never rerun training, nor the trainer a report."""
    assert "src/pipeline/report/charts.py" not in rules["train_run"]["code"]
    assert "src/pipeline/engine/trainer.py" not in rules["report"]["code"]
    assert not any("templates" in path for path in rules["summarize"]["code"])


def test_an_edit_to_the_intervals_over_images_reruns_what_scores_images_not_the_timing(
    rules: dict[str, dict],
) -> None:
    """The detection intervals are a module of their own: the bench and the profile, which
    read only the timing statistics, stay up to date when they change."""
    over_images = "src/pipeline/evaluation/image_bootstrap.py"
    for name in ("evaluate_run", "summarize", "report"):
        assert over_images in rules[name]["code"]
    for name in ("bench_backend", "profile_run"):
        assert over_images not in rules[name]["code"]
        assert "src/pipeline/stats.py" in rules[name]["code"]


def test_every_template_stylesheet_and_schema_is_an_input_of_the_rules_that_read_it(
    rules: dict[str, dict],
) -> None:
    data = {
        str(path.relative_to(REPO))
        for path in SOURCES.rglob("*")
        if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts
    }
    assert data
    templates = {path for path in data if "/report/" in path}
    assert templates <= set(rules["report"]["code"]) and templates <= set(rules["compare"]["code"])
    schemas = {path for path in data if "/schemas/" in path}
    assert schemas <= set(rules["train_run"]["code"])  # read by config and formats
    unclaimed = data - {path for rule in rules.values() for path in rule["code"]}
    assert not unclaimed


def write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / "pipeline" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "pipeline" / name).write_text(text)
    return root / "pipeline"


def test_the_graph_follows_lazy_relative_and_submodule_imports_but_not_type_checking_ones(
    tmp_path: Path,
) -> None:
    package = write_package(
        tmp_path,
        {
            "__init__.py": "",
            "__main__.py": "from pipeline.cli import main\n",
            "cli.py": "import json\n",
            "commands/__init__.py": "",
            "commands/run.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from pipeline import hints\n"
                "def main():\n    from pipeline import engine as e\n    from ..engine import deep\n"
            ),
            "engine/__init__.py": "from .helpers import tool\n",
            "engine/helpers.py": "",
            "engine/deep.py": "import pipeline.leaf\n",
            "leaf.py": "NAME = 'layout.css'\n",
            "layout.css": "body {}\n",
            "hints.py": "",
            "unused.py": "",
        },
    )
    graph = import_graph.Graph(package)
    closure = graph.closure(["pipeline.commands.run"])
    assert closure == {
        "pipeline",
        "pipeline.commands",
        "pipeline.commands.run",
        "pipeline.engine",
        "pipeline.engine.helpers",
        "pipeline.engine.deep",
        "pipeline.leaf",
    }
    files = {str(path.relative_to(package)) for path in graph.sources(["pipeline.leaf"])}
    assert files == {"__init__.py", "leaf.py", "layout.css"}


def test_a_cached_graph_of_the_package_is_the_graph_read_from_its_source_without_parsing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache" / "import-graph.json"
    fresh = import_graph.Graph(SOURCES)
    import_graph.Graph(SOURCES, cache)  # fills the cache
    assert cache.is_file()

    def no_parsing(*args: object) -> None:
        raise AssertionError("parsed a module whose syntax the cache holds")

    monkeypatch.setattr(import_graph, "read_syntax", no_parsing)
    cached = import_graph.Graph(SOURCES, cache)
    for command, (module, _) in cli.COMMANDS.items():
        entry = [import_graph.ENTRY_POINT, module]
        assert cached.closure(entry) == fresh.closure(entry), command
        assert cached.sources(entry) == fresh.sources(entry), command


def test_an_edit_that_keeps_a_modules_size_and_time_is_read_again_past_the_cache(
    tmp_path: Path,
) -> None:
    """What Snakemake reruns after an edit follows the graph: an entry is the file's bytes'."""
    package = write_package(
        tmp_path,
        {"__init__.py": "", "run.py": "import pipeline.aaaa\n", "aaaa.py": "", "bbbb.py": ""},
    )
    cache = tmp_path / "import-graph.json"
    assert import_graph.Graph(package, cache).closure(["pipeline.run"]) == {
        "pipeline",
        "pipeline.run",
        "pipeline.aaaa",
    }
    run = package / "run.py"
    before = run.stat()
    run.write_text("import pipeline.bbbb\n")
    os.utime(run, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert run.stat().st_size == before.st_size and run.stat().st_mtime_ns == before.st_mtime_ns
    assert import_graph.Graph(package, cache).closure(["pipeline.run"]) == {
        "pipeline",
        "pipeline.run",
        "pipeline.bbbb",
    }


@pytest.mark.parametrize("damage", ["not json", '{"version": 1}', "[]", "folder"])
def test_a_damaged_or_unwritable_cache_is_read_past_and_the_graph_read_from_source(
    tmp_path: Path, damage: str
) -> None:
    package = write_package(tmp_path, {"__init__.py": "", "run.py": "from . import leaf\n"})
    (package / "leaf.py").write_text("")
    cache = tmp_path / "cache" / "import-graph.json"
    if damage == "folder":  # a file where the cache's folder should be: nothing can be written
        cache.parent.write_text("")
    else:
        cache.parent.mkdir()
        cache.write_text(damage)
    graph = import_graph.Graph(package, cache)
    assert graph.closure(["pipeline.run"]) == {"pipeline", "pipeline.run", "pipeline.leaf"}
    if damage != "folder":
        assert import_graph.Graph(package, cache).imports("pipeline.run") == {
            "pipeline",
            "pipeline.leaf",
        }
        assert json.loads(cache.read_text())["entries"]  # rewritten whole


@pytest.fixture(scope="module")
def checked_copy(
    checked_env: tuple[Path, subprocess.CompletedProcess[str]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    """A copy of the repository whose environment check has run (env.json decides the runs)."""
    return copy_checked_env(checked_env, tmp_path_factory.mktemp("checked") / "repo")


@pytest.mark.slow
def test_the_shipped_train_target_benchmarks_its_backend_and_chooses_before_it_trains(
    checked_copy: Path,
) -> None:
    """precision: measured is the shipped default, so `snakemake train --config device=...` runs
    that backend's benchmark job (one process timing every precision and mode, the three
    training benchmarks among them) and the choice first, and nothing else."""
    result = snakemake(checked_copy, "train", "-n", "--config", "device=cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    counts = job_counts(result)
    assert counts.get("bench_backend") == 1 and counts.get("choose_precision") == 1, counts
    outputs = [
        line.split(":", 1)[1].strip().split(", ")
        for line in result.stdout.splitlines()
        if line.strip().startswith("output: results/bench/")
    ]
    assert outputs == [
        [
            f"results/bench/cpu-{precision}-{mode}.json"
            for precision in ("fp32", "fp16", "bf16")
            for mode in ("train", "infer")
        ]
    ]


@pytest.mark.slow
def test_editing_the_weight_average_puts_training_out_of_date_and_a_chart_does_not(
    checked_copy: Path,
) -> None:
    """On outputs that exist and are newer than every input: a dry run of one training run."""
    root = checked_copy
    args = ("--config", "precision=fp32")
    target = "results/train/cpu-fp32/train_summary.json"
    outputs = [f"resources/data/shapes/instances_{split}.json" for split in ("train", "val")]
    for name in [*outputs, target, "results/train/cpu-fp32/best.pth"]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("{}")
    before = snakemake(root, target, "-n", *args)
    assert "Nothing to be done" in before.stdout + before.stderr, before.stdout[-3000:]

    edit(root / "src/pipeline/report/charts.py")
    unrelated = snakemake(root, target, "-n", *args)
    assert "Nothing to be done" in unrelated.stdout + unrelated.stderr, unrelated.stdout[-3000:]

    edit(root / "src/pipeline/engine/ema.py")
    result = snakemake(root, target, "-n", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert planned_jobs(result) == {"train_run"}
    assert "Updated input files: src/pipeline/engine/ema.py" in result.stdout


def test_the_cache_lies_in_pipeline_cache_dir_where_set_else_in_the_users_cache_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv(import_graph.CACHE_DIR_ENV, str(tmp_path / "own"))
    assert import_graph.user_cache() == tmp_path / "own" / "import-graph.json"
    monkeypatch.delenv(import_graph.CACHE_DIR_ENV)
    assert import_graph.user_cache() == tmp_path / "xdg" / "pipeline" / "import-graph.json"
