"""Which schema (src/pipeline/schemas) each file under a results folder has, and a check of a
whole folder against them.

Not a test module: test_workflow.py (a real workflow's results) and test_formats.py (the
report tests' fixture tree) import it.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from pipeline import formats

BY_FILE_NAME = {
    "env.json": "env",
    "train_summary.json": "train_summary",
    "metrics.jsonl": "metrics_row",
    "profile.json": "profile",
    "operators.json": "operators",
    "summary.json": "summary",
}


def schema_of(relative: Path) -> str | None:
    """The schema of a file at `relative` under results/; None for files without one."""
    folder = relative.parts[0]
    if folder in ("bench", "choice"):
        return folder
    if folder == "eval":
        return "predictions" if relative.stem.endswith("_predictions") else "eval"
    if folder == "predict":
        return "predict" if relative.name == "images.json" else None
    return BY_FILE_NAME.get(relative.name)


def check_results(results: Path) -> Counter[str]:
    """Every JSON file (each line of a JSON-lines file) under `results` that has a schema is
    checked against it; returns how many files of each schema there were."""
    checked: Counter[str] = Counter()
    for path in sorted(results.rglob("*.json*")):
        relative = path.relative_to(results)
        name = schema_of(relative)
        if name is None:
            continue
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines() if path.suffix == ".jsonl" else [text]
        for line in lines:
            problem = formats.problem(json.loads(line), name)
            assert problem is None, f"{relative} {problem}"
        checked[name] += 1
    return checked
