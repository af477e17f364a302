"""The Jinja2 templates (autoescaping on, formatting.py's functions as filters) and the
stylesheet, package data both, shared by the report and the comparison page."""

from __future__ import annotations

from functools import cache
from importlib import resources

import jinja2

from pipeline.report.formatting import FILTERS


def stylesheet() -> str:
    """static/report.css, inlined by the page template so the report stays one file."""
    return resources.files(__package__).joinpath("static", "report.css").read_text("utf-8")


@cache
def templates() -> jinja2.Environment:
    """The templates, with autoescaping on and formatting.py's functions as filters."""
    environment = jinja2.Environment(
        loader=jinja2.PackageLoader(__package__, "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        finalize=lambda value: "" if value is None else value,  # a null in a file shows as nothing
    )
    environment.filters.update(FILTERS)
    return environment
