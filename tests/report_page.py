"""Read a report back as a browser would: its sections, their text, tags and attributes; and
render it in headless Chromium (the browser tests and scripts/report_answer_png.py)."""

from __future__ import annotations

import base64
import io
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

from PIL import Image

BROWSER_TIMEOUT_S = 60

SECTION_IDS = [
    "answer",
    "environment",
    "benchmarks",
    "amp-policy",
    "training",
    "evaluation",
    "profile",
    "provenance",
]


BLOCKS = frozenset(
    {
        "p",
        "div",
        "li",
        "td",
        "th",
        "tr",
        "dt",
        "dd",
        "br",
        "h2",
        "h3",
        "pre",
        "figcaption",
        "caption",
    }
)


class Page(HTMLParser):
    """Tags, attributes and the text of each section, as parsed from the report."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.section_text: dict[str, list[str]] = {}
        self._sections: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        self.tags.append((tag, attributes))
        self._break(tag)
        if tag == "section":
            self._sections.append(attributes.get("id") or "")
            self.section_text.setdefault(self._sections[-1], [])

    def handle_endtag(self, tag: str) -> None:
        self._break(tag)
        if tag == "section" and self._sections:
            self._sections.pop()

    def handle_data(self, data: str) -> None:
        if self._sections:
            self.section_text[self._sections[-1]].append(data)

    def _break(self, tag: str) -> None:
        """Block elements separate words, as a browser lays them out; inline ones do not."""
        if tag in BLOCKS and self._sections:
            self.section_text[self._sections[-1]].append(" ")

    def text(self, section: str) -> str:
        return " ".join("".join(self.section_text[section]).split())


def assert_self_contained(source: str, page: Page, min_images: int) -> None:
    """Every image an embedded PNG that decodes; nothing fetched from the network; no scripts."""
    images = [attrs for tag, attrs in page.tags if tag == "img"]
    assert len(images) >= min_images
    for attrs in images:
        data = attrs["src"] or ""
        assert data.startswith("data:image/png;base64,")
        png = base64.b64decode(data.removeprefix("data:image/png;base64,"), validate=True)
        assert png.startswith(b"\x89PNG\r\n\x1a\n")
        with Image.open(io.BytesIO(png)) as image:
            image.verify()
    for tag, attrs in page.tags:
        for name in ("src", "href"):
            value = (attrs.get(name) or "").lower()
            assert not value.startswith(("http:", "https:", "//")), (tag, value)
    assert "http://" not in source and "https://" not in source
    assert not [tag for tag, _ in page.tags if tag in {"link", "script", "iframe", "object"}]


class Outline(Page):
    """What a reader sees of each section: headings, tables cell by cell, figures by alt and caption.

    Used to compare two reports built from the same results (tests/report_golden.py).
    """

    def __init__(self) -> None:
        super().__init__()
        self.sections: list[dict] = []
        self._capture: list[str] | None = None  # text of the heading, cell or caption being read
        self._row: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        super().handle_starttag(tag, attrs)
        attributes = dict(attrs)
        if tag == "section":
            self.sections.append(
                {
                    "id": attributes.get("id"),
                    "heading": None,
                    "subheadings": [],
                    "tables": [],
                    "figures": [],
                }
            )
        if not self.sections:
            return
        current = self.sections[-1]
        if tag == "table":
            current["tables"].append({"headers": [], "rows": []})
        elif tag == "tr":
            self._row = []
        elif tag in ("th", "td", "h2", "h3", "figcaption"):
            self._capture = []
        elif tag == "br" and self._capture is not None:
            self._capture.append(" ")
        elif tag == "img":
            current["figures"].append({"alt": attributes.get("alt"), "caption": None})

    def handle_endtag(self, tag: str) -> None:
        super().handle_endtag(tag)
        if not self.sections or (self._capture is None and tag != "tr"):
            return
        current = self.sections[-1]
        text = " ".join("".join(self._capture or []).split())
        if tag == "th":
            current["tables"][-1]["headers"].append(text)
        elif tag == "td" and self._row is not None:
            self._row.append(text)
        elif tag == "tr":
            if self._row:
                current["tables"][-1]["rows"].append(self._row)
            self._row = None
            return
        elif tag == "h2":
            current["heading"] = text
        elif tag == "h3":
            current["subheadings"].append(text)
        elif tag == "figcaption":
            current["figures"][-1]["caption"] = text
        else:
            return
        self._capture = None

    def handle_data(self, data: str) -> None:
        super().handle_data(data)
        if self._capture is not None:
            self._capture.append(data)

    def outline(self) -> list[dict]:
        """Each section's outline, with its whole text (as `Page.text` reads it) beside it."""
        return [{**section, "text": self.text(section["id"])} for section in self.sections]


def find_chromium() -> str | None:
    """The Chromium executable, or None where it is not installed."""
    found = shutil.which("chromium") or (Path("/usr/bin/chromium").exists() and "/usr/bin/chromium")
    return str(found) if found else None


def chromium() -> str:
    """Chromium for a test: skips where it is not installed, unless PIPELINE_REQUIRE_BROWSER=1
    (CI), where a missing browser fails the test."""
    import pytest

    found = find_chromium()
    if found:
        return found
    message = "Chromium is not installed (no /usr/bin/chromium, no chromium on PATH): apt-get install chromium"
    if os.environ.get("PIPELINE_REQUIRE_BROWSER") == "1":
        pytest.fail(f"PIPELINE_REQUIRE_BROWSER=1 but {message}")
    pytest.skip(message)


def headless_chromium(
    browser: str, profile_dir: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    """One headless run with a fresh profile and nothing that reaches out to the network."""
    profile_dir.mkdir(parents=True)
    command = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--no-first-run",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile_dir}",
        *args,
    ]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S, check=False
    )
