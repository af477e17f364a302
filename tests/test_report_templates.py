"""The report's templates: the page's structure, escaping of everything that comes from files,
the stylesheet inlined from the package, and no markup built in Python.

Section templates are rendered here from view models written by hand, so a template can be
changed and checked without results files.
"""

from __future__ import annotations

import ast
import re
import tomllib
from datetime import UTC, datetime
from html.parser import HTMLParser
from pathlib import Path

import pytest
from report_page import SECTION_IDS, Page

from pipeline.report import charts, render
from pipeline.summary import load
from pipeline.summary.build import summary_of

PACKAGE = Path(render.__file__).parent
REPO = Path(__file__).resolve().parents[1]
SCRIPT = "<script>alert(1)</script>"
ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"
GENERATED = datetime(2026, 11, 29, 17, 30, tzinfo=UTC)


class Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def section_html(section: str, view: object) -> str:
    return (
        render.templates()
        .get_template(f"sections/{section}.html.j2")
        .render(view=view, generated=GENERATED)
    )


def tags_of(html: str) -> list[tuple[str, dict[str, str | None]]]:
    parser = Tags()
    parser.feed(html)
    return parser.tags


def empty_page(tmp_path: Path) -> Page:
    page = Page()
    page.feed(empty_html(tmp_path))
    return page


def empty_html(tmp_path: Path) -> str:
    """The report of an empty results folder."""
    results = load.load_results(tmp_path)
    summary = summary_of(results, None)
    return render.render(results, summary, None, tmp_path / "report.html", GENERATED)


def test_autoescaping_is_on() -> None:
    assert render.templates().autoescape is True


def test_the_page_has_every_section_in_order_with_its_heading_and_a_nav_link(
    tmp_path: Path,
) -> None:
    page = empty_page(tmp_path)
    assert list(render.SECTIONS) == SECTION_IDS
    assert [attrs["id"] for tag, attrs in page.tags if tag == "section"] == SECTION_IDS
    links = [attrs["href"] for tag, attrs in page.tags if tag == "a"]
    assert links == [f"#{id_}" for id_ in SECTION_IDS]
    for id_, title in render.SECTIONS.items():
        assert page.text(id_).startswith(title)


def test_an_empty_results_folder_gives_a_note_in_every_section(tmp_path: Path) -> None:
    page = empty_page(tmp_path)
    notes = [
        attrs["class"]
        for tag, attrs in page.tags
        if tag == "p" and "note" in (attrs.get("class") or "")
    ]
    assert len(notes) >= len(SECTION_IDS) - 1  # provenance also lists what it has
    assert "No successful training benchmark yet" in page.text("answer")
    assert "No benchmark records under results/bench yet" in page.text("benchmarks")
    assert "No evaluation results under results/eval yet" in page.text("evaluation")


def test_the_stylesheet_is_the_package_file_inlined_and_nothing_is_linked(tmp_path: Path) -> None:
    css = (PACKAGE / "static" / "report.css").read_text(encoding="utf-8")
    html = empty_html(tmp_path)
    assert f"<style>\n{css}" in html
    assert not [tag for tag, _ in tags_of(html) if tag in {"link", "script"}]


@pytest.mark.parametrize(
    ("section", "view"),
    [
        (
            "environment",
            {
                "backends": [
                    {
                        "name": "cuda",
                        "available": False,
                        "amp_default": True,
                        "amp_supported": True,
                        "description": None,
                        "reason": SCRIPT,
                    },
                    {
                        "name": SCRIPT,
                        "available": True,
                        "amp_default": False,
                        "amp_supported": False,
                        "description": SCRIPT,
                        "reason": None,
                    },
                ],
                "facts": [(SCRIPT, SCRIPT)],
            },
        ),
        (
            "amp-policy",
            {
                "verdicts": [SCRIPT],
                "rows": [
                    {
                        "backend": "cpu",
                        "default": SCRIPT,
                        "records": [
                            {"record": None, "speed": None},
                            {"record": {"status": "skipped", "reason": SCRIPT}, "speed": None},
                            {"record": None, "speed": None},
                        ],
                        "measured": SCRIPT,
                        "measured_reason": SCRIPT,
                    }
                ],
                "precisions": ["fp32", "fp16", "bf16"],
                "model": SCRIPT,
                "precision": SCRIPT,
            },
        ),
        (
            "training",
            {
                "chart": None,
                "runs": [
                    {
                        "name": SCRIPT,
                        "has_train_summary": False,
                        "metrics_note": SCRIPT,
                        "device": SCRIPT,
                        "amp": True,
                        "precision": SCRIPT,
                        "epochs": SCRIPT,
                        "epoch_time_s": None,
                        "wall_time_s": None,
                        "images_per_s": None,
                        "peak_memory": {"peak_mb": 1.0, "exact": True, "label": SCRIPT},
                        "backend": "cuda",
                        "host_peak_rss_mb": None,
                        "scores": {
                            "split": SCRIPT,
                            "f1": 0.5,
                            "f1_interval": None,
                            "f1_threshold": "validation",
                            "ap50": None,
                            "ap50_interval": None,
                        },
                        "best_validation_f1": {"value": 0.5, "epoch": SCRIPT},
                        "ema": True,
                    }
                ],
                "comparison": {
                    "swept_keys": [SCRIPT],
                    "runs": [
                        {
                            "name": SCRIPT,
                            "swept": [SCRIPT],
                            "backend": SCRIPT,
                            "precision": SCRIPT,
                            "wall_time_s": 1.0,
                            "scores": {
                                "split": SCRIPT,
                                "f1": None,
                                "f1_interval": None,
                                "f1_threshold": "score threshold",
                                "ap50": None,
                                "ap50_interval": None,
                            },
                        }
                    ],
                    "chart": None,
                },
            },
        ),
        (
            "provenance",
            {
                "reproduce": f"snakemake --cores 1 results/report.html --configfile {SCRIPT}",
                "rebuild_report": f"snakemake report -R report --configfile {SCRIPT}",
                "facts": [(SCRIPT, SCRIPT)],
                "config_yaml": f"note: {SCRIPT}\n",
                "files": [{"path": f"bench/{SCRIPT}.json", "created": SCRIPT, "modified": None}],
                "job_stats": [
                    {
                        "job": SCRIPT,
                        "wall_s": 1.0,
                        "max_rss_mb": 2.0,
                        "cpu_time_s": 3.0,
                        "mean_load": 4.0,
                    }
                ],
            },
        ),
    ],
)
def test_text_from_files_is_escaped_wherever_a_section_shows_it(section: str, view: dict) -> None:
    html = section_html(section, view)
    assert "<script" not in html
    assert html.count(ESCAPED) >= 3


def test_a_script_tag_in_a_class_name_a_file_name_and_a_profiler_note_is_escaped() -> None:
    evaluation = {
        "runs": [],
        "per_class": {
            "runs": [SCRIPT],
            "classes": [{"name": SCRIPT, "num_gt": 3, "scores": [None]}],
            "without_objects": [SCRIPT],
        },
        "sizes": {
            "runs": [SCRIPT, "b"],
            "few_in_bucket": 10,
            "buckets": [
                {
                    "name": "small",
                    "range_px": [0, 16],
                    "cells": [
                        None,
                        {
                            "num_gt": 5,
                            "ap50": 0.5,
                            "ap": 0.3,
                            "recall": 0.4,
                            "few": [{"name": SCRIPT, "num_gt": 2, "ap50": 0.1}],
                        },
                    ],
                }
            ],
        },
        "grid": {
            "run": SCRIPT,
            "predictions_file": SCRIPT,
            "image": None,
            "threshold": 0.3,
            "max_detections": 25,
            "missing": [f"images/{SCRIPT}.png"],
        },
    }
    html = section_html("evaluation", evaluation)
    assert (
        "<script" not in html and html.count(ESCAPED) == 7
    )  # the note on classes without objects names it too
    profile = {
        "chart": None,
        "latency": [],
        "operators": [
            {
                "name": SCRIPT,
                "trace_name": "trace.json",
                "trace_path": f"../{SCRIPT}/trace.json",
                "trace_href": "..%2F%3Cscript%3E/trace.json",
                "profiler": {
                    "batch_size": 4,
                    "steps": 3,
                    "sorted_by": SCRIPT,
                    "activities": [SCRIPT],
                    "note": SCRIPT,
                    "top": [
                        {
                            "name": SCRIPT,
                            "calls": 1,
                            "self_cpu_ms": 1.0,
                            "self_device_ms": 0.0,
                            "share": 0.5,
                        }
                    ],
                },
            }
        ],
    }
    html = section_html("profile", profile)
    assert "<script" not in html and html.count(ESCAPED) >= 6


def test_an_image_is_a_figure_with_its_alt_text_and_caption() -> None:
    image = charts.png_image(
        b"\x89PNG\r\n\x1a\n" + bytes(8) + (288).to_bytes(4, "big") + bytes(8), SCRIPT
    )
    grid = {
        "run": "cpu-fp32",
        "predictions_file": "p.json",
        "image": image,
        "threshold": 0.3,
        "max_detections": 25,
        "missing": [],
    }
    html = section_html(
        "evaluation",
        {
            "runs": [],
            "per_class": {"runs": [], "classes": [], "without_objects": []},
            "sizes": {"runs": [], "buckets": []},
            "grid": grid,
        },
    )
    img = next(attrs for tag, attrs in tags_of(html) if tag == "img")
    assert img["alt"] == SCRIPT and img["width"] == "192"  # 288 px at 144 dpi, shown at 96 dpi
    assert img["src"] == image.uri and image.uri.startswith("data:image/png;base64,")
    assert "cpu-fp32: ground truth in green, detections with score ≥ 0.30 in red" in html


def test_a_null_from_a_file_shows_as_an_empty_cell() -> None:
    html = section_html(
        "provenance",
        {
            "reproduce": "snakemake --cores 1 results/report.html",
            "rebuild_report": "snakemake report -R report",
            "facts": [],
            "config_yaml": None,
            "files": [],
            "job_stats": [
                {
                    "job": None,
                    "wall_s": None,
                    "max_rss_mb": None,
                    "cpu_time_s": None,
                    "mean_load": None,
                }
            ],
        },
    )
    assert "<td></td>" in html and "None" not in html
    assert html.count('<td class="num">n/a</td>') == 4


def test_templates_and_the_stylesheet_are_shipped_as_package_data() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = pyproject["tool"]["setuptools"]["package-data"]["pipeline"]
    shipped = [
        path for path in PACKAGE.rglob("*") if path.is_file() and path.suffix in {".j2", ".css"}
    ]
    assert len(shipped) >= 10  # page, macros, eight sections, the stylesheet
    matched = {path for pattern in patterns for path in PACKAGE.parent.glob(pattern)}
    assert set(shipped) <= matched, "not in [tool.setuptools.package-data]: " + ", ".join(
        path.relative_to(PACKAGE.parent).as_posix() for path in set(shipped) - matched
    )


def test_no_python_module_of_the_report_holds_markup() -> None:
    """Markup lives in the templates: no string literal in the package's code is an HTML tag."""
    tag = re.compile(r"</?[a-zA-Z][a-zA-Z0-9]*(\s[^<>]*)?/?>")
    found = []
    for path in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        found += [
            f"{path.name}:{node.lineno}: {node.value[:60]!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and tag.search(node.value)
        ]
    assert found == []
    assert max(len(path.read_text().splitlines()) for path in PACKAGE.glob("*.py")) <= 500
