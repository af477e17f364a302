"""Reading one config file: YAML as a mapping of keys, a key set twice refused, and every way a
file can fail to read said in one line naming it. No torch here: the Snakefile imports this at
parse time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pipeline.errors import ConfigError


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key set twice in one mapping: plain YAML keeps the last
    without a word, so a second `data:` block at the end of a file would drop every key of the
    first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[str, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: keys written beside win
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in first_line:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"the key {key!r} is set a second time (first on line {first_line[key]}); "
                    "only the last would count: merge them into one",
                    key_node.start_mark,
                )
            if isinstance(key, str):
                first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's error on one line, where it is: its own text draws the line with a caret under
    the place, over several lines."""
    if not isinstance(error, yaml.MarkedYAMLError) or error.problem_mark is None:
        return f"{error}."
    mark = error.problem_mark
    context = f"{error.context}, " if error.context else ""
    return f"{context}{error.problem} (line {mark.line + 1}, column {mark.column + 1})."


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = yaml.load(
            path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader
        )  # safe: no Python objects
    except FileNotFoundError as error:
        raise ConfigError(f"Config file {path} does not exist.") from error
    except IsADirectoryError as error:
        raise ConfigError(f"Config file {path} is a folder, not a YAML file.") from error
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"Config file {path} is not a YAML text file: the byte at offset {error.start} is "
            f"not UTF-8 ({error.reason}). Save it as UTF-8 text."
        ) from error
    except OSError as error:
        raise ConfigError(
            f"Config file {path} cannot be read: {error.strerror or error}."
        ) from error
    except yaml.YAMLError as error:
        raise ConfigError(
            f"Config file {path} is not valid YAML: {_yaml_problem(error)}"
        ) from error
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"Config file {path} must hold a mapping of keys, not {type(data).__name__}."
        )
    return data
