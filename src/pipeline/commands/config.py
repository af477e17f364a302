"""`python -m pipeline config`: the merged configuration, and where each value comes from.

Layered as every other command and Snakemake layer it: config/config.yaml (where it exists),
then each --configfile, then the settings. Each value is followed by the file it came from,
"command line", or "default" (the schema's). The output is YAML: saved, it is a config file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

from pipeline.cli import add_config_options, command_parser, config_layers_from_args
from pipeline.config import COMMAND_LINE, DEFAULTS, Layer, load_schema, validate_layers

LABELS = {DEFAULTS: "default", COMMAND_LINE: "command line"}
COMMENT_COLUMN = 40


def flow(value: Any) -> str:
    """A value as one line of YAML (lists and mappings in flow style, strings quoted if need be)."""
    return yaml.safe_dump([value], default_flow_style=True, width=10**6).strip()[1:-1]


def annotated(config: dict[str, Any], layers: Sequence[Layer]) -> str:
    """`config` as YAML in the schema's key order, each value followed by its layer."""
    lines: list[str] = []

    def walk(node: dict[str, Any], schema: dict[str, Any], path: list[str]) -> None:
        properties = schema.get("properties", {})
        indent = "  " * len(path)
        for key in [*properties, *(key for key in node if key not in properties)]:
            if key not in node:
                continue
            value, spec, here = node[key], properties.get(key, {}), [*path, key]
            if isinstance(value, dict) and value and "properties" in spec:
                lines.append(f"{indent}{key}:")
                walk(value, spec, here)
                continue
            origin = Layer.origin(layers, here)
            text = f"{indent}{key}: {flow(value)}"
            lines.append(f"{text.ljust(COMMENT_COLUMN)} # {LABELS.get(origin, origin)}")

    walk(config, load_schema(), [])
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = command_parser("config", __doc__)
    add_config_options(parser, "train.epochs=5")
    args = parser.parse_args(argv)
    layers = config_layers_from_args(args)
    config = validate_layers(layers)
    merged = ", ".join(LABELS.get(layer.source, layer.source) for layer in layers) or "nothing"
    print(f"# merged from: {merged}; keys no layer sets are the schema's defaults")
    print(annotated(config, layers), end="")
    return 0
