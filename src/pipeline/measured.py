"""`precision: measured`: train with the precision the benchmarks found fastest, where it is safe.

A reduced precision is chosen on a backend when its benchmarked training step beats the
same backend's fp32 step with the whole bootstrap interval beyond the tolerance, its
numerics were acceptable, and the device layer lets `precision: measured` train in it there (on a
CPU: only with native bf16/fp16 instructions); of two that are, fp16 only when it beats bf16
by the same rule. Otherwise the run trains in fp32, and the choice says why. The same
function serves `python -m pipeline train --precision measured`, the workflow (which names the run
after the choice) and the report ("what measured would do"), so nothing here imports torch:
the device layer's verdicts come in as `refused` reasons.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from pipeline import formats, stats
from pipeline.errors import ConfigError, DataError

FORMAT = "pipeline.choice/1"
BENCH_FORMAT = "pipeline.bench/2"
REDUCED = ("bf16", "fp16")  # preference among equally fast precisions: bf16 needs no scaler
DEFAULT_BENCH_DIR = Path("results/bench")


def read_bench_file(path: str | Path) -> list[dict[str, Any]]:
    """The records of one `python -m pipeline bench` file, checked against bench.schema.yaml."""
    path = Path(path)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as error:
        raise DataError(f"Benchmark file {path} does not exist.") from error
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"Benchmark file {path} is not valid JSON: {error}.") from error
    problem = formats.problem(document, "bench")
    if problem:
        raise DataError(
            f"Benchmark file {path} {problem}. Run the benchmark again (snakemake bench, or "
            "python -m pipeline bench) to rewrite it."
        )
    return document["records"]


def train_records(bench_dir: str | Path, backend: str) -> list[tuple[dict[str, Any], Path]]:
    """Every training-mode record of `backend` under `bench_dir`, with the file it came from."""
    found = []
    for path in sorted(Path(bench_dir).glob(f"{backend}-*-train.json")):
        found += [(record, path) for record in read_bench_file(path) if record["mode"] == "train"]
    return found


def has_records(
    records: Iterable[tuple[Mapping[str, Any], str | Path]], backend: str, model: str
) -> bool:
    """Whether `records` hold a training benchmark of `model` on `backend` to choose from."""
    return any(
        record["backend"] == backend and record["mode"] == "train" and record["model"] == model
        for record, _ in records
    )


@dataclass(frozen=True)
class Candidate:
    """One reduced precision as the choice saw it: its speed-up over fp32 and the verdict."""

    precision: str
    eligible: bool
    reason: str
    speedup: dict[str, Any] | None = None
    record: str | None = None


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision `precision: measured` trains in on one backend, with the evidence behind it."""

    backend: str
    model: str
    precision: str
    reason: str
    speedup: dict[str, Any] | None = None
    reference: str | None = None
    candidates: list[Candidate] = field(default_factory=list)
    configuration: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrecisionChoice:
        values = dict(data)
        values["candidates"] = [Candidate(**item) for item in values.get("candidates", [])]
        return cls(**values)


def unmeasured_choice(backend: str, model: str, auto_precision: str) -> PrecisionChoice:
    """precision=measured where nothing was measured: precision=auto's `auto_precision`, and why.

    The shipped default is `measured`, so a first `python -m pipeline train` outside the workflow
    meets no benchmark records; it trains as `auto` would rather than stop or spend minutes
    benchmarking unasked, and its train_summary.json says so in the choice's reason.
    """
    return PrecisionChoice(
        backend,
        model,
        auto_precision,
        f"precision=measured had no training benchmarks of {model} on {backend} to choose from, "
        f"so this run trains in {auto_precision}, as precision=auto does. To train in what this "
        f"machine measures fastest, benchmark first: snakemake --cores 1 train benchmarks before "
        f"it trains, and python -m pipeline train reads {DEFAULT_BENCH_DIR}/{backend}-*-train.json "
        f"(or --bench DIR), which snakemake --cores 1 bench or python -m pipeline bench "
        f"--device {backend} --precision fp32,fp16,bf16 --mode train --out-dir {DEFAULT_BENCH_DIR} "
        f"writes",
    )


def choose_precision(
    records: Iterable[tuple[Mapping[str, Any], str | Path]],
    backend: str,
    model: str,
    refused: Mapping[str, str | None],
) -> PrecisionChoice:
    """The fastest safe precision for training `model` on `backend`, from its train records.

    `refused[p]` is the device layer's reason why `precision: measured` may not train in `p` on this
    backend (None where it may): `pipeline.device.measured_precision_refused_reason`.
    """
    mine = [
        (record, str(path))
        for record, path in records
        if record["backend"] == backend and record["mode"] == "train" and record["model"] == model
    ]
    if not mine:
        raise ConfigError(
            f"precision=measured needs training benchmarks of {model} on {backend}, and there are none. "
            f"Run them first: snakemake bench, or python -m pipeline bench --device {backend} "
            f"--precision fp32,fp16,bf16 --mode train --out-dir {DEFAULT_BENCH_DIR}."
        )
    by_precision = {record["precision"]: (record, path) for record, path in mine}
    reference = by_precision.get("fp32")
    if reference is None or reference[0]["status"] != "ok":
        return PrecisionChoice(
            backend,
            model,
            "fp32",
            "there is no fp32 timing to compare against, so no reduced precision can be shown "
            "to be faster",
        )
    ref_record, ref_path = reference
    candidates = [
        _judge(precision, by_precision.get(precision), ref_record, refused.get(precision))
        for precision in REDUCED
    ]
    eligible = [c for c in candidates if c.eligible]
    configuration = ref_record.get("configuration")
    if not eligible:
        why = "; ".join(f"{c.precision}: {c.reason}" for c in candidates)
        return PrecisionChoice(
            backend,
            model,
            "fp32",
            f"no reduced precision trained faster than fp32 with acceptable numerics ({why})",
            None,
            ref_path,
            candidates,
            configuration,
        )
    best, candidates = _choose_among(eligible, candidates, by_precision)
    return PrecisionChoice(
        backend,
        model,
        best.precision,
        best.reason,
        best.speedup,
        ref_path,
        candidates,
        configuration,
    )


def _choose_among(
    eligible: list[Candidate],
    candidates: list[Candidate],
    by_precision: Mapping[str, tuple[Mapping[str, Any], str]],
) -> tuple[Candidate, list[Candidate]]:
    """The eligible candidate to train in, and the candidates with the tie-break said in theirs.

    Both reduced precisions beating fp32 says nothing about which of them is faster, so the
    two are timed against each other on their own samples: where the one ahead in the median
    is not faster beyond the tolerance, bf16 wins the tie (REDUCED's order), as it keeps fp32's
    range and needs no loss scaling. A point estimate a few percent ahead is not a reason.
    """
    ahead = max(eligible, key=lambda c: c.speedup["ratio"])
    preferred = eligible[0]  # candidates come in REDUCED's order
    if preferred is ahead:
        return ahead, candidates
    head_to_head = stats.speedup_between(
        by_precision[preferred.precision][0]["timing"], by_precision[ahead.precision][0]["timing"]
    )
    if head_to_head.verdict == "faster":
        return ahead, candidates
    tie = (
        f"{ahead.precision} against {preferred.precision} is {head_to_head.text}, and "
        f"{preferred.precision} needs no loss scaling"
    )
    chosen = replace(preferred, reason=f"{preferred.reason}; {tie}")
    passed_over = replace(ahead, reason=f"{ahead.reason}, but {tie}")
    swap = {preferred.precision: chosen, ahead.precision: passed_over}
    return chosen, [swap.get(c.precision, c) for c in candidates]


def _judge(
    precision: str,
    found: tuple[Mapping[str, Any], str] | None,
    reference: Mapping[str, Any],
    refused: str | None,
) -> Candidate:
    if found is None:
        return Candidate(precision, False, "not benchmarked")
    record, path = found
    if record["status"] != "ok":
        return Candidate(precision, False, f"could not run: {record['reason']}", None, path)
    speed = stats.speedup_between(reference["timing"], record["timing"])
    as_dict = {**speed.as_dict(), "text": speed.text}
    numerics = record.get("numerics") or {}
    if not numerics.get("acceptable", False):
        problem = numerics.get("problem") or "numerics not acceptable"
        return Candidate(precision, False, f"{speed.text}, but {problem}", as_dict, path)
    if speed.verdict != "faster":
        also = f"; measured mode may not use it anyway: {refused}" if refused else ""
        return Candidate(precision, False, f"not faster: {speed.text}{also}", as_dict, path)
    if refused:
        return Candidate(
            precision,
            False,
            f"{speed.text}, but measured mode may not use it: {refused}",
            as_dict,
            path,
        )
    reason = (
        f"{precision} trains {speed.ratio:.2f}x faster than fp32 ({speed.interval_text}) with "
        "acceptable numerics"
    )
    return Candidate(precision, True, reason, as_dict, path)


def choices_document(backend: str, choices: Iterable[PrecisionChoice]) -> dict[str, Any]:
    """What `python -m pipeline choose-precision` writes: one choice per benchmarked model."""
    return {"format": FORMAT, "backend": backend, "choices": [c.as_dict() for c in choices]}


def read_choices(path: str | Path) -> dict[str, PrecisionChoice]:
    """The choices of a file `choose-precision` wrote, by model name."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise DataError(f"Precision choice file {path} cannot be read: {error}.") from error
    problem = formats.problem(data, "choice")
    if problem:
        raise DataError(
            f"{path} is not a precision choice file: it {problem}. Write it again with "
            "python -m pipeline choose-precision."
        )
    return {item["model"]: PrecisionChoice.from_dict(item) for item in data["choices"]}


def choice_for_model(path: str | Path, model: str) -> PrecisionChoice:
    """The choice for `model` in a choice file; a model it does not cover is an error."""
    choices = read_choices(path)
    if model not in choices:
        raise ConfigError(
            f"Precision choice file {path} covers {sorted(choices)}, not {model!r}: benchmark "
            f"{model} (bench.models) and choose again."
        )
    return choices[model]
