"""scripts/report_answer_png.py: the README's picture of the report's answer section."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from PIL import Image
from report_page import Page, chromium

pytestmark = pytest.mark.usefixtures("restore_pipeline_logger")
_PATH = Path(__file__).resolve().parents[1] / "scripts" / "report_answer_png.py"
_SPEC = importlib.util.spec_from_file_location("report_answer_png", _PATH)
report_answer_png = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(report_answer_png)


def test_the_page_pictured_holds_the_answer_section_alone(report_file: Path) -> None:
    full = report_file.read_text(encoding="utf-8")
    page = Page()
    page.feed(report_answer_png.answer_only(full))
    whole = Page()
    whole.feed(full)
    assert set(page.section_text) == {"answer"}
    assert page.text("answer") == whole.text("answer")
    assert "train with" in page.text("answer")
    assert not [tag for tag, _ in page.tags if tag == "nav"]


def test_a_page_without_an_answer_section_is_refused() -> None:
    with pytest.raises(ValueError, match="no answer section"):
        report_answer_png.answer_only("<html><body><p>hello</p></body></html>")


def test_chromium_pictures_the_answer_cropped_to_what_it_shows(
    report_file: Path, tmp_path: Path
) -> None:
    out = report_answer_png.picture(report_file, tmp_path / "answer.png", chromium())
    with Image.open(out) as image:
        width, height = image.size
        colours = image.convert("L").getcolors(maxcolors=1_000_000) or []
    assert width <= report_answer_png.WIDTH
    assert 100 < height < report_answer_png.HEIGHT  # cropped: not the whole window
    assert len(colours) > 16  # text on a background, not a blank page
