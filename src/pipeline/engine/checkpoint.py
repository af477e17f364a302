"""Checkpoints: written atomically, read only with `torch.load(weights_only=True)`.

A kill during a save leaves the previous file in place (temporary file, then rename);
a checkpoint from elsewhere cannot run code on load.
"""

from __future__ import annotations

import pickle
import random
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline import atomic
from pipeline.config import COMMAND_LINE, Layer, upgrade_legacy_precision, validate_layers
from pipeline.errors import CheckpointError

FORMAT = "pipeline.checkpoint/1"
EXPECTED = f"Expected a best.pth or last.pth that 'python -m pipeline train' wrote ({FORMAT})."
_USE_ANOTHER = "Use the run's other checkpoint (best.pth or last.pth), or train again."
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_MAGIC = b"\x80"  # pickle protocol 2 and later: torch's legacy (pre-1.6) format
# keys every reader of a checkpoint needs (eval, profile, resume)
_REQUIRED_KEYS = ("model", "config", "class_names", "epoch")


def save(path: str | Path, state: dict[str, Any], advice: str = "") -> Path:
    """Write `state` (plus the format tag) to `path` through a temporary file; `advice` goes
    into the error of a failed write (see atomic.write_with)."""
    state = {"format": FORMAT, **state}

    def write(tmp: Path) -> None:
        # Into a Python file object: torch then reports a full disk as a RuntimeError
        # ("unexpected pos ...") whose context is the OSError; into a path, without any errno.
        with open(tmp, "wb") as handle:
            torch.save(state, handle)

    return atomic.write_with(path, write, advice)


def load(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint safely; every way it can fail becomes one CheckpointError that names the
    file, says what it is instead and what was expected."""
    path = Path(path)
    _check_is_a_torch_file(path)
    try:
        with warnings.catch_warnings():  # e.g. about a pickle protocol: the outcome is what counts
            warnings.simplefilter("ignore", UserWarning)
            state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        # torch's message cannot tell a hostile pickle from other non-tensor content: say both
        raise CheckpointError(
            f"Checkpoint {path} was refused by torch.load(weights_only=True): it holds pickled Python "
            "objects beyond tensors and plain containers, which could run code when loaded (or it is "
            "not a torch checkpoint at all). Checkpoints are never loaded any other way: only use "
            f"files you trust, re-saved as plain tensors. ({_unpickler_reason(error)})"
        ) from error
    except MemoryError:
        raise
    except Exception as error:  # torch.load of arbitrary bytes can fail with any exception type
        raise _damaged(path, error) from error
    _check_contents(state, path)
    state["config"] = upgrade_legacy_precision(state["config"])
    return state


def _check_is_a_torch_file(path: Path) -> None:
    """Refuse, from its first bytes, a file that cannot be a torch checkpoint at all: torch.load
    would fail on it with an unpickler's KeyError or IndexError, or misreport it."""
    if not path.exists():
        raise CheckpointError(
            f"Checkpoint {path} does not exist. Train first (python -m pipeline train) or check the path."
        )
    if not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise CheckpointError(f"Checkpoint {path} is {kind}. {EXPECTED}")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(
            f"Checkpoint {path} is empty (0 bytes): a copy or a save that never finished. {EXPECTED}"
        )
    try:
        with open(path, "rb") as handle:
            head = handle.read(512)
    except OSError as error:
        raise CheckpointError(
            f"Checkpoint {path} cannot be read: {error.strerror or error}."
        ) from error
    if head.startswith(_ZIP_MAGIC):
        _check_zip(path, size)
    elif not head.startswith(_PICKLE_MAGIC):
        raise CheckpointError(
            f"Checkpoint {path} is not a checkpoint: {_what_it_is(head)}. {EXPECTED}"
        )


def _check_zip(path: Path, size: int) -> None:
    """A torch checkpoint is a zip archive holding `<name>/data.pkl`, and no TorchScript code."""
    if not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"Checkpoint {path} is damaged: it starts as a torch checkpoint (a zip archive) does, "
            f"but its end is missing after {size} bytes, so it was cut short. {_USE_ANOTHER}"
        )
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError) as error:
        raise _damaged(path, error) from error
    if any("/code/" in name for name in names):
        raise CheckpointError(
            f"Checkpoint {path} is a TorchScript model (torch.jit.save), not a checkpoint: it holds "
            f"code, which is never loaded. {EXPECTED}"
        )
    if not any(name.endswith("/data.pkl") for name in names):
        listed = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise CheckpointError(
            f"Checkpoint {path} is a zip archive but not a torch checkpoint: it holds {listed} and "
            f"no data.pkl. {EXPECTED}"
        )


def _what_it_is(head: bytes) -> str:
    """The kind of file its first bytes show, for a message."""
    if head.startswith(b"\x1f\x8b"):
        return "it is gzip-compressed"
    if b"\0" not in head:
        try:
            text = head.decode("utf-8")
        except UnicodeDecodeError as error:
            text = head[: error.start].decode("utf-8") if error.start > len(head) - 4 else None
        if text is not None:
            start = " ".join(text.split())[:40]
            return f"it is a text file (it starts with {start!r})"
    return f"its first bytes ({head[:8].hex(' ')}) are those of neither a zip archive nor a pickle"


def _check_contents(state: Any, path: Path) -> None:
    """What torch.load returned must be this pipeline's checkpoint dict."""
    if not isinstance(state, dict):
        raise CheckpointError(
            f"Checkpoint {path} is a torch file holding a {type(state).__name__}, not a checkpoint. "
            f"{EXPECTED}"
        )
    if "format" not in state:
        if state and all(isinstance(value, torch.Tensor) for value in state.values()):
            what = (
                f"a bare state_dict of {len(state)} tensors (first {next(iter(state))!r}), as "
                "torch.save(model.state_dict()) writes, without the config and class names that "
                "rebuild the model"
            )
        else:
            keys = ", ".join(repr(key) for key in list(state)[:5])
            what = (
                f"a dict with the keys {keys}{', ...' if len(state) > 5 else ''} and no format tag"
            )
        raise CheckpointError(
            f"Checkpoint {path} was not written by this pipeline: it holds {what}. {EXPECTED}"
        )
    if state["format"] != FORMAT:
        raise CheckpointError(
            f"Checkpoint {path} has the format tag {state['format']!r}, which this version of the "
            f"pipeline does not read. {EXPECTED}"
        )
    missing = [key for key in _REQUIRED_KEYS if key not in state]
    if missing:
        raise CheckpointError(
            f"Checkpoint {path} has the format tag but lacks {', '.join(map(repr, missing))}: it "
            f"was edited or written by another program. {EXPECTED}"
        )


def _damaged(path: Path, error: BaseException) -> CheckpointError:
    return CheckpointError(
        f"Checkpoint {path} is damaged (truncated, or not a torch checkpoint): "
        f"{_first_line(error)}. {_USE_ANOTHER}"
    )


def _unpickler_reason(error: pickle.UnpicklingError) -> str:
    """The line of torch's long refusal that says what the file holds (an unsupported global
    names the class or function the pickle would call)."""
    text = str(error)
    marker = "WeightsUnpickler error:"
    lines = [line.strip() for line in text.split(marker, 1)[-1].splitlines() if line.strip()]
    if marker in text and lines:
        return lines[0].split(". ", 1)[0].rstrip(".")
    return _first_line(error)


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


def weights_fit(model: torch.nn.Module, state: dict[str, Any]) -> bool:
    """Whether the checkpoint's weights have the model's names and shapes: weights of an earlier
    version of the model (say, one box per cell) do not, and a resume that may start afresh
    must find that out before loading, since `load_state_dict` copies what fits and then raises."""
    own, theirs = model.state_dict(), state["model"]
    return own.keys() == theirs.keys() and all(
        tuple(own[key].shape) == tuple(theirs[key].shape) for key in own
    )


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


def operating_point(val_metrics: dict[str, Any]) -> dict[str, Any]:
    """What best.pth keeps of its epoch's validation: the best-F1 score threshold, the model's
    operating point, which evaluation, the report and predict use unless eval.score_threshold
    names one."""
    return {
        "score_threshold": float(val_metrics["best_f1_threshold"]),
        "f1": float(val_metrics["best_f1"]),
        "picked_on": "val",
    }


def config_of(
    state: dict[str, Any], path: str | Path, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The checkpoint's config validated with today's defaults filled in (a checkpoint of an
    older version names no key added since), `overrides` (the command line's) on top; a bad
    value's error names the checkpoint file, or the command line, it came from."""
    layers = [Layer(f"the config of {path}", state["config"])]
    if overrides is not None:
        layers.append(Layer(COMMAND_LINE, overrides))
    return validate_layers(layers)


def score_threshold(config: dict[str, Any], state: dict[str, Any]) -> tuple[float | None, str]:
    """The score threshold detections of this checkpoint count from, and where it comes from.

    An explicit `eval.score_threshold` wins ("eval.score_threshold"); else the operating point
    training saved ("checkpoint"); else (None, "validation"): a checkpoint written before the
    operating point was saved, whose config asks for it all the same, leaves the choice to the
    caller (evaluation picks it on validation again; predict needs a threshold given).
    """
    explicit = config["eval"]["score_threshold"]
    if explicit is not None:
        return float(explicit), "eval.score_threshold"
    point = state.get("operating_point")
    if point is not None:
        return float(point["score_threshold"]), "checkpoint"
    return None, "validation"


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
