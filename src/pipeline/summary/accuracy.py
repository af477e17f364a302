"""Whether a reduced precision kept the accuracy: each reduced-precision run against its fp32
twin, by paired intervals over the images both were scored on, and the scores a run is judged by.

Plain functions on the runs' results, called once by summary/build.py; the verdicts are text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.errors import PipelineError
from pipeline.evaluation.image_bootstrap import PairedChange, f1_change
from pipeline.evaluation.paired_ap import ap50_change
from pipeline.report.formatting import number
from pipeline.runs import parse_run
from pipeline.summary.load import RunResults

# A reduced-precision run that loses at most this much F1 and AP@.5 (in [0, 1]) against its fp32
# twin, with the whole 95% interval of each change above it, has kept the accuracy (AP@.5 of
# evaluations without `ap50_matches`, one figure, must not fall further).
ACCURACY_TOLERANCE = 0.01


@dataclass(frozen=True)
class AccuracyCheck:
    """A reduced-precision run against the fp32 run of otherwise equal settings.

    `f1_change` is the paired interval of the F1 change over the images both were scored on;
    None where either evaluation lacks per-image counts (`why_unpaired` says why).
    `ap50_change` is AP@.5's, None where either evaluation lacks pycocotools' matches.
    """

    reduced: str
    reference: str
    precision: str
    f1: float | None
    reference_f1: float | None
    ap50: float | None
    reference_ap50: float | None
    split: str
    f1_change: PairedChange | None = None
    why_unpaired: str | None = None
    ap50_change: PairedChange | None = None

    @property
    def drops(self) -> dict[str, float | None]:
        """Points lost (positive) or gained (negative) against fp32, per metric."""
        return {
            "F1": None if None in (self.f1, self.reference_f1) else self.reference_f1 - self.f1,
            "AP@.5": None
            if None in (self.ap50, self.reference_ap50)
            else self.reference_ap50 - self.ap50,
        }

    @property
    def verdict(self) -> str:
        """'held' (both changes held), 'dropped' (either dropped), 'undecided' (the images
        cannot tell, or F1 held and AP@.5, unpaired, fell) or 'not comparable' (no paired F1)."""
        if self.f1_change is None:
            return "not comparable"
        if self.ap50_change is not None:
            verdicts = {self.f1_change.verdict, self.ap50_change.verdict}
            if "dropped" in verdicts:
                return "dropped"
            return "held" if verdicts == {"held"} else "undecided"
        ap_drop = self.drops["AP@.5"]
        if self.f1_change.verdict == "held" and (ap_drop or 0.0) > ACCURACY_TOLERANCE:
            return "undecided"
        return self.f1_change.verdict


def accuracy_checks(runs: list[RunResults]) -> list[AccuracyCheck]:
    """Each reduced-precision run beside the fp32 run that differs from it only in precision."""
    parsed = {}
    for run in runs:
        try:
            parsed[run.name] = parse_run(run.name)
        except PipelineError:
            continue
    by_name = {run.name: run for run in runs}
    checks = []
    for name, spec in parsed.items():
        if spec.precision == "fp32":
            continue
        twin = next(
            (
                other
                for other, candidate in parsed.items()
                if candidate.precision == "fp32"
                and candidate.device == spec.device
                and candidate.sweep == spec.sweep
            ),
            None,
        )
        if twin is None:
            continue
        reduced, reference = run_scores(by_name[name]), run_scores(by_name[twin])
        change, why_unpaired = paired_f1_change(reference, reduced)
        checks.append(
            AccuracyCheck(
                name,
                twin,
                spec.precision,
                reduced["f1"],
                reference["f1"],
                reduced["ap50"],
                reference["ap50"],
                reduced["split"] if reduced["split"] == reference["split"] else "mixed",
                change,
                why_unpaired,
                paired_ap50_change(reference, reduced) if change is not None else None,
            )
        )
    return checks


def paired_ap50_change(reference: dict[str, Any], reduced: dict[str, Any]) -> PairedChange | None:
    """The paired AP@.5 change of two runs' scores; None where either evaluation lacks
    pycocotools' matches (an earlier version's) or they do not pair."""
    matches = (reference["ap50_matches"], reduced["ap50_matches"])
    try:
        return None if None in matches else ap50_change(*matches, tolerance=ACCURACY_TOLERANCE)
    except (ValueError, KeyError, TypeError):
        return None


def paired_f1_change(
    reference: dict[str, Any], reduced: dict[str, Any]
) -> tuple[PairedChange | None, str | None]:
    """The paired F1 change of two runs' scores (`run_scores`), or None and why not."""
    if reference["split"] != reduced["split"]:
        return (
            None,
            f"they were scored on different splits ({reference['split']}, {reduced['split']})",
        )
    if reference["per_image"] is None or reduced["per_image"] is None:
        return None, (
            "no per-image counts to pair them by (an evaluation of an earlier version, or only "
            "validation during training): rerun the evaluation"
        )
    try:
        return f1_change(
            reference["per_image"], reduced["per_image"], tolerance=ACCURACY_TOLERANCE
        ), None
    except ValueError as error:
        return None, str(error)
    except (KeyError, TypeError):
        return None, "their per-image counts are malformed: rerun the evaluation"


def run_scores(run: RunResults) -> dict[str, Any]:
    """F1 at the fixed threshold, best F1 and AP@.5: from the evaluation where it ran, else
    the last validation of training; `split` says which."""
    if run.evaluation:
        metrics = run.evaluation["metrics"]

        def mapping(key: str) -> dict[str, Any] | None:
            return metrics.get(key) if isinstance(metrics.get(key), dict) else None

        return {
            "f1": number(metrics.get("f1")),
            "f1_interval": mapping("f1_interval"),
            "best_f1": number(metrics.get("best_f1")),
            "ap50": number(metrics.get("ap50")),
            "ap50_interval": mapping("ap50_interval"),
            "ap50_matches": mapping("ap50_matches"),
            "split": str(run.evaluation.get("split") or "evaluation"),
            "per_image": mapping("per_image"),
        }
    final = (run.summary or {}).get("final_val") or {}
    return {
        "f1": number(final.get("f1")),
        "f1_interval": None,
        "best_f1": number(final.get("best_f1")),
        "ap50": number(final.get("ap50")),
        "ap50_interval": None,
        "ap50_matches": None,
        "split": "validation during training",
        "per_image": None,
    }


def best_f1(run: RunResults) -> tuple[float | None, Any]:
    """Highest validation F1 and its epoch, from the metrics rows (the summary monitors any metric)."""
    points = [
        (number(row["val"].get("f1")), row.get("epoch"))
        for row in run.metrics
        if row.get("type") == "epoch" and isinstance(row.get("val"), dict)
    ]
    points = [(value, epoch) for value, epoch in points if value is not None]
    if points:
        return max(points, key=lambda point: point[0])
    summary = run.summary or {}
    if summary.get("monitor") == "f1" and number(summary.get("best_metric")) is not None:
        return number(summary["best_metric"]), summary.get("best_epoch")
    return None, None


def swept_values(name: str) -> dict[str, Any]:
    """The settings a run's name carries beyond device and precision (a sweep's values)."""
    try:
        return dict(parse_run(name).sweep)
    except PipelineError:
        return {}
