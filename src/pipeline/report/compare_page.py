"""The comparison of machines (pipeline.compare) as one self-contained HTML page: the
template compare.html.j2 with the report's stylesheet, autoescaped like the report."""

from __future__ import annotations

from datetime import UTC, datetime

from pipeline.compare import Section
from pipeline.report.templating import stylesheet, templates


def render(sections: list[Section], generated: datetime | None = None) -> str:
    page = templates().get_template("compare.html.j2")
    return page.render(
        sections=sections, generated=generated or datetime.now(UTC), stylesheet=stylesheet()
    )
