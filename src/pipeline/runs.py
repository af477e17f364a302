"""Run names and the workflow's job matrix, derived from the config and the environment report.

A training run is named `<device>-<precision>` (for example `cpu-fp32`, `cuda1-fp16`), plus
`+key=value` for each swept setting (`cpu-fp32+seed=1+lr=0.01`): the name says how the
run was trained, so `--config device=mps` adds runs beside the CPU ones instead of
replacing them. 'auto' is resolved through the environment report that the `check_env`
checkpoint writes, never by probing torch here: the Snakefile imports this module in
every cluster job, possibly on a node without the GPU.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline.config import leaves, merge, parse_overrides
from pipeline.errors import ConfigError, PipelineError

PRECISIONS = ("fp32", "fp16", "bf16")
# sweep key -> the config key it sets
SWEEP_KEYS = {
    "seed": "seed",
    "lr": "train.lr",
    "batch_size": "train.batch_size",
    "model": "model.name",
}
_DEVICE_PART = re.compile(r"^(cpu|mps|cuda)(\d*)$")


class DeviceUnavailableInEnv(PipelineError):
    """A backend named in the config is missing on the machine check_env looked at."""


def read_env(path: str | Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def device_part(spec: str) -> str:
    """'cuda:1' -> 'cuda1' (a file-name-safe device spec)."""
    return spec.replace(":", "")


def device_spec(part: str) -> str:
    """'cuda1' -> 'cuda:1'; the inverse of device_part."""
    match = _DEVICE_PART.match(part)
    if not match:
        raise ConfigError(f"{part!r} is not a device part of a run name (cpu, mps, cuda, cudaN).")
    backend, index = match.groups()
    return f"{backend}:{index}" if index else backend


def require_backend(env: dict[str, Any], backend: str) -> None:
    entry = env["backends"][backend]
    if not entry["available"]:
        raise DeviceUnavailableInEnv(
            entry["error"] or f"Device {backend!r} is not available: {entry['reason']}."
        )


def resolve_device_spec(env: dict[str, Any], spec: str) -> str:
    """'auto' -> the backend check_env found best; an explicit backend must be available."""
    if spec == "auto":
        return env["auto"]
    require_backend(env, spec.partition(":")[0])
    return spec


def precision_for(env: dict[str, Any], backend: str, requested: str) -> str:
    """The precision a run of `precision: requested` (not measured) trains in on `backend`, as
    the device layer resolved it for env.json (device.training_precision)."""
    return env["backends"][backend]["precisions"][requested]


@dataclass(frozen=True)
class Run:
    device: str  # a device spec, e.g. cuda:1
    precision: str
    sweep: tuple[tuple[str, Any], ...] = field(default_factory=tuple)
    measured: bool = False  # the precision is what precision=measured chose (not in the name)

    @property
    def name(self) -> str:
        return f"{device_part(self.device)}-{self.precision}" + "".join(
            f"+{k}={v}" for k, v in self.sweep
        )

    @property
    def model(self) -> str | None:
        """The swept model, if the model is swept."""
        return dict(self.sweep).get("model")

    def settings(self) -> list[str]:
        """`key=value` settings that make `python -m pipeline train` do this run."""
        precision = "measured" if self.measured else self.precision
        items = [f"device={self.device}", f"precision={precision}"]
        items += [f"{SWEEP_KEYS[key]}={json.dumps(value)}" for key, value in self.sweep]
        return items


def run_config(config: dict[str, Any], run: Run) -> dict[str, Any]:
    """The config `run` trains with: the workflow's, with the run's device, precision and
    swept values, as `python -m pipeline train` reads its settings."""
    return merge(config, parse_overrides(run.settings()))


def parse_run(name: str) -> Run:
    head, *swept = name.split("+")
    part, _, precision = head.rpartition("-")
    if precision not in PRECISIONS:
        raise ConfigError(
            f"Run name {name!r} does not end its first part in a precision ({', '.join(PRECISIONS)})."
        )
    sweep = []
    for item in swept:
        key, sep, text = item.partition("=")
        if not sep or key not in SWEEP_KEYS:
            raise ConfigError(f"Run name {name!r} has an unknown sweep part {item!r}.")
        sweep.append((key, yaml.safe_load(text)))
    return Run(device_spec(part), precision, tuple(sweep))


MeasuredChoices = Callable[[str], Mapping[str, str]]


def training_runs(
    config: dict[str, Any], env: dict[str, Any], measured: MeasuredChoices | None = None
) -> list[Run]:
    """Every run the config asks for: one, or the product of the sweep's lists.

    `measured(backend)` gives the precision precision=measured chose per model on that backend
    (the workflow reads it from the choose_precision checkpoint); it is only called when a run
    asks for measured. A measured run whose choice equals another run's precision is the
    same run, kept once (as the measured one, whose summary records the choice).
    """
    device = resolve_device_spec(env, config["device"])
    backend = device.partition(":")[0]
    sweep = config.get("sweep") or {}
    requested = _requested_precisions(config)
    swept = sweep.get("precision") or []
    lost = [p for p in swept if p != "measured" and precision_for(env, backend, p) != p]
    if lost:
        raise ConfigError(
            f"sweep.precision asks for {lost} on {backend}, which does not train in them (AMP is "
            "off by the device layer's policy, and the CPU does not compute them natively): those "
            "runs would train in fp32 like the fp32 run. Remove them from sweep.precision, use "
            "measured (the benchmarks' choice), or train on a backend with AMP (cuda, mps)."
        )
    keys = [key for key in SWEEP_KEYS if sweep.get(key)]
    runs: dict[str, Run] = {}
    for wanted in requested:
        is_measured = wanted == "measured"
        for values in itertools.product(*(sweep[key] for key in keys)):
            swept = tuple(zip(keys, values, strict=True))
            if is_measured:
                if measured is None:
                    raise ConfigError(
                        "precision=measured needs the benchmarks' choice of precision."
                    )
                model = dict(swept).get("model", config["model"]["name"])
                precision = measured(backend)[model]
            else:
                precision = precision_for(env, backend, wanted)
            run = Run(device, precision, swept, is_measured)
            if run.name not in runs or is_measured:
                runs[run.name] = run
    return list(runs.values())


def _requested_precisions(config: dict[str, Any]) -> list[str]:
    """sweep.precision, or the config's precision without it."""
    return (config.get("sweep") or {}).get("precision") or [config["precision"]]


def measured_backends(config: dict[str, Any], env: dict[str, Any]) -> list[str]:
    """The backends whose precision choice the config's runs need (precision=measured, or
    measured in sweep.precision): the workflow declares their choice files as plain inputs of what
    aggregates the runs, so a missing choice is made even when those targets already exist."""
    if "measured" not in _requested_precisions(config):
        return []
    return [resolve_device_spec(env, config["device"]).partition(":")[0]]


def find_run(runs: list[Run], name: str) -> Run:
    """The run of a name among the config's runs (a wildcard value back to its run)."""
    for run in runs:
        if run.name == name:
            return run
    raise ConfigError(
        f"Run {name!r} is not one the config asks for: {[r.name for r in runs]}. A run is named "
        "by its backend and precision (and any swept settings): set device, precision or sweep "
        "so that the config asks for it (--config device=cpu precision=fp16 asks for cpu-fp16), "
        "or name one of those."
    )


def benchmarked_models(config: dict[str, Any]) -> list[str]:
    """`bench.models`, or what training trains: model.name and any swept models."""
    if config["bench"]["models"]:
        return list(config["bench"]["models"])
    swept = (config.get("sweep") or {}).get("model") or []
    return list(dict.fromkeys([config["model"]["name"], *swept]))


def bench_matrix(config: dict[str, Any], env: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(backend, precision, mode) jobs: every available backend, or the listed ones (all required)."""
    bench = config["bench"]
    if bench["backends"] == "available":
        backends = env["available"]
    else:
        backends = list(bench["backends"])
        for backend in backends:
            require_backend(env, backend)
    return [(b, p, m) for b in backends for p in bench["precisions"] for m in bench["modes"]]


# What the benchmark reads of the training config that changes the step it times. The
# optimizer's hyperparameters (lr, weight decay, momentum) and the loss weights change no
# timing: a new learning rate reruns training, not the benchmarks.
BENCH_TRAIN_KEYS = ("batch_size", "channels_last", "grad_clip", "optimizer")
# What the benchmark's numerics check reads besides: the steps it trains before comparing the
# precisions, and the loss it compares, are training's.
BENCH_NUMERICS_KEYS = ("box_weight", "lr", "momentum", "weight_decay")
# Data keys that only change how fast images load or how they are augmented, not the step.
DATA_LOADING_KEYS = ("augment", "cache", "cache_budget", "num_workers", "synthetic")
# Data keys that change the step the benchmark times: the input size, and the class count (the
# head's channels), which data.classes gives, or the generated set's classes, or else the
# classes with objects in a data set's training and validation splits (pipeline.data.class_count):
# the files those come from (CLASS_FILE_KEYS; data.test_fraction takes images out of training,
# data.val_fraction only moves them to validation, which the count reads as well).
BENCH_DATA_KEYS = ("format", "image_size", "classes")
CLASS_FILE_KEYS = (
    "root",
    "train_split",
    "val_split",
    "train_annotations",
    "val_annotations",
    "test_fraction",
)


def bench_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The settings a benchmark depends on (the workflow's rerun trigger for bench jobs)."""
    data = config["data"]
    timed = {key: data[key] for key in BENCH_DATA_KEYS}
    if data["format"] == "synthetic":
        timed["synthetic"] = {"classes": data["synthetic"]["classes"]}
    elif not data["classes"]:
        timed.update({key: data[key] for key in CLASS_FILE_KEYS})
    return {
        "deterministic": config["deterministic"],
        "data": timed,
        "model": config["model"],
        "train": {key: config["train"][key] for key in BENCH_TRAIN_KEYS},
        "bench": {**config["bench"], "models": benchmarked_models(config)},
    }


def bench_numerics_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The training keys only the benchmark's numerics check reads (BENCH_NUMERICS_KEYS): the
    workflow passes them so that the check runs at the config's values, not at the defaults,
    without making them a rerun trigger."""
    return {"train": {key: config["train"][key] for key in BENCH_NUMERICS_KEYS}}


def bench_data_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The data keys the benchmark reads besides `bench_settings`' (where the images are, what
    validation and test take): class_count loads the splits as training does, and needs them
    to find the same files; none changes the step it times, so the workflow passes them without
    making them a rerun trigger."""
    timed = bench_settings(config)["data"]
    return {
        "data": {
            key: value
            for key, value in config["data"].items()
            if key not in DATA_LOADING_KEYS and key not in timed
        }
    }


def flatten(settings: dict[str, Any]) -> list[str]:
    """Nested settings as `a.b=value` items (values as JSON, which the CLI reads as YAML).

    Sorted: Snakemake compares a params list as its text, and merging `--config` changes
    the order of a section's keys, which would rerun a job whose settings are all the same.
    """
    return sorted(f"{key}={json.dumps(value)}" for key, value in leaves(settings).items())
