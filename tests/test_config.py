"""Config loading: schema defaults, `key=value` overrides, Snakemake's strings, and error messages."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.config import (
    DEFAULT_CONFIG,
    DEFAULTS,
    Layer,
    config_paths,
    load_config,
    load_schema,
    merge,
    normalize,
    parse_bool,
    parse_overrides,
    upgrade_legacy_precision,
    validate,
)
from pipeline.config_files import read_yaml
from pipeline.config_reference import reference_markdown
from pipeline.errors import ConfigError
from pipeline.setting_groups import differing_keys, result_settings, speed_settings

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("data", "model", "train", "eval", "bench", "profile", "predict", "cluster", "sweep")


def _schema_keys(schema: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, dict]]:
    """Every property of the schema as (dotted key, its subschema), depth first."""
    for name, sub in schema.get("properties", {}).items():
        key = f"{prefix}{name}"
        yield key, sub
        yield from _schema_keys(sub, f"{key}.")


def _get(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        node = node[part]
    return node


# ----------------------------------------------------------------------------- defaults


def test_defaults_fill_every_section() -> None:
    config = load_config(None)
    assert set(config) == {
        "device",
        "precision",
        "seed",
        "deterministic",
        "cpu_threads",
        "compare",
        *SECTIONS,
    }
    assert config["data"]["augment"]["hflip"] == 0.5
    assert config["data"]["synthetic"]["classes"] == ["circle", "square", "triangle", "cross"]
    assert (
        config["train"]["epochs"]
        == load_schema()["properties"]["train"]["properties"]["epochs"]["default"]
    )
    assert config["sweep"] == {}


def test_every_schema_default_reaches_the_loaded_config() -> None:
    config = load_config(None)
    checked = 0
    for key, sub in _schema_keys(load_schema()):
        if "default" not in sub:
            continue  # sweep lists: absent unless asked for
        value = _get(config, key)
        if sub.get("type") == "object":
            assert isinstance(value, dict), key
        else:
            assert value == sub["default"], key
            checked += 1
    assert checked > 60


def test_defaults_are_fresh_copies_for_every_load() -> None:
    first = load_config(None)
    first["bench"]["precisions"].append("fp8")
    first["data"]["synthetic"]["classes"].clear()
    second = load_config(None)
    assert second["bench"]["precisions"] == ["fp32", "fp16", "bf16"]
    assert second["data"]["synthetic"]["classes"] == ["circle", "square", "triangle", "cross"]


def test_the_repository_config_file_equals_the_schema_defaults() -> None:
    """config/config.yaml documents the defaults: a change to one must change the other."""
    path = REPO / "config" / "config.yaml"
    from_file = load_config(path)
    defaults = load_config(None)
    assert from_file == defaults
    # same types too (48 vs 48.0 would be equal above but read differently by a person)
    assert yaml.safe_dump(from_file, sort_keys=True) == yaml.safe_dump(defaults, sort_keys=True)
    # and the file spells out every key, so it is the complete reference
    assert read_yaml(path) == defaults


def test_an_empty_config_file_gives_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing set\n")
    assert load_config(path) == load_config(None)


def test_a_config_file_sets_nested_keys_and_keeps_the_other_defaults(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("train:\n  epochs: 2\ndata:\n  augment:\n    vflip: 0.0\n")
    config = load_config(path)
    assert config["train"]["epochs"] == 2
    assert config["train"]["batch_size"] == load_config(None)["train"]["batch_size"]
    assert config["data"]["augment"] == {**load_config(None)["data"]["augment"], "vflip": 0.0}


def test_config_files_layer_in_order_with_later_ones_winning(tmp_path: Path) -> None:
    """A preset under the user's own file, as Snakemake's `--configfile A B` layers them."""
    preset, mine = tmp_path / "preset.yaml", tmp_path / "mine.yaml"
    preset.write_text("train:\n  epochs: 2\n  batch_size: 4\ndata:\n  augment:\n    vflip: 0.0\n")
    mine.write_text("train:\n  epochs: 7\ndata:\n  augment:\n    hflip: 0.0\n")
    config = load_config([preset, mine], ["train.lr=0.01"])
    assert (config["train"]["epochs"], config["train"]["batch_size"]) == (7, 4)
    assert config["train"]["lr"] == 0.01
    augment = config["data"]["augment"]
    assert (augment["vflip"], augment["hflip"]) == (0.0, 0.0)
    assert load_config([mine, preset])["train"]["epochs"] == 2


def test_an_error_in_layered_files_names_the_file_the_bad_key_or_value_came_from(
    tmp_path: Path,
) -> None:
    preset, mine = tmp_path / "preset.yaml", tmp_path / "mine.yaml"
    preset.write_text("train:\n  epochs: 0\n  lr: 0.01\n")
    mine.write_text("train:\n  lr: 0.02\n")
    with pytest.raises(ConfigError, match=re.escape(f"train.epochs = 0 in {preset} is not valid")):
        load_config([preset, mine])
    mine.write_text("train:\n  epoch: 7\n")
    with pytest.raises(ConfigError, match=re.escape(f"Unknown config key train.epoch in {mine}. ")):
        load_config([preset, mine], ["train.epochs=3"])
    with pytest.raises(ConfigError, match=re.escape("train.epochs = 0 in the command line")):
        load_config([preset], ["train.epochs=0"])


def test_a_value_is_traced_to_the_last_layer_that_set_it_or_to_the_defaults() -> None:
    layers = [
        Layer("a.yaml", {"train": {"epochs": 2, "lr": 0.1}, "data": {"classes": ["x"]}}),
        Layer("b.yaml", {"train": {"epochs": 3}, "data": {"classes": None}}),
    ]
    assert Layer.origin(layers, ["train", "epochs"]) == "b.yaml"
    assert Layer.origin(layers, ["train", "lr"]) == "a.yaml"
    assert Layer.origin(layers, ["data", "classes"]) == "b.yaml"
    assert Layer.origin(layers, ["train", "batch_size"]) == DEFAULTS
    assert Layer.origin(layers, ["seed"]) == DEFAULTS


def test_a_misspelt_choice_is_named_with_the_closest_valid_one() -> None:
    with pytest.raises(ConfigError, match="Did you mean 'measured'\\?"):
        load_config(None, ["precision=measure"])


def test_commands_layer_their_config_files_over_config_config_yaml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As Snakemake does: an edit of config/config.yaml holds for every command, files or not."""
    monkeypatch.chdir(tmp_path)
    assert config_paths(["mine.yaml"]) == [Path("mine.yaml")]
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text("train:\n  epochs: 9\n  lr: 0.5\n")
    (tmp_path / "mine.yaml").write_text("train:\n  epochs: 2\n")
    assert config_paths(["mine.yaml"]) == [DEFAULT_CONFIG, Path("mine.yaml")]
    config = load_config(config_paths(["mine.yaml"]))
    assert (config["train"]["epochs"], config["train"]["lr"]) == (2, 0.5)


def test_every_schema_key_is_documented_in_the_configuration_page() -> None:
    readme = REPO / "docs" / "configuration.md"
    assert readme.is_file(), f"{readme} does not exist"
    text = readme.read_text(encoding="utf-8")
    missing = [
        key
        for key, _ in _schema_keys(load_schema())
        # the dotted key, not as part of a longer name (seed inside x.seed)
        if not re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", text)
    ]
    assert missing == []


def test_the_configuration_page_tables_are_the_ones_generated_from_the_schema() -> None:
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    embedded = text.split("<!-- reference:start -->\n", 1)[1].split("<!-- reference:end -->", 1)[0]
    assert embedded == reference_markdown()


# ---------------------------------------------------------------------------- overrides


def test_overrides_set_nested_keys_with_yaml_values() -> None:
    config = load_config(
        None,
        [
            "train.lr=0.01",
            "train.epochs=3",
            "data.classes=[a, b]",
            "device=cuda:1",
            "precision=fp32",
            "train.grad_clip=null",
            "bench.backends=[cpu]",
        ],
    )
    assert config["train"]["lr"] == 0.01
    assert config["train"]["epochs"] == 3
    assert config["data"]["classes"] == ["a", "b"]
    assert config["device"] == "cuda:1"
    assert config["precision"] == "fp32"
    assert config["train"]["grad_clip"] is None
    assert config["bench"]["backends"] == ["cpu"]


def test_overrides_win_over_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("train:\n  epochs: 2\n  batch_size: 4\n")
    config = load_config(path, ["train.epochs=5"])
    assert (config["train"]["epochs"], config["train"]["batch_size"]) == (5, 4)


def test_parse_overrides_builds_a_nested_dict() -> None:
    assert parse_overrides(["a.b.c=1", "a.b.d=x", "a.e=[1, 2]", "f=", "g={h: true}"]) == {
        "a": {"b": {"c": 1, "d": "x"}, "e": [1, 2]},
        "f": None,
        "g": {"h": True},
    }


@pytest.mark.parametrize("item", ["train.epochs", "=3", " =3"])
def test_a_setting_without_key_or_equals_sign_is_rejected(item: str) -> None:
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides([item])


def test_a_setting_with_invalid_yaml_is_rejected_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"data\.classes=\[a,"):
        parse_overrides(["data.classes=[a,"])


def test_a_setting_below_a_plain_value_conflicts() -> None:
    with pytest.raises(ConfigError, match="train"):
        parse_overrides(["train=1", "train.epochs=3"])


def test_merge_is_recursive_and_changes_neither_input() -> None:
    base = {"a": {"b": 1, "c": [1]}, "d": 1}
    update = {"a": {"b": 2}, "e": 3}
    merged = merge(base, update)
    assert merged == {"a": {"b": 2, "c": [1]}, "d": 1, "e": 3}
    merged["a"]["c"].append(2)
    assert base == {"a": {"b": 1, "c": [1]}, "d": 1}
    assert update == {"a": {"b": 2}, "e": 3}


# ------------------------------------------------------------ Snakemake-style strings


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("true", True),
        ("True", True),
        ("yes", True),
        ("on", True),
        ("1", True),
        ("false", False),
        ("FALSE", False),
        ("no", False),
        ("off", False),
        ("0", False),
        (" false ", False),
    ],
)
def test_boolean_strings_become_booleans(text: str, expected: Any) -> None:
    deterministic = validate({"deterministic": text})["deterministic"]
    assert deterministic is expected


@pytest.mark.parametrize("text", ["false", "False", "no", "No", "off", "0"])
def test_false_words_are_never_read_as_true(text: str) -> None:
    config = validate({"deterministic": text, "data": {"cache": text}})
    assert config["deterministic"] is False
    assert config["data"]["cache"] is False


def test_a_quoted_false_on_the_command_line_is_false() -> None:
    config = load_config(None, ["data.cache='off'", "deterministic='0'"])
    assert config["data"]["cache"] is False
    assert config["deterministic"] is False


@pytest.mark.parametrize(("number", "expected"), [(1, True), (0, False)])
def test_a_boolean_as_an_integer_from_snakemake_config_is_a_boolean(
    number: int, expected: bool
) -> None:
    # `snakemake --config deterministic=1` parses the value with int() first
    config = validate({"deterministic": number, "data": {"cache": number}})
    assert config["deterministic"] is expected
    assert config["data"]["cache"] is expected


def test_the_image_cache_decides_by_size_unless_set_to_true_or_false() -> None:
    assert load_config(None)["data"]["cache"] == "auto"
    assert load_config(None, ["data.cache=auto"])["data"]["cache"] == "auto"
    assert load_config(None, ["data.cache=yes"])["data"]["cache"] is True


def test_integer_strings_become_integers() -> None:
    config = validate(
        {"seed": "3", "train": {"epochs": "3", "batch_size": "16"}, "cpu_threads": "4"}
    )
    assert config["seed"] == 3 and isinstance(config["seed"], int)
    assert config["train"]["epochs"] == 3 and isinstance(config["train"]["epochs"], int)
    assert config["train"]["batch_size"] == 16
    assert config["cpu_threads"] == 4


@pytest.mark.parametrize(("text", "expected"), [("0.01", 0.01), ("1e-3", 0.001), ("2", 2.0)])
def test_number_strings_become_numbers(text: str, expected: float) -> None:
    config = validate({"train": {"lr": text}})
    assert config["train"]["lr"] == pytest.approx(expected)
    assert isinstance(config["train"]["lr"], float)


def test_lists_of_strings_become_lists_of_integers_and_numbers() -> None:
    config = validate(
        {
            "profile": {"batch_sizes": ["1", "8"]},
            "sweep": {"seed": ["0", "1"], "lr": ["0.01", "1e-3"], "batch_size": ["4"]},
        }
    )
    assert config["profile"]["batch_sizes"] == [1, 8]
    assert config["sweep"] == {"seed": [0, 1], "lr": [0.01, 0.001], "batch_size": [4]}
    assert all(isinstance(v, int) for v in config["sweep"]["seed"])


def test_null_strings_become_none_where_null_is_allowed() -> None:
    config = validate({"train": {"grad_clip": "null"}, "data": {"classes": "null"}})
    assert config["train"]["grad_clip"] is None
    assert config["data"]["classes"] is None


def test_strings_that_are_not_numbers_stay_strings_and_fail_validation() -> None:
    assert normalize("3.5", {"type": "integer"}) == "3.5"  # never truncated to 3
    assert normalize("1e3", {"type": "integer"}) == "1e3"
    assert normalize("auto", {"anyOf": [{"const": "auto"}, {"type": "integer"}]}) == "auto"
    with pytest.raises(ConfigError, match=r"train\.epochs = '3\.5'"):
        validate({"train": {"epochs": "3.5"}})


def test_strings_are_left_alone_where_the_schema_wants_a_string() -> None:
    config = validate({"data": {"root": "1", "train_split": "true"}})
    assert config["data"]["root"] == "1"
    assert config["data"]["train_split"] == "true"


@pytest.mark.parametrize(
    ("given", "read"), [("CPU", "cpu"), (" Cuda:1 ", "cuda:1"), ("MPS", "mps"), ("Auto", "auto")]
)
def test_a_device_name_is_read_in_lower_case_as_the_device_option_reads_it(
    given: str, read: str
) -> None:
    """`--device CPU` works on the command line; `device: CPU` in a file and Snakemake's
    `--config device=CPU` are the same request, and every reader sees one spelling."""
    assert validate({"device": given})["device"] == read
    assert load_config(None, [f"device={given}"])["device"] == read


def test_backend_names_in_bench_backends_are_read_in_lower_case() -> None:
    config = validate({"bench": {"backends": ["CPU", " Mps "]}})
    assert config["bench"]["backends"] == ["cpu", "mps"]


def test_parse_bool_leaves_other_values_unchanged() -> None:
    assert parse_bool("maybe") == "maybe"
    assert parse_bool(None) is None
    assert parse_bool("On") is True


# ------------------------------------------------------------------------------- errors


def test_an_unknown_top_level_key_is_named_with_the_valid_keys() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["epochs=3"])
    message = str(caught.value)
    assert "epochs" in message
    assert (
        "Valid keys: bench, cluster, compare, cpu_threads, data, deterministic, device," in message
    )


@pytest.mark.parametrize(
    ("item", "key", "section"),
    [
        ("train.epoch=3", "train.epoch", "train"),
        ("data.synthetic.num_tests=3", "data.synthetic.num_tests", "data.synthetic"),
        ("data.augment.rotate=0.5", "data.augment.rotate", "data.augment"),
    ],
)
def test_an_unknown_nested_key_is_named_with_the_valid_keys(
    item: str, key: str, section: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, [item])
    message = str(caught.value)
    assert f"Unknown config key {key} " in message
    valid = sorted(
        _get(load_schema()["properties"], section.replace(".", ".properties."))["properties"]
    )
    assert f"Valid keys in {section}: {', '.join(valid)}." in message


def test_an_unknown_key_in_a_config_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("trian:\n  epochs: 2\n")
    with pytest.raises(ConfigError, match=rf"trian.*{re.escape(str(path))}"):
        load_config(path)


@pytest.mark.parametrize(
    ("item", "key", "value"),
    [
        ("train.epochs=abc", "train.epochs", "'abc'"),
        ("train.epochs=2.5", "train.epochs", "2.5"),
        ("train.lr=fast", "train.lr", "'fast'"),
        ("data.cache=maybe", "data.cache", "'maybe'"),
        ("data.cache_budget=0", "data.cache_budget", "0"),
        ("data.cache_budget=1.5", "data.cache_budget", "1.5"),
        ("data.classes=cat", "data.classes", "'cat'"),
        ("train.epochs=0", "train.epochs", "0"),
        ("train.epochs=-2", "train.epochs", "-2"),
        ("train.batch_size=0", "train.batch_size", "0"),
        ("train.batch_size=-8", "train.batch_size", "-8"),
        ("data.image_size=0", "data.image_size", "0"),
        ("data.image_size=-64", "data.image_size", "-64"),
        ("eval.batch_size=0", "eval.batch_size", "0"),
        ("eval.min_score=-0.01", "eval.min_score", "-0.01"),
        ("eval.min_score=1", "eval.min_score", "1"),
        ("eval.min_score=1.5", "eval.min_score", "1.5"),
        ("train.lr=0", "train.lr", "0"),
        ("model.name=yolo", "model.name", "'yolo'"),
        ("train.optimizer=lamb", "train.optimizer", "'lamb'"),
        ("train.scheduler=poly", "train.scheduler", "'poly'"),
        ("precision=fp8", "precision", "'fp8'"),
        ("bench.precisions=[fp32, fp8]", "bench.precisions.1", "'fp8'"),
        ("sweep.precision=[int8]", "sweep.precision.0", "'int8'"),
        ("precision=true", "precision", "True"),
        ("device=gpu", "device", "'gpu'"),
        ("device=cuda:x", "device", "'cuda:x'"),
        ("device=mps:0:1", "device", "'mps:0:1'"),
        ("bench.backends=[tpu]", "bench.backends", "['tpu']"),
        ("bench.instances=0", "bench.instances", "0"),
        ("bench.instances=1.5", "bench.instances", "1.5"),
    ],
)
def test_an_invalid_value_is_named_with_its_key(item: str, key: str, value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, [item])
    assert f"Config key {key} = {value} " in str(caught.value)


def test_min_objects_above_max_objects_is_named_with_both_values() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["data.synthetic.min_objects=5", "data.synthetic.max_objects=2"])
    message = str(caught.value)
    assert "data.synthetic.min_objects = 5" in message
    assert "max_objects = 2" in message


def test_a_score_threshold_below_the_score_floor_is_refused_naming_both() -> None:
    """Detections under eval.min_score are gone before anything counts them: a lower
    threshold would silently count as the floor."""
    with pytest.raises(
        ConfigError, match=r"eval.score_threshold = 0.005 and eval.min_score = 0.01"
    ):
        load_config(None, ["eval.score_threshold=0.005"])
    assert load_config(None, ["eval.score_threshold=0.005", "eval.min_score=0"])["eval"] == {
        **load_config(None)["eval"],
        "score_threshold": 0.005,
        "min_score": 0,
    }


def test_object_sizes_out_of_order_or_larger_than_the_image_are_rejected() -> None:
    with pytest.raises(ConfigError, match=r"min_object_size = 40"):
        load_config(
            None, ["data.synthetic.min_object_size=40", "data.synthetic.max_object_size=20"]
        )
    with pytest.raises(ConfigError, match=r"max_object_size = 64.*image_size = 32"):
        load_config(None, ["data.synthetic.image_size=32", "data.synthetic.max_object_size=64"])


def test_a_missing_config_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))} does not exist"):
        load_config(path)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just words\n", "42\n"])
def test_a_config_file_that_is_not_a_mapping_is_named(tmp_path: Path, text: str) -> None:
    path = tmp_path / "list.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))} must hold a mapping"):
        load_config(path)


def test_a_config_file_with_broken_yaml_is_named_with_the_place_on_one_line(
    tmp_path: Path,
) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("train: {epochs: 3\n")
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert str(raised.value) == (
        f"Config file {path} is not valid YAML: while parsing a flow mapping, expected ',' or "
        "'}', but got '<stream end>' (line 2, column 1)."
    )


def test_a_config_file_that_is_a_folder_or_not_utf8_text_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=rf"^Config file {re.escape(str(tmp_path))} is a folder"):
        load_config(tmp_path)
    binary = tmp_path / "latin1.yaml"
    binary.write_bytes("data: {root: /donn\u00e9es}\n".encode("latin-1"))
    with pytest.raises(ConfigError) as raised:
        load_config(binary)
    assert str(raised.value) == (
        f"Config file {binary} is not a YAML text file: the byte at offset 18 is not UTF-8 "
        "(invalid continuation byte). Save it as UTF-8 text."
    )


def test_a_key_set_twice_in_a_config_file_is_refused_naming_the_key_and_its_lines(
    tmp_path: Path,
) -> None:
    """Plain YAML keeps the last of two keys: a second `data:` block would drop the first's."""
    path = tmp_path / "mine.yaml"
    path.write_text("data:\n  image_size: 64\ntrain:\n  epochs: 2\ndata:\n  root: /x\n")
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert str(raised.value) == (
        f"Config file {path} is not valid YAML: the key 'data' is set a second time (first on "
        "line 1); only the last would count: merge them into one (line 5, column 1)."
    )
    path.write_text("data:\n  image_size: 64\n  image_size: 96\n")
    with pytest.raises(ConfigError, match="the key 'image_size' is set a second time"):
        load_config(path)


def test_a_merge_key_and_the_keys_beside_it_are_not_a_key_set_twice(tmp_path: Path) -> None:
    path = tmp_path / "anchors.yaml"
    path.write_text("train:\n  <<: {epochs: 2, batch_size: 4}\n  epochs: 3\n")
    train = load_config(path)["train"]
    assert (train["epochs"], train["batch_size"]) == (3, 4)


def test_a_preset_given_after_a_users_file_warns_naming_each_value_it_overrides(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Later files win: `--configfile mine.yaml presets/p.yaml` silently undoes mine.yaml."""
    (tmp_path / "presets").mkdir()
    preset = tmp_path / "presets" / "photos.yaml"
    preset.write_text("data:\n  augment: {hflip: 0.5, vflip: 0.0}\ntrain: {epochs: 100}\n")
    mine = tmp_path / "mine.yaml"
    mine.write_text("data:\n  augment: {hflip: 0.0, vflip: 0.0}\n  image_size: 256\n")
    with caplog.at_level("WARNING", logger="pipeline"):
        config = load_config([mine, preset])
    assert config["data"]["augment"]["hflip"] == 0.5  # the order still decides
    assert [record.getMessage() for record in caplog.records] == [
        f"{preset}, given after {mine}, overrides what it sets: data.augment.hflip (0.0 -> 0.5). "
        f"Later config files win: if {mine} is your own, give it after the presets "
        f"(--configfile {preset} {mine})."
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="pipeline"):
        load_config([preset, mine], ["train.epochs=3"])
    assert caplog.records == []


def test_a_class_named_twice_in_data_classes_is_refused() -> None:
    """Both would take the first's label: a class the model has but never trains."""
    with pytest.raises(ConfigError, match=r"data.classes = \['cat', 'cat'\] .* non-unique"):
        load_config(None, ["data.classes=[cat,cat]"])


@pytest.mark.parametrize(
    ("setting", "shown"),
    [
        ("eval.score_threshold=nan", "nan"),
        ("train.lr=inf", "inf"),
        ("sweep.lr=[0.1,-.inf]", "-inf"),
    ],
)
def test_a_value_that_is_not_a_finite_number_is_refused_naming_its_key(
    setting: str, shown: str
) -> None:
    """NaN passes every minimum and maximum: a threshold of NaN would count no detection."""
    key = setting.split("=")[0]
    with pytest.raises(ConfigError) as raised:
        load_config(None, [setting])
    assert str(raised.value) == (
        f"Config key {key} = {shown} in the command line is not valid: {shown} is not a finite "
        "number."
    )


def test_result_and_speed_settings_split_what_training_reads_without_overlap() -> None:
    config = load_config(None, ["eval.batch_size=7", "data.num_workers=3"])
    result, speed = result_settings(config), speed_settings(config)
    assert speed == {
        "data": {"num_workers": 3, "cache": "auto", "cache_budget": 0.25},
        "eval": {"batch_size": 7},
    }
    assert set(result) == {
        "seed",
        "deterministic",
        "precision",
        "data",
        "model",
        "train",
        "eval",
    }
    assert result["eval"] == {
        "score_threshold": None,
        "iou_threshold": 0.5,
        "max_detections": 100,
        "min_score": 0.01,
        "protocol": "auto",
        "flip_test": False,
    }
    test_keys = {"test_split", "test_annotations", "test_images_dir"}  # evaluation's alone
    off = {"val_fraction", "test_fraction"}  # left out while null (off): see test_holdout.py
    assert set(result["data"]) | set(speed["data"]) | test_keys | off == set(config["data"])
    assert not set(result["data"]) & set(speed["data"])
    assert "num_test" not in result["data"]["synthetic"]
    assert result["model"] == config["model"] and result["train"] == config["train"]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (["amp=false"], "fp32"),
        (["amp=true", "amp_dtype=bf16"], "bf16"),
        (["amp=true"], "fp16"),
        (["amp=measured", "amp_dtype=bf16"], "measured"),
        (["amp=auto"], "auto"),
        (["amp_dtype=bf16"], "bf16"),
    ],
)
def test_the_replaced_keys_amp_and_amp_dtype_are_refused_naming_the_precision_to_write(
    old: list[str], new: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, old)
    message = str(caught.value)
    assert message.startswith(f"Config key{'s' if len(old) > 1 else ''} {old[0].split('=')[0]} = ")
    assert "in the command line: amp and amp_dtype were replaced by one key, precision" in message
    assert f"write precision: {new} " in message


def test_a_checkpoints_config_with_amp_and_amp_dtype_is_read_in_todays_keys() -> None:
    old = {"seed": 1, "amp": True, "amp_dtype": "bf16", "train": {"epochs": 2}}
    assert upgrade_legacy_precision(old) == {"seed": 1, "precision": "bf16", "train": {"epochs": 2}}
    assert upgrade_legacy_precision({"amp": "false"})["precision"] == "fp32"
    assert validate(upgrade_legacy_precision({"amp": "measured"}))["precision"] == "measured"
    current = {"precision": "fp16"}
    assert upgrade_legacy_precision(current) is current


def test_differing_keys_names_nested_keys_and_keys_only_one_side_has() -> None:
    old = {"seed": 0, "train": {"lr": 0.1, "epochs": 3}, "data": {"augment": {"hflip": 0.5}}}
    new = {"seed": 0, "train": {"lr": 0.2, "epochs": 3}, "data": {"augment": {}}, "amp": True}
    assert differing_keys(old, new) == ["train.lr", "data.augment.hflip", "amp"]
    assert differing_keys(old, old) == []


@pytest.mark.parametrize(
    "settings",
    [
        ["precision=measured", "bench.modes=[infer]"],
        ["precision=measured", "bench.precisions=[bf16]"],
        ["sweep.precision=[fp32, measured]", "bench.modes=[infer]"],
    ],
)
def test_measured_without_training_benchmarks_against_fp32_is_refused(
    settings: list[str],
) -> None:
    with pytest.raises(ConfigError, match="precision=measured in the command line"):
        load_config(None, settings)


def test_class_sizes_take_any_shape_as_key_and_numbers_from_strings() -> None:
    config = validate({"data": {"synthetic": {"class_sizes": {"circle": ["8", "20"]}}}})
    assert config["data"]["synthetic"]["class_sizes"] == {"circle": [8, 20]}
    with pytest.raises(ConfigError, match=r"data\.synthetic\.class_sizes.*hexagon"):
        validate({"data": {"synthetic": {"class_sizes": {"hexagon": [8, 20]}}}})
