"""Which settings a figure depends on: what must match for a training to resume or be reused
(`result_settings`), what only changes its speed (`speed_settings`), and what two runs' accuracy
figures are comparable under (`accuracy_settings`); and what the workflow must pass the jobs that
read a checkpoint, whose config lacks it or holds training's value (`evaluation_settings`,
`loading_settings`). No torch here: the Snakefile imports this at parse time.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

# What training reads that changes how fast it runs, never what it learns: data loading
# (augmentation is seeded per sample, so workers and caching give the same batches) and
# the batch size of validation passes.
SPEED_SETTINGS = {"data": ("num_workers", "cache", "cache_budget"), "eval": ("batch_size",)}
# Top-level keys and whole sections that training's result depends on; of `eval`, the keys
# that training's validation reads (it picks best.pth by them).
RESULT_KEYS = ("seed", "deterministic", "precision", "data", "model", "train")
VALIDATION_EVAL_KEYS = (
    "score_threshold",
    "iou_threshold",
    "max_detections",
    "min_score",
    "protocol",
    "flip_test",
)
# Data keys no training result depends on: the held-out test split is the evaluation's alone
# (training checks them only while it carves the test split: see other_training_settings).
TEST_SPLIT_KEYS = ("test_split", "test_annotations", "test_images_dir")
# Data keys whose null means off, left out of the settings while off: a run made before they
# existed (a checkpoint's config, a summary without them) then has the same settings. Set, both
# change what is trained (the images carved out of training) and what is measured.
OFF_WHILE_NULL = ("val_fraction", "test_fraction")


def _in_settings(key: str, value: Any) -> bool:
    """Whether a data key's value belongs in the settings (see OFF_WHILE_NULL)."""
    return not (key in OFF_WHILE_NULL and value is None)


def result_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a training run's result depends on, and nothing else.

    One definition for both places that ask: what must match for `train --resume` to
    continue a run, and what the workflow's training rule passes as params (a change
    reruns training and what follows; a change of anything else reruns neither).
    """
    settings = {key: copy.deepcopy(config.get(key)) for key in RESULT_KEYS}
    settings["data"] = {
        key: value
        for key, value in (settings["data"] or {}).items()
        if key not in SPEED_SETTINGS["data"]
        and key not in TEST_SPLIT_KEYS
        and _in_settings(key, value)
    }
    synthetic = settings["data"].get("synthetic")
    if isinstance(synthetic, dict):
        settings["data"]["synthetic"] = {k: v for k, v in synthetic.items() if k != "num_test"}
    evaluation = config.get("eval") or {}
    settings["eval"] = {key: evaluation.get(key) for key in VALIDATION_EVAL_KEYS}
    return settings


def test_split_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The data keys that say which test split to report on (TEST_SPLIT_KEYS, and whether the
    generated set has one: data.synthetic.num_test). Training leaves them out of its
    checkpoint's config, so the evaluation must be told them: without them it reads the
    checkpoint's defaults, and reports on validation though the config names a test split, or
    on a test file the config no longer asks for (num_test: 0, after a run that had one)."""
    data = config.get("data") or {}
    settings = {key: copy.deepcopy(data.get(key)) for key in TEST_SPLIT_KEYS}
    synthetic = data.get("synthetic")
    if isinstance(synthetic, dict):
        settings["synthetic"] = {"num_test": synthetic.get("num_test")}
    return {"data": settings}


def speed_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The settings training reads besides `result_settings` (see SPEED_SETTINGS)."""
    return {
        section: {key: copy.deepcopy(config[section][key]) for key in keys}
        for section, keys in SPEED_SETTINGS.items()
    }


def other_training_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """What training reads besides `result_settings`, none of which changes what it learns:
    `speed_settings`, and, while data.test_fraction carves the test split out of training, the
    keys that give one (`test_split_settings`). Training refuses a test split both carved and
    given, so without the user's data.test_split: null it would find the default's file under
    data.root and refuse the very setting that allows carving."""
    settings = speed_settings(config)
    if (config.get("data") or {}).get("test_fraction") is not None:
        settings["data"].update(test_split_settings(config)["data"])
    return settings


def accuracy_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a pipeline run's accuracy figures depend on: what training's result
    depends on (`result_settings`) and what defines the test figures (the test split and every
    eval key but the speed ones). Two runs with equal settings have comparable accuracy, on
    whatever machines they ran. Where the data set is generated, its folder is left out:
    data.synthetic alone says what it holds."""
    settings = result_settings(config)
    data = config.get("data") or {}
    settings["data"] = {
        key: copy.deepcopy(value)
        for key, value in data.items()
        if key not in SPEED_SETTINGS["data"]
        and _in_settings(key, value)
        and not (key == "root" and data.get("format") == "synthetic")
    }
    settings["eval"] = {
        key: copy.deepcopy(value)
        for key, value in (config.get("eval") or {}).items()
        if key not in SPEED_SETTINGS["eval"]
    }
    return settings


def evaluation_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """What the workflow's evaluation job reruns on besides its checkpoint: every eval key, and
    the test split (`test_split_settings`), which the checkpoint leaves out."""
    return {"eval": copy.deepcopy(dict(config.get("eval") or {})), **test_split_settings(config)}


def loading_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """How fast data load (SPEED_SETTINGS' data keys): what an evaluation must be told besides
    `evaluation_settings`, as the checkpoint holds training's values, never rerun by a change."""
    return {"data": speed_settings(config)["data"]}


def differing_keys(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two (nested) settings, in order."""
    keys = list(old) + [key for key in new if key not in old]
    found = []
    for key in keys:
        before, after = old.get(key), new.get(key)
        if isinstance(before, Mapping) and isinstance(after, Mapping):
            found += differing_keys(before, after, f"{prefix}{key}.")
        elif before != after or (key in old) != (key in new):
            found.append(f"{prefix}{key}")
    return found
