"""Checkpoints: written atomically, read only with `torch.load(weights_only=True)`.

A kill during a save leaves the previous file in place (temporary file, then rename);
a checkpoint from elsewhere cannot run code on load.
"""

from __future__ import annotations

import pickle
import random
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline import atomic
from pipeline.errors import CheckpointError

FORMAT = "pipeline.checkpoint/1"


def save(path: str | Path, state: dict[str, Any]) -> Path:
    """Write `state` (plus the format tag) to `path` through a temporary file."""
    state = {"format": FORMAT, **state}
    return atomic.write_with(path, lambda tmp: torch.save(state, tmp))


def load(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint safely; every way it can fail becomes one CheckpointError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"Checkpoint {path} does not exist. Train first (python -m pipeline train) or check the path."
        )
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        # torch's message cannot tell a hostile pickle from other non-tensor content: say both
        raise CheckpointError(
            f"Checkpoint {path} was refused by torch.load(weights_only=True): it holds pickled Python "
            "objects beyond tensors and plain containers, which could run code when loaded (or it is "
            "not a torch checkpoint at all). Checkpoints are never loaded any other way: only use "
            f"files you trust, re-saved as plain tensors. ({_first_line(error)})"
        ) from error
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as error:
        raise CheckpointError(
            f"Checkpoint {path} is damaged (truncated, or not a torch checkpoint): {_first_line(error)}."
        ) from error
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(
            f"Checkpoint {path} was not written by this pipeline (no '{FORMAT}' format tag)."
        )
    return state


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def check_compatible(
    state: dict[str, Any], path: str | Path, *, model_name: str, num_classes: int, label_mode: str
) -> None:
    """Refuse weights from another model, class count or label mode, saying which differs."""
    config = state["config"]
    found = {
        "model": config["model"]["name"],
        "number of classes": len(state["class_names"]),
        "label mode": config["model"]["label_mode"],
    }
    wanted = {"model": model_name, "number of classes": num_classes, "label mode": label_mode}
    differences = [
        f"{key} {found[key]!r} (expected {wanted[key]!r})"
        for key in wanted
        if found[key] != wanted[key]
    ]
    if differences:
        raise CheckpointError(f"Checkpoint {path} does not fit: it holds {'; '.join(differences)}.")


def load_weights(model: torch.nn.Module, state: dict[str, Any], path: str | Path) -> None:
    """Copy a checkpoint's weights into `model`; weights of another architecture, width or
    class count raise a CheckpointError naming the model and the first mismatch, not torch's
    multi-line RuntimeError."""
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as error:
        details = [line.strip() for line in str(error).splitlines()[1:] if line.strip()]
        first = (details[0] if details else _first_line(error)).rstrip(".")
        if len(first) > 300:
            first = first[:300] + " ..."
        model_config = state["config"]["model"]
        width = f", width {model_config['width']}" if model_config["name"] == "tiny_conv" else ""
        raise CheckpointError(
            f"Checkpoint {path} does not fit model {model_config['name']!r} ({len(state['class_names'])} "
            f"classes{width}) that its own config describes: its weights are of another architecture, "
            f"width or class count ({first}). Use a best.pth or last.pth that training wrote, unedited."
        ) from error


def restore_model(
    state: dict[str, Any],
    device: torch.device,
    memory_format: torch.memory_format,
    path: str | Path = "(in memory)",
) -> torch.nn.Module:
    """The trained model of a checkpoint, on `device`, in eval mode."""
    from pipeline.models import build_from_config

    model = build_from_config(state["config"]["model"], len(state["class_names"]))
    load_weights(model, state, path)
    return model.to(device, memory_format=memory_format).eval()


def rng_state() -> dict[str, Any]:
    """Every global RNG, in types that weights_only loading accepts."""
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
