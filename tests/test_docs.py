"""The README and docs/ stay usable: short README, every relative link resolves, machines named
by what they are."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
CODE_SPAN = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.MULTILINE)
NICKNAME = re.compile(r"\b(Zen \d|AMX( fp16)?|AVX2|AVX-512|Intel|AMD) machine\b")


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = CODE_SPAN.sub(lambda m: m[0].strip("`"), heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor, with GitHub's -1, -2 suffixes for repeated headings."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(heading)
        count = seen.get(base, 0)
        found.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return found


def broken_links(page: Path) -> list[str]:
    """Relative links of `page` to a file that does not exist, or to a heading it lacks."""
    text = CODE_SPAN.sub("", FENCE.sub("", page.read_text(encoding="utf-8")))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target} (no such heading in {linked.name})")
    return broken


def test_the_readme_is_short_enough_for_a_newcomer() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves_to_a_file_and_heading(page: Path) -> None:
    assert broken_links(page) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## Choosing `data.image_size`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#choosing-dataimage_size) [ok](#page) ![ok](other.md)\n"
        "[gone](missing.md) [no heading](other.md#nowhere) [web](https://example.org)\n"
        "`[not a link](missing.md)`\n\n```\n[not a link](missing.md)\n```\n"
    )
    assert broken_links(page) == [
        "missing.md (no such file)",
        "other.md#nowhere (no such heading in other.md)",
    ]


def test_no_machine_is_named_by_a_nickname() -> None:
    """Machines are named by what they are (CPU model, flags), never 'the Zen 4 machine'."""
    files = [*pages(), REPO / "benchmarks" / "README.md", REPO / "config" / "config.yaml"]
    files += sorted((REPO / "config" / "presets").glob("*.yaml"))
    files += sorted((REPO / "src").rglob("*.py")) + sorted((REPO / "benchmarks").glob("*.py"))
    found = [
        f"{path.relative_to(REPO)}: {match[0]}"
        for path in files
        for match in NICKNAME.finditer(path.read_text(encoding="utf-8"))
    ]
    assert found == []
