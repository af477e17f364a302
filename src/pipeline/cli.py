"""`python -m pipeline COMMAND`: one module per subcommand, each with `main(argv)`.

Errors a user can cause (a missing device, a bad config value, a broken file) print one
paragraph and exit 2; `--debug` shows the traceback instead. Ctrl-C (SIGINT) exits 130 and
SIGTERM 143, each after `finally` blocks have removed temporary files.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeline import __version__, atomic
from pipeline.config import Layer, config_layers, config_paths, validate_layers
from pipeline.errors import ConfigError, OutputError, PipelineError, user_message

COMMANDS = {
    "check-env": ("pipeline.commands.check_env", "report Python, torch, CPU and every backend"),
    "prepare-data": (
        "pipeline.commands.prepare_data",
        "generate the built-in synthetic detection set",
    ),
    "train": ("pipeline.commands.train", "train a detector with the resolved device and AMP"),
    "evaluate": (
        "pipeline.commands.evaluate",
        "evaluate a checkpoint: P/R/F1 and COCO AP (alias: eval)",
    ),
    "bench": (
        "pipeline.commands.bench",
        "time one backend x precision x mode, with numerics and memory",
    ),
    "choose-precision": (
        "pipeline.commands.choose_precision",
        "what precision=measured trains in on a backend, from its benchmarks, and why",
    ),
    "profile": (
        "pipeline.commands.profile",
        "inference latency per batch size and a torch.profiler trace",
    ),
    "summarize": (
        "pipeline.commands.summarize",
        "sum up a results folder in summary.json: the answer, the benchmarks, every run",
    ),
    "predict": (
        "pipeline.commands.predict",
        "a checkpoint's detections on image files, folders or globs",
    ),
    "report": ("pipeline.commands.report", "build the self-contained HTML comparison report"),
    "compare": (
        "pipeline.commands.compare",
        "machines side by side, from their summary.json files: HTML and Markdown",
    ),
    "config": (
        "pipeline.commands.config",
        "print the merged configuration and the file each value comes from",
    ),
}
# Other names a command answers to: `eval` was evaluate's name before it matched the workflow's.
ALIASES = {"eval": "evaluate"}
# Commands that run torch, and take every CPU they may use (see device.set_cpu_threads).
COMPUTE_COMMANDS = frozenset({"check-env", "train", "evaluate", "bench", "profile", "predict"})
log = logging.getLogger("pipeline")


class Terminated(BaseException):
    """SIGTERM as an exception, like KeyboardInterrupt for SIGINT: `finally` blocks still run."""


@contextmanager
def sigterm_raises_terminated() -> Iterator[None]:
    """While inside, SIGTERM raises Terminated in this process instead of killing it outright.

    Forked children (DataLoader workers) inherit the handler: they die of SIGTERM as before.
    """
    owner = os.getpid()

    def handler(signum: int, frame: object) -> None:
        if os.getpid() != owner:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise Terminated

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (cli.main called from a thread): leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _expanding_home(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Option values that start with `~` (`--out '~/run'`, quoted, or after `=`, where no shell
    expands it) name a path under the home folder, as everywhere else: expanded for every
    option without a type of its own (a path, a glob; never a number or a choice)."""
    parser.register("type", None, os.path.expanduser)
    return parser


def common_options() -> argparse.ArgumentParser:
    """Options every subcommand accepts; pass as `parents=[common_options()]`."""
    parser = _expanding_home(argparse.ArgumentParser(add_help=False))
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    parser.add_argument("--log", metavar="FILE", help="also write the log to FILE")
    parser.add_argument(
        "--cpu-threads",
        default="auto",
        metavar="N",
        help="torch CPU threads for compute commands (default auto: every CPU this process may use)",
    )
    return parser


def add_config_options(parser: argparse.ArgumentParser, example: str) -> None:
    """`--configfile FILE...` and `--config key=value...` as Snakemake spells them, and
    `key=value` settings, as every command that reads the config takes them."""
    parser.add_argument(
        "--configfile",
        nargs="+",
        action="extend",
        default=[],
        metavar="FILE",
        help="config files layered over config/config.yaml (where it exists), later ones "
        "winning, as with snakemake --configfile",
    )
    parser.add_argument(
        "--config",
        nargs="+",
        action="extend",
        default=[],
        metavar="key=value",
        help=f"settings over the files, as with snakemake --config (dotted keys work), e.g. {example}",
    )
    parser.add_argument("settings", nargs="*", metavar="key=value", help="the same as --config")


def config_layers_from_args(args: argparse.Namespace, *extra: str) -> list[Layer]:
    """The config files and settings a command was given (see add_config_options), plus
    `extra` settings of its own options, as layers in Snakemake's order."""
    for item in args.config:
        if "=" not in item:
            raise ConfigError(
                f"--config {item} is not a key=value setting: --config takes settings, as "
                f"snakemake --config does; give a config file as --configfile {item}."
            )
    # --configfile takes every word after it: a key=value that names no file is a setting
    files = [item for item in args.configfile if "=" not in item or Path(item).exists()]
    settings = [item for item in args.configfile if item not in files]
    return config_layers(config_paths(files), [*settings, *args.config, *args.settings, *extra])


def config_from_args(args: argparse.Namespace, *extra: str) -> dict[str, Any]:
    """The validated config of a command's arguments (see config_layers_from_args)."""
    return validate_layers(config_layers_from_args(args, *extra))


def add_resolved_config_options(parser: argparse.ArgumentParser) -> None:
    """The workflow's resolved config as JSON (what the workflow passes), or config files and
    settings layered as every command layers them, for the commands that read a results folder
    (summarize, report)."""
    parser.add_argument(
        "--config-json",
        metavar="JSON",
        help="the workflow's resolved config as a JSON string (instead of files and settings)",
    )
    add_config_options(parser, "eval.score_threshold=0.3")


def resolved_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """The config `add_resolved_config_options` asked for, defaults filled in; None if none."""
    layered = bool(args.configfile or args.config or args.settings)
    if args.config_json is not None:
        if layered:
            raise ConfigError(
                "--config-json is the workflow's resolved config: give it alone, without "
                "--configfile or settings."
            )
        return json_object(args.config_json, "--config-json")
    return config_from_args(args) if layered else None


def json_object(text: str, option: str) -> dict[str, Any]:
    """The JSON object an option's value holds; anything else is a ConfigError naming it."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"{option} is not valid JSON ({error.msg} at column {error.colno})."
        ) from error
    if not isinstance(value, dict):
        raise ConfigError(f"{option} must be a JSON object, not a {type(value).__name__}.")
    return value


class _ReplacedByPrecision(argparse.Action):
    """`--amp`, which --precision replaced: refused with the spelling that replaces it."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        raise ConfigError(
            f"--amp {values} was replaced by --precision (auto, fp32, fp16, bf16 or measured): "
            "--amp false is --precision fp32, --amp true is --precision fp16 or bf16, "
            "--amp auto and --amp measured are --precision auto and --precision measured."
        )


def add_precision_option(parser: argparse.ArgumentParser, help: str, *choices: str) -> None:
    """`--precision`, in the config's vocabulary (auto, fp32, fp16, bf16, measured)."""
    parser.add_argument(
        "--precision", choices=choices or ("auto", "fp32", "fp16", "bf16", "measured"), help=help
    )
    parser.add_argument("--amp", action=_ReplacedByPrecision, help=argparse.SUPPRESS)


def refuse_writing_over(
    inputs: Iterable[tuple[str, str | None]], outputs: Iterable[tuple[str, str | None]]
) -> None:
    """Refuse an output that names a file the command reads (`evaluate --out best.pth` wrote
    its metrics over the checkpoint) or one another output writes (the first lost), before any
    work: each pair is an option and the path given to it (None: not given)."""
    taken: dict[Path, tuple[str, str]] = {}
    for option, value in inputs:
        if value:
            taken.setdefault(Path(value).resolve(), (option, "reads"))
    for option, value in outputs:
        if not value:
            continue
        path = Path(value).resolve()
        if path in taken:
            other, verb = taken[path]
            raise ConfigError(
                f"{option} {value} names the same file as {other}, which the command {verb}: it "
                f"would be written over. Give {option} a path of its own."
            )
        taken[path] = (option, "writes")


def command_parser(name: str, description: str) -> argparse.ArgumentParser:
    return _expanding_home(
        argparse.ArgumentParser(
            prog=f"python -m pipeline {name}", description=description, parents=[common_options()]
        )
    )


def _add_handler(handler: logging.Handler) -> None:
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    log.addHandler(handler)


def configure_logging(log_file: str | None) -> None:
    """Log to stderr, and to `log_file` where given; a log file that cannot be opened (a folder
    or a file in the way) is an OutputError, said on stderr, whose handler is in place first."""
    log.handlers.clear()
    log.setLevel(logging.INFO)
    log.propagate = False
    _add_handler(logging.StreamHandler(sys.stderr))
    if log_file:
        path = Path(log_file)
        atomic.make_folder(path.parent, "--log")
        try:
            _add_handler(logging.FileHandler(path, mode="w", encoding="utf-8"))
        except OSError as error:
            raise OutputError(
                f"Could not open the log file {path} (--log): {error.strerror or error}. "
                "Nothing was run. Give --log a file path in a folder that can be written."
            ) from error


def _root_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline",
        description="Which backend and precision to train with on this machine: check the "
        "environment, benchmark, train, evaluate, profile and report.",
        epilog="Run 'python -m pipeline COMMAND --help' for a command's options.",
        parents=[common_options()],
    )
    parser.add_argument("--version", action="version", version=f"pipeline {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, summary) in COMMANDS.items():
        sub.add_parser(name, help=summary, add_help=False)
    return parser


def _command_position(argv: list[str]) -> int | None:
    """Index of the command word, skipping the value of a common option such as `--log FILE`."""
    skip_next = False
    for index, arg in enumerate(argv):
        if skip_next:
            skip_next = False
        elif arg in ("--log", "--cpu-threads"):
            skip_next = True
        elif not arg.startswith("-"):
            return index
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    root = _root_parser()
    position = _command_position(argv)
    if position is None:
        if "--version" in argv:
            root.parse_args(["--version"])  # prints it and exits 0
        root.print_help()
        return 0 if {"-h", "--help"} & set(argv) else 2
    name = ALIASES.get(argv[position], argv[position])
    if name not in COMMANDS:
        root.error(f"unknown command {name!r}; choose one of: {', '.join(COMMANDS)}")
    rest = argv[:position] + argv[position + 1 :]
    options, _ = common_options().parse_known_args(rest)
    try:
        configure_logging(options.log)
        with sigterm_raises_terminated():
            if name in COMPUTE_COMMANDS:
                from pipeline.device import set_cpu_threads

                set_cpu_threads(options.cpu_threads)
            return int(importlib.import_module(COMMANDS[name][0]).main(rest) or 0)
    except PipelineError as error:
        if options.debug:
            raise
        log.error("%s", user_message(error))
        return 2
    except KeyboardInterrupt:
        log.error("interrupted")
        return 130
    except Terminated:
        log.error("terminated")
        return 143
