"""The report and the comparison page in a real browser: headless Chromium loads them from disk,
lays them out and renders them.

Skips when Chromium is not installed, unless PIPELINE_REQUIRE_BROWSER=1 (CI sets it where
Chromium is part of the image), in which case a missing browser fails the test.
"""

from __future__ import annotations

import json
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from PIL import Image
from report_fixtures import write_results_tree
from report_page import SECTION_IDS, chromium, headless_chromium

from pipeline import cli

pytestmark = pytest.mark.usefixtures("restore_pipeline_logger")


def run_browser(browser: str, profile_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = headless_chromium(browser, profile_dir, *args)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


class SectionIds(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.tags: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        if tag == "section":
            self.ids.add(dict(attrs).get("id") or "")


def test_chromium_loads_every_section_of_the_report(report_file: Path, tmp_path: Path) -> None:
    browser = chromium()
    done = run_browser(browser, tmp_path / "profile-dom", "--dump-dom", report_file.as_uri())
    dom = SectionIds()
    dom.feed(done.stdout)
    assert dom.ids >= set(SECTION_IDS)
    assert "script" not in dom.tags


def test_chromium_renders_a_screenshot_of_the_report(report_file: Path, tmp_path: Path) -> None:
    browser = chromium()
    shot = tmp_path / "shot.png"
    run_browser(
        browser,
        tmp_path / "profile-shot",
        f"--screenshot={shot}",
        "--window-size=1280,2000",
        report_file.as_uri(),
    )
    assert shot.exists()
    assert shot.stat().st_size > 20_000  # a blank page is a few kilobytes
    with Image.open(shot) as image:
        assert image.size == (1280, 2000)
        colours = image.convert("L").getcolors(maxcolors=1_000_000) or []
    assert len(colours) > 16  # text, tables and plots, not one flat colour


@pytest.fixture
def compare_file(tmp_path: Path) -> Path:
    """compare.html of two summaries of the fixture tree: the machine described in it, and
    another without a GPU that ran a larger test split (so accuracy is not compared)."""
    summaries = []
    for name, num_test in (("gpu", 16), ("cpu", 24)):
        results = write_results_tree(tmp_path / name)
        config = {"data": {"format": "synthetic", "synthetic": {"num_test": num_test}}}
        args = ["summarize", "--results", str(results), "--config-json", json.dumps(config)]
        assert cli.main(args) == 0
        summaries.append(results / "summary.json")
    other = json.loads(summaries[1].read_text())
    other["machine"].update(cpu_model="Intel Xeon (another machine)", gpus=[])
    summaries[1].write_text(json.dumps(other))
    out = tmp_path / "compare.html"
    assert cli.main(["compare", *map(str, summaries), "--out", str(out)]) == 0
    return out


def test_chromium_loads_every_section_of_the_comparison_page(
    compare_file: Path, tmp_path: Path
) -> None:
    browser = chromium()
    done = run_browser(browser, tmp_path / "profile-compare", "--dump-dom", compare_file.as_uri())
    dom = SectionIds()
    dom.feed(done.stdout)
    assert dom.ids == {"machines", "answers", "speed", "training"}
    assert "script" not in dom.tags and "table" in dom.tags
    assert "Intel Xeon (another machine)" in done.stdout
    assert "they ran different settings (data.synthetic.num_test: 24 vs 16)" in done.stdout
