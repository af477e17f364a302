"""`python -m pipeline choose-precision`: what `precision: measured` trains in on a backend, and why.

Reads the backend's training benchmarks (results/bench/<backend>-<precision>-train.json) and
prints, per benchmarked model, the chosen precision with its speed-up over fp32 and interval,
and why each other precision was not chosen; `--out` writes the same as JSON.
"""

from __future__ import annotations

import logging

from pipeline import atomic
from pipeline.cli import add_config_options, command_parser, config_from_args
from pipeline.errors import ConfigError

log = logging.getLogger("pipeline")


def main(argv: list[str]) -> int:
    parser = command_parser("choose-precision", __doc__)
    parser.add_argument("--device", default="auto", help="backend to choose for (default: auto)")
    parser.add_argument(
        "--bench", default="results/bench", metavar="DIR", help="benchmark records to read"
    )
    parser.add_argument("--out", metavar="FILE.json", help="also write the choices as JSON")
    parser.add_argument(
        "--env",
        metavar="ENV.json",
        help="the environment check's report (results/env.json, as the workflow passes it): "
        "which precisions measured may use on the backend comes from it, so torch is not "
        "imported; without it the device is probed",
    )
    add_config_options(parser, "model.name=resnet18")
    args = parser.parse_args(argv)
    atomic.refuse_unwritable_output("--out", args.out)
    config = config_from_args(args)

    from pipeline import measured
    from pipeline.runs import benchmarked_models

    backend, refused = _from_env(args.env, args.device) if args.env else (None, None)
    if refused is None:
        from pipeline import device as dev

        backend = dev.resolve_device(args.device).type
        refused = dev.measured_refusals(backend)
    models = benchmarked_models(config)
    records = measured.train_records(args.bench, backend)
    choices = [measured.choose_precision(records, backend, model, refused) for model in models]
    for choice in choices:
        print(f"{backend} {choice.model}: train in {choice.precision}: {choice.reason}")
        for candidate in choice.candidates:
            verdict = "eligible" if candidate.eligible else "not chosen"
            print(f"  {candidate.precision}: {verdict}: {candidate.reason}")
    if args.out:
        atomic.write_json(args.out, measured.choices_document(backend, choices))
    return 0


def _from_env(path: str, device: str) -> tuple[str, dict[str, str | None] | None]:
    """The backend `device` names and why measured may not use each reduced precision there,
    as the environment check recorded them; None for an env.json without them (older ones)."""
    from pipeline.runs import read_env

    try:
        env = read_env(path)
    except (OSError, ValueError) as error:
        raise ConfigError(f"--env {path} cannot be read as an env.json: {error}.") from error
    backend = (env.get("auto") if device == "auto" else device.partition(":")[0]) or "cpu"
    entry = (env.get("backends") or {}).get(backend)
    if not isinstance(entry, dict):
        raise ConfigError(f"--env {path} does not describe backend {backend!r}.")
    if not entry.get("available"):
        raise ConfigError(
            f"Backend {backend!r} is not available by {path}: {entry.get('reason') or 'no reason given'}."
        )
    refused = entry.get("measured_refused")
    return backend, refused if isinstance(refused, dict) else None
