"""Run names and the workflow's job matrix, resolved against an environment report (env.json)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.config import load_config, parse_overrides
from pipeline.errors import ConfigError
from pipeline.runs import (
    DeviceUnavailableInEnv,
    Run,
    bench_data_settings,
    bench_matrix,
    bench_settings,
    device_part,
    device_spec,
    find_run,
    flatten,
    parse_run,
    read_env,
    run_config,
    training_runs,
)
from pipeline.setting_groups import other_training_settings, result_settings

# the AMP policy of the device layer, as check_env writes it into env.json
RESOLVED_AMP = {
    "cuda": {"auto": True, "true": True, "false": False},
    "mps": {"auto": False, "true": True, "false": False},
    "cpu": {"auto": False, "true": False, "false": False},
}


def precisions(resolved_amp: dict[str, bool]) -> dict[str, str]:
    """What each precision setting trains in, as device.training_precision resolves it where
    no CPU computes fp16 or bf16 natively."""
    reduced = {p: p if resolved_amp["true"] else "fp32" for p in ("fp16", "bf16")}
    return {"auto": "fp16" if resolved_amp["auto"] else "fp32", "fp32": "fp32", **reduced}


def _backend(name: str, available: bool, available_list: list[str]) -> dict[str, Any]:
    reason = None if available else f"no {name} here (fake reason)"
    return {
        "available": available,
        "reason": reason,
        "description": name.upper() if available else f"{name.upper()} (not available: {reason})",
        "amp_default": RESOLVED_AMP[name]["auto"],
        "amp_supported": name != "cpu",
        "resolved_amp": dict(RESOLVED_AMP[name]),
        "precisions": precisions(RESOLVED_AMP[name]),
        "pin_memory": name == "cuda",
        # as on a CPU without native bf16/fp16: measured mode may use them only on the GPUs
        "measured_refused": (
            {
                p: "this CPU has no native instructions (fake)" if name == "cpu" else None
                for p in ("bf16", "fp16")
            }
            if available
            else None
        ),
        "error": None
        if available
        else f"Device {name!r} is not available: {reason}. Available backends: {available_list}.",
    }


def make_env(*available: str) -> dict[str, Any]:
    """An env.json like check_env writes (same structure as results/env.json)."""
    names = [b for b in ("cuda", "mps", "cpu") if b in available]
    return {
        "format": "pipeline.env/1",
        "backends": {b: _backend(b, b in available, names) for b in ("cuda", "mps", "cpu")},
        "cpu_native": {
            p: {"native": False, "evidence": "fake", "hidden": False} for p in ("bf16", "fp16")
        },
        "available": names,
        "auto": names[0],
        "cuda": {"built": True, "version": "12.4", "devices": [], "visible_devices_env": None},
        "mps": {"built": "mps" in available, "available": "mps" in available, "macos": None},
    }


CPU_ONLY = make_env("cpu")
CUDA = make_env("cuda", "cpu")
MPS = make_env("mps", "cpu")


def _config(*items: str) -> dict[str, Any]:
    """The defaults with precision=auto, the static policy these tests resolve (the shipped
    default, measured, needs a choice: see the tests of measured runs)."""
    return load_config(None, ["precision=auto", *items])


def test_fake_env_has_the_structure_check_env_writes() -> None:
    from pipeline import environment

    real = environment.collect()
    assert set(CPU_ONLY) <= set(real)
    assert set(real["backends"]) == set(CPU_ONLY["backends"])
    for name, entry in real["backends"].items():
        assert set(entry) == set(CPU_ONLY["backends"][name]), name
        assert set(entry["resolved_amp"]) == {"auto", "true", "false"}
    assert real["backends"]["cpu"]["resolved_amp"] == RESOLVED_AMP["cpu"]
    assert real["auto"] in real["available"]


def test_read_env_reads_the_report(tmp_path: Path) -> None:
    path = tmp_path / "env.json"
    path.write_text(json.dumps(CUDA))
    assert read_env(path) == CUDA


# ---------------------------------------------------------------------------- run names


@pytest.mark.parametrize(
    ("name", "run"),
    [
        ("cpu-fp32", Run("cpu", "fp32")),
        ("cuda1-fp16", Run("cuda:1", "fp16")),
        ("cuda-bf16", Run("cuda", "bf16")),
        ("mps-fp16", Run("mps", "fp16")),
        ("cpu-fp32+seed=1+lr=0.01", Run("cpu", "fp32", (("seed", 1), ("lr", 0.01)))),
        (
            "cuda0-fp16+model=resnet18+batch_size=8",
            Run("cuda:0", "fp16", (("model", "resnet18"), ("batch_size", 8))),
        ),
    ],
)
def test_run_names_round_trip_through_parse_run(name: str, run: Run) -> None:
    assert parse_run(name) == run
    assert run.name == name
    assert parse_run(run.name).name == name


@pytest.mark.parametrize(
    "name",
    ["cpu-fp8", "cpu", "gpu-fp32", "cuda:1-fp16", "cpu-fp32+epochs=3", "cpu-fp32+seed"],
)
def test_malformed_run_names_raise_config_error(name: str) -> None:
    with pytest.raises(ConfigError):
        parse_run(name)


def test_device_part_and_spec_are_inverse() -> None:
    for spec in ("cpu", "mps", "cuda", "cuda:0", "cuda:12"):
        assert device_spec(device_part(spec)) == spec
    assert device_part("cuda:1") == "cuda1"


def test_settings_of_an_fp32_run_set_its_precision() -> None:
    assert Run("cpu", "fp32").settings() == ["device=cpu", "precision=fp32"]


def test_settings_of_a_mixed_precision_run_set_its_precision_and_sweep() -> None:
    run = Run(
        "cuda:1", "bf16", (("seed", 2), ("lr", 0.01), ("batch_size", 8), ("model", "resnet18"))
    )
    assert run.settings() == [
        "device=cuda:1",
        "precision=bf16",
        "seed=2",
        "train.lr=0.01",
        "train.batch_size=8",
        'model.name="resnet18"',
    ]


def test_settings_make_the_config_train_the_run() -> None:
    run = parse_run("cuda1-fp16+seed=3+lr=0.02+batch_size=4+model=resnet18")
    config = _config(*run.settings())
    assert config["device"] == "cuda:1"
    assert config["precision"] == "fp16"
    assert config["seed"] == 3
    assert config["train"]["lr"] == 0.02
    assert config["train"]["batch_size"] == 4
    assert config["model"]["name"] == "resnet18"
    assert _config(*parse_run("cpu-fp32").settings())["precision"] == "fp32"


# ---------------------------------------------------------------------- training runs


def test_auto_device_resolves_to_the_envs_auto_backend() -> None:
    assert training_runs(_config(), CUDA) == [Run("cuda", "fp16")]
    assert training_runs(_config(), CPU_ONLY) == [Run("cpu", "fp32")]
    assert training_runs(_config(), MPS) == [Run("mps", "fp32")]  # AMP auto is off on mps


def test_explicit_devices_are_kept_as_given() -> None:
    assert [r.name for r in training_runs(_config("device=cuda:1"), CUDA)] == ["cuda1-fp16"]
    assert [r.name for r in training_runs(_config("device=cpu"), CUDA)] == ["cpu-fp32"]


def test_a_device_in_capitals_names_the_same_runs_as_in_lower_case() -> None:
    assert [r.name for r in training_runs(_config("device=CUDA:1"), CUDA)] == ["cuda1-fp16"]
    assert [r.name for r in training_runs(_config("device= CPU "), CUDA)] == ["cpu-fp32"]
    assert bench_matrix(_config("bench.backends=[CPU]", "bench.precisions=[fp32]"), CUDA) == [
        ("cpu", "fp32", "train"),
        ("cpu", "fp32", "infer"),
    ]


@pytest.mark.parametrize(
    ("device", "env"), [("mps", CPU_ONLY), ("cuda:0", MPS), ("cuda", CPU_ONLY)]
)
def test_an_absent_backend_raises_with_the_envs_error_text(device: str, env: dict) -> None:
    with pytest.raises(DeviceUnavailableInEnv) as caught:
        training_runs(_config(f"device={device}"), env)
    assert str(caught.value) == env["backends"][device.partition(":")[0]]["error"]


def test_an_absent_backend_without_an_error_text_names_it_and_the_reason() -> None:
    env = copy.deepcopy(CPU_ONLY)
    env["backends"]["mps"]["error"] = None
    with pytest.raises(DeviceUnavailableInEnv, match=r"'mps'.*fake reason"):
        training_runs(_config("device=mps"), env)


@pytest.mark.parametrize(
    ("device", "requested", "env", "precision"),
    [
        ("cuda", "auto", CUDA, "fp16"),
        ("cuda", "bf16", CUDA, "bf16"),
        ("cuda", "fp32", CUDA, "fp32"),
        ("cpu", "bf16", CUDA, "fp32"),  # no AMP on a cpu without native bf16
        ("cpu", "auto", CPU_ONLY, "fp32"),
        ("mps", "auto", MPS, "fp32"),
        ("mps", "bf16", MPS, "bf16"),
        ("mps", "fp16", MPS, "fp16"),
    ],
)
def test_precision_follows_the_envs_precision_table(
    device: str, requested: str, env: dict, precision: str
) -> None:
    config = _config(f"device={device}", f"precision={requested}")
    assert [r.precision for r in training_runs(config, env)] == [precision]


def test_precision_uses_the_table_not_a_hard_coded_policy() -> None:
    env = copy.deepcopy(CPU_ONLY)
    env["backends"]["cpu"]["precisions"]["auto"] = "bf16"
    assert training_runs(_config(), env) == [Run("cpu", "bf16")]


# a CPU with native bf16, as check_env reports one: an explicit bf16 (and measured) may use it
NATIVE_BF16 = copy.deepcopy(CPU_ONLY)
NATIVE_BF16["backends"]["cpu"]["measured_refused"]["bf16"] = None
NATIVE_BF16["backends"]["cpu"]["precisions"]["bf16"] = "bf16"


def test_bf16_on_a_cpu_with_native_bf16_trains_bf16_as_the_device_layer_resolves_it() -> None:
    assert training_runs(_config("precision=bf16"), NATIVE_BF16) == [Run("cpu", "bf16")]
    assert training_runs(_config("precision=fp16"), NATIVE_BF16) == [Run("cpu", "fp32")]
    assert training_runs(_config("precision=auto"), NATIVE_BF16) == [Run("cpu", "fp32")]
    runs = training_runs(_config("sweep.precision=[fp32, bf16]"), NATIVE_BF16)
    assert [r.name for r in runs] == ["cpu-fp32", "cpu-bf16"]


def test_a_sweep_expands_to_the_product_of_its_lists() -> None:
    runs = training_runs(_config("sweep.seed=[0, 1]", "sweep.lr=[0.01, 0.001]"), CPU_ONLY)
    assert [r.name for r in runs] == [
        "cpu-fp32+seed=0+lr=0.01",
        "cpu-fp32+seed=0+lr=0.001",
        "cpu-fp32+seed=1+lr=0.01",
        "cpu-fp32+seed=1+lr=0.001",
    ]
    assert len({r.name for r in runs}) == 4
    assert all(parse_run(r.name) == r for r in runs)


def test_a_precision_sweep_times_other_sweeps_on_a_backend_with_amp() -> None:
    config = _config(
        "device=cuda:1", "sweep.precision=[fp32, bf16]", "sweep.model=[tiny_conv, resnet18]"
    )
    runs = training_runs(config, CUDA)
    assert [r.name for r in runs] == [
        "cuda1-fp32+model=tiny_conv",
        "cuda1-fp32+model=resnet18",
        "cuda1-bf16+model=tiny_conv",
        "cuda1-bf16+model=resnet18",
    ]
    assert _config(*runs[2].settings())["precision"] == "bf16"


# an mps whose AMP policy is off even when asked for (as for an old torch)
MPS_NO_AMP = copy.deepcopy(MPS)
MPS_NO_AMP["backends"]["mps"]["precisions"].update(fp16="fp32", bf16="fp32")


@pytest.mark.parametrize(
    ("device", "env", "lost"),
    [("cpu", CPU_ONLY, "fp16"), ("cpu", CUDA, "bf16"), ("auto", MPS_NO_AMP, "fp16")],
)
def test_a_precision_sweep_that_amp_policy_would_collapse_to_fp32_is_refused(
    device: str, env: dict, lost: str
) -> None:
    config = _config(f"device={device}", f"sweep.precision=[fp32, {lost}]")
    with pytest.raises(ConfigError, match=rf"sweep\.precision asks for \['{lost}'\]"):
        training_runs(config, env)


def test_an_fp32_only_precision_sweep_is_fine_anywhere() -> None:
    assert training_runs(_config("sweep.precision=[fp32]"), CPU_ONLY) == [Run("cpu", "fp32")]


# ----------------------------------------------------------------------- bench matrix


def test_bench_matrix_available_covers_every_available_backend() -> None:
    config = _config("bench.precisions=[fp32, bf16]", "bench.modes=[infer]")
    assert bench_matrix(config, CUDA) == [
        ("cuda", "fp32", "infer"),
        ("cuda", "bf16", "infer"),
        ("cpu", "fp32", "infer"),
        ("cpu", "bf16", "infer"),
    ]
    assert [job[0] for job in bench_matrix(config, CPU_ONLY)] == ["cpu", "cpu"]


def test_bench_matrix_for_an_explicit_list_takes_only_those_backends() -> None:
    config = _config("bench.backends=[cpu]", "bench.precisions=[fp32]")
    assert bench_matrix(config, CUDA) == [("cpu", "fp32", "train"), ("cpu", "fp32", "infer")]


def test_bench_matrix_with_an_absent_listed_backend_raises_with_the_envs_error() -> None:
    config = _config("bench.backends=[cpu, mps]")
    with pytest.raises(DeviceUnavailableInEnv) as caught:
        bench_matrix(config, CUDA)
    assert str(caught.value) == CUDA["backends"]["mps"]["error"]


# ---------------------------------------------------------------------------- flatten


def test_flatten_gives_dotted_json_items_sorted() -> None:
    assert flatten({"eval": {"score_threshold": 0.25, "batch_size": 8}, "device": "cpu"}) == [
        'device="cpu"',
        "eval.batch_size=8",
        "eval.score_threshold=0.25",
    ]


def test_flatten_does_not_depend_on_the_order_keys_were_merged_in() -> None:
    """Snakemake compares params as text: `--config train={lr: 0.01}` reorders train's keys."""
    assert flatten({"train": {"lr": 0.1, "epochs": 2}}) == flatten(
        {"train": {"epochs": 2, "lr": 0.1}}
    )


def test_flatten_items_read_back_to_the_same_nested_dict() -> None:
    settings = {
        "data": {
            "synthetic": {
                "num_train": 8,
                "classes": ["circle", "ring"],
                "noise_std": 12.5,
                "seed": 0,
            },
            "classes": None,
            "root": "resources/data/1",
            "cache": False,
            "train_split": "true",  # a string that YAML would read as a bool unquoted
        },
        "sweep": {},
        "precision": "auto",
        "train": {"grad_clip": None, "lr": 0.006},
    }
    assert parse_overrides(flatten(settings)) == settings


def test_flattened_config_sections_reproduce_the_config() -> None:
    """What the workflow passes to `python -m pipeline` gives the config it started from."""
    config = _config("train.lr=0.00001", "data.synthetic.num_train=8", "eval.score_threshold=0.25")
    sections = {key: config[key] for key in ("data", "train", "eval", "model")}
    assert _config(*flatten(sections)) == config


# ---------------------------------------------------------------- precision: measured
def chosen(**by_model: str):
    """The workflow's reader of the choose_precision checkpoint, for fixed choices."""
    calls: list[str] = []

    def measured(backend: str) -> dict[str, str]:
        calls.append(backend)
        return by_model

    measured.calls = calls
    return measured


def test_a_measured_run_is_named_after_the_precision_the_benchmarks_chose() -> None:
    measured = chosen(tiny_conv="bf16")
    (run,) = training_runs(_config("precision=measured"), CPU_ONLY, measured)
    assert run == Run("cpu", "bf16", (), measured=True)
    assert run.name == "cpu-bf16" and measured.calls == ["cpu"]
    assert run.settings() == ["device=cpu", "precision=measured"]
    config = _config(*run.settings())
    assert config["precision"] == "measured"


def test_the_choice_is_only_read_when_a_run_is_measured() -> None:
    measured = chosen(tiny_conv="bf16")
    assert training_runs(_config("precision=auto"), CPU_ONLY, measured) == [Run("cpu", "fp32")]
    assert measured.calls == []


def test_a_precision_sweep_of_fp32_and_measured_trains_both_for_the_accuracy_check() -> None:
    runs = training_runs(
        _config("sweep.precision=[fp32, measured]"), CUDA, chosen(tiny_conv="fp16")
    )
    assert [(r.name, r.measured) for r in runs] == [("cuda-fp32", False), ("cuda-fp16", True)]


def test_measured_choosing_fp32_beside_fp32_is_one_run_that_records_the_choice() -> None:
    runs = training_runs(
        _config("sweep.precision=[fp32, measured]"), CPU_ONLY, chosen(tiny_conv="fp32")
    )
    assert runs == [Run("cpu", "fp32", (), measured=True)]


def test_measured_runs_of_a_model_sweep_take_each_models_own_choice() -> None:
    runs = training_runs(
        _config("precision=measured", "sweep.model=[tiny_conv, resnet18]"),
        CUDA,
        chosen(tiny_conv="fp32", resnet18="bf16"),
    )
    assert [r.name for r in runs] == ["cuda-fp32+model=tiny_conv", "cuda-bf16+model=resnet18"]


def test_find_run_maps_a_wildcard_back_to_its_run() -> None:
    runs = training_runs(_config("precision=measured"), CPU_ONLY, chosen(tiny_conv="fp32"))
    assert find_run(runs, "cpu-fp32").measured is True
    with pytest.raises(ConfigError, match=r"is not one the config asks for.*set device, precision"):
        find_run(runs, "cpu-bf16")


def test_bench_settings_are_what_a_benchmark_reads_and_not_what_it_ignores() -> None:
    settings = bench_settings(_config("sweep.model=[resnet18]", "train.epochs=3"))
    assert settings["bench"]["models"] == ["tiny_conv", "resnet18"]
    assert "epochs" not in settings["train"] and settings["train"]["batch_size"] == 16
    assert "num_workers" not in settings["data"] and "augment" not in settings["data"]
    assert settings["data"]["synthetic"] == {"classes": ["circle", "square", "triangle", "cross"]}
    changed = _config("train.epochs=30", "eval.batch_size=7", "data.cache=false")
    assert bench_settings(changed) == bench_settings(_config())
    assert bench_settings(_config("data.cache_budget=0.1")) == bench_settings(_config())


@pytest.mark.parametrize("data_format", ["synthetic", "coco"])
def test_bench_settings_take_the_data_keys_that_change_the_timed_step_and_no_others(
    data_format: str,
) -> None:
    """Input size and class count change the step; where images lie, what validation and
    test take, and how images are fitted to the input do not: a change of those reruns
    training, not the benchmarks, which are still told them (bench_data_settings) to count
    the classes as training does."""
    base = [f"data.format={data_format}"]
    plain = bench_settings(_config(*base))
    own = data_format != "synthetic"  # only a data set of the user's is carved
    for same in (
        "data.resize=stretch",
        "data.test_split=null",
        "data.images_dir=/elsewhere",
        "data.val_images_dir=/elsewhere",
        *(["data.val_fraction=0.2"] if own else []),
    ):
        assert bench_settings(_config(*base, same)) == plain, same
    counted = (
        ["data.train_annotations=x.json", "data.test_fraction=0.2"]
        if own
        else ["data.synthetic.classes=[circle, ring]"]
    )
    for different in ("data.image_size=96", "data.classes=[a, b]", *counted):
        assert bench_settings(_config(*base, different)) != plain, different
    config = _config(*base)
    told = {**bench_settings(config)["data"], **bench_data_settings(config)["data"]}
    loading = {"augment", "cache", "cache_budget", "num_workers", "synthetic"}
    # every data key the benchmark was told before, no more: of data.synthetic, its classes
    assert set(told) == set(config["data"]) - loading | ({"synthetic"} if not own else set())


def test_run_config_is_the_workflow_config_with_the_runs_device_precision_and_sweep() -> None:
    config = load_config(None, ["train.lr=0.006", "precision=fp16"])
    got = run_config(config, parse_run("cuda1-bf16+seed=3+lr=0.01"))
    assert (got["device"], got["precision"]) == ("cuda:1", "bf16")
    assert (got["seed"], got["train"]["lr"]) == (3, 0.01)
    assert got["train"]["epochs"] == config["train"]["epochs"]
    assert run_config(config, parse_run("cpu-fp32"))["precision"] == "fp32"
    assert config["train"]["lr"] == 0.006  # the workflow's config is left as it was


def test_the_workflows_training_settings_reproduce_every_setting_training_reads() -> None:
    """The train rule passes result_settings as params and other_training_settings beside them:
    between them nothing may be left to the train command's own default config."""
    config = _config("train.lr=0.00001", "data.cache=false", "eval.batch_size=3", "precision=bf16")
    passed = _config(*flatten(result_settings(config)), *flatten(other_training_settings(config)))
    for key in ("seed", "deterministic", "precision", "data", "model", "train", "eval"):
        assert passed[key] == config[key], key


def test_a_training_that_carves_the_test_split_is_told_the_test_split_null_that_allows_it(
    tmp_path: Path,
) -> None:
    """A data.root holding a test file may still carve the test split (data.test_fraction)
    with data.test_split: null; training, left the default test_split, found the file and
    refused, asking for the very setting the config had."""
    from pipeline.data import carved_splits

    (tmp_path / "instances_test.json").write_text("{}")
    config = _config(
        "data.format=coco",
        f"data.root={tmp_path}",
        "data.test_fraction=0.2",
        "data.test_split=null",
    )
    passed = _config(*flatten(result_settings(config)), *flatten(other_training_settings(config)))
    assert carved_splits(passed) == {"test": 0.2}
    assert "test_split" not in other_training_settings(_config())["data"]  # retrains nothing


def test_the_held_out_test_split_is_no_training_setting() -> None:
    """Only evaluation reads the test split: changing it must neither retrain nor block a resume."""
    changed = _config("data.test_split=holdout", "data.synthetic.num_test=9")
    assert result_settings(changed) == result_settings(_config())
