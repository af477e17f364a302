"""benchmarks/report_time.py's split of `make report`: stages from Snakemake's benchmark files,
start-up from `python -X importtime`, each process attributed to the job Snakemake started."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from benchmark_modules import load

report_time = load("report_time")

HEADER = report_time.PROCESS_HEADER
LOG = f"""{HEADER}
import time:      1000 |       2000 | snakemake
import time:       500 |        500 |   snakemake.api
Building DAG of jobs...
[Sat Dec  5 06:00:00 2026]
localcheckpoint check_env:
    output: results/env.json
{HEADER}
import time:       100 |     300000 | torch
import time:        50 |    1200000 |   torch._C
import time:       100 |     100000 | pipeline.cli
Finished jobid: 1 (Rule: check_env)
[Sat Dec  5 06:00:05 2026]
rule summarize:
{HEADER}
import time:       100 |     250000 | pipeline.cli
06:00:06 INFO summary written
import time:       100 |     150000 | pipeline.summary.build
"""


def test_each_process_is_attributed_to_the_job_snakemake_started_last_with_its_top_level_imports() -> (
    None
):
    processes = report_time.import_times(LOG)["processes"]
    assert [p["rule"] for p in processes] == ["snakemake", "check_env", "summarize"]
    snakemake, check_env, summarize = processes
    assert snakemake["imports_s"] == pytest.approx(0.002)  # nested lines are in the cumulative
    assert check_env["imports_s"] == pytest.approx(0.4) and check_env["torch_s"] == pytest.approx(
        0.3
    )
    # an import done lazily, after the command logged, still counts for its process
    assert summarize["imports_s"] == pytest.approx(0.4) and summarize["torch_s"] == 0


def test_stages_sum_the_wall_seconds_of_every_job_of_a_rule(tmp_path: Path) -> None:
    stats = tmp_path / "results" / "job_stats"
    header = "s\th:m:s\tmax_rss\n"
    for name, seconds in (("bench/cpu", 10.5), ("bench/cuda", 8.0)):
        (stats / name).parent.mkdir(parents=True, exist_ok=True)
        (stats / f"{name}.tsv").write_text(f"{header}{seconds}\t0:00:10\t100\n")
    (stats / "choice").mkdir()
    (stats / "choice" / "cpu.tsv").write_text(f"{header}2.0\t0:00:02\t50\n")
    (stats / "report.tsv").write_text(f"{header}3.25\t0:00:03\t80\n")
    assert report_time.job_stats(tmp_path) == {
        "bench_backend": {"jobs": 2, "s": 18.5},
        "choose_precision": {"jobs": 1, "s": 2.0},
        "report": {"jobs": 1, "s": 3.25},
    }


def test_the_copy_is_a_clone_of_the_commit_with_the_uncommitted_files_over_it(
    tmp_path: Path,
) -> None:
    """So that the run's summary.json names the commit it ran (git_state in the copy)."""
    source = tmp_path / "checkout"
    source.mkdir()

    def git(*args: str, cwd: Path = source) -> str:
        return subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=cwd, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip

    git("init", "--quiet")
    (source / ".gitignore").write_text("results/\n")
    for name in ("kept.txt", "edited.txt", "deleted.txt"):
        (source / name).write_text("committed\n")
    git("add", ".")
    git("commit", "--quiet", "-m", "first")
    (source / "edited.txt").write_text("edited\n")
    (source / "deleted.txt").unlink()
    (source / "new.txt").write_text("untracked\n")
    (source / "results").mkdir()
    (source / "results" / "old.json").write_text("{}\n")

    copy = report_time.copy_repository(tmp_path / "copy", source)

    assert git("rev-parse", "HEAD", cwd=copy) == git("rev-parse", "HEAD")
    assert (copy / "edited.txt").read_text() == "edited\n"
    assert (copy / "new.txt").read_text() == "untracked\n"
    assert not (copy / "deleted.txt").exists()
    assert not (copy / "results").exists()
    changed = git("status", "--porcelain", cwd=copy).splitlines()
    assert sorted(changed) == sorted(git("status", "--porcelain").splitlines())
