"""Report time: how long `make report` takes after set-up, and where the time goes.

Runs what `make report` runs (`snakemake --cores N results/report.html`, the shipped config) in
a fresh clone of the checkout's commit with its uncommitted files laid over it (no results; the
run's summary names the commit), with that copy's `src` first on PYTHONPATH, and splits the wall time:

- by stage: the wall time of each rule's jobs, from the `benchmark:` files the workflow writes
  (results/job_stats/);
- Snakemake's own share: the wall time no job accounts for (parsing the workflow, building
  and re-evaluating the DAG after each checkpoint, scheduling, bookkeeping), per job;
- start-up per job: the seconds each job's Python spends importing before it works, from
  `python -X importtime` of every process (PYTHONPROFILEIMPORTTIME=1, which adds a little to
  every process: --no-importtime turns it off), with the part torch takes.

Target (issue 44's acceptance): the whole at most 180 s on a 2-core CPU with native bf16.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import harness

from pipeline import timing
from pipeline.errors import PipelineError

NAME = "report_time"
TARGET_S = 180.0
SNAKEMAKE = Path(sys.executable).parent / "snakemake"
# "import time:       712 |      12345 | torch" (self us | cumulative us | name, indented by depth)
IMPORT_LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \| ( *)(\S+)")
PROCESS_HEADER = "import time: self [us] | cumulative | imported package"
JOB_HEADER = re.compile(r"^(?:local)?(?:rule|checkpoint) (\w+):$")


def parse_args(argv: list[str]):
    parser = harness.parser(NAME, __doc__)
    parser.add_argument("--cores", type=int, default=1, help="as make report's CORES (default 1)")
    parser.add_argument(
        "--no-importtime",
        action="store_true",
        help="do not profile imports (no start-up split, and nothing added to any process)",
    )
    parser.add_argument(
        "--keep",
        type=Path,
        help="copy the finished repository copy here (results, logs) to look at",
    )
    parser.add_argument(
        "settings",
        nargs="*",
        metavar="key=value",
        help="--config settings for the run (none: the shipped config)",
    )
    args = parser.parse_args(argv)
    harness.check_positive(parser, args, "cores")
    return args


def copy_repository(target: Path, source: Path = harness.REPO) -> Path:
    """A fresh clone of the checkout's commit with its uncommitted files laid over it, so that
    the run's summary names the commit and counts the files that differ from it, as it would in
    the checkout itself."""
    subprocess.run(
        ["git", "clone", "--quiet", "--shared", "--no-checkout", str(source), str(target)],
        check=True,
    )
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=source, capture_output=True, text=True, check=True
    ).stdout.strip()
    subprocess.run(["git", "checkout", "--quiet", "--detach", head], cwd=target, check=True)
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=source,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    for name in listed:
        here, there = source / name, target / name
        if here.is_file() or here.is_symlink():
            there.parent.mkdir(parents=True, exist_ok=True)
            there.unlink(missing_ok=True)
            shutil.copy2(here, there, follow_symlinks=False)
        elif there.is_file() or there.is_symlink():
            there.unlink()  # deleted in the checkout, not yet committed
    return target


def job_stats(root: Path) -> dict[str, dict[str, Any]]:
    """Rule -> {jobs, s}: the wall seconds of its jobs' commands (Snakemake's benchmark files)."""
    stages: dict[str, dict[str, Any]] = defaultdict(lambda: {"jobs": 0, "s": 0.0})
    for path in sorted((root / "results" / "job_stats").rglob("*.tsv")):
        relative = path.relative_to(root / "results" / "job_stats")
        name = relative.parts[0].removesuffix(".tsv")
        rule = STAGE_OF_FILE.get(name, name)
        with path.open(encoding="utf-8") as handle:
            for row in csv.DictReader(handle, delimiter="\t"):
                stages[rule]["jobs"] += 1
                stages[rule]["s"] += float(row["s"])
    return dict(stages)


# results/job_stats/<name>[/...].tsv -> the rule that writes it
STAGE_OF_FILE = {
    "bench": "bench_backend",
    "train": "train_run",
    "evaluate": "evaluate_run",
    "profile": "profile_run",
    "predict": "predict_run",
    "choice": "choose_precision",
}


def import_times(log: str) -> dict[str, Any]:
    """Per process, the seconds of its top-level imports and of torch's, attributed to the rule
    whose header Snakemake printed last (`snakemake` itself before the first)."""
    current = "snakemake"
    processes: list[dict[str, Any]] = []
    for line in log.splitlines():
        header = JOB_HEADER.match(line.strip())
        if header:
            current = header.group(1)
        elif line.startswith(PROCESS_HEADER):  # every interpreter prints it first
            processes.append({"rule": current, "imports_s": 0.0, "torch_s": 0.0})
        elif processes and (match := IMPORT_LINE.match(line)):
            _, cumulative, indent, name = match.groups()
            if not indent:  # top level: its cumulative time holds every nested import
                processes[-1]["imports_s"] += int(cumulative) / 1e6
            if name == "torch":  # imported once, at whatever depth
                processes[-1]["torch_s"] += int(cumulative) / 1e6
    return {"processes": processes}


def run_chain(root: Path, args, log: Path) -> float:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), *filter(None, [env.get("PYTHONPATH")])])
    if not args.no_importtime:
        env["PYTHONPROFILEIMPORTTIME"] = "1"
    command = [str(SNAKEMAKE), "--cores", str(args.cores), "results/report.html"]
    if args.settings:
        command += ["--config", *args.settings]
    start = time.perf_counter()
    with log.open("w", encoding="utf-8") as out:
        done = subprocess.run(command, cwd=root, stdout=out, stderr=subprocess.STDOUT, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        tail = "\n".join(
            line
            for line in log.read_text(encoding="utf-8").splitlines()
            if not line.startswith("import time:")
        ).splitlines()[-15:]
        raise PipelineError(
            f"{' '.join(command)} exited {done.returncode} in {root}; the end of its output:\n"
            + "\n".join(tail)
        )
    return wall


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    print(
        f"{NAME}: snakemake --cores {args.cores} results/report.html in a fresh copy of the "
        f"repository ({'the shipped config' if not args.settings else ' '.join(args.settings)})",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="report-time-") as tmp:
        root = copy_repository(Path(tmp) / "repo")
        log = Path(tmp) / "snakemake.log"
        conditions = timing.RunConditions()
        wall = run_chain(root, args, log)
        conditions = conditions.finish()
        stages = job_stats(root)
        imports = import_times(log.read_text(encoding="utf-8"))
        choices = sorted((root / "results" / "train").glob("*/train_summary.json"))
        runs = [path.parent.name for path in choices]
        if args.keep:
            shutil.copytree(root, args.keep, dirs_exist_ok=True)
            shutil.copy2(log, args.keep / "report_time.log")
    harness.warn_if_loaded(conditions, "the run")

    jobs = sum(stage["jobs"] for stage in stages.values())
    in_jobs = sum(stage["s"] for stage in stages.values())
    own = wall - in_jobs
    by_rule: dict[str, dict[str, float]] = defaultdict(lambda: {"n": 0, "s": 0.0, "torch": 0.0})
    for process in imports["processes"]:
        entry = by_rule[process["rule"]]
        entry["n"] += 1
        entry["s"] += process["imports_s"]
        entry["torch"] += process["torch_s"]
    job_imports = {rule: entry for rule, entry in by_rule.items() if rule != "snakemake"}
    import_s = sum(entry["s"] for entry in job_imports.values())
    torch_s = sum(entry["torch"] for entry in job_imports.values())

    rows = [
        [
            rule,
            stage["jobs"],
            f"{stage['s']:.1f}",
            f"{stage['s'] / wall:.0%}",
            f"{job_imports[rule]['s']:.1f}" if rule in job_imports else "n/a",
        ]
        for rule, stage in sorted(stages.items(), key=lambda item: -item[1]["s"])
    ]
    rows.append(["Snakemake itself (no job)", "", f"{own:.1f}", f"{own / wall:.0%}", ""])
    print(harness.table(("stage", "jobs", "wall s", "share", "imports s"), rows))
    print(f"runs trained: {', '.join(runs) or 'none'}")
    print(
        f"{jobs} jobs; Snakemake's own time {own:.1f} s = {own / max(jobs, 1):.2f} s per job; "
        f"job start-up (imports) {import_s:.1f} s = {import_s / max(jobs, 1):.2f} s per job, "
        f"of which torch {torch_s:.1f} s"
    )
    passed, line = harness.verdict("make report wall time (s)", wall, TARGET_S)
    print(line)

    figures = [
        harness.figure(
            "wall_s",
            "make report after set-up: snakemake --cores N results/report.html, wall seconds",
            wall,
            "s",
            target=("<=", TARGET_S),
        ),
        harness.figure("jobs", "jobs in the default chain", jobs, "count"),
        harness.figure(
            "snakemake.own_s", "wall seconds no job accounts for (Snakemake itself)", own, "s"
        ),
        harness.figure(
            "snakemake.own_per_job_s", "Snakemake's own seconds per job", own / max(jobs, 1), "s"
        ),
    ]
    for rule, stage in sorted(stages.items()):
        figures.append(
            harness.figure(
                f"stage.{rule}.s",
                f"{rule}: wall seconds of its {stage['jobs']} job(s)",
                stage["s"],
                "s",
            )
        )
    if not args.no_importtime:
        figures += [
            harness.figure(
                "startup.imports_s",
                "every job's Python imports before it works, summed (python -X importtime)",
                import_s,
                "s",
            ),
            harness.figure(
                "startup.imports_per_job_s", "imports per job", import_s / max(jobs, 1), "s"
            ),
            harness.figure("startup.torch_s", "of which importing torch, summed", torch_s, "s"),
        ]
        for rule, entry in sorted(job_imports.items()):
            figures.append(
                harness.figure(
                    f"startup.{rule}.imports_s",
                    f"{rule}: imports of its {int(entry['n'])} process(es), summed",
                    entry["s"],
                    "s",
                )
            )
        if "snakemake" in by_rule:
            figures.append(
                harness.figure(
                    "startup.snakemake.imports_s",
                    "Snakemake's own imports (the workflow's included)",
                    by_rule["snakemake"]["s"],
                    "s",
                )
            )
    flags = harness.condition_flags(conditions, "the run")
    flags.append(
        f"1-minute load average {conditions['load_1m_start']} at the start, "
        f"{conditions['load_1m_end']} at the end, on {conditions['cpu_count']} CPUs"
    )
    if not args.no_importtime:
        flags.append("python -X importtime was on in every process: it adds a little to each")
    if args.settings:
        flags.append(f"not the shipped config: --config {' '.join(args.settings)}")
    settings = {"cores": args.cores, "config": args.settings, "runs": runs}
    harness.write_record(args, harness.record(NAME, figures, settings=settings, flags=flags))
    record = {
        "benchmark": NAME,
        "wall_s": wall,
        "stages": stages,
        "imports": imports,
        "conditions": conditions,
    }
    return harness.finish(args.out, record, passed, args.check)


if __name__ == "__main__":
    harness.run(main)
