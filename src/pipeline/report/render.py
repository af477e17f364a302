"""The page: one view model (plain dicts) per section, rendered by the Jinja2 templates under
templates/ with autoescaping on, and written atomically.

Python picks and shapes the data (here, in bench_views.py and in run_views.py); the markup and
the wording around the data live in the templates, and every string from a results file
reaches the page escaped by Jinja2.
"""

from __future__ import annotations

from datetime import UTC, datetime
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
import yaml

from pipeline import atomic
from pipeline.report import charts
from pipeline.report.bench_views import amp_policy_view, answer_view, benchmarks_view
from pipeline.report.formatting import FILTERS, backend_label, yes_no
from pipeline.report.load import Results, git_facts, load_results, modified_time
from pipeline.report.run_views import evaluation_view, profile_view, training_view

SECTIONS = {  # id: heading, in page order; each has its template sections/<id>.html.j2
    "answer": "Answer",
    "environment": "Environment",
    "benchmarks": "Benchmarks",
    "amp-policy": "AMP policy",
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
) -> Path:
    """Read every result under `results_dir` and write the report to `out` atomically;
    `invocation` (how the workflow was called) goes into the commands the report gives."""
    results = load_results(Path(results_dir))
    out = Path(out)
    return atomic.write_text(out, render(results, config, out, datetime.now(UTC), invocation))


def render(
    results: Results,
    config: dict[str, Any] | None,
    out: Path,
    generated: datetime,
    invocation: dict[str, Any] | None = None,
) -> str:
    """The page as HTML; `out` is where it will be written (links are relative to it)."""
    colors = charts.run_colors(results.runs)
    views = {
        "answer": answer_view(results, config, invocation),
        "environment": environment_view(results.env),
        "benchmarks": benchmarks_view(results.bench),
        "amp-policy": amp_policy_view(results, config),
        "training": training_view(results.runs, colors),
        "evaluation": evaluation_view(results.runs, config),
        "profile": profile_view(results.runs, colors, out),
        "provenance": provenance_view(results, config),
    }
    sections = [{"id": id_, "title": title, "view": views[id_]} for id_, title in SECTIONS.items()]
    page = templates().get_template("page.html.j2")
    return page.render(
        sections=sections, root=results.root, generated=generated, stylesheet=stylesheet()
    )


def stylesheet() -> str:
    """static/report.css, inlined by the page template so the report stays one file."""
    return resources.files(__package__).joinpath("static", "report.css").read_text("utf-8")


@cache
def templates() -> jinja2.Environment:
    """The templates, with autoescaping on and formatting.py's functions as filters."""
    environment = jinja2.Environment(
        loader=jinja2.PackageLoader(__package__, "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        finalize=lambda value: "" if value is None else value,  # a null in a file shows as nothing
    )
    environment.filters.update(FILTERS)
    return environment


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
    """Whether the CPU computes bf16/fp16 natively: what lets amp=measured use them on it."""
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


def provenance_view(results: Results, config: dict[str, Any] | None) -> dict[str, Any]:
    stats = results.job_stats
    return {
        "facts": git_facts(results.root),
        "config_yaml": yaml.safe_dump(
            config, sort_keys=False, allow_unicode=True, default_flow_style=False
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
