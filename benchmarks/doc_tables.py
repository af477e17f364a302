"""Rewrite the generated tables of the docs from the committed records (--check: only compare).

A generated block is the text between `<!-- generated:NAME:start -->` and
`<!-- generated:NAME:end -->` in README.md or docs/*.md. NAME is a script of this folder, whose
table comes from its records (benchmarks/records/NAME/*.json, written by the script); or
`real_sets`, whose records (benchmarks/records/real/) have a format and a table of their own
(`real_sets.table`); or `machines`, the machines side by side from pipeline.compare's Markdown
over the committed summaries (benchmarks/machines/*.json). A figure reaches the docs only this
way, never typed.

    python benchmarks/doc_tables.py            # rewrite every block
    python benchmarks/doc_tables.py --check    # exit 1 naming each block out of step
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import atomic, formats
from pipeline.environment import machine_id
from pipeline.errors import PipelineError

REPO = Path(__file__).resolve().parent.parent
RECORDS_DIR = REPO / "benchmarks" / "records"
MACHINES_DIR = REPO / "benchmarks" / "machines"
MACHINES = "machines"
# helpers, not benchmark scripts
NOT_SCRIPTS = {
    "harness",
    "doc_tables",
    "real_layouts",
    "repeated_runs",
    "detection_workload",
    "config_ab",
}
OWN_TABLE = "real_sets"  # its records and its table are its own (real_sets.table)
# A marker is a line of its own: one quoted in prose (`<!-- generated:NAME:start -->`) is not.
BLOCK = re.compile(
    r"(?P<start>^<!-- generated:(?P<name>[A-Za-z0-9_-]+):start -->\n)"
    r"(?P<body>.*?)"
    r"(?P<end>^<!-- generated:(?P=name):end -->$)",
    re.DOTALL | re.MULTILINE,
)
ANY_MARKER = re.compile(r"^<!-- generated:([^:]*):(start|end) -->$", re.MULTILINE)
OPS = {"<=": "≤", ">=": "≥", "==": "="}
TIME_UNITS = {"ms", "s"}


def doc_files(repo: Path = REPO) -> list[Path]:
    """The files that may hold generated blocks: README.md and every page under docs/."""
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def script_names(folder: Path = REPO / "benchmarks") -> list[str]:
    """The benchmark scripts that write records of `harness.record`'s format."""
    return sorted(
        p.stem for p in folder.glob("*.py") if p.stem not in NOT_SCRIPTS and p.stem != OWN_TABLE
    )


def load_records(
    directory: Path, scripts: Sequence[str] | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Every record in the scripts' folders under `directory`, by script, oldest first; one that
    is not a record stops. Other folders (real_sets' records/real/) are not read."""
    found: dict[str, list[dict[str, Any]]] = {}
    names = script_names() if scripts is None else scripts
    for path in sorted(p for name in names for p in (directory / name).glob("*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise PipelineError(f"Record {path} is not valid JSON: {error}.") from error
        problem = formats.problem(record, "benchmark_record")
        if problem:
            raise PipelineError(f"Record {path} {problem}.")
        if record["benchmark"] != path.parent.name:
            raise PipelineError(
                f"Record {path} is of benchmark {record['benchmark']!r} but lies in the folder "
                f"of {path.parent.name!r}: move it to {directory / record['benchmark']}."
            )
        found.setdefault(record["benchmark"], []).append(record)
    for records in found.values():
        records.sort(key=lambda r: (r["created"], machine_id(r["machine"])))
    return found


# ---- one script's table ------------------------------------------------------------------
def value_text(figure: dict[str, Any]) -> str:
    """A figure as a reader compares it: its unit's precision, its interval, pass or FAIL."""
    value, unit = figure["value"], figure["unit"]
    if value is None:
        text = "n/a"
    elif unit == "boolean":
        text = "yes" if value else "no"
    else:
        text = _number(value, unit)
        if figure["interval"] is not None:
            low, high = figure["interval"]["low"], figure["interval"]["high"]
            text += f" ({_number(low, unit)}–{_number(high, unit)})"
    if figure["passed"] is not None:
        text += ", pass" if figure["passed"] else ", **FAIL**"
    return text


def _number(value: float, unit: str) -> str:
    if unit == "ms":
        return f"{value:.2f}" if abs(value) < 100 else f"{value:.1f}"
    if unit == "s":  # a tenth where a second is a large share of the figure
        return f"{value:.1f}" if abs(value) < 100 else f"{value:.0f}"
    if unit in ("count", "epochs"):
        return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"
    if unit == "speed-up":
        return f"{value:.2f}x"
    if unit == "map":  # differences of output maps, from float rounding up
        return f"{value:.1e}"
    return f"{value:.3f}"


def target_text(figure: dict[str, Any]) -> str:
    target = figure["target"]
    if target is None:
        return ""
    bound = target["value"]
    shown = ("yes" if bound else "no") if isinstance(bound, bool) else f"{bound:g}"
    return f"{OPS[target['op']]} {shown}"


def machine_text(machine: dict[str, Any]) -> str:
    """A machine named by what it is: CPU model, instruction set, native precisions, GPUs."""
    native = [
        f"native {precision} ({', '.join(found['features'])})"
        if found["native"]
        else f"no native {precision}" + (" (hidden)" if found["hidden"] else "")
        for precision, found in machine["cpu_native"].items()
    ]
    gpus = ", ".join(f"{gpu['name']} ({gpu['memory_gib']:g} GiB)" for gpu in machine["gpus"])
    return (
        f"{machine['cpu_model']} ({machine['architecture']}, {machine['cpu_capability']}; "
        f"{'; '.join(native)}), {machine['usable_cpus']} CPUs, {gpus or 'no GPU'}; "
        f"torch {machine['torch']}, Python {machine['python']}"
    )


def provenance_text(record: dict[str, Any]) -> str:
    commit = record["commit"]
    where = "no git checkout"
    if commit is not None:
        where = f"commit {commit['sha'][:7]}" + (
            " with uncommitted changes" if commit["dirty"] else ""
        )
    return f"{record['created'][:10]}, {where}, `{record['command']}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def benchmark_table(name: str, records: Sequence[dict[str, Any]]) -> str:
    """Figures as rows, one column per record (machine and date), a legend under the table."""
    if not records:
        return (
            f"No record yet: run `python benchmarks/{name}.py` on an otherwise idle machine "
            "and commit the record it writes under benchmarks/records/.\n"
        )
    rows: dict[str, dict[str, Any]] = {}  # key -> the first record's figure: label and target
    for record in records:
        for figure in record["figures"]:
            rows.setdefault(figure["key"], figure)
    columns = [f"({number})" for number in range(1, len(records) + 1)]
    lines = [
        "| figure | target | " + " | ".join(columns) + " |",
        "| --- | --- | " + " | ".join("---" for _ in columns) + " |",
    ]
    for key, first in rows.items():
        cells = []
        for record in records:
            found = next((f for f in record["figures"] if f["key"] == key), None)
            cells.append("—" if found is None else _cell(value_text(found)))
        # a time's unit is not in its label; a ratio, an AP, a count say what they are
        label = (
            f"{first['label']} ({first['unit']})" if first["unit"] in TIME_UNITS else first["label"]
        )
        lines.append(f"| {_cell(label)} | {target_text(first)} | " + " | ".join(cells) + " |")
    lines.append("")
    for column, record in zip(columns, records, strict=True):
        flags = "; ".join(record["flags"])
        lines.append(
            f"- {column} {machine_text(record['machine'])}. {provenance_text(record)}."
            + (f" Flagged: {flags}." if flags else "")
        )
    return "\n".join(lines) + "\n"


# ---- the machines table --------------------------------------------------------------------
NO_MACHINES = "No machine summary is committed yet.\n"


def machines_table(directory: Path) -> str | None:
    """pipeline.compare's Markdown of the committed summaries; None where it does not exist yet."""
    try:
        compare = importlib.import_module("pipeline.compare")
    except ModuleNotFoundError:
        return None
    render = getattr(compare, "markdown", None)
    if render is None:
        return None
    summaries = sorted(directory.glob("*.json"))
    if not summaries:
        return NO_MACHINES
    # paths as the table shows them: relative to the repository, whichever checkout this is
    root = REPO if directory.resolve().is_relative_to(REPO) else directory
    with contextlib.chdir(root):
        return render([path.resolve().relative_to(root.resolve()) for path in summaries])


def real_sets_table() -> str:
    """real_sets.py's own table of its records (benchmarks/records/real/*.json)."""
    real_sets = importlib.import_module("real_sets")
    paths = sorted(real_sets.RECORDS.glob("*.json"))
    return real_sets.table([json.loads(p.read_text(encoding="utf-8")) for p in paths]) + "\n"


# ---- blocks --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sources:
    """Where each block's text comes from."""

    records: dict[str, list[dict[str, Any]]]
    scripts: Sequence[str]
    machines: Callable[[], str | None]
    real_sets: Callable[[], str] = real_sets_table

    @classmethod
    def committed(cls, records_dir: Path = RECORDS_DIR, machines_dir: Path = MACHINES_DIR):
        scripts = script_names()
        return cls(
            load_records(records_dir, scripts), scripts, lambda: machines_table(machines_dir)
        )

    def text(self, name: str, where: Path) -> str | None:
        """The block's text; None where its source cannot render it yet (left as it is)."""
        if name == MACHINES:
            return self.machines()
        if name == OWN_TABLE:
            return self.real_sets()
        if name in self.scripts:
            return benchmark_table(name, self.records.get(name, []))
        raise PipelineError(
            f"{where}: generated block {name!r} has no source: name a script of benchmarks/ "
            f"({', '.join(self.scripts)}), {OWN_TABLE!r} or {MACHINES!r}."
        )


@dataclass
class Outcome:
    text: str
    stale: list[str]
    untouched: list[str]


def regenerate(text: str, sources: Sources, where: Path) -> Outcome:
    """`text` with every generated block rewritten; which were out of step, which left alone."""
    _check_markers(text, where)
    stale: list[str] = []
    untouched: list[str] = []

    def replace(match: re.Match[str]) -> str:
        name = match["name"]
        new = sources.text(name, where)
        if new is None:
            untouched.append(name)
            return match[0]
        if new != match["body"]:
            stale.append(name)
        return match["start"] + new + match["end"]

    return Outcome(BLOCK.sub(replace, text), stale, untouched)


def _check_markers(text: str, where: Path) -> None:
    """Every start marker has its end marker: a lone one would hide a block from the check."""
    paired = sum(2 for _ in BLOCK.finditer(text))
    markers = ANY_MARKER.findall(text)
    if paired != len(markers):
        names = sorted({name for name, _ in markers})
        raise PipelineError(
            f"{where}: the generated-block markers of {', '.join(names)} do not pair up: each "
            "block needs '<!-- generated:NAME:start -->' on a line of its own, then its text, "
            "then '<!-- generated:NAME:end -->'."
        )


def run(files: Sequence[Path], sources: Sources, *, check: bool) -> int:
    """Rewrite (or, with check, compare) every block of `files`; 1 when check finds one stale."""
    stale_anywhere = False
    for path in files:
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8")
        outcome = regenerate(text, sources, path)
        for name in outcome.untouched:
            print(f"{path}: block {name!r} left as it is (its source cannot render it yet)")
        if outcome.stale:
            stale_anywhere = True
            verb = "out of step with its records" if check else "rewritten"
            for name in outcome.stale:
                print(f"{path}: block {name!r} {verb}")
            if not check:
                atomic.write_text(path, outcome.text)
    if check and stale_anywhere:
        print("Run: python benchmarks/doc_tables.py, then commit the docs with the records.")
        return 1
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 when stale")
    parser.add_argument("files", nargs="*", type=Path, help="default: README.md and docs/*.md")
    args = parser.parse_args(argv)
    try:
        return run(args.files or doc_files(), Sources.committed(), check=args.check)
    except PipelineError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
