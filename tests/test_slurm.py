"""The workflow through a real single-node SLURM cluster (scripts/slurm_local.sh).

It runs the tiny test config with the sweep of tests/test_workflow.py through
`snakemake --profile workflow/profiles/slurm-local`, and checks that the jobs really went
through SLURM and that the report compares the swept runs; then a second workflow run, in a
results folder of its own and on the cluster's other partition, ends in one comparison page
of the two (results/compare.html). Starting that cluster installs
Debian's SLURM packages and runs their daemons on this machine (the teardown stops them and
purges what it installed), so it runs only where
PIPELINE_REQUIRE_SLURM=1 asks for it (.ci/run sets it), and then fails rather than skips when
it cannot (no root, no Linux, no apt-get). The site-profile dry run needs only the plugin.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from report_page import Page
from test_workflow import CI_CONFIG, REPO, SWEEP, copy_repository, snakemake, sweep_runs

pytestmark = pytest.mark.slow
WORKFLOW_TIMEOUT_S = 900  # hard bound: a stuck status check must not hang CI
REQUIRE = "PIPELINE_REQUIRE_SLURM"
PLUGIN = "snakemake_executor_plugin_slurm"
NO_PLUGIN = "snakemake-executor-plugin-slurm is not installed (pip install -e '.[cluster]')"


def unavailable_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return "a local SLURM cluster needs Linux"
    if os.geteuid() != 0:
        return "starting SLURM's daemons needs root"
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        return "SLURM is not installed and there is no apt-get to install it"
    if importlib.util.find_spec(PLUGIN) is None:
        return NO_PLUGIN
    return None


@pytest.fixture(scope="module")
def cluster():
    if os.environ.get(REQUIRE) != "1":
        pytest.skip(
            "it installs SLURM's packages and starts their daemons on this machine; run it "
            f"where that is fine (Linux, root, apt-get) with {REQUIRE}=1, as .ci/run does"
        )
    reason = unavailable_reason()
    if reason:
        pytest.fail(f"{REQUIRE}=1 but {reason}")
    script = REPO / "scripts" / "slurm_local.sh"
    env = {**os.environ, "SLURM_LOCAL_CPUS": "4"}
    # left installed, SLURM's client makes every later snakemake call here wait 10 s
    teardown = "stop" if shutil.which("slurmctld") else "uninstall"
    try:
        started = subprocess.run(
            [str(script), "start"], env=env, capture_output=True, text=True, timeout=600
        )
        assert started.returncode == 0, started.stderr
        yield
    finally:
        subprocess.run([str(script), teardown], capture_output=True, timeout=600)


@pytest.fixture(scope="module")
def swept(cluster, tmp_path_factory: pytest.TempPathFactory):
    root = copy_repository(tmp_path_factory.mktemp("slurm-repo"))
    started = time.monotonic()
    result = snakemake(
        root,
        "results/report.html",
        "--profile",
        "workflow/profiles/slurm-local",
        "--configfile",
        CI_CONFIG,
        "--config",
        SWEEP,
        timeout=WORKFLOW_TIMEOUT_S,
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    print(f"\nworkflow through SLURM: {elapsed:.0f} s")
    return root, result


def test_every_job_ran_as_a_slurm_job(swept) -> None:
    root, result = swept
    output = result.stdout + result.stderr
    submitted = re.findall(r"submitted with SLURM jobid (\d+)", output)
    jobs = re.findall(r"^\s*(?:local)?(?:rule|checkpoint) (\w+):", output, re.MULTILINE)
    assert submitted and len(submitted) == len(set(submitted))
    assert len(submitted) == len(jobs)  # not one job ran outside SLURM
    logs = list((root / ".snakemake" / "slurm_logs").rglob("*.log"))
    assert {path.stem for path in logs} == set(submitted)


def test_the_report_compares_the_swept_runs(swept) -> None:
    root, _ = swept
    trained = {p.parent.name for p in (root / "results" / "train").glob("*/train_summary.json")}
    assert trained == sweep_runs(root)  # named after the precision precision=measured chose
    page = Page()
    page.feed((root / "results" / "report.html").read_text())
    for run in trained:
        assert run in page.text("training")
        assert run in page.text("evaluation")


@pytest.fixture(scope="module")
def second_partition(swept, tmp_path_factory: pytest.TempPathFactory):
    """The tiny config once more, in a copy with its own results folder, on partition
    `second` (scripts/slurm_local.sh), ending in results/compare.html of the two runs'
    summaries: one "machine" per partition setting."""
    first, _ = swept
    root = copy_repository(tmp_path_factory.mktemp("slurm-second"))
    compared = f"compare=[{first / 'results' / 'summary.json'}, results/summary.json]"
    result = snakemake(
        root,
        "results/compare.html",
        "--profile",
        "workflow/profiles/slurm-local",
        "--default-resources",
        "slurm_partition=second",
        "mem_mb=1000",
        "runtime=10",
        "--configfile",
        CI_CONFIG,
        "--config",
        compared,
        timeout=WORKFLOW_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return root, result


def test_two_partitions_runs_end_in_one_comparison_page(swept, second_partition) -> None:
    first, _ = swept
    root, result = second_partition
    output = result.stdout + result.stderr
    submitted = re.findall(r"submitted with SLURM jobid (\d+)", output)
    jobs = re.findall(r"^\s*(?:local)?(?:rule|checkpoint) (\w+):", output, re.MULTILINE)
    assert "compare" in jobs and len(submitted) == len(jobs)  # every job through SLURM
    page = Page()
    page.feed((root / "results" / "compare.html").read_text())
    machines = page.text("machines")
    assert (
        str(first / "results" / "summary.json") in machines and "results/summary.json" in machines
    )
    assert "Not compared" not in page.text("speed") + page.text("training")  # the same settings
    second_runs = {p.parent.name for p in (root / "results" / "train").glob("*/train_summary.json")}
    for run in sweep_runs(first) | second_runs:  # both runs' trainings, side by side
        assert run in page.text("training")


def planned_job_blocks(dry_run_output: str) -> list[dict[str, str]]:
    """Each job of a dry run as {'rule', 'output', 'resources'} read from its printed block."""
    blocks = []
    for chunk in re.split(r"\n(?=(?:local)?(?:rule|checkpoint) \w+:)", dry_run_output):
        header = re.match(r"(?:local)?(?:rule|checkpoint) (\w+):", chunk)
        if not header:
            continue
        fields = dict(re.findall(r"^    (\w+): (.*)$", chunk, re.MULTILINE))
        blocks.append({"rule": header.group(1), "output": fields.get("output", ""),
                       "resources": fields.get("resources", "")})  # fmt: skip
    return blocks


def site_plan(folder: Path, *settings: str, cuda_env: bool = True) -> list[dict[str, str]]:
    """The site template's dry run of the report, with its placeholders, in a copy of the
    repository in `folder`, `settings` given to --config, as job blocks.

    `cuda_env`: a made-up env.json of a CUDA machine stands in for the check_env checkpoint's
    output; `--rerun-triggers mtime` keeps Snakemake from redoing it for want of metadata.
    """
    if importlib.util.find_spec(PLUGIN) is None:
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{REQUIRE}=1 but {NO_PLUGIN}")
        pytest.skip(NO_PLUGIN)
    root = copy_repository(folder)
    options = []
    if cuda_env:
        (root / "results").mkdir()
        shutil.copy(REPO / "tests" / "config" / "env_cuda.json", root / "results" / "env.json")
        options = ["--rerun-triggers", "mtime"]
    result = snakemake(
        root, "results/report.html", "-n", "--profile", "workflow/profiles/slurm", *options,
        "--config", *settings,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return planned_job_blocks(result.stdout)


@pytest.fixture(scope="module")
def cuda_site_plan(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    """The site template's dry run for a CUDA machine and six CPUs a compute job
    (cluster.threads), as job blocks."""
    return site_plan(
        tmp_path_factory.mktemp("site"),
        "device=cuda",
        "bench={backends: [cuda, cpu]}",
        "precision=auto",  # measured (the default) names its runs only after the choice job
        "cluster={threads: 6}",
    )


def test_gpu_requests_appear_only_on_cuda_jobs_in_a_site_dry_run(
    cuda_site_plan: list[dict[str, str]],
) -> None:
    """The site template dry-runs with its placeholders; cuda jobs ask for a GPU, cpu jobs not."""
    jobs = cuda_site_plan
    gpu_jobs = [job for job in jobs if re.search(r"\bgpu=1\b", job["resources"])]
    cuda_jobs = [job for job in jobs if "/cuda" in job["output"]]
    assert {"bench_backend", "train_run", "evaluate_run", "profile_run"} <= {
        j["rule"] for j in cuda_jobs
    }
    assert {id(job) for job in cuda_jobs} <= {id(job) for job in gpu_jobs}
    cpu_jobs = [
        job for job in jobs if "/cpu-" in job["output"] or job["rule"] in ("prepare_data", "report")
    ]
    assert cpu_jobs and not [job for job in cpu_jobs if "gpu" in job["resources"]]
    exclusive = [job for job in jobs if "--exclusive" in job["resources"]]
    assert {job["rule"] for job in exclusive} == {"bench_backend", "profile_run"}


def test_compute_jobs_ask_the_cluster_for_cluster_threads_cpus_in_a_site_dry_run(
    cuda_site_plan: list[dict[str, str]],
) -> None:
    """The SLURM plugin gives sbatch and srun a job's cpus_per_task before its threads, which
    Snakemake caps at --cores (1 by workflow/profiles/default, under --profile too): with
    threads alone every job asked for one CPU, whatever cluster.threads said."""
    compute = {"bench_backend", "train_run", "evaluate_run", "profile_run"}
    cpus = {
        job["rule"]: re.findall(r"\bcpus_per_task=(\d+)", job["resources"])
        for job in cuda_site_plan
    }
    assert compute <= set(cpus)
    assert all(cpus[rule] == ["6"] for rule in compute)
    assert not [rule for rule, found in cpus.items() if rule not in compute and found]


def test_the_precision_choice_of_a_cuda_backend_asks_for_no_gpu_in_a_site_dry_run(
    tmp_path: Path,
) -> None:
    """choose-precision reads the benchmark files and env.json, never the device: a GPU request
    would queue a job of a second for a GPU node."""
    plan = site_plan(tmp_path, "device=cuda", "bench={backends: [cuda]}")
    jobs = {job["rule"]: job["resources"] for job in plan}
    assert re.search(r"\bgpu=1\b", jobs["bench_backend"])
    assert "gpu" not in jobs["choose_precision"]


def test_the_environment_check_asks_for_the_cpus_of_a_compute_job_in_a_site_dry_run(
    tmp_path: Path,
) -> None:
    """env.json's torch threads (and the CPUs `auto` sees) name the machine in the report and in
    compare: with one CPU, a summary said "torch uses 1 thread" of jobs that used cluster.threads."""
    plan = site_plan(tmp_path, "cluster={threads: 6}", cuda_env=False)
    jobs = {job["rule"]: job["resources"] for job in plan}
    assert re.findall(r"\bcpus_per_task=(\d+)", jobs["check_env"]) == ["6"]
