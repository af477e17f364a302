"""Benchmark scripts' records (benchmarks/harness.py) and the docs' tables generated from them
(benchmarks/doc_tables.py): a figure is written once, by the script, and every table is made
from the committed records."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest
from benchmark_modules import load

from pipeline import formats
from pipeline.environment import machine, machine_id
from pipeline.errors import PipelineError

harness = load("harness")
doc_tables = load("doc_tables")
REPO = Path(__file__).resolve().parents[1]


def a_record(created: str = "2026-12-05T10:00:00+00:00", ratio: float = 1.004) -> dict:
    """A record of trainer_overhead as the script writes one, on this machine."""
    figures = [
        harness.figure("ratio", "median A / median B", ratio, "ratio", target=("<=", 1.05)),
        harness.figure("a.median_ms", "median step time, A", 61.25, "ms"),
    ]
    document = harness.record(
        "trainer_overhead",
        figures,
        settings={"rounds": 40},
        flags=["A noisy: IQR 12% of its median"],
        argv=[str(REPO / "benchmarks" / "trainer_overhead.py"), "--rounds", "40"],
    )
    return document | {"created": created}


def write(directory: Path, document: dict) -> Path:
    path = harness.default_record_path(document)
    path = directory / path.relative_to(harness.RECORDS_DIR)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------- the records


def test_a_record_names_the_machine_the_commit_and_the_command_and_matches_its_schema() -> None:
    document = a_record()
    assert formats.problem(document, "benchmark_record") is None
    assert document["command"] == "python benchmarks/trainer_overhead.py --rounds 40"
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert document["commit"]["sha"] == head
    assert document["machine"] == machine()
    assert set(document["machine"]["cpu_native"]) == {"bf16", "fp16"}
    assert document["passed"] is True


def test_a_figure_passes_only_within_its_target_and_a_missed_one_fails_the_record() -> None:
    assert harness.figure("r", "r", 1.05, "ratio", target=("<=", 1.05))["passed"] is True
    assert harness.figure("r", "r", 1.06, "ratio", target=("<=", 1.05))["passed"] is False
    assert harness.figure("f", "f", 0.92, "F1", target=(">=", 0.93))["passed"] is False
    assert harness.figure("o", "o", None, "AP", target=(">=", 0.9))["passed"] is False
    assert harness.figure("m", "m", 12.0, "ms")["passed"] is None
    assert a_record(ratio=1.2)["passed"] is False


def test_records_go_by_default_under_benchmarks_records_one_per_script_machine_day_and_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(harness, "RECORDS_DIR", tmp_path)
    sha = "0123456" + "f" * 33
    document = a_record() | {"commit": {"sha": sha, "dirty": False}}
    args = argparse.Namespace(record=None, no_record=False)
    written = harness.write_record(args, document)
    day = f"{machine_id(machine())}-2026-12-05"
    assert written == tmp_path / "trainer_overhead" / f"{day}-0123456.json"
    assert json.loads(written.read_text()) == document
    dirty = document | {"commit": {"sha": sha, "dirty": True}}
    assert harness.default_record_path(dirty).name == f"{day}-0123456-dirty.json"
    assert harness.default_record_path(document | {"commit": None}).name == f"{day}.json"
    assert harness.write_record(argparse.Namespace(record=None, no_record=True), document) is None


def test_a_record_off_its_schema_is_never_written(tmp_path: Path) -> None:
    document = a_record() | {"figures": []}
    with pytest.raises(RuntimeError, match="figures"):
        harness.write_record(
            argparse.Namespace(record=tmp_path / "r.json", no_record=False), document
        )
    assert not (tmp_path / "r.json").exists()


def test_machines_that_differ_in_cpu_features_or_cpus_get_other_ids() -> None:
    here = machine()
    other_cpus = here | {"usable_cpus": here["usable_cpus"] + 1}
    other_native = json.loads(json.dumps(here))
    other_native["cpu_native"]["fp16"]["features"] = ["amx_fp16"]
    newer_torch = here | {"torch": "9.9.9"}
    ids = {machine_id(m) for m in (here, other_cpus, other_native)}
    assert len(ids) == 3
    assert machine_id(newer_torch) == machine_id(here)


# ---------------------------------------------------------------------------- the tables

DOC = """# Results

Text before, naming `<!-- generated:trainer_overhead:start -->` in prose.

<!-- generated:trainer_overhead:start -->
| figure | old |
<!-- generated:trainer_overhead:end -->

Text after.
"""


def sources(records: Path, machines: str | None = None) -> object:
    return doc_tables.Sources(
        doc_tables.load_records(records), doc_tables.script_names(), lambda: machines
    )


def test_real_sets_records_keep_their_own_folder_format_and_table(tmp_path: Path) -> None:
    """records/real/ holds real_sets.py's records: never read as harness records, and its block
    is real_sets.table's output."""
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "raccoon.json").write_text('{"format": "benchmarks.real_set/1"}')
    assert doc_tables.load_records(tmp_path) == {}
    doc = tmp_path / "results.md"
    doc.write_text("<!-- generated:real_sets:start -->\n<!-- generated:real_sets:end -->\n")
    own = doc_tables.Sources({}, doc_tables.script_names(), lambda: None, lambda: "| set |\n")
    doc_tables.run([doc], own, check=False)
    assert "| set |" in doc.read_text()


def test_every_generated_block_of_the_docs_is_in_step_with_the_committed_records(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = doc_tables.run(doc_tables.doc_files(), doc_tables.Sources.committed(), check=True)
    assert status == 0, capsys.readouterr().out


def test_a_block_out_of_step_is_named_then_rewritten_from_its_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = tmp_path / "records"
    write(records, a_record("2026-12-04T09:00:00+00:00", 1.004))
    write(records, a_record("2026-12-05T09:00:00+00:00", 1.2))
    doc = tmp_path / "results.md"
    doc.write_text(DOC, encoding="utf-8")

    assert doc_tables.run([doc], sources(records), check=True) == 1
    assert "block 'trainer_overhead' out of step" in capsys.readouterr().out
    assert doc.read_text() == DOC  # --check writes nothing

    assert doc_tables.run([doc], sources(records), check=False) == 0
    text = doc.read_text()
    assert text.startswith(DOC.split("<!-- generated:trainer_overhead:start -->\n")[0])
    assert text.endswith("\nText after.\n")
    assert "| median A / median B | ≤ 1.05 | 1.004, pass | 1.200, **FAIL** |" in text
    assert "| median step time, A (ms) |  | 61.25 | 61.25 |" in text
    assert "`python benchmarks/trainer_overhead.py --rounds 40`" in text
    assert "Flagged: A noisy: IQR 12% of its median." in text
    assert doc_tables.run([doc], sources(records), check=True) == 0


def test_a_script_without_records_says_how_to_make_one(tmp_path: Path) -> None:
    doc = tmp_path / "results.md"
    doc.write_text(DOC, encoding="utf-8")
    doc_tables.run([doc], sources(tmp_path / "none"), check=False)
    assert "No record yet: run `python benchmarks/trainer_overhead.py`" in doc.read_text()


def test_the_machines_block_is_left_as_it_is_until_compare_can_render_it(tmp_path: Path) -> None:
    doc = tmp_path / "results.md"
    block = "<!-- generated:machines:start -->\nby hand\n<!-- generated:machines:end -->\n"
    doc.write_text(block, encoding="utf-8")
    assert doc_tables.run([doc], sources(tmp_path, machines=None), check=True) == 0
    assert doc_tables.run([doc], sources(tmp_path, machines="| m |\n"), check=True) == 1
    doc_tables.run([doc], sources(tmp_path, machines="| m |\n"), check=False)
    assert doc.read_text() == block.replace("by hand\n", "| m |\n")


def test_a_block_without_a_source_or_without_its_end_marker_is_an_error_naming_the_file(
    tmp_path: Path,
) -> None:
    doc = tmp_path / "page.md"
    doc.write_text(DOC.replace("trainer_overhead", "typed_by_hand"), encoding="utf-8")
    with pytest.raises(PipelineError, match=r"page\.md: generated block 'typed_by_hand' has no"):
        doc_tables.run([doc], sources(tmp_path), check=True)
    doc.write_text(DOC.replace("<!-- generated:trainer_overhead:end -->", ""), encoding="utf-8")
    with pytest.raises(PipelineError, match=r"page\.md: the generated-block markers"):
        doc_tables.run([doc], sources(tmp_path), check=True)


def test_a_record_in_the_wrong_folder_or_off_its_schema_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, a_record())
    moved = tmp_path / "input_pipeline" / path.name
    moved.parent.mkdir()
    path.rename(moved)
    with pytest.raises(PipelineError, match="is of benchmark 'trainer_overhead' but lies in"):
        doc_tables.load_records(tmp_path)
    moved.write_text(json.dumps(a_record() | {"benchmark": "input_pipeline", "machine": {}}))
    with pytest.raises(PipelineError, match=r"input_pipeline/.*does not match benchmark_record"):
        doc_tables.load_records(tmp_path)
