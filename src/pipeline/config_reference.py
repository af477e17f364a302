"""The configuration reference: every key of the config schema as Markdown tables, which the
configuration docs embed verbatim (tests/test_config.py checks they are in step)."""

from __future__ import annotations

import json
from typing import Any

from pipeline.config import load_schema


def _default_text(spec: dict[str, Any]) -> str:
    if "default" not in spec:
        return "—"
    value = spec["default"]
    if isinstance(value, bool) or value is None:
        return f"`{str(value).lower() if value is not None else 'null'}`"
    return f"`{json.dumps(value) if isinstance(value, list | dict) else value}`"


def _allowed_text(spec: dict[str, Any]) -> str:
    def word(value: Any) -> str:
        return f"`{str(value).lower() if isinstance(value, bool) else value}`"

    if "enum" in spec:
        return " / ".join(word(v) for v in spec["enum"])
    if "anyOf" in spec:
        return " or ".join(
            word(option["const"]) if "const" in option else _allowed_text(option)
            for option in spec["anyOf"]
        )
    kind = spec.get("type", "")
    text = " or ".join(kind) if isinstance(kind, list) else kind
    if kind == "array":
        items = spec.get("items", {})
        text = "list of " + (
            " / ".join(word(v) for v in items["enum"]) if "enum" in items else items.get("type", "")
        )
    bounds = [
        f"{sign} {spec[key]}"
        for key, sign in (
            ("minimum", "≥"),
            ("exclusiveMinimum", ">"),
            ("maximum", "≤"),
            ("exclusiveMaximum", "<"),
        )
        if key in spec
    ]
    if "pattern" in spec:
        bounds.append(f"matching `{spec['pattern']}`")
    return " ".join([text, ", ".join(bounds)]).strip()


def reference_markdown() -> str:
    """Every key of the schema as Markdown tables (docs/configuration.md embeds this verbatim)."""
    header = "| key | default | allowed | meaning |\n| --- | --- | --- | --- |"
    lines: list[str] = []

    def rows(properties: dict[str, Any], prefix: str) -> None:
        for name, spec in properties.items():
            key = prefix + name
            if spec.get("type") == "object" and "properties" in spec:
                continue
            meaning = spec.get("description", "").replace("<", "&lt;").replace(">", "&gt;")
            cells = [f"`{key}`", _default_text(spec), _allowed_text(spec), meaning]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")

    def sections(properties: dict[str, Any], prefix: str) -> None:
        for name, spec in properties.items():
            if spec.get("type") == "object" and "properties" in spec:
                key = prefix + name
                description = spec.get("description", "")
                lines.extend(["", f"### `{key}`", ""])
                if description:
                    lines.extend([description[0].upper() + description[1:] + ".", ""])
                lines.append(header)
                rows(spec["properties"], key + ".")
                sections(spec["properties"], key + ".")

    top = load_schema()["properties"]
    lines.append(header)
    rows(top, "")
    sections(top, "")
    return "\n".join(lines) + "\n"
