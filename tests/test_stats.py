"""Statistics of step times (summaries, drift, the warm-up settling rule, speed-up intervals)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline import stats


def test_summarize_one_to_ten_ms_gives_numpy_linear_percentiles() -> None:
    samples_ms = list(range(1, 11))
    summary = stats.summarize([ms / 1000 for ms in reversed(samples_ms)])  # order must not matter
    assert summary["count"] == 10
    assert summary["median_ms"] == pytest.approx(5.5)
    assert summary["p50_ms"] == pytest.approx(5.5)
    assert summary["mean_ms"] == pytest.approx(5.5)
    assert summary["iqr_ms"] == pytest.approx(4.5)
    assert summary["p10_ms"] == pytest.approx(1.9)
    assert summary["p90_ms"] == pytest.approx(9.1)
    assert summary["p99_ms"] == pytest.approx(9.91)
    assert (summary["min_ms"], summary["max_ms"]) == pytest.approx((1.0, 10.0))
    assert summary["iqr_ratio"] == pytest.approx(4.5 / 5.5)
    assert summary["noisy"] is True
    for q in (10, 25, 50, 75, 90, 99):
        assert stats.percentile([float(v) for v in samples_ms], q) == pytest.approx(
            np.percentile(samples_ms, q)
        )


@pytest.mark.parametrize(
    ("samples_ms", "noisy"),
    [
        ([91, 95.5, 100, 104.5, 109], False),  # IQR 9 / median 100 = 0.09
        ([89, 94.5, 100, 105.5, 111], True),  # IQR 11 / median 100 = 0.11
        ([100] * 5, False),
        ([50, 100, 100, 100, 500], False),  # outliers beyond the quartiles do not count
    ],
)
def test_noisy_flags_an_iqr_above_10_percent_of_the_median(
    samples_ms: list[float], noisy: bool
) -> None:
    assert stats.summarize([ms / 1000 for ms in samples_ms])["noisy"] is noisy


def test_summarize_of_no_samples_is_a_zero_count() -> None:
    assert stats.summarize([]) == {"count": 0}
    assert math.isnan(stats.percentile([], 50))


def test_percentile_of_one_sample_is_that_sample() -> None:
    assert stats.percentile([3.0], 99) == 3.0
    assert stats.summarize([0.003])["iqr_ms"] == 0.0


# --- drift -----------------------------------------------------------------------------------


def test_a_warm_up_trend_in_the_samples_is_flagged_as_drift_and_not_as_noise() -> None:
    # the case: the first nine steps 57-118 ms, the last eleven 41-50 ms
    first = [118, 97, 88, 80, 74, 69, 64, 60, 57]
    last = [50, 46, 44, 43, 45, 41, 47, 44, 42, 48, 43]
    summary = stats.summarize([ms / 1000 for ms in first + last])
    assert summary["drifting"] is True
    assert summary["drift_ratio"] == pytest.approx(44 / 69, rel=0.05)
    words = stats.quality_words(summary)
    assert words[0].startswith("drifting: the second half of the timed steps ran")
    assert "faster than the first" in words[0]


@pytest.mark.parametrize(
    ("samples_ms", "drifting"),
    [
        ([100, 104, 98, 101, 99, 103, 100, 102], False),
        ([100, 100, 100, 100, 106, 106, 106, 106], True),  # 6% slower later
        ([100, 100, 100, 100, 104, 104, 104, 104], False),  # 4%: within the limit
    ],
)
def test_drift_compares_the_medians_of_the_two_halves_in_timed_order(
    samples_ms: list[float], drifting: bool
) -> None:
    summary = stats.summarize([ms / 1000 for ms in samples_ms])
    assert summary["drifting"] is drifting
    assert stats.summarize([ms / 1000 for ms in sorted(samples_ms)])["drift_ratio"] >= 1


def test_too_few_samples_have_no_drift_ratio() -> None:
    summary = stats.summarize([0.100, 0.101, 0.102])
    assert summary["drift_ratio"] is None and summary["drifting"] is False
    assert stats.quality_words(summary) == []


# --- settling --------------------------------------------------------------------------------


def test_settled_needs_two_windows_whose_medians_agree() -> None:
    assert not stats.settled([1.0] * (2 * stats.SETTLE_WINDOW - 1))
    assert stats.settled([1.0] * (2 * stats.SETTLE_WINDOW))
    falling = [2.0, 1.8, 1.6, 1.4, 1.2, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert not stats.settled(falling)
    assert stats.settled([*falling, 1.0, 1.0, 1.02, 0.99, 1.0])


def test_steps_that_take_no_measurable_time_count_as_settled() -> None:
    assert stats.settled([0.0] * 10)


# --- speed-ups -------------------------------------------------------------------------------


def _normal(median_ms: float, spread_ms: float, count: int, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    return list((median_ms + spread_ms * rng.standard_normal(count)) / 1000)


def test_a_clear_speed_up_is_faster_with_an_interval_around_the_ratio() -> None:
    result = stats.speedup(_normal(50, 2, 30, 0), _normal(35, 2, 30, 1))
    assert result.verdict == "faster"
    assert result.low < result.ratio < result.high
    assert result.ratio == pytest.approx(50 / 35, rel=0.05)
    assert result.low > 1 + result.tolerance
    assert result.text.startswith(f"{result.ratio:.2f}x faster (95% interval")


def test_two_samples_of_one_distribution_are_indistinguishable() -> None:
    result = stats.speedup(_normal(50, 3, 30, 0), _normal(50, 3, 30, 1))
    assert result.verdict == "indistinguishable"
    assert result.low < 1 < result.high
    assert result.text.startswith("indistinguishable (")


def test_a_ratio_inside_the_tolerance_is_never_called_faster() -> None:
    # 3% faster with almost no spread: the interval is tight, but within the 5% tolerance
    result = stats.speedup(_normal(100, 0.2, 30, 0), _normal(97, 0.2, 30, 1))
    assert result.low > 1
    assert result.verdict == "indistinguishable"


def test_a_budget_limited_slow_precision_is_slower_from_a_few_steps() -> None:
    result = stats.speedup(_normal(50, 2, 30, 0), [1.60, 1.72])
    assert result.verdict == "slower"
    assert result.text.startswith(f"{1 / result.ratio:.2f}x slower (95% interval")


@pytest.mark.parametrize(("reference", "candidate"), [([0.05], [0.03]), ([0.05] * 30, [0.03])])
def test_a_single_step_supports_no_claim(reference: list[float], candidate: list[float]) -> None:
    result = stats.speedup(reference, candidate)
    assert result.verdict == "too few samples"
    assert "too few timed steps" in result.text


def test_the_interval_is_reproducible() -> None:
    a, b = _normal(50, 5, 20, 0), _normal(40, 5, 20, 1)
    assert stats.speedup(a, b) == stats.speedup(a, b)


def test_a_speed_up_needs_samples_on_both_sides() -> None:
    with pytest.raises(ValueError, match="at least one timed step"):
        stats.speedup([], [0.1])


def _interleaved(ratio: float, rounds: int, machine: list[float], seed: int = 0):
    """Blocks of 3 steps of a reference (50 ms) and a candidate `ratio` times faster, one
    block each per round, on a machine whose speed factor in round r is machine[r]."""
    rng = np.random.default_rng(seed)
    ref, cand, ref_rounds, cand_rounds = [], [], [], []
    for r in range(rounds):
        noise = 1 + 0.01 * rng.standard_normal(6)
        ref += list(0.050 * machine[r] * noise[:3])
        cand += list(0.050 / ratio * machine[r] * noise[3:])
        ref_rounds += [r] * 3
        cand_rounds += [r] * 3
    return ref, cand, ref_rounds, cand_rounds


def test_a_paired_speed_up_is_the_median_of_per_round_ratios_within_its_interval() -> None:
    machine = [1.0, 1.3, 0.9, 1.6, 1.1, 1.0, 1.4, 0.8, 1.2, 1.0]  # drifts a lot between rounds
    ref, cand, ref_rounds, cand_rounds = _interleaved(1.5, 10, machine)
    result = stats.speedup(ref, cand, rounds=(ref_rounds, cand_rounds))
    ratios = stats.round_ratios(ref, cand, ref_rounds, cand_rounds)
    assert result.paired_rounds == 10 and result.method == stats.PAIRED_METHOD
    assert result.ratio == pytest.approx(float(np.median(ratios)))
    assert result.low <= result.ratio <= result.high
    assert result.low < 1.5 < result.high
    assert result.verdict == "faster"
    # the machine's drift between rounds is no part of the paired interval, and it swamps
    # the unpaired one: the two sets resampled independently cannot even tell it faster
    unpaired = stats.speedup(ref, cand)
    assert unpaired.paired_rounds is None and unpaired.method == stats.INDEPENDENT_METHOD
    assert (result.high - result.low) < (unpaired.high - unpaired.low) / 3


def test_the_paired_interval_is_reproducible() -> None:
    ref, cand, ref_rounds, cand_rounds = _interleaved(1.2, 8, [1.0] * 8, seed=3)
    rounds = (ref_rounds, cand_rounds)
    assert stats.speedup(ref, cand, rounds=rounds) == stats.speedup(ref, cand, rounds=rounds)


def test_rounds_only_one_side_timed_are_not_paired() -> None:
    ref, cand, ref_rounds, cand_rounds = _interleaved(1.5, 8, [1.0] * 8)
    # the candidate stopped after its sixth round: rounds 6 and 7 have no partner
    cut = cand_rounds.index(6)
    ratios = stats.round_ratios(ref, cand[:cut], ref_rounds, cand_rounds[:cut])
    assert len(ratios) == 6
    result = stats.speedup(ref, cand[:cut], rounds=(ref_rounds, cand_rounds[:cut]))
    assert result.paired_rounds == 6


def test_with_too_few_rounds_in_common_the_sets_are_resampled_independently() -> None:
    ref, cand, ref_rounds, cand_rounds = _interleaved(1.5, stats.MIN_ROUNDS_TO_PAIR - 1, [1.0] * 5)
    paired = stats.speedup(ref, cand, rounds=(ref_rounds, cand_rounds))
    assert paired == stats.speedup(ref, cand)
    assert paired.paired_rounds is None


def test_every_step_needs_its_round() -> None:
    with pytest.raises(ValueError, match="round"):
        stats.speedup([0.05] * 6, [0.04] * 6, rounds=([0, 0, 0, 1, 1, 1], [0, 1]))


def test_on_a_wandering_machine_the_paired_interval_covers_the_true_ratio_as_often_as_it_says() -> (
    None
):
    """200 simulated runs: the machine's speed wanders from block to block (a random walk,
    5% a block), steps vary 3% around it, and the candidate is truly 1.5x faster. Interleaved
    and paired, the 95% interval holds 1.5 about 95% of the time; the same blocks timed one
    precision after the other, resampled independently, hold it far less often."""
    rng = np.random.default_rng(1)
    runs, paired_hits, sequential_hits = 200, 0, 0
    for trial in range(runs):
        machine = np.exp(np.cumsum(rng.normal(0, 0.05, 20)))  # 20 blocks, in time order

        def block(level: float, ms: float) -> list[float]:
            return list(ms / 1000 * level * np.exp(rng.normal(0, 0.03, 3)))

        ref, cand, rounds = [], [], []
        for r in range(10):  # ABBA: fp32 first in even rounds, second in odd ones
            early, late = machine[2 * r], machine[2 * r + 1]
            ref += block(early if r % 2 == 0 else late, 50)
            cand += block(late if r % 2 == 0 else early, 50 / 1.5)
            rounds += [r] * 3
        paired = stats.speedup(ref, cand, rounds=(rounds, rounds), resamples=500, seed=trial)
        paired_hits += paired.low <= 1.5 <= paired.high
        one_then_other = stats.speedup(
            [step for b in range(10) for step in block(machine[b], 50)],
            [step for b in range(10, 20) for step in block(machine[b], 50 / 1.5)],
            resamples=500,
            seed=trial,
        )
        sequential_hits += one_then_other.low <= 1.5 <= one_then_other.high
    assert paired_hits / runs >= 0.9
    assert sequential_hits / runs <= 0.6


def _instance_schedule(
    fp32_modes: np.ndarray, bf16_modes: np.ndarray, rounds: int, rng: np.random.Generator
) -> tuple[list[float], list[float], list[int], list[int]]:
    """An interleaved schedule of `rounds` rounds (blocks of 2 steps) over model instances
    that each keep their own speed mode (median step in s): round r times instance pair
    `timing.instance_of_round`, as the bench does; steps vary 3% around their instance's."""
    ref, cand, rounds_of, instances = [], [], [], []
    for r in range(rounds):
        k = (r // 2) % len(fp32_modes)
        ref += list(fp32_modes[k] * np.exp(rng.normal(0, 0.03, 2)))
        cand += list(bf16_modes[k] * np.exp(rng.normal(0, 0.03, 2)))
        rounds_of += [r, r]
        instances += [k, k]
    return ref, cand, rounds_of, instances


def test_over_instances_in_their_own_speed_modes_the_interval_covers_the_true_ratio() -> None:
    """150 simulated benches: every freshly built model lands in a speed mode of its own
    (instance medians spread 15% around 50 ms for fp32 and 50/1.4 ms for bf16; steps 3%
    around their instance's), so the true speed-up, 1.4, is the ratio of typical instances.
    Timed on one instance per precision, the interval over rounds says only how fast that
    pair ran, and rarely holds 1.4; timed on six instance pairs and resampled over pairs and
    then rounds, it holds 1.4 nearly as often as it says (a percentile interval over a few
    clusters runs a little narrow). Three pairs already hold it far more often than one,
    though well below 95%: no interval over three instances can hold a median much more
    often than their range does (75%)."""
    rng = np.random.default_rng(7)
    runs, true = 150, 1.4
    hits = {1: 0, 3: 0, 6: 0}
    for trial in range(runs):
        fp32_modes = 0.050 * np.exp(rng.normal(0, 0.15, 6))
        bf16_modes = 0.050 / true * np.exp(rng.normal(0, 0.15, 6))
        for count in hits:
            ref, cand, rounds, instances = _instance_schedule(
                fp32_modes[:count], bf16_modes[:count], 15, rng
            )
            speed = stats.speedup(
                ref,
                cand,
                rounds=(rounds, rounds),
                instances=(instances, instances),
                resamples=400,
                seed=trial,
            )
            assert speed.paired_instances == count and speed.paired_rounds == 15
            hits[count] += speed.low <= true <= speed.high
    assert hits[1] / runs <= 0.3
    assert hits[6] / runs >= 0.82
    assert hits[3] / runs >= 0.6


def test_sets_of_separate_runs_are_resampled_over_their_instances_then_steps() -> None:
    """120 simulated pairs of runs in separate processes (another machine, another backend):
    each run's six freshly built models land in speed modes of their own (15% spread), steps
    3% around them, and the candidate is truly 1.4x faster. Resampling the steps alone, the
    interval says how fast these twelve models ran and often misses 1.4; resampling each
    run's instances, then the steps within each, it holds 1.4 about as often as it says."""
    rng = np.random.default_rng(11)
    runs, true = 120, 1.4
    hits = {"steps": 0, "instances": 0}
    for trial in range(runs):
        ones = np.ones(6)
        ref, _, _, ref_instances = _instance_schedule(
            0.050 * np.exp(rng.normal(0, 0.15, 6)), ones, 15, rng
        )
        cand, _, _, cand_instances = _instance_schedule(
            0.050 / true * np.exp(rng.normal(0, 0.15, 6)), ones, 15, rng
        )
        steps = stats.speedup(ref, cand, resamples=400, seed=trial)
        instances = stats.speedup(
            ref, cand, instances=(ref_instances, cand_instances), resamples=400, seed=trial
        )
        assert instances.method == stats.INDEPENDENT_INSTANCES_METHOD
        assert instances.paired_rounds is None and instances.paired_instances is None
        hits["steps"] += steps.low <= true <= steps.high
        hits["instances"] += instances.low <= true <= instances.high
    assert hits["steps"] / runs <= 0.75
    assert hits["instances"] / runs >= 0.85


def test_one_instance_a_side_resamples_the_steps_as_without_instances() -> None:
    ref, cand = [0.050, 0.052, 0.049, 0.055, 0.051, 0.050], [0.040, 0.041, 0.043, 0.039, 0.040]
    one = stats.speedup(ref, cand, instances=([0] * 6, [3] * 5))
    assert one == stats.speedup(ref, cand) and one.method == stats.INDEPENDENT_METHOD
    with pytest.raises(ValueError, match="model instance"):
        stats.speedup(ref, cand, instances=([0] * 6, [0, 1]))


def test_one_instance_pair_gives_the_interval_over_rounds_draw_for_draw() -> None:
    machine = [1.0, 1.3, 0.9, 1.6, 1.1, 1.0, 1.4, 0.8, 1.2, 1.0]
    ref, cand, ref_rounds, cand_rounds = _interleaved(1.5, 10, machine)
    rounds = (ref_rounds, cand_rounds)
    one = stats.speedup(ref, cand, rounds=rounds, instances=([0] * len(ref), [0] * len(cand)))
    assert one == stats.speedup(ref, cand, rounds=rounds)
    assert one.paired_instances == 1 and one.method == stats.PAIRED_METHOD
    # the percentile interval of the median of per-round ratios, rounds resampled, as before
    ratios = stats.round_ratios(ref, cand, ref_rounds, cand_rounds)
    drawn = np.random.default_rng(0).choice(ratios, (stats.BOOTSTRAP_RESAMPLES, ratios.size))
    assert (one.low, one.high) == stats.percentile_interval(np.median(drawn, axis=1))
    assert "model instances" not in one.text


def test_rounds_are_clustered_by_the_pair_of_instances_they_timed() -> None:
    """A candidate left with one instance (its later ones not built) still pairs with each
    of fp32's: every distinct pair is a cluster; and every step needs its instance."""
    rounds = [r for r in range(6) for _ in range(2)]
    fp32_instances = [(r // 2) % 3 for r in rounds]
    labels = stats.round_instance_pairs(rounds, rounds, fp32_instances, [0] * len(rounds))
    assert labels.tolist() == [0, 0, 1, 1, 2, 2]
    ref, cand = [0.05] * 12, [0.04 * (1 + 0.01 * (i % 3)) for i in range(12)]
    speed = stats.speedup(ref, cand, rounds=(rounds, rounds), instances=(fp32_instances, [0] * 12))
    assert speed.paired_instances == 3 and speed.method == stats.INSTANCES_METHOD
    assert "over 3 model instances" in speed.text
    with pytest.raises(ValueError, match="model instance"):
        stats.speedup(ref, cand, rounds=(rounds, rounds), instances=(fp32_instances, [0, 1]))


def test_records_that_name_their_instances_are_resampled_over_them() -> None:
    rng = np.random.default_rng(3)
    modes = 0.050 * np.exp(rng.normal(0, 0.15, 3))
    ref, cand, rounds, instances = _instance_schedule(modes, modes / 1.3, 15, rng)
    with_instances = stats.speedup_between(
        {**_timing(ref, rounds, "a"), "instances": instances},
        {**_timing(cand, rounds, "a"), "instances": instances},
    )
    assert with_instances.paired_instances == 3 and with_instances.paired_rounds == 15
    assert with_instances == stats.speedup(
        ref, cand, rounds=(rounds, rounds), instances=(instances, instances)
    )
    # a record written before instances were timed: one model each, paired over rounds
    before = stats.speedup_between(_timing(ref, rounds, "a"), _timing(cand, rounds, "a"))
    assert before.paired_instances == 1
    assert before == stats.speedup(ref, cand, rounds=(rounds, rounds))
    # records of separate schedules (another process): each over its own instances
    apart = stats.speedup_between(
        {**_timing(ref, rounds, "a"), "instances": instances},
        {**_timing(cand, rounds, "b"), "instances": instances},
    )
    assert apart == stats.speedup(ref, cand, instances=(instances, instances))
    assert apart.method == stats.INDEPENDENT_INSTANCES_METHOD


def _timing(samples_s: list[float], rounds: list[int] | None, schedule: str | None) -> dict:
    timing = {"samples_ms": [s * 1000 for s in samples_s]}
    if rounds is not None:
        timing.update(rounds=rounds, schedule_id=schedule, block_steps=3)
    return timing


def test_records_are_paired_only_when_timed_in_one_schedule() -> None:
    ref, cand, ref_rounds, cand_rounds = _interleaved(1.5, 6, [1.0, 1.2, 0.9, 1.1, 1.0, 1.3])
    together = stats.speedup_between(_timing(ref, ref_rounds, "a"), _timing(cand, cand_rounds, "a"))
    assert together.paired_rounds == 6
    apart = stats.speedup_between(_timing(ref, ref_rounds, "a"), _timing(cand, cand_rounds, "b"))
    old = stats.speedup_between(_timing(ref, None, None), _timing(cand, None, None))
    independent = stats.speedup(ref, cand)
    assert apart.paired_rounds is None and apart.ratio == pytest.approx(independent.ratio)
    # records of the sequential format (no rounds) still give the independent figure
    assert old.paired_rounds is None
    assert (old.ratio, old.low, old.high) == pytest.approx(
        (independent.ratio, independent.low, independent.high)
    )
