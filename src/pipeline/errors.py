"""Errors a user can cause, each answered with one actionable paragraph and exit status 2.

The CLI prints these without a traceback (unless `--debug`); anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations


class PipelineError(Exception):
    """Base for errors caused by input the user controls (config, device, data, files)."""


class ConfigError(PipelineError):
    """A config key, value or command-line setting is wrong."""


class DataError(PipelineError):
    """A data set, image or annotation file is missing or malformed."""


class CheckpointError(PipelineError):
    """A checkpoint is missing, damaged, unsafe or does not fit the model."""


class TrainingError(PipelineError):
    """Training cannot go on (for example the loss stopped being finite)."""


class ResultsFileError(PipelineError):
    """A file under the results folder is unreadable or not in the format its stage writes."""


class OutputError(PipelineError):
    """An output could not be written: a full disk, a quota, no permission, a read-only mount."""


def user_message(error: PipelineError) -> str:
    """The error's own paragraph, also where a DataLoader worker raised it: torch re-raises it
    in the main process with the worker's traceback as its message, which ends in
    `<module>.<class>: <the paragraph>`."""
    text = str(error)
    marker = f"{type(error).__module__}.{type(error).__qualname__}: "
    if text.startswith("Caught ") and marker in text:
        return text.rsplit(marker, 1)[1].strip()
    return text
