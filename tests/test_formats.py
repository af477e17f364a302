"""The results files' schemas: valid, one per format tag, and what a mismatch says.

That every writer's output matches its schema is checked wherever the suite writes one
(`written_documents_match_their_schemas` in conftest.py) and for every file of a real
workflow run (tests/test_workflow.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator
from report_fixtures import write_results_tree
from results_schemas import check_results

from pipeline import atomic, environment, formats, measured, prediction, profiling
from pipeline.commands import evaluate
from pipeline.engine import trainer
from pipeline.errors import DataError
from pipeline.summary import build as summary_build

WRITERS_TAGS = {
    "bench": measured.BENCH_FORMAT,
    "choice": measured.FORMAT,
    "env": environment.FORMAT,
    "eval": evaluate.FORMAT,
    "predictions": evaluate.PREDICTIONS_FORMAT,
    "predict": prediction.FORMAT,
    "profile": profiling.FORMAT,
    "train_summary": trainer.SUMMARY_FORMAT,
    "summary": summary_build.FORMAT,
}


@pytest.mark.parametrize("name", formats.names())
def test_every_schema_is_a_valid_draft_2020_12_schema_named_after_its_file(name: str) -> None:
    schema = formats.schema(name)
    Draft202012Validator.check_schema(schema)
    assert schema["$id"] == f"{name}.schema.yaml"
    assert schema["title"] and schema["description"]


def test_each_writers_format_tag_is_the_one_its_schema_names() -> None:
    assert {name: formats.format_tag(name) for name in WRITERS_TAGS} == WRITERS_TAGS
    for name, tag in WRITERS_TAGS.items():
        assert formats.name_for_tag(tag) == name
    assert formats.name_for_tag("pipeline.eval/0") is None


def operators(**changes: object) -> dict[str, object]:
    """An operator profile (operators.json) as profiling writes one, with `changes`."""
    block = {
        "activities": ["CPU"],
        "batch_size": 4,
        "steps": 3,
        "sorted_by": "self_cpu_ms",
        "top_operators": [],
        "trace": "trace.json",
        "note": None,
    }
    return block | changes


def test_a_mismatch_names_the_schema_the_place_and_what_is_wrong() -> None:
    assert formats.problem(operators(), "operators") is None
    row = {"name": "aten::conv2d", "kind": "operator", "calls": "many", "share": 1.0}
    row |= {"self_cpu_ms": 1.0, "cpu_total_ms": 1.0, "self_device_ms": 0.0}
    assert formats.problem(operators(top_operators=[row]), "operators") == (
        "does not match operators.schema.yaml at top_operators/0/calls: "
        "'many' is not of type 'integer'"
    )
    assert formats.problem([operators()], "operators").startswith(
        "does not match operators.schema.yaml at (top level): [{'activities': ['CPU']"
    )


def test_a_message_quoting_a_large_value_is_cut_short() -> None:
    problem = formats.problem(operators(steps="x" * 5000), "operators")
    assert problem is not None and problem.startswith(
        "does not match operators.schema.yaml at steps: 'xxx"
    )
    assert len(problem) < 300 and problem.endswith("...")


def test_a_writer_that_drifts_from_its_schema_fails_the_suite(tmp_path: Path) -> None:
    """The conftest check is live: a tagged document its schema rejects is not written."""
    with pytest.raises(AssertionError, match=r"profile\.schema\.yaml at \(top level\)"):
        atomic.write_json(tmp_path / "profile.json", {"format": profiling.FORMAT})
    assert not (tmp_path / "profile.json").exists()
    atomic.write_json(tmp_path / "untagged.json", {"anything": 1})  # no tag: no schema


def test_a_choice_file_of_another_shape_is_refused_naming_the_file_and_place(
    tmp_path: Path,
) -> None:
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"format": measured.FORMAT, "backend": "cpu", "choices": [{}]}))
    with pytest.raises(
        DataError,
        match=r"cpu\.json is not a precision choice file: it does not "
        r"match choice\.schema\.yaml at choices/0: 'backend' is a required",
    ):
        measured.read_choices(path)


def test_the_report_tests_full_results_tree_is_shaped_like_real_files(tmp_path: Path) -> None:
    """The fixture the report tests start from; their variants leave pieces out on purpose.
    (Benchmark script records live under benchmarks/records, not in a results folder.)"""
    checked = check_results(write_results_tree(tmp_path))
    assert set(checked) == set(formats.names()) - {
        "common",
        "choice",
        "summary",
        "predict",
        "benchmark_record",
    }
