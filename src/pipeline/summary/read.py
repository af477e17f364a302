"""A summary file read back for the report and `compare`, or one paragraph naming the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline import formats
from pipeline.errors import ResultsFileError
from pipeline.summary.build import FORMAT

REMAKE = (
    "Write it with python -m pipeline summarize --results DIR --out FILE (or snakemake "
    "--cores 1 results/summary.json)."
)


def read_summary(path: str | Path) -> dict[str, Any]:
    """The summary in `path`, checked against summary.schema.yaml; a missing file, another
    file kind or another version of the format is a ResultsFileError naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as error:
        raise ResultsFileError(f"Summary file {path} does not exist. {REMAKE}") from error
    except (OSError, UnicodeDecodeError) as error:
        raise ResultsFileError(f"Summary file {path} cannot be read: {error}.") from error
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise ResultsFileError(
            f"{path} is not a summary: it is not valid JSON ({error.msg} at line {error.lineno}, "
            f"column {error.colno}). {REMAKE}"
        ) from error
    tag = document.get("format") if isinstance(document, dict) else None
    if tag != FORMAT:
        what = f"a file of format {tag}" if isinstance(tag, str) else "not a pipeline summary"
        raise ResultsFileError(
            f"{path} is {what}, where a summary of format {FORMAT} was expected. {REMAKE}"
        )
    problem = formats.problem(document, "summary")
    if problem:
        raise ResultsFileError(
            f"{path} is not a summary this version reads: it {problem}. {REMAKE}"
        )
    return document
