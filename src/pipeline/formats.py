"""The formats of the files the stages write: one JSON schema each, in `schemas/`.

A schema is named after its file (`eval` for `schemas/eval.schema.yaml`) and names its format
tag (`format: {const: pipeline.eval/1}`); parts several files share (a memory reading, the
metrics by object size) are defined once, in `common.schema.yaml`. The files a decision rests
on (benchmarks and precision choices, which `precision: measured` trains by) are checked where they
are read, so one that a different version wrote, or that was edited, stops naming the place
where it goes wrong; the report reads the others leniently, and the test suite holds every
writer to its schema. Nothing here imports torch: the report and `precision: measured` run without it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml

SCHEMA_DIR = Path(__file__).parent / "schemas"
SUFFIX = ".schema.yaml"
MESSAGE_LIMIT = 200  # jsonschema repeats the offending value: a whole metrics block, say


@functools.cache
def schema(name: str) -> dict[str, Any]:
    """The parsed schema `schemas/<name>.schema.yaml` (read-only: it is shared). Parsed by
    libyaml where PyYAML has it (its wheels do): a tenth of the pure-Python parser's time, paid
    by every command and Snakemake job that validates a config or a file."""
    return yaml.load(
        (SCHEMA_DIR / f"{name}{SUFFIX}").read_text(encoding="utf-8"),
        Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader),  # safe: no Python objects
    )


def names() -> list[str]:
    """Every file format with a schema here (the configuration's schema is config.py's)."""
    return sorted(
        path.name.removesuffix(SUFFIX)
        for path in SCHEMA_DIR.glob(f"*{SUFFIX}")
        if "$id" in schema(path.name.removesuffix(SUFFIX))
    )


def format_tag(name: str) -> str | None:
    """The `format` value a file of this schema carries; None for one without a tag."""
    return schema(name).get("properties", {}).get("format", {}).get("const")


def name_for_tag(tag: str) -> str | None:
    """The schema of the files tagged `tag` (pipeline.eval/1 -> eval); None if none is."""
    return next((name for name in names() if format_tag(name) == tag), None)


@functools.cache
def validator(name: str) -> Any:
    """A Draft 2020-12 validator of schema `name`, resolving references to the other schemas."""
    import jsonschema
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    registry = Registry().with_resources(
        (schema(other)["$id"], Resource.from_contents(schema(other), DRAFT202012))
        for other in names()
    )
    return jsonschema.Draft202012Validator(schema(name), registry=registry)


def problem(document: Any, name: str) -> str | None:
    """Where `document` departs from schema `name`, in one phrase ('does not match
    eval.schema.yaml at metrics/f1: ...'); None when it matches."""
    from jsonschema.exceptions import best_match

    error = best_match(validator(name).iter_errors(document))
    if error is None:
        return None
    where = "/".join(str(part) for part in error.absolute_path) or "(top level)"
    message = error.message
    if len(message) > MESSAGE_LIMIT:
        message = message[: MESSAGE_LIMIT - 3] + "..."
    return f"does not match {name}{SUFFIX} at {where}: {message}"
