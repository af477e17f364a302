"""Load, normalise and validate the configuration: one schema for the CLI and the workflow.

Values arrive as YAML, as `key=value` on the command line, or through Snakemake's
`--config`, which passes `deterministic=true` as the *string* 'true' and nested values as strings.
`normalize()` turns such strings into the types the schema asks for, in this one place,
and never reads 'false' as true; device names are read in lower case, as `--device` reads
them. Files are layered as Snakemake layers them (config/config.yaml, then each
`--configfile`, then the settings), and every layer keeps its name, so an error names the file
a bad value came from. No torch here: the Snakefile imports this at parse time.
"""

from __future__ import annotations

import copy
import difflib
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from pipeline import formats
from pipeline.config_files import read_yaml
from pipeline.errors import ConfigError

log = logging.getLogger("pipeline")

DEFAULT_CONFIG = Path("config/config.yaml")
COMMAND_LINE = "the command line"
DEFAULTS = "the defaults"
PRESETS_FOLDER = "presets"  # config/presets/: files meant to go under a user's own
TRUE_WORDS = frozenset({"true", "yes", "on", "1"})
FALSE_WORDS = frozenset({"false", "no", "off", "0"})


def load_schema() -> dict[str, Any]:
    """The config schema, parsed once per process (read-only: defaults are copied, never shared)."""
    return formats.schema("config")


def parse_bool(value: Any) -> Any:
    """'true'/'yes'/'on'/'1' -> True, 'false'/'no'/'off'/'0' -> False; anything else unchanged."""
    if isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
    return value


def _parse_number(value: str, integer: bool) -> Any:
    try:
        number = float(value)
    except ValueError:
        return value
    if integer:
        return (
            int(number)
            if number.is_integer() and "." not in value and "e" not in value.lower()
            else value
        )
    return number


def _types(schema: dict[str, Any]) -> set[str]:
    kinds = schema.get("type", [])
    found = {kinds} if isinstance(kinds, str) else set(kinds)
    for option in schema.get("anyOf", []):
        found |= _types(option)
    if any(isinstance(item, bool) for item in schema.get("enum", [])):
        found.add("boolean")
    return found


def normalize(value: Any, schema: dict[str, Any] | None = None) -> Any:
    """Coerce strings to the schema's types where unambiguous ('3' -> 3, 'true' -> True)."""
    schema = load_schema() if schema is None else schema
    kinds = _types(schema)
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        others = schema.get("additionalProperties")
        others = others if isinstance(others, dict) else {}
        return {key: normalize(item, properties.get(key, others)) for key, item in value.items()}
    if isinstance(value, list):
        return [normalize(item, schema.get("items", {})) for item in value]
    if (
        type(value) is int
        and value in (0, 1)
        and "boolean" in kinds
        and not kinds & {"integer", "number"}
    ):
        return bool(value)  # `snakemake --config deterministic=1` passes the int 1 ('1' is 'true')
    if isinstance(value, str):
        if value.strip().lower() == "null" and "null" in kinds:
            return None
        if "boolean" in kinds and parse_bool(value) is not value:
            return parse_bool(value)
        if "integer" in kinds:
            value = _parse_number(value, integer=True)
        if isinstance(value, str) and "number" in kinds:
            value = _parse_number(value, integer=False)
    return value


def _device_names_in_lower_case(config: dict[str, Any]) -> dict[str, Any]:
    """`device` and the names in `bench.backends` in lower case without surrounding spaces, as
    `--device` reads a name (device.resolve_device): `device: CPU` is `--device CPU`, and every
    reader of the config (run names such as cpu-bf16, env.json, device.py) sees one spelling."""
    if isinstance(config.get("device"), str):
        config["device"] = config["device"].strip().lower()
    bench = config.get("bench")
    if isinstance(bench, dict) and isinstance(bench.get("backends"), list):
        bench["backends"] = [
            name.strip().lower() if isinstance(name, str) else name for name in bench["backends"]
        ]
    return config


def _extend_with_default(validator_class):
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, subschema in properties.items():
                if "default" in subschema:
                    instance.setdefault(name, copy.deepcopy(subschema["default"]))
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


_DefaultingValidator = _extend_with_default(jsonschema.Draft202012Validator)


Origin = Callable[[Sequence[str]], str]


def close_match(word: Any, choices: Iterable[Any]) -> str | None:
    """The choice nearest to a misspelt word (difflib's closest), or None."""
    strings = [choice for choice in choices if isinstance(choice, str)]
    if not isinstance(word, str) or not strings:
        return None
    found = difflib.get_close_matches(word, strings, n=1)
    return found[0] if found else None


def _describe(error: jsonschema.ValidationError, origin: Origin) -> str:
    """One paragraph: the key path, the file (or command line) it came from, the value, what
    is allowed, and for a misspelt key or choice the closest valid one."""
    path = [str(part) for part in error.absolute_path]
    key = ".".join(path) or "(top level)"
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        unknown = sorted(set(error.instance) - set(allowed))
        where = f"{key}." if path else ""
        named = [f"{where}{name} in {origin([*path, name])}" for name in unknown]
        close = close_match(unknown[0], allowed)
        hint = f" Did you mean {where}{close}?" if close else ""
        return (
            f"Unknown config key{'s' if len(unknown) > 1 else ''} {', '.join(named)}.{hint} "
            f"Valid keys{' in ' + key if path else ''}: {', '.join(allowed)}."
        )
    description = error.schema.get("description")
    expected = f" ({key}: {description})" if description else ""
    close = close_match(error.instance, error.schema.get("enum", []))
    hint = f" Did you mean {close!r}?" if close and close != error.instance else ""
    return (
        f"Config key {key} = {error.instance!r} in {origin(path)} is not valid: "
        f"{error.message}{expected}.{hint}"
    )


# The keys `precision` replaced, and what each of their values asks for.
LEGACY_PRECISION_KEYS = ("amp", "amp_dtype")


def legacy_precision(amp: Any, amp_dtype: Any) -> str:
    """The `precision` that the replaced keys amp and amp_dtype asked for (amp: true trained
    in amp_dtype; with amp: auto, amp_dtype only chose cuda's dtype, which auto now fixes)."""
    amp = parse_bool(amp)
    if amp == "measured":
        return "measured"
    if amp is False:
        return "fp32"
    if amp is True:
        return amp_dtype if amp_dtype in ("fp16", "bf16") else "fp16"
    return "auto"


def upgrade_legacy_precision(config: dict[str, Any]) -> dict[str, Any]:
    """A config written before `precision` replaced amp and amp_dtype (a checkpoint's), in
    today's keys; user input with the old keys is refused instead (see validate)."""
    if not any(key in config for key in LEGACY_PRECISION_KEYS):
        return config
    upgraded = {k: v for k, v in config.items() if k not in LEGACY_PRECISION_KEYS}
    upgraded.setdefault("precision", legacy_precision(config.get("amp"), config.get("amp_dtype")))
    return upgraded


def _refuse_legacy_precision(config: dict[str, Any], origin: Origin) -> None:
    given = [key for key in LEGACY_PRECISION_KEYS if key in config]
    if not given:
        return
    named = ", ".join(f"{key} = {config[key]!r} in {origin([key])}" for key in given)
    wanted = (
        legacy_precision(config["amp"], config.get("amp_dtype"))
        if "amp" in config
        else config["amp_dtype"]
    )
    raise ConfigError(
        f"Config key{'s' if len(given) > 1 else ''} {named}: amp and amp_dtype were replaced by "
        f"one key, precision (auto, fp32, fp16, bf16 or measured); write precision: {wanted} "
        "(amp: false is fp32, amp: true with amp_dtype: bf16 is bf16, amp: measured is measured)."
    )


def _refuse_non_finite(value: Any, origin: Origin, path: tuple[str, ...] = ()) -> None:
    """NaN and infinity pass every minimum and maximum of the schema (a comparison with NaN is
    false): eval.score_threshold=nan would count no detection, and read as an F1 of 0."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            _refuse_non_finite(item, origin, (*path, str(key)))
    elif isinstance(value, list):
        for item in value:
            _refuse_non_finite(item, origin, path)
    elif isinstance(value, float) and not math.isfinite(value):
        key = ".".join(path)
        raise ConfigError(
            f"Config key {key} = {value!r} in {origin(path)} is not valid: {value!r} is not a "
            "finite number."
        )


def validate(
    config: dict[str, Any], source: str = "the configuration", origin: Origin | None = None
) -> dict[str, Any]:
    """Normalise, fill defaults and validate; raises ConfigError naming the key and value, and
    where it came from: `origin(key path)` (see `Layer.origin`), else `source`."""
    _refuse_legacy_precision(config, origin or (lambda path: source))
    config = _device_names_in_lower_case(normalize(copy.deepcopy(config)))
    _refuse_non_finite(config, origin or (lambda path: source))
    validator = _DefaultingValidator(load_schema())
    errors = sorted(
        validator.iter_errors(config), key=lambda e: (len(e.absolute_path), str(e.absolute_path))
    )
    if errors:
        raise ConfigError(_describe(errors[0], origin or (lambda path: source)))
    check_relations(config, source)
    return config


def check_relations(config: dict[str, Any], source: str) -> None:
    """Rules across keys that a JSON schema cannot say."""
    measured = config["precision"] == "measured" or "measured" in (
        (config.get("sweep") or {}).get("precision") or []
    )
    bench = config["bench"]
    if measured and ("train" not in bench["modes"] or "fp32" not in bench["precisions"]):
        raise ConfigError(
            f"precision=measured in {source} chooses from the training benchmarks against fp32, but "
            f"bench.modes = {bench['modes']} and bench.precisions = {bench['precisions']}: "
            "include train in bench.modes and fp32 in bench.precisions, or set precision to "
            "auto, fp32, fp16 or bf16."
        )
    augment = config["data"]["augment"]
    if augment["scale_min"] > augment["scale_max"]:
        raise ConfigError(
            f"Config keys data.augment.scale_min = {augment['scale_min']} and scale_max = "
            f"{augment['scale_max']} in {source} are not valid: scale_min must not exceed scale_max."
        )
    _check_carved_fractions(config["data"], source)
    evaluation = config["eval"]
    if (
        evaluation["score_threshold"] is not None
        and evaluation["score_threshold"] < evaluation["min_score"]
    ):
        raise ConfigError(
            f"Config keys eval.score_threshold = {evaluation['score_threshold']} and eval.min_score = "
            f"{evaluation['min_score']} in {source} are not valid: detections scoring below "
            "eval.min_score are dropped before any figure is counted, so a lower score threshold "
            "would count the same detections as eval.min_score itself. Lower eval.min_score (0 "
            "keeps every detection) or raise eval.score_threshold."
        )
    synthetic = config["data"]["synthetic"]
    if synthetic["min_objects"] > synthetic["max_objects"]:
        raise ConfigError(
            f"Config keys data.synthetic.min_objects = {synthetic['min_objects']} and max_objects = "
            f"{synthetic['max_objects']} in {source} are not valid: min_objects must not exceed max_objects."
        )
    if synthetic["min_object_size"] > synthetic["max_object_size"]:
        raise ConfigError(
            f"Config keys data.synthetic.min_object_size = {synthetic['min_object_size']} and "
            f"max_object_size = {synthetic['max_object_size']} in {source} are not valid: the minimum "
            "must not exceed the maximum."
        )
    if synthetic["max_object_size"] > synthetic["image_size"]:
        raise ConfigError(
            f"Config key data.synthetic.max_object_size = {synthetic['max_object_size']} in {source} is "
            f"larger than data.synthetic.image_size = {synthetic['image_size']}."
        )


def _check_carved_fractions(data: dict[str, Any], source: str) -> None:
    """data.val_fraction and data.test_fraction carve a user's own training split
    (pipeline.data.holdout): the synthetic set generates its splits, and together they must
    leave the training split some of its images."""
    given = {key: data[key] for key in ("val_fraction", "test_fraction") if data[key] is not None}
    if not given:
        return
    named = " and ".join(f"data.{key} = {value}" for key, value in given.items())
    if data["format"] == "synthetic":
        raise ConfigError(
            f"Config key(s) {named} in {source} carve splits out of a data set's training split, "
            "but data.format is synthetic, whose validation and test splits are generated "
            "(data.synthetic.num_val, num_test). Set data.format to coco or voc for your own "
            "data, or remove the fraction(s)."
        )
    if sum(given.values()) >= 1:
        raise ConfigError(
            f"Config keys {named} in {source} are not valid: together they carve "
            f"{sum(given.values()):g} of the training split, leaving nothing to train on. Their "
            "sum must stay below 1."
        )


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """`train.lr=0.01 data.classes=[a,b]` -> nested dict; values are read as YAML."""
    result: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"Setting {item!r} is not of the form key=value (for example train.epochs=5)."
            )
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as error:
            raise ConfigError(
                f"Setting {item!r}: the value is not valid YAML ({error})."
            ) from error
        node = result
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"Setting {item!r} conflicts with an earlier setting of {part}.")
        node[parts[-1]] = value
    return result


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge: `update` wins; neither input is changed."""
    merged = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


@dataclass(frozen=True)
class Layer:
    """One file, or the command line's settings, as merged over the layers before it."""

    source: str  # what an error calls it: a file's path, or the command line
    values: dict[str, Any]

    @classmethod
    def from_file(cls, path: str | Path) -> Layer:
        """A config file, named by its path relative to the working directory when inside it."""
        relative = os.path.relpath(path)
        return cls(str(path) if relative.startswith("..") else relative, read_yaml(path))

    @staticmethod
    def origin(layers: Sequence[Layer], path: Sequence[str]) -> str:
        """Which layer set the value at `path` (the last one holding it, or a non-mapping above
        it), else the schema's defaults."""
        for layer in reversed(layers):
            node: Any = layer.values
            for part in path:
                if not isinstance(node, Mapping):
                    return layer.source  # it replaced the whole mapping
                if part not in node:
                    break
                node = node[part]
            else:
                return layer.source
        return DEFAULTS


def config_paths(given: Sequence[str | Path] | None) -> list[Path]:
    """The config files of a command, as Snakemake layers them: config/config.yaml (where the
    command runs from holds it), then each --configfile given, later ones winning."""
    base = [DEFAULT_CONFIG] if DEFAULT_CONFIG.exists() else []
    return base + [Path(path) for path in given or ()]


def merge_layers(layers: Sequence[Layer]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for layer in layers:
        config = merge(config, layer.values)
    return config


def leaves(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every value under nested settings by its dotted key (an empty mapping is a value)."""
    found: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping) and value:
            found.update(leaves(value, f"{prefix}{key}."))
        else:
            found[f"{prefix}{key}"] = value
    return found


def _is_preset(layer: Layer) -> bool:
    return Path(layer.source).parent.name == PRESETS_FOLDER


def _warn_of_presets_layered_last(layers: Sequence[Layer]) -> None:
    """A preset layered after a file of the user's overrides what that file set, as the later
    file always wins: most often the files were given in the wrong order (presets go first)."""
    for index, preset in enumerate(layers):
        if not _is_preset(preset):
            continue
        theirs = leaves(preset.values)
        for mine in layers[:index]:
            if mine.source in (COMMAND_LINE, str(DEFAULT_CONFIG)) or _is_preset(mine):
                continue  # the shipped defaults are what presets amend
            lost = [
                f"{key} ({value!r} -> {theirs[key]!r})"
                for key, value in leaves(mine.values).items()
                if key in theirs and theirs[key] != value
            ]
            if lost:
                log.warning(
                    "%s, given after %s, overrides what it sets: %s. Later config files win: if "
                    "%s is your own, give it after the presets (--configfile %s %s).",
                    preset.source,
                    mine.source,
                    ", ".join(lost),
                    mine.source,
                    preset.source,
                    mine.source,
                )


def validate_layers(
    layers: Sequence[Layer], merged: dict[str, Any] | None = None
) -> dict[str, Any]:
    """`merged` (default: the layers merged in order) validated, an error naming the layer its
    bad value came from."""
    _warn_of_presets_layered_last(layers)
    source = " + ".join(layer.source for layer in layers) or DEFAULTS
    return validate(
        merge_layers(layers) if merged is None else merged,
        source,
        lambda path: Layer.origin(layers, path),
    )


def config_layers(
    paths: str | Path | Sequence[str | Path] | None = None, overrides: Iterable[str] = ()
) -> list[Layer]:
    """The files (in order) and `key=value` overrides of a command, as layers."""
    if paths is None:
        paths = []
    elif isinstance(paths, str | Path):
        paths = [paths]
    layers = [Layer.from_file(path) for path in paths]
    items = list(overrides)
    if items:
        layers.append(Layer(COMMAND_LINE, parse_overrides(items)))
    return layers


def load_config(
    paths: str | Path | Sequence[str | Path] | None = None, overrides: Iterable[str] = ()
) -> dict[str, Any]:
    """YAML files merged in order, later ones winning (or the schema's defaults alone), then
    `key=value` overrides, validated; as Snakemake layers `--configfile A B --config k=v`."""
    return validate_layers(config_layers(paths, overrides))
