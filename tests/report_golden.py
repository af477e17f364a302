"""The report's outline for three results trees, kept in tests/data/report_golden.json.

`test_report_golden.py` builds the same reports and compares their outlines (sections, headings,
tables cell by cell, figures by alt text and caption, and each section's text) with the file,
so a change of the report's code that changes what it shows fails there. After a change of the
report's content made on purpose, regenerate the file and review its diff:

    PYTHONPATH=src .venv/bin/python tests/report_golden.py
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))  # report_fixtures and report_page, run as a script

from report_fixtures import BENCH, write_json, write_results_tree
from report_page import Outline

from pipeline import cli

GOLDEN = Path(__file__).parent / "data" / "report_golden.json"
CONFIG = {
    "model": {"name": "tiny_conv"},
    "amp": "auto",
    "amp_dtype": "fp16",
    "eval": {"score_threshold": 0.3},
    "note": "</pre><script>x()</script>",
}
# what differs from one build to the next: clock times, the git state, the temporary folder
VOLATILE = (
    (re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} UTC"), "<time>"),
    (re.compile(r"\b[0-9a-f]{40}\b"), "<commit>"),
    (
        re.compile(r"working tree (clean|dirty: \d+ changed and \d+ untracked file\(s\)|unknown)"),
        "working tree <state>",
    ),
)


def full_tree(root: Path) -> tuple[Path, list[str]]:
    """The fixture tree, with the test config: every section has something to show."""
    return write_results_tree(root), ["--config-json", json.dumps(CONFIG)]


def swept_tree(root: Path) -> tuple[Path, list[str]]:
    """The fixture tree plus a copy of the cpu-fp32 run as a swept run: runs are compared."""
    results = write_results_tree(root)
    source = results / "train" / "cpu-fp32"
    swept = results / "train" / "cpu-fp32+seed=1+lr=0.01"
    swept.mkdir()
    for item in source.iterdir():
        (swept / item.name).write_bytes(item.read_bytes())
    return results, []


def sparse_tree(root: Path) -> tuple[Path, list[str]]:
    """One skipped benchmark and nothing else: every section says what is missing."""
    results = root / "results"
    skipped = next(record for record in BENCH if record["status"] == "skipped")
    write_json(
        results / "bench" / "mps-bf16-train.json",
        {"format": "pipeline.bench/1", "records": [skipped]},
    )
    return results, []


TREES = {"full": full_tree, "swept": swept_tree, "sparse": sparse_tree}


def normalised(value: Any, root: Path) -> Any:
    if isinstance(value, str):
        value = value.replace(str(root), "<tmp>")
        for pattern, replacement in VOLATILE:
            value = pattern.sub(replacement, value)
        return value
    if isinstance(value, list):
        return [normalised(item, root) for item in value]
    if isinstance(value, dict):
        return {key: normalised(item, root) for key, item in value.items()}
    return value


def outline_of(tree: str) -> list[dict[str, Any]]:
    """Build the report of one tree with `python -m pipeline report` and outline it."""
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder).resolve()
        results, extra = TREES[tree](root)
        out = root / "out" / "report.html"
        code = cli.main(["report", "--results", str(results), "--out", str(out), *extra])
        if code != 0:
            raise RuntimeError(f"the report of tree {tree!r} failed with exit code {code}")
        page = Outline()
        page.feed(out.read_text(encoding="utf-8"))
        return normalised(page.outline(), root)


def main() -> None:
    golden = {tree: outline_of(tree) for tree in TREES}
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
