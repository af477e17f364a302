"""Read a report back as a browser would: its sections, their text, tags and attributes."""

from __future__ import annotations

import base64
import io
from html.parser import HTMLParser

from PIL import Image

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
