"""The bootstrap intervals over images of a detection F1, precision and recall, and of the F1
change between two runs."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from pipeline import stats
from pipeline.evaluation import image_bootstrap


def counts(tp: list[int], fp: list[int], fn: list[int], ids: list[int] | None = None) -> dict:
    return {"image_ids": ids or list(range(len(tp))), "tp": tp, "fp": fp, "fn": fn}


def noisy_images(images: int, seed: int) -> dict:
    """Images of 0 to 4 objects each, found with random misses and false positives."""
    rng = np.random.default_rng(seed)
    objects = rng.integers(0, 5, images)
    tp = rng.binomial(objects, 0.9)
    return counts(tp.tolist(), rng.binomial(2, 0.1, images).tolist(), (objects - tp).tolist())


def test_f1_of_counts_is_2tp_over_2tp_fp_fn_and_0_where_nothing_was_found_or_expected() -> None:
    assert image_bootstrap.f1_of_counts(3, 1, 1) == pytest.approx(0.75)
    assert image_bootstrap.f1_of_counts(
        np.array([0, 2]), np.array([0, 0]), np.array([0, 2])
    ).tolist() == [
        0.0,
        pytest.approx(2 / 3),
    ]


def test_the_micro_intervals_hold_their_figures_and_halve_with_four_times_the_images() -> None:
    small, large = noisy_images(250, seed=1), noisy_images(1000, seed=2)
    widths = []
    for per_image in (small, large):
        tp, fp, fn = (sum(per_image[key]) for key in ("tp", "fp", "fn"))
        figures = {"f1": image_bootstrap.f1_of_counts(tp, fp, fn), "precision": tp / (tp + fp)}
        figures["recall"] = tp / (tp + fn)
        intervals = image_bootstrap.micro_intervals(per_image)
        assert set(intervals) == set(figures)
        for name, value in figures.items():
            assert intervals[name]["low"] < value < intervals[name]["high"], name
        widths.append(intervals["f1"]["high"] - intervals["f1"]["low"])
    assert widths[1] / widths[0] == pytest.approx(0.5, abs=0.15)
    assert image_bootstrap.micro_intervals(small) == image_bootstrap.micro_intervals(
        small
    )  # seeded


def test_precision_and_recall_intervals_follow_where_the_errors_are() -> None:
    """False positives spread over the images and misses in 5 of 200: precision varies with
    every resample, recall only with how often those 5 are drawn, so each interval is where
    its own errors put it."""
    images = 200
    per_image = counts([3] * images, [1] * images, [4 if i < 5 else 0 for i in range(images)])
    intervals = image_bootstrap.micro_intervals(per_image)
    assert intervals["precision"]["low"] == intervals["precision"]["high"] == pytest.approx(0.75)
    recall = intervals["recall"]
    assert recall["low"] < 600 / 620 < recall["high"] and recall["high"] <= 1.0


def test_micro_intervals_of_identical_images_are_points_and_of_no_images_none() -> None:
    intervals = image_bootstrap.micro_intervals(counts([2] * 10, [1] * 10, [1] * 10))
    interval = intervals["f1"]
    assert interval["low"] == interval["high"] == pytest.approx(2 / 3)
    assert intervals["precision"]["low"] == intervals["precision"]["high"] == pytest.approx(2 / 3)
    assert image_bootstrap.micro_intervals(counts([], [], [])) == dict.fromkeys(
        image_bootstrap.MICRO_FIGURES
    )
    assert image_bootstrap.interval_text(interval) == "95% interval 0.667-0.667 over 10 images"
    assert image_bootstrap.interval_text(None) == "no interval: no images"


def test_a_run_against_itself_held_whatever_the_order_of_its_images() -> None:
    run = noisy_images(200, seed=3)
    shuffled = {key: list(reversed(values)) for key, values in run.items()}
    change = image_bootstrap.f1_change(run, shuffled, tolerance=0.01)
    assert (change.change, change.low, change.high) == (0.0, 0.0, 0.0)
    assert change.verdict == "held" and change.images == 200


def test_pairing_narrows_the_interval_of_a_change_both_runs_share_the_images_of() -> None:
    """The candidate misses 2 more objects in 20 of 500 noisy images: a sure loss of about 2
    points. Each run's own interval is wider than that loss; paired, only those 20 images
    differ between the runs, and the change's interval is narrower than either run's."""
    reference = noisy_images(500, seed=4)
    candidate = {key: list(values) for key, values in reference.items()}
    worse = [i for i, tp in enumerate(reference["tp"]) if tp >= 2][:20]
    for i in worse:
        candidate["tp"][i] -= 2
        candidate["fn"][i] += 2
    change = image_bootstrap.f1_change(reference, candidate, tolerance=0.01)
    assert change.high < -0.01 and change.verdict == "dropped"
    alone = image_bootstrap.micro_intervals(reference)["f1"]
    assert alone["high"] - alone["low"] > -change.change
    assert change.high - change.low < alone["high"] - alone["low"]


def test_a_change_straddling_the_tolerance_is_undecided() -> None:
    reference = noisy_images(40, seed=5)
    candidate = {key: list(values) for key, values in reference.items()}
    hit = next(i for i, tp in enumerate(reference["tp"]) if tp >= 2)
    candidate["tp"][hit] -= 2
    candidate["fn"][hit] += 2
    change = image_bootstrap.f1_change(reference, candidate, tolerance=0.01)
    assert change.low < -0.01 < change.high and change.verdict == "undecided"


def test_runs_of_different_or_repeated_images_are_refused() -> None:
    run = counts([1, 1], [0, 0], [0, 0])
    with pytest.raises(ValueError, match="scored different images"):
        image_bootstrap.f1_change(run, counts([1, 1], [0, 0], [0, 0], ids=[0, 2]), tolerance=0.01)
    twice = counts([1, 1], [0, 0], [0, 0], ids=[3, 3])
    with pytest.raises(ValueError, match="scored different images"):
        image_bootstrap.f1_change(twice, twice, tolerance=0.01)
    with pytest.raises(ValueError, match="no images"):
        image_bootstrap.f1_change(counts([], [], []), counts([], [], []), tolerance=0.01)


def test_an_undecided_change_says_about_how_many_images_would_settle_it() -> None:
    undecided = image_bootstrap.PairedChange(-0.008, -0.011, -0.005, "undecided", 1000, 0.01)
    # half-width 0.003, 0.002 from -1 point: (0.003 / 0.002)^2 = 2.25 times the images
    assert undecided.images_to_settle() == 2304
    at_the_tolerance = image_bootstrap.PairedChange(-0.01, -0.013, -0.007, "undecided", 1000, 0.01)
    assert at_the_tolerance.images_to_settle() is None
    close = image_bootstrap.PairedChange(-0.0095, -0.012, -0.007, "undecided", 1000, 0.01)
    assert close.images_to_settle() is None  # 25 times the images: past the limit
    assert (
        image_bootstrap.PairedChange(0.0, -0.005, 0.005, "held", 1000, 0.01).images_to_settle()
        is None
    )


def test_bootstrap_weights_are_drawn_once_per_size_and_cannot_be_changed_by_a_caller() -> None:
    """Every figure of an evaluation reads the same resamples: drawn once, read-only, each row
    how often each image came up in as many seeded uniform draws as there are images."""
    first = np.concatenate(list(image_bootstrap.bootstrap_weights(37, resamples=300, seed=4)))
    again = list(image_bootstrap.bootstrap_weights(37, resamples=300, seed=4))
    rng = np.random.default_rng(4)
    fresh = np.stack([np.bincount(rng.integers(0, 37, size=37), minlength=37) for _ in range(300)])
    assert np.array_equal(first, fresh) and np.array_equal(np.concatenate(again), fresh)
    with pytest.raises(ValueError):
        again[0][0, 0] += 1


def test_bootstrap_weights_have_the_multinomial_resamples_distribution() -> None:
    """Drawn as counts of uniform draws, the weights are the bootstrap's multinomial: every
    row sums to the images, an image's count has mean 1 and variance 1 - 1/n, and an image
    is left out of a resample with probability (1 - 1/n)**n, as in numpy's multinomial."""
    images, rows = 50, 4000
    drawn = np.concatenate(list(image_bootstrap.bootstrap_weights(images, rows, seed=9)))
    multinomial = np.random.default_rng(9).multinomial(images, np.full(images, 1 / images), rows)
    assert drawn.shape == (rows, images) and (drawn.sum(axis=1) == images).all()
    for weights in (drawn, multinomial):  # the same checks hold the reference draw
        assert weights.mean() == pytest.approx(1.0, abs=1e-12)  # rows sum to n exactly
        assert weights.var() == pytest.approx(1 - 1 / images, rel=0.03)
        assert (weights == 0).mean() == pytest.approx((1 - 1 / images) ** images, abs=0.01)
    assert (drawn == 0).mean() == pytest.approx((multinomial == 0).mean(), abs=0.01)


def test_a_centred_interval_holds_its_estimate_with_the_resamples_spread() -> None:
    """Resamples lying wholly above the figure (a statistic resampling itself raises): the
    interval is theirs moved down by their median's distance from the figure, so it holds the
    figure, as wide as theirs."""
    samples = np.random.default_rng(1).normal(0.45, 0.01, 2000)
    low, high, shift = image_bootstrap.centred_percentile_interval(samples, 0.41)
    plain = stats.percentile_interval(samples)
    assert plain[0] > 0.41
    assert shift == pytest.approx(np.median(samples) - 0.41, abs=1e-15)
    assert (low, high) == pytest.approx((plain[0] - shift, plain[1] - shift), abs=1e-12)
    assert low < 0.41 < high
    recorded = image_bootstrap.bootstrap_interval(samples, 300, "m", estimate=0.41)
    assert (recorded["low"], recorded["high"], recorded["shift"]) == (low, high, shift)
    assert "shift" not in image_bootstrap.bootstrap_interval(samples, 300, "m")


def test_a_centred_interval_stays_within_the_figures_range() -> None:
    """Resamples below a figure near its top (AP 0.99): moved up, the upper bound is held at
    the figure's own limit, not past it."""
    samples = np.random.default_rng(2).uniform(0.9, 1.0, 2000)
    low, high, shift = image_bootstrap.centred_percentile_interval(samples, 0.99, within=(0.0, 1.0))
    assert shift < 0 and stats.percentile_interval(samples)[1] - shift > 1.0
    assert low < 0.99 < high == 1.0


def test_bootstrap_weights_asked_for_by_two_threads_at_once_are_drawn_once(monkeypatch) -> None:
    """An evaluation's P/R/F1 and AP intervals run on threads of their own and ask for the
    same resamples: the second waits for the first's draw instead of drawing them again."""
    image_bootstrap._drawn.cache_clear()
    chunks: list[int] = []
    drawing = image_bootstrap.drawn_counts

    def slow_drawing(*args: Any) -> np.ndarray:
        chunks.append(1)
        time.sleep(0.02)  # long enough for the other thread to ask meanwhile
        return drawing(*args)

    def resamples(_: int) -> np.ndarray:
        return np.concatenate(list(image_bootstrap.bootstrap_weights(29, 600, 3)))

    monkeypatch.setattr(image_bootstrap, "drawn_counts", slow_drawing)
    with ThreadPoolExecutor(2) as pool:
        found = list(pool.map(resamples, range(2)))
    assert len(chunks) == 3  # one draw of three chunks of 200
    np.testing.assert_array_equal(found[0], found[1])
    image_bootstrap._drawn.cache_clear()
