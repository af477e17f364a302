"""`python -m pipeline choose-precision`: what `precision: measured` trains in on a backend, and why.

Reads the backend's training benchmarks (results/bench/<backend>-<precision>-train.json) and
prints, per benchmarked model, the chosen precision with its speed-up over fp32 and interval,
and why each other precision was not chosen; `--out` writes the same as JSON.
"""

from __future__ import annotations

import logging

from pipeline import atomic
from pipeline.cli import add_config_options, command_parser, config_from_args

log = logging.getLogger("pipeline")


def main(argv: list[str]) -> int:
    parser = command_parser("choose-precision", __doc__)
    parser.add_argument("--device", default="auto", help="backend to choose for (default: auto)")
    parser.add_argument(
        "--bench", default="results/bench", metavar="DIR", help="benchmark records to read"
    )
    parser.add_argument("--out", metavar="FILE.json", help="also write the choices as JSON")
    add_config_options(parser, "model.name=resnet18")
    args = parser.parse_args(argv)
    config = config_from_args(args)

    from pipeline import device as dev
    from pipeline import measured
    from pipeline.runs import benchmarked_models

    backend = dev.resolve_device(args.device).type
    models = benchmarked_models(config)
    records = measured.train_records(args.bench, backend)
    refused = dev.measured_refusals(backend)
    choices = [measured.choose_precision(records, backend, model, refused) for model in models]
    for choice in choices:
        print(f"{backend} {choice.model}: train in {choice.precision}: {choice.reason}")
        for candidate in choice.candidates:
            verdict = "eligible" if candidate.eligible else "not chosen"
            print(f"  {candidate.precision}: {verdict}: {candidate.reason}")
    if args.out:
        atomic.write_json(args.out, measured.choices_document(backend, choices))
    return 0
