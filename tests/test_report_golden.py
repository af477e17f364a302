"""The report shows what it showed when tests/data/report_golden.json was written.

Sections, headings, tables cell by cell, figures (alt text and caption) and each section's text
of three results trees, built with `python -m pipeline report`. A change of what the report
says made on purpose: regenerate the file (tests/report_golden.py says how) and review its diff.
"""

from __future__ import annotations

import json

import pytest
from report_golden import GOLDEN, TREES, outline_of

pytestmark = pytest.mark.usefixtures("restore_pipeline_logger")


@pytest.mark.parametrize("tree", sorted(TREES))
def test_the_report_shows_the_same_sections_tables_and_figures_as_the_golden_file(
    tree: str,
) -> None:
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))[tree]
    outline = outline_of(tree)
    assert [(s["id"], s["heading"]) for s in outline] == [(s["id"], s["heading"]) for s in golden]
    for section, expected in zip(outline, golden, strict=True):
        for part in ("subheadings", "tables", "figures", "text"):
            assert section[part] == expected[part], f"{tree}: section {section['id']}, {part}"
