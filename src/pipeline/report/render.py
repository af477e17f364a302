"""The page: one view model (plain dicts) per section, rendered by the Jinja2 templates under
templates/ with autoescaping on, and written atomically.

The answer, the decisions and the run tables are the summary's (pipeline.summary); the charts,
the images, the profile and the provenance come from the results folder itself. Python shapes
the data (here, in bench_views.py and in run_views.py); the markup and the wording around the
data live in the templates, and every string from a results file reaches the page escaped by
Jinja2.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from pipeline import atomic
from pipeline.report import charts
from pipeline.report.bench_views import (
    amp_policy_view,
    answer_view,
    benchmarks_view,
    workflow_command,
)
from pipeline.report.formatting import backend_label, yes_no
from pipeline.report.run_views import evaluation_view, profile_view, training_view
from pipeline.report.templating import stylesheet, templates
from pipeline.summary.build import summary_of
from pipeline.summary.load import Results, load_results, modified_time
from pipeline.summary.read import read_summary

log = logging.getLogger("pipeline")

SECTIONS = {  # id: heading, in page order; each has its template sections/<id>.html.j2
    "answer": "Answer",
    "environment": "Environment",
    "benchmarks": "Benchmarks",
    "amp-policy": "Precision policy",
    "training": "Training",
    "evaluation": "Evaluation",
    "profile": "Inference profile",
    "provenance": "Provenance",
}


def build(
    results_dir: str | Path,
    out: str | Path,
    config: dict[str, Any] | None = None,
    invocation: dict[str, Any] | None = None,
    summary_path: str | Path | None = None,
) -> Path:
    """Read the summary and the results under `results_dir` and write the report to `out`
    atomically; `invocation` (how the workflow was called) goes into the commands the report
    gives. Without `summary_path`, <results_dir>/summary.json is read where it exists, and the
    folder is summarised here (by pipeline.summary, writing nothing) where it does not."""
    results = load_results(Path(results_dir))
    default = results.root / "summary.json"
    if summary_path is None and not default.exists():
        log.info("no %s: summarising the results folder for this report", default)
        summary = summary_of(results, config)
    else:
        path = Path(summary_path) if summary_path is not None else default
        summary = read_summary(path)
        results.files[path] = summary["created"]
    out = Path(out)
    page = render(results, summary, config, out, datetime.now(UTC), invocation)
    return atomic.write_text(out, page)


def render(
    results: Results,
    summary: dict[str, Any],
    config: dict[str, Any] | None,
    out: Path,
    generated: datetime,
    invocation: dict[str, Any] | None = None,
) -> str:
    """The page as HTML; `out` is where it will be written (links are relative to it)."""
    colors = charts.run_colors(results.runs)
    views = {
        "answer": answer_view(summary, invocation),
        "environment": environment_view(results.env),
        "benchmarks": benchmarks_view(summary["benchmarks"]),
        "amp-policy": amp_policy_view(summary, config),
        "training": training_view(results.runs, summary["runs"], colors),
        "evaluation": evaluation_view(results.runs, summary["runs"], config),
        "profile": profile_view(results.runs, colors, out),
        "provenance": provenance_view(results, summary, config, invocation),
    }
    sections = [{"id": id_, "title": title, "view": views[id_]} for id_, title in SECTIONS.items()]
    page = templates().get_template("page.html.j2")
    return page.render(
        sections=sections, root=results.root, generated=generated, stylesheet=stylesheet()
    )


# ---- environment and provenance ----------------------------------------------------------


def environment_view(env: dict[str, Any] | None) -> dict[str, Any] | None:
    if not env:
        return None
    backends = [
        {
            "name": name,
            "available": bool(entry.get("available")),
            "amp_default": entry.get("amp_default"),
            "amp_supported": entry.get("amp_supported"),
            "description": entry.get("description"),
            "reason": entry.get("reason"),
        }
        for name, entry in (env.get("backends") or {}).items()
    ]
    platform = env.get("platform") or {}
    versions = env.get("versions") or {}
    facts = [
        ("auto chose", backend_label(env.get("auto"))),
        (
            "CPU",
            f"{platform.get('cpu_model', 'n/a')}, {platform.get('cpu_count', 'n/a')} cores; torch uses {platform.get('torch_threads', 'n/a')} threads",
        ),
        ("OS", platform.get("os", "n/a")),
        (
            "versions",
            ", ".join(f"{key} {value}" for key, value in versions.items() if value) or "n/a",
        ),
        *cpu_native_facts(env),
        *gpu_facts(env),
    ]
    return {"backends": backends, "facts": facts}


def cpu_native_facts(env: dict[str, Any]) -> list[tuple[str, str]]:
    """Whether the CPU computes bf16/fp16 natively: what lets precision=measured use them on it."""
    return [
        (
            f"CPU native {precision}",
            f"{'yes' if found.get('native') else 'no'} ({found.get('evidence', 'n/a')})",
        )
        for precision, found in (env.get("cpu_native") or {}).items()
        if isinstance(found, dict)
    ]


def gpu_facts(env: dict[str, Any]) -> list[tuple[str, str]]:
    facts = []
    cuda = env.get("cuda") or {}
    for gpu in cuda.get("devices") or []:
        facts.append(
            (
                f"cuda:{gpu.get('index')}",
                f"{gpu.get('name')}, {gpu.get('total_memory_gib')} GiB, compute capability {gpu.get('capability')}, {gpu.get('multiprocessors')} SMs",
            )
        )
    if cuda.get("built"):
        visible = cuda.get("visible_devices_env")
        facts.append(
            (
                "CUDA build",
                f"torch built for CUDA {cuda.get('version')}, cuDNN {cuda.get('cudnn') or 'n/a'}; CUDA_VISIBLE_DEVICES {'unset' if visible is None else repr(visible)}",
            )
        )
    mps = env.get("mps") or {}
    if mps.get("built") or mps.get("macos"):
        facts.append(
            (
                "MPS",
                f"built: {yes_no(mps.get('built'))}, available: {yes_no(mps.get('available'))}, macOS {mps.get('macos') or 'n/a'}",
            )
        )
    return facts


def provenance_view(
    results: Results,
    summary: dict[str, Any],
    config: dict[str, Any] | None,
    invocation: dict[str, Any] | None = None,
) -> dict[str, Any]:
    stats = results.job_stats
    return {
        "reproduce": workflow_command([], invocation),
        "rebuild_report": workflow_command([], invocation, start="snakemake report -R report"),
        "facts": commit_facts(summary["commit"]),
        "config_yaml": yaml.safe_dump(
            shown_config(config), sort_keys=False, allow_unicode=True, default_flow_style=False
        )
        if config
        else None,
        "files": [
            {
                "path": path.relative_to(results.root).as_posix(),
                "created": created,
                "modified": modified_time(path),
            }
            for path, created in results.files.items()
        ],
        "job_stats": None if stats is None else stats.to_dict("records"),
    }


def shown_config(config: dict[str, Any]) -> dict[str, Any]:
    """The resolved config as the report lists it: data.synthetic's keys shape only the
    generated set, so beside a data set of the user's they would be settings that did nothing."""
    data = config.get("data")
    if not isinstance(data, dict) or data.get("format", "synthetic") == "synthetic":
        return config
    return {**config, "data": {key: value for key, value in data.items() if key != "synthetic"}}


def commit_facts(commit: dict[str, Any]) -> list[tuple[str, str]]:
    """The commit of the checkout holding the results and its working-tree state, as far as
    git told the summary."""
    if commit["id"] is None:
        return [("git commit", "unknown (not a git checkout, or no commit yet)")]
    if commit["changed"] is None:
        state = "unknown"
    elif commit["changed"] == commit["untracked"] == 0:
        state = "clean"
    else:
        state = f"dirty: {commit['changed']} changed and {commit['untracked']} untracked file(s)"
    return [("git commit", commit["id"]), ("working tree", state)]
