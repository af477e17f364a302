"""What each install holds: `make report` installs the pipeline alone, `make test` adds the dev
extra, which pulls in the cluster extra (the SLURM executor plugin).

The plugin runs `scontrol show config` (10 s timeout) when Snakemake imports it, and Snakemake
imports every installed executor plugin at each start, whichever executor runs. Where a SLURM
client is installed but no controller answers, that is a 10 s wait at every start; an install
without the cluster extra never pays it. The Makefile is checked with `make -n`, which runs
nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
import tomllib
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
EXTRAS = PROJECT["optional-dependencies"]
SLURM_PLUGIN = "snakemake-executor-plugin-slurm"


def requirement_names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(text).name) for text in requirements}


def test_the_slurm_plugin_comes_only_with_the_cluster_extra_which_dev_pulls_in() -> None:
    assert SLURM_PLUGIN not in requirement_names(PROJECT["dependencies"])
    assert SLURM_PLUGIN in requirement_names(EXTRAS["cluster"])
    own_extras = [Requirement(text) for text in EXTRAS["dev"] if text.startswith("pipeline[")]
    assert [requirement.extras for requirement in own_extras] == [{"cluster"}]


# --- the Makefile ------------------------------------------------------------------------------


def pip_installs(folder: Path, target: str) -> list[str]:
    """What `pip install` would be given by `make -n TARGET` in `folder` (nothing runs)."""
    plan = subprocess.run(
        ["make", "-n", target], cwd=folder, capture_output=True, text=True, check=True
    ).stdout
    return [
        line.split("pip install ", 1)[1] for line in plan.splitlines() if "pip install " in line
    ]


def made(folder: Path, *names: str, after_pyproject: bool = True) -> None:
    """Files under .venv/ as a finished make step leaves them, newer or older than pyproject.toml."""
    reference = (folder / "pyproject.toml").stat().st_mtime
    when = reference + (60 if after_pyproject else -60)
    for name in names:
        path = folder / ".venv" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        os.utime(path, (when, when))


def test_make_report_installs_the_pipeline_alone_and_make_test_adds_the_dev_extra_once(
    tmp_path: Path,
) -> None:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    dev = '-e ".[dev]"'

    # a fresh clone
    assert pip_installs(tmp_path, "report") == ["-e ."]
    assert pip_installs(tmp_path, "test") == [dev]
    # after `make report`: `make test` adds the dev extra
    made(tmp_path, "bin/python", ".installed")
    assert pip_installs(tmp_path, "report") == []
    assert pip_installs(tmp_path, "test") == [dev]
    # after `make test` as well: nothing to install for either
    made(tmp_path, ".installed-dev")
    assert pip_installs(tmp_path, "report") == []
    assert pip_installs(tmp_path, "test") == []
    # pyproject.toml edited: each installs again, `make test` in one pip run
    made(tmp_path, ".installed", ".installed-dev", after_pyproject=False)
    assert pip_installs(tmp_path, "report") == ["-e ."]
    assert pip_installs(tmp_path, "test") == [dev]


# --- the SLURM plugin's probe at every Snakemake start -----------------------------------------


def slurm_client_without_controller(folder: Path, scontrol_then: str) -> tuple[dict, Path]:
    """An environment whose PATH has stand-ins for SLURM's client tools: `sinfo` and `squeue`
    answer, `scontrol` records that it ran and then does `scontrol_then` (a controller that
    does not answer makes the real one wait). Returns the environment and the record's path."""
    tools = folder / "slurm-client"
    tools.mkdir(parents=True)
    called = folder / "scontrol-was-called"
    scripts = {
        "sinfo": "exit 0",
        "squeue": "exit 0",
        "scontrol": f"echo \"$@\" >> '{called}'\n{scontrol_then}",
    }
    for name, body in scripts.items():
        (tools / name).write_text(f"#!/bin/sh\n{body}\n")
        (tools / name).chmod(0o755)
    return {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"}, called


def nothing_to_do(folder: Path) -> Path:
    """A workflow whose one output exists: a Snakemake run there has nothing to do."""
    workflow = folder / "workflow"
    workflow.mkdir()
    (workflow / "Snakefile").write_text(
        'rule done:\n    output:\n        "done.txt"\n    shell:\n        "touch {output}"\n'
    )
    (workflow / "done.txt").touch()
    return workflow


def run_snakemake(python: Path | str, workflow: Path, env: dict) -> tuple[float, str]:
    started = time.monotonic()
    result = subprocess.run(
        [str(python), "-m", "snakemake", "--cores", "1"],
        cwd=workflow,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    seconds = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Nothing to be done" in result.stdout + result.stderr
    return seconds, result.stderr


def without_the_cluster_extra(target: Path) -> Path:
    """A venv holding what `pip install -e .` (make report) leaves: this venv's packages less
    those of the cluster extra (the SLURM plugin and its slurm-jobstep plugin, whose modules
    share its name). Returns its python."""
    venv.EnvBuilder(symlinks=True).create(target)
    site = Path(sysconfig.get_paths()["purelib"])
    target_site = target / site.relative_to(sys.prefix)
    cluster_modules = tuple(name.replace("-", "_") for name in requirement_names(EXTRAS["cluster"]))
    for entry in site.iterdir():
        if not entry.name.lower().startswith(cluster_modules):
            (target_site / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    return target / "bin" / "python"


@pytest.mark.slow
def test_without_the_cluster_extra_snakemake_starts_without_waiting_for_scontrol(
    tmp_path: Path,
) -> None:
    workflow = nothing_to_do(tmp_path)
    # This venv has the cluster extra: its plugin calls the stand-in scontrol at start.
    env, called = slurm_client_without_controller(tmp_path / "failing", "exit 1")
    run_snakemake(sys.executable, workflow, env)
    assert called.read_text().split() == ["show", "config"], "the stand-ins miss the plugin's probe"

    # Installed as `make report` installs it, beside a scontrol that would hang for 30 s (the
    # plugin would wait 10 s of them): it starts as fast as without any SLURM client.
    local_python = without_the_cluster_extra(tmp_path / "local-venv")
    alone, _ = run_snakemake(local_python, workflow, dict(os.environ))
    env, called = slurm_client_without_controller(tmp_path / "hanging", "exec sleep 30")
    beside_slurm, stderr = run_snakemake(local_python, workflow, env)
    assert not called.exists(), "scontrol was called without the cluster extra"
    assert beside_slurm < alone + 5, (
        f"{beside_slurm:.1f} s beside the SLURM client, {alone:.1f} s without:\n{stderr[-2000:]}"
    )


def test_no_module_of_the_package_imports_torchvision_when_imported() -> None:
    """Importing torchvision imports torch's compiler (torch._dynamo): seconds at the start of
    every command and Snakemake job. It is imported where it is used (a resize, the library
    augmentations, a ResNet, the VOC matcher), never by importing a module: a run on images at
    the input size, with the default augmentation, starts without it."""
    code = (
        "import importlib, pkgutil, sys, pipeline\n"
        "for module in pkgutil.walk_packages(pipeline.__path__, 'pipeline.'):\n"
        "    if not module.name.endswith('__main__'):\n"
        "        importlib.import_module(module.name)\n"
        "print(sorted(name for name in sys.modules if name.split('.')[0] == 'torchvision'))"
    )
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert found.stdout.strip() == "[]", found.stdout
