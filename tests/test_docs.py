"""The README and docs/ stay usable: short README, every relative link resolves, every
`python -m pipeline` command shown exists with the options it is shown with, every test a page
names (`tests/FILE.py::NAME`) exists, machines named by what they are."""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import re
from pathlib import Path

import pytest

from pipeline.cli import ALIASES, COMMANDS

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^ *```.*?^ *```", re.DOTALL | re.MULTILINE)  # indented in a list too
CODE_SPAN = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.MULTILINE)
# `python -m pipeline [--debug|--log F|--cpu-threads N] COMMAND rest`, in code a page shows
PIPELINE_COMMAND = re.compile(
    r"python -m pipeline((?: --(?:cpu-threads|log) \S+| --debug)*) ([a-z][\w-]*)([^#]*)"
)
OPTION = re.compile(r"(?<![\w-])--[a-z][\w-]*")
SPAN = re.compile(r"`([^`]+)`")
# `tests/test_x.py::test_name`, as failure-modes.md names the test behind each row
TEST_REFERENCE = re.compile(r"\btests/([\w/]+\.py)::(\w+)")
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


@functools.cache
def command_options(name: str) -> frozenset[str]:
    """The options `python -m pipeline NAME` takes, as its --help lists them."""
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), pytest.raises(SystemExit):
        importlib.import_module(COMMANDS[name][0]).main(["--help"])
    return frozenset(OPTION.findall(shown.getvalue()))


def shown_code(text: str) -> list[str]:
    """Every line of the fenced blocks and every inline code span of a page (a span may wrap
    onto the next line; a line continued with a backslash is one)."""
    fences = [block.strip().strip("`") for block in FENCE.findall(text)]
    spans = [span.replace("\n", " ") for span in SPAN.findall(FENCE.sub("", text))]
    lines = re.sub(r" *\\\n\s*", " ", "\n".join(fences)).splitlines()
    return lines + spans


def unknown_commands_and_options(page: Path) -> list[str]:
    """`python -m pipeline` commands a page shows that do not exist, or with an option that
    the command does not take."""
    unknown = []
    for code in shown_code(page.read_text(encoding="utf-8")):
        for match in PIPELINE_COMMAND.finditer(code):
            name = ALIASES.get(match[2], match[2])
            if name not in COMMANDS:
                unknown.append(f"{match[0].strip()} (no command {name})")
                continue
            unknown += [
                f"{match[0].strip()} ({name} takes no {option})"
                for option in OPTION.findall(match[3])
                if option not in command_options(name)
            ]
    return unknown


def missing_tests(page: Path, tests: Path = REPO / "tests") -> list[str]:
    """`tests/FILE.py::NAME` references of a page whose file or test function does not exist
    (a test renamed or removed, its reference left behind)."""
    missing = []
    for module, name in TEST_REFERENCE.findall(page.read_text(encoding="utf-8")):
        path = tests / module
        found = path.is_file() and re.search(
            rf"^\s*def {name}\(", path.read_text(encoding="utf-8"), re.MULTILINE
        )
        if not found:
            missing.append(f"tests/{module}::{name}")
    return missing


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


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_pipeline_command_shown_exists_with_the_options_shown(page: Path) -> None:
    assert unknown_commands_and_options(page) == []


def test_the_command_check_finds_an_unknown_command_and_option(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Run `python -m pipeline --cpu-threads 2 evaluate --checkpoint b.pth\n--out e.json` or\n"
        "`python -m pipeline eval --checkpoint b.pth --outfile e.json`.\n\n```bash\n"
        "python -m pipeline train --out x \\\n    --epochs 3 train.lr=0.1   # not --resume\n"
        "python -m pipeline trian --out x\npython -m pipeline --help\n```\n"
    )
    assert unknown_commands_and_options(page) == [
        "python -m pipeline train --out x --epochs 3 train.lr=0.1 (train takes no --epochs)",
        "python -m pipeline trian --out x (no command trian)",
        "python -m pipeline eval --checkpoint b.pth --outfile e.json (evaluate takes no --outfile)",
    ]


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_test_a_page_names_exists(page: Path) -> None:
    assert missing_tests(page) == []


def test_the_test_check_finds_a_missing_file_and_a_missing_test(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_kept() -> None:\n    pass\n")
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- tests/test_a.py::test_kept; tests/test_a.py::test_renamed -->\n"
        "`tests/test_gone.py::test_kept` and tests/test_a.py::test_kept_longer\n"
    )
    assert missing_tests(page, tmp_path / "tests") == [
        "tests/test_a.py::test_renamed",
        "tests/test_gone.py::test_kept",
        "tests/test_a.py::test_kept_longer",
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
