"""Timing statistics without torch, which the report reads too: robust summaries of step
times (median and IQR, as torch.utils.benchmark gives them), a drift check, the warm-up
settling rule, and speed-ups with a bootstrap interval (paired by round where the two were
interleaved, and resampled in two stages where the rounds ran on several model instances).
The intervals over a detection run's images are pipeline.evaluation.image_bootstrap's."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

NOISY_IQR_RATIO = 0.10  # IQR/median above this marks a measurement as noisy
DRIFT_LIMIT = 0.05  # second-half median this far from the first half's marks a drifting record
SETTLE_WINDOW = 5  # warm-up ends when the median of the last steps ...
SETTLE_TOLERANCE = 0.05  # ... is within this of the median of the steps before them
SPEEDUP_TOLERANCE = 0.05  # a speed-up is claimed only where its whole interval is beyond this
CONFIDENCE = 0.95
BOOTSTRAP_RESAMPLES = 2000
MIN_SAMPLES_FOR_A_CLAIM = 5  # fewer timed steps than this in either set: no claim either way
MIN_STEPS_APART = 2  # ... unless this many of one set lie beyond every step of the other


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) of already sorted values."""
    if not sorted_values:
        return math.nan
    position = (len(sorted_values) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def percentile_interval(samples: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The central `confidence` interval of bootstrap samples (the percentile method)."""
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(samples, [tail, 100 - tail])
    return float(low), float(high)


def drift(samples_s: Sequence[float]) -> dict[str, Any]:
    """Median of the second half of the samples over the first half's, in timed order.

    A step time still falling (caches, allocator, clocks settling) or rising (another job, heat)
    shows here even when the spread around the median looks small.
    """
    half = len(samples_s) // 2
    if half < 2:
        return {"ratio": None, "drifting": False}
    first = statistics.median(samples_s[:half])
    second = statistics.median(samples_s[len(samples_s) - half :])
    ratio = second / first if first > 0 else math.inf
    return {"ratio": ratio, "drifting": abs(ratio - 1) > DRIFT_LIMIT}


def summarize(samples_s: list[float]) -> dict[str, Any]:
    """Median, mean, IQR, p10/p50/p90/p99, min, max (in ms), the noisy flag and the drift check."""
    values = sorted(samples_s)
    if not values:
        return {"count": 0}
    ms = [v * 1000 for v in values]
    median = percentile(ms, 50)
    iqr = percentile(ms, 75) - percentile(ms, 25)
    ratio = iqr / median if median > 0 else math.inf
    trend = drift(samples_s)
    return {
        "count": len(ms),
        "median_ms": median,
        "mean_ms": sum(ms) / len(ms),
        "iqr_ms": iqr,
        "iqr_ratio": ratio,
        "p10_ms": percentile(ms, 10),
        "p50_ms": median,
        "p90_ms": percentile(ms, 90),
        "p99_ms": percentile(ms, 99),
        "min_ms": ms[0],
        "max_ms": ms[-1],
        "noisy": ratio > NOISY_IQR_RATIO,
        "drift_ratio": trend["ratio"],
        "drifting": trend["drifting"],
    }


def quality_words(summary: dict[str, Any]) -> list[str]:
    """What a person should know about a timing before trusting it, in plain words."""
    words = []
    if summary.get("drifting"):
        ratio = summary["drift_ratio"]
        direction = "slower" if ratio > 1 else "faster"
        words.append(
            f"drifting: the second half of the timed steps ran {abs(ratio - 1):.0%} {direction} "
            "than the first (still warming up, or the machine got busier)"
        )
    if summary.get("noisy"):
        words.append(
            f"noisy: the middle half of the steps spans {summary['iqr_ratio']:.0%} of the median"
        )
    return words


def settled(step_times: Sequence[float], window: int = SETTLE_WINDOW) -> bool:
    """Whether the median of the last `window` steps is within tolerance of the `window` before."""
    if len(step_times) < 2 * window:
        return False
    recent = statistics.median(step_times[-window:])
    before = statistics.median(step_times[-2 * window : -window])
    if before == 0:
        return recent == 0
    return abs(recent / before - 1) <= SETTLE_TOLERANCE


INDEPENDENT_METHOD = (
    f"percentile bootstrap of the ratio of medians, {BOOTSTRAP_RESAMPLES} resamples of each set"
)
PAIRED_METHOD = (
    "percentile bootstrap over rounds of the median of per-round ratios (reference block median "
    f"over candidate block median, blocks interleaved in one process), {BOOTSTRAP_RESAMPLES} "
    "resamples"
)
INSTANCES_METHOD = (
    "two-stage percentile bootstrap of the median of per-round ratios (reference block median "
    "over candidate block median, the blocks of each model instance pair interleaved in one "
    "process, on a CPU a process of its own): model instance pairs resampled, then rounds "
    f"within each, {BOOTSTRAP_RESAMPLES} resamples"
)
INDEPENDENT_INSTANCES_METHOD = (
    "two-stage percentile bootstrap of the ratio of medians: each set's model instances "
    f"resampled, then steps within each, {BOOTSTRAP_RESAMPLES} resamples of each set"
)
MIN_ROUNDS_TO_PAIR = 5  # fewer rounds in common: the sets are resampled independently (the
# percentile bootstrap of a median over 3 or 4 rounds holds far less than its confidence)


@dataclass(frozen=True)
class Speedup:
    """How much faster a candidate ran than a reference, with a bootstrap interval.

    `ratio` is the reference's median step time over the candidate's (2.0: twice as fast);
    `low`/`high` bound it at `confidence`. `verdict` is 'faster' or 'slower' only where the
    whole interval lies beyond the tolerance, 'indistinguishable' where it does not, and
    'too few samples' where either set has fewer than MIN_SAMPLES_FOR_A_CLAIM steps, unless a
    well-timed set and at least two steps of the other do not even overlap (a much slower,
    budget-limited precision).

    `paired_rounds` is the number of interleaved rounds the ratio and interval were paired
    over (`paired_speedup`); None where the two sets were resampled independently (records
    timed one after another, from different processes, or with too few rounds in common).
    `paired_instances` is the number of model instance pairs those rounds ran on (1: one
    model per side, the interval sees no instance-to-instance spread); None where unpaired.
    """

    ratio: float
    low: float
    high: float
    verdict: str
    reference_count: int
    candidate_count: int
    confidence: float = CONFIDENCE
    tolerance: float = SPEEDUP_TOLERANCE
    method: str = INDEPENDENT_METHOD
    paired_rounds: int | None = None
    paired_instances: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def over_instances(self) -> str:
        """' over 3 model instances' where the interval is over more than one, else ''."""
        count = self.paired_instances or 1
        return f" over {count} model instances" if count > 1 else ""

    @property
    def interval_text(self) -> str:
        """'95% interval 1.80-2.20x' (as a speed-up), with ' over N model instances' where
        the rounds ran on several."""
        return (
            f"{self.confidence:.0%} interval {self.low:.2f}-{self.high:.2f}x{self.over_instances}"
        )

    @property
    def text(self) -> str:
        """'2.00x faster (95% interval 1.80-2.20x)' and the like, for logs and the report."""
        interval = self.interval_text
        if self.verdict == "faster":
            return f"{self.ratio:.2f}x faster ({interval})"
        if self.verdict == "slower":
            slower = (
                f"{self.confidence:.0%} interval {1 / self.high:.2f}-{1 / self.low:.2f}x"
                f"{self.over_instances}"
            )
            return f"{1 / self.ratio:.2f}x slower ({slower})"
        if self.verdict == "too few samples":
            return (
                f"{self.ratio:.2f}x, too few timed steps to tell "
                f"({self.candidate_count} against {self.reference_count}; {interval})"
            )
        return f"indistinguishable ({self.ratio:.2f}x, {interval})"


def _verdict(
    reference: np.ndarray, candidate: np.ndarray, low: float, high: float, tolerance: float
) -> str:
    sizes = sorted((reference.size, candidate.size))
    enough = sizes[0] >= MIN_SAMPLES_FOR_A_CLAIM
    # a budget-limited slow side with a few steps, all beyond every step of a well-timed side
    apart = (
        sizes[0] >= MIN_STEPS_APART
        and sizes[1] >= MIN_SAMPLES_FOR_A_CLAIM
        and (reference.min() > candidate.max() or candidate.min() > reference.max())
    )
    if not (enough or apart):
        return "too few samples"
    if low > 1 + tolerance:
        return "faster"
    if high < 1 / (1 + tolerance):
        return "slower"
    return "indistinguishable"


def speedup(
    reference_s: Sequence[float],
    candidate_s: Sequence[float],
    *,
    rounds: tuple[Sequence[int], Sequence[int]] | None = None,
    instances: tuple[Sequence[int], Sequence[int]] | None = None,
    tolerance: float = SPEEDUP_TOLERANCE,
    confidence: float = CONFIDENCE,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> Speedup:
    """Speed-up of `candidate` over `reference` from their step times, with its interval.

    With `rounds` (each sample's round of an interleaved schedule, reference's and
    candidate's, as the two were timed in one schedule) and at least MIN_ROUNDS_TO_PAIR rounds
    in common, the figure is `paired_speedup`'s; `instances` (each sample's model instance,
    both sides) makes its interval one over instance pairs as well. Otherwise both sets are
    resampled independently (they come from separate runs), and the interval is the
    percentile interval of the ratio of medians: no assumption about the shape of the
    step-time distribution, which on shared machines has long right tails; with `instances`,
    each set's instances first, then steps within each (`cluster_bootstrap_medians`), as a
    model's steps share its speed mode and the steps alone would give an interval far too
    narrow. Seeded: the same samples always give the same interval. The verdict rules are the
    same either way.
    """
    reference = np.asarray(reference_s, dtype=np.float64)
    candidate = np.asarray(candidate_s, dtype=np.float64)
    if reference.size == 0 or candidate.size == 0:
        raise ValueError("A speed-up needs at least one timed step on each side.")
    paired = None
    if rounds is not None:
        paired = paired_speedup(
            reference,
            candidate,
            *rounds,
            instances=instances,
            confidence=confidence,
            resamples=resamples,
            seed=seed,
        )
    if paired is not None:
        ratio, low, high, pairs, instance_pairs = paired
        method = INSTANCES_METHOD if instance_pairs > 1 else PAIRED_METHOD
        counts: tuple[int | None, int | None] = (pairs, instance_pairs)
    else:
        ratio, low, high, several = _independent_speedup(
            reference, candidate, instances, confidence, resamples, seed
        )
        method = INDEPENDENT_INSTANCES_METHOD if several else INDEPENDENT_METHOD
        counts = (None, None)
    return Speedup(
        ratio,
        low,
        high,
        _verdict(reference, candidate, low, high, tolerance),
        int(reference.size),
        int(candidate.size),
        confidence,
        tolerance,
        method,
        *counts,
    )


def _independent_speedup(
    reference: np.ndarray,
    candidate: np.ndarray,
    instances: tuple[Sequence[int], Sequence[int]] | None,
    confidence: float,
    resamples: int,
    seed: int,
) -> tuple[float, float, float, bool]:
    """(ratio of medians, low, high, whether a side ran on several instances): each set
    resampled on its own, over its instances first where they are given."""
    if instances is None:
        clusters = (np.zeros(reference.size, np.int64), np.zeros(candidate.size, np.int64))
    else:
        clusters = (np.asarray(instances[0]), np.asarray(instances[1]))
        if clusters[0].shape != reference.shape or clusters[1].shape != candidate.shape:
            raise ValueError("Every timed step needs its model instance.")
    rng = np.random.default_rng(seed)
    ref_medians = cluster_bootstrap_medians(reference, clusters[0], rng, resamples)
    cand_medians = cluster_bootstrap_medians(candidate, clusters[1], rng, resamples)
    low, high = percentile_interval(ref_medians / cand_medians, confidence)
    several = max(np.unique(found).size for found in clusters) > 1
    return float(np.median(reference) / np.median(candidate)), low, high, several


def _common_rounds(
    reference_rounds: Sequence[int],
    candidate_rounds: Sequence[int],
    steps: tuple[int, int],
    what: str = "round",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Both sides' rounds as arrays, and the rounds both timed; ValueError where a side's
    rounds do not match its `steps` (its samples, or its instances: `what` it lacks)."""
    ref_rounds, cand_rounds = np.asarray(reference_rounds), np.asarray(candidate_rounds)
    if ref_rounds.shape != (steps[0],) or cand_rounds.shape != (steps[1],):
        raise ValueError(f"Every timed step needs its {what}.")
    return ref_rounds, cand_rounds, np.intersect1d(ref_rounds, cand_rounds)


def round_ratios(
    reference_s: Sequence[float],
    candidate_s: Sequence[float],
    reference_rounds: Sequence[int],
    candidate_rounds: Sequence[int],
) -> np.ndarray:
    """Per round that timed both, the reference's block median over the candidate's, in
    round order: the drift of the machine between rounds cancels out of each ratio."""
    reference, candidate = np.asarray(reference_s, float), np.asarray(candidate_s, float)
    ref_rounds, cand_rounds, common = _common_rounds(
        reference_rounds, candidate_rounds, (reference.size, candidate.size)
    )
    return np.asarray(
        [
            np.median(reference[ref_rounds == r]) / np.median(candidate[cand_rounds == r])
            for r in common
        ]
    )


def round_instance_pairs(
    reference_rounds: Sequence[int],
    candidate_rounds: Sequence[int],
    reference_instances: Sequence[int],
    candidate_instances: Sequence[int],
) -> np.ndarray:
    """Per round that timed both (in `round_ratios`' order), the pair of model instances it
    timed, reference's and candidate's, as one label: the cluster a round belongs to."""
    ref_rounds, cand_rounds, common = _common_rounds(
        reference_rounds,
        candidate_rounds,
        (len(reference_instances), len(candidate_instances)),
        "model instance",
    )
    ref_instances, cand_instances = np.asarray(reference_instances), np.asarray(candidate_instances)
    pairs = [
        (int(ref_instances[ref_rounds == r][0]), int(cand_instances[cand_rounds == r][0]))
        for r in common
    ]
    labels = {pair: index for index, pair in enumerate(dict.fromkeys(pairs))}
    return np.asarray([labels[pair] for pair in pairs], dtype=np.int64)


def cluster_bootstrap_medians(
    values: np.ndarray, clusters: np.ndarray, rng: np.random.Generator, resamples: int
) -> np.ndarray:
    """Medians of `values` resampled in two stages: as many clusters as there are, drawn with
    replacement, then within each drawn cluster as many of its values as it holds, drawn
    with replacement. With one cluster the first stage has nothing to choose, and this is
    the ordinary bootstrap of the median, draw for draw.

    Values of one cluster share what made that cluster differ from the others (a model
    instance's speed mode): the clusters, not the values, are the independent units, and a
    resampling of values alone sees none of the spread between them.
    """
    labels, inverse = np.unique(clusters, return_inverse=True)
    if labels.size == 1:
        return np.median(rng.choice(values, (resamples, values.size)), axis=1)
    count, sizes = labels.size, np.bincount(inverse)
    widest = int(sizes.max())
    padded = np.full((count, widest), np.nan)
    for cluster in range(count):
        padded[cluster, : sizes[cluster]] = values[inverse == cluster]
    picked = rng.integers(0, count, (resamples, count))
    picked_sizes = sizes[picked][..., None]
    within = (rng.random((resamples, count, widest)) * picked_sizes).astype(np.int64)
    drawn = padded[picked[..., None], within]
    drawn[np.arange(widest) >= picked_sizes] = np.nan  # a smaller cluster draws fewer
    return np.nanmedian(drawn.reshape(resamples, -1), axis=1)


def paired_speedup(
    reference_s: Sequence[float],
    candidate_s: Sequence[float],
    reference_rounds: Sequence[int],
    candidate_rounds: Sequence[int],
    *,
    instances: tuple[Sequence[int], Sequence[int]] | None = None,
    confidence: float = CONFIDENCE,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float, float, int, int] | None:
    """(ratio, low, high, rounds, instance pairs) of an interleaved schedule: the median of
    the per-round ratios (`round_ratios`) and its percentile interval, resampled with
    `cluster_bootstrap_medians` (instance pairs, then rounds within each; over rounds alone
    where one pair of instances, or no `instances`, timed them); None with fewer than
    MIN_ROUNDS_TO_PAIR rounds in common.

    Blocks of one round ran next to each other, so what the machine did over the seconds
    of the run (frequency, other tenants, heat) is in both halves of a ratio, and the rounds,
    not the steps, are the independent units: steps within a block are correlated, and
    resampling them as independent gives intervals far too narrow. Likewise a freshly built
    model can settle in a faster or slower mode and keep it: the rounds of one instance pair
    share it, and only resampling instance pairs puts that spread into the interval.
    """
    ratios = round_ratios(reference_s, candidate_s, reference_rounds, candidate_rounds)
    if ratios.size < MIN_ROUNDS_TO_PAIR:
        return None
    if instances is None:
        clusters = np.zeros(ratios.size, dtype=np.int64)
    else:
        clusters = round_instance_pairs(reference_rounds, candidate_rounds, *instances)
    rng = np.random.default_rng(seed)
    resampled = cluster_bootstrap_medians(ratios, clusters, rng, resamples)
    low, high = percentile_interval(resampled, confidence)
    pairs = int(np.unique(clusters).size)
    return float(np.median(ratios)), low, high, int(ratios.size), pairs


def speedup_between(reference: Mapping[str, Any], candidate: Mapping[str, Any]) -> Speedup:
    """The speed-up of one benchmark record's timing (its `timing` object) over another's:
    paired by rounds where the two were interleaved in one schedule (the same
    `schedule_id`), and over instance pairs where the records say which model instance
    timed each step (`instances`; records written before instances timed one each), else
    the independent bootstrap (records of the old sequential format, another process,
    another backend), over each record's instances where both say them."""
    reference_s = [ms / 1000 for ms in reference["samples_ms"]]
    candidate_s = [ms / 1000 for ms in candidate["samples_ms"]]
    same = reference.get("schedule_id") is not None and reference.get(
        "schedule_id"
    ) == candidate.get("schedule_id")
    rounds = (reference["rounds"], candidate["rounds"]) if same else None
    instances = None
    if "instances" in reference and "instances" in candidate:
        instances = (reference["instances"], candidate["instances"])
    return speedup(reference_s, candidate_s, rounds=rounds, instances=instances)
