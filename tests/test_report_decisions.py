"""What the report concludes, tested on frames and records alone: no HTML is built here.

Records come from `report_fixtures.bench_record` (shaped like the bench step's files) and go
through `load.bench_frame`, as the report reads them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from report_fixtures import (
    BENCH,
    ap50_matches,
    bench_record,
    env_json,
    metrics_rows,
    per_image_counts,
    train_summary,
)

from pipeline.stats import SPEEDUP_TOLERANCE, speedup
from pipeline.summary import accuracy, decisions, load


def frame_of(*records: dict[str, Any]) -> pd.DataFrame:
    return load.bench_frame(
        [(record, Path(f"bench/{index}.json")) for index, record in enumerate(records)]
    )


def cpu_env(native_bf16: bool = False) -> dict[str, Any]:
    """env.json of a CPU with or without native bf16 (what measured mode may use there)."""
    env = env_json()
    if native_bf16:
        env["backends"]["cpu"]["measured_refused"]["bf16"] = None
    return env


def test_the_answer_is_the_fastest_setting_with_acceptable_numerics() -> None:
    choice = decisions.choose_setting(frame_of(*BENCH), "tiny_conv", env_json())
    assert (choice.best["backend"], choice.best["precision"]) == ("cuda", "fp16")
    assert list(choice.faster_unsafe["precision"]) == ["bf16"]  # faster, but 5% off fp32
    assert choice.speedup_vs_cpu_fp32.ratio == pytest.approx(100.0 / 4.0)
    assert choice.speedup_vs_cpu_fp32.verdict == "faster"
    assert choice.speedup_vs_cpu_fp32.low < 25 < choice.speedup_vs_cpu_fp32.high
    assert not choice.is_cpu_fp32
    assert choice.faster_refused == []
    assert {b: c.precision for b, c in choice.per_backend.items()} == {
        "cuda": "fp16",
        "mps": "fp16",
        "cpu": "fp32",
    }


def test_the_answer_model_is_the_configured_one_else_a_listed_one_else_the_first() -> None:
    other = bench_record("cpu", "fp32", "train", 50.0)
    other["model"] = "resnet18"
    frame = frame_of(*BENCH, other)
    assert decisions.answer_model(frame, {"model": {"name": "resnet18"}}) == "resnet18"
    assert (
        decisions.answer_model(frame, {"model": {"name": "absent"}}) == "resnet18"
    )  # first in order
    listed = {"model": {"name": "absent"}, "bench": {"models": ["absent", "tiny_conv"]}}
    assert decisions.answer_model(frame, listed) == "tiny_conv"
    assert decisions.answer_model(frame_of(BENCH[5]), None) is None  # only a skipped record


def test_cpu_bf16_is_chosen_only_where_the_cpu_has_native_bf16() -> None:
    frame = frame_of(
        bench_record("cpu", "fp32", "train", 100.0), bench_record("cpu", "bf16", "train", 60.0)
    )
    without = decisions.choose_setting(frame, "tiny_conv", cpu_env(native_bf16=False))
    assert without.is_cpu_fp32 and without.speedup_vs_cpu_fp32.ratio == 1.0
    ((row, reason),) = without.faster_refused
    assert row["precision"] == "bf16" and "no native bf16 instructions" in reason
    native = decisions.choose_setting(frame, "tiny_conv", cpu_env(native_bf16=True))
    assert native.best["precision"] == "bf16" and native.faster_refused == []
    assert native.speedup_vs_cpu_fp32.verdict == "faster"


def test_an_fp16_that_bf16_is_timed_alike_with_is_named_as_passed_over() -> None:
    frame = frame_of(
        bench_record("cpu", "fp32", "train", 100.0),
        bench_record("cpu", "fp16", "train", 60.0),
        bench_record("cpu", "bf16", "train", 61.0),
    )
    env = cpu_env(native_bf16=True)
    env["backends"]["cpu"]["measured_refused"]["fp16"] = None
    choice = decisions.choose_setting(frame, "tiny_conv", env)
    assert choice.best["precision"] == "bf16"
    ((row, reason),) = choice.faster_refused
    assert row["precision"] == "fp16"
    assert "but fp16 against bf16 is indistinguishable" in reason


def test_a_precision_within_the_tolerance_of_fp32_is_not_chosen() -> None:
    near = 100.0 / (1 + SPEEDUP_TOLERANCE / 2)
    frame = frame_of(
        bench_record("mps", "fp32", "train", 100.0), bench_record("mps", "fp16", "train", near)
    )
    choice = decisions.choose_setting(frame, "tiny_conv", env_json())
    assert choice.best["precision"] == "fp32"
    ((row, reason),) = choice.faster_refused
    assert row["precision"] == "fp16" and reason.startswith("not faster: indistinguishable")


def test_an_env_json_without_the_native_check_keeps_cpu_autocast_off() -> None:
    env = env_json()
    del env["backends"]["cpu"]["measured_refused"]
    assert set(decisions.refusals(env, "cpu").values()) == {
        "env.json does not say whether this CPU has native support"
    }
    assert decisions.refusals(env, "cuda") == {"bf16": None, "fp16": None}


def test_without_a_setting_with_acceptable_numerics_there_is_no_answer() -> None:
    frame = frame_of(bench_record("cuda", "fp16", "train", 4.0, loss_rel_diff=0.3))
    choice = decisions.choose_setting(frame, "tiny_conv", env_json())
    assert choice.best is None and choice.speedup_vs_cpu_fp32 is None
    assert list(choice.faster_unsafe["precision"]) == ["fp16"]


def test_numerics_problems_are_named() -> None:
    unacceptable = bench_record("cuda", "bf16", "train", 3.0, loss_rel_diff=0.05)
    assert decisions.numerics_problem(unacceptable) == "the loss is 5.0% off fp32's"
    unacceptable["numerics"]["problem"] = None
    assert "differs from fp32 by 5.00e-02 relative" in decisions.numerics_problem(unacceptable)
    unacceptable["numerics"]["finite"] = False
    assert decisions.numerics_problem(unacceptable) == "it produced non-finite outputs or loss"
    unacceptable["numerics"] = None
    assert "were not measured" in decisions.numerics_problem(unacceptable)


def test_timings_to_trust_less_are_flagged() -> None:
    record = bench_record("cuda", "fp32", "train", 10.0, high_load=True)
    record["timing"].update(noisy=True, iqr_ratio=0.18, budget_limited=True, count=7)
    record["timing"].update(drifting=True, drift_ratio=0.8, warmup_settled=False)
    record["configuration"]["overridden"] = ["batch_size"]
    assert decisions.flags_of(record) == [
        "drifting: the second half of the timed steps ran 20% faster than the first (still "
        "warming up, or the machine got busier)",
        "noisy: the middle half of the steps spans 18% of the median",
        "warm-up ended by its time budget after 10 steps, before the step time settled",
        "budget-limited: 7 of 20 steps",
        "high load: 2.3 on 2 cores, others used 66% CPU",
        "TF32 allowed: cuDNN",
        "timed with bench.batch_size set, not what training runs",
    ]
    assert decisions.flags_of(bench_record("cpu", "fp32", "train", 10.0)) == []


def test_a_precision_stopped_for_being_slower_than_fp32_says_so_beside_its_timing() -> None:
    record = bench_record("cpu", "fp16", "train", 900.0)
    record["timing"].update(count=5, warmup_steps=5, warmup_settled=False, budget_limited=False)
    record["timing"]["warmup_ended_early"] = "its fastest warm-up step was far behind"
    record["timing"]["stopped_early"] = "fp16 is slower than fp32"
    assert decisions.flags_of(record) == [
        "warm-up ended after 5 steps, before the step time settled: its fastest warm-up step "
        "was far behind",
        "stopped early: 5 of 20 steps; fp16 is slower than fp32",
    ]


def test_answer_cautions_cover_the_choice_and_the_cpu_baseline() -> None:
    frame = frame_of(*BENCH)
    choice = decisions.choose_setting(frame, "tiny_conv", env_json())
    assert decisions.answer_cautions(choice.best, frame) == [
        ("CPU fp32", ["high load: 2.3 on 2 cores, others used 66% CPU"])
    ]


@pytest.mark.parametrize(
    ("candidate_ms", "verdict"),
    [(40.0, "faster"), (49.0, None), (51.0, None), (60.0, "slower")],
)
def test_speed_ups_whose_interval_is_within_the_tolerance_are_no_verdict(
    candidate_ms: float, verdict: str | None
) -> None:
    reference = [ms / 1000 for ms in (50, 49.5, 50.5, 50, 49.8, 50.2, 50.1, 49.9)]
    candidate = [v * candidate_ms / 50 for v in reference]
    assert decisions.speed_verdict(speedup(reference, candidate)) == verdict
    assert decisions.speed_verdict(None) is None


def test_the_default_precision_is_what_env_json_says_auto_trains_in() -> None:
    env = env_json()
    assert decisions.default_precision(env, "cuda") == "fp16"
    assert decisions.default_precision(env, "mps") == "fp32"
    env["backends"]["cuda"]["precisions"]["auto"] = "bf16"
    assert decisions.default_precision(env, "cuda") == "bf16"
    del env["backends"]["mps"]["precisions"]
    assert decisions.default_precision(env, "mps") is None


def verdict(frame: pd.DataFrame, backend: str, default: str | None, env=None) -> str:
    return decisions.amp_verdict(frame, backend, default, "tiny_conv", env or env_json())


def test_each_backends_precision_auto_is_set_beside_what_the_shipped_measured_trains_in() -> None:
    frame = frame_of(*BENCH)
    assert verdict(frame, "cuda", "fp16").endswith(
        "precision=measured, the shipped default, trains in fp16 too, so the two agree."
    )
    assert "fp16 2.50x faster (95% interval" in verdict(frame, "cuda", "fp16")
    assert verdict(frame, "mps", "fp32").endswith(
        "precision=measured, the shipped default, trains in fp16 here, 1.33x faster "
        "(95% interval 1.29-1.37x) than fp32."
    )
    assert verdict(frame, "cpu", "fp32") == (
        "CPU: precision=auto trains in fp32; only fp32 was measured: precision=measured, the "
        "shipped default, trains in fp32 too, so the two agree."
    )
    assert verdict(frame, "mps", None) == "MPS: env.json records no precision=auto policy."
    assert "AMP" not in verdict(frame, "mps", "fp32")  # today's vocabulary: precision


def test_an_amp_verdict_within_the_tolerance_keeps_the_default() -> None:
    near = 100.0 / (1 + SPEEDUP_TOLERANCE / 2)
    frame = frame_of(
        bench_record("mps", "fp32", "train", 100.0), bench_record("mps", "fp16", "train", near)
    )
    text = verdict(frame, "mps", "fp32")
    assert "fp16 indistinguishable (1.02x" in text and text.endswith("so the two agree.")


def test_the_cpu_verdict_follows_the_cpus_native_bf16() -> None:
    frame = frame_of(
        bench_record("cpu", "fp32", "train", 100.0), bench_record("cpu", "bf16", "train", 60.0)
    )
    without = verdict(frame, "cpu", "fp32", cpu_env(native_bf16=False))
    assert without.startswith("CPU: precision=auto trains in fp32; bf16 1.67x faster")
    assert without.endswith("trains in fp32 too, so the two agree.")
    native = verdict(frame, "cpu", "fp32", cpu_env(native_bf16=True))
    assert "precision=measured, the shipped default, trains in bf16 here, 1.67x faster" in native


def test_an_amp_verdict_on_a_default_that_failed_or_was_not_measured_says_what_measured_does() -> (
    None
):
    failed = frame_of(
        bench_record("cuda", "fp32", "train", 10.0),
        bench_record("cuda", "fp16", "train", 4.0, loss_rel_diff=0.3),
    )
    text = verdict(failed, "cuda", "fp16")
    assert "but fp16 failed the numerics check (the loss is 30.0% off fp32's)" in text
    assert "precision=measured, the shipped default, trains in fp32 here" in text
    missing = frame_of(bench_record("cuda", "fp32", "train", 10.0))
    assert "fp16 was not measured (skipped or not run)" in verdict(missing, "cuda", "fp16")
    unsafe = frame_of(bench_record("cuda", "fp16", "train", 4.0, loss_rel_diff=0.3))
    assert "no fp32 training benchmark ran" in verdict(unsafe, "cuda", "fp16")
    assert "no fp32 training benchmark ran" in verdict(frame_of(BENCH[5]), "mps", "fp32")


def test_the_policy_table_has_a_record_or_none_per_precision() -> None:
    rows = decisions.policy_rows(frame_of(*BENCH), "cuda", "tiny_conv")
    records = decisions.precision_records(rows)
    assert list(records) == ["fp32", "fp16", "bf16"]
    assert records["bf16"]["median_ms"] == 3.0
    mps = decisions.precision_records(decisions.policy_rows(frame_of(*BENCH), "mps", "tiny_conv"))
    assert mps["bf16"]["status"] == "skipped"
    assert (
        decisions.precision_records(decisions.policy_rows(frame_of(*BENCH), "cpu", None))["fp16"]
        is None
    )


# ---- accuracy against fp32 ------------------------------------------------------------------


def scored(name: str, f1: float, ap50: float, images: int = 1000) -> load.RunResults:
    """An evaluated run with per-image counts of that F1 (`per_image_counts`)."""
    metrics = {"f1": f1, "best_f1": f1, "ap50": ap50, "per_image": per_image_counts(f1, images)}
    return load.RunResults(name, evaluation={"split": "val", "metrics": metrics})


def test_a_reduced_precision_run_is_compared_with_its_fp32_twin() -> None:
    runs = [
        scored("cpu-fp32+seed=1", 0.937, 0.963),
        scored("cpu-bf16+seed=1", 0.931, 0.960),
        scored("cpu-bf16+seed=2", 0.90, 0.90),  # no fp32 twin: not compared
        scored("cuda-fp32+seed=1", 0.95, 0.97),
        scored("cuda-fp16+seed=1", 0.92, 0.969),
    ]
    checks = {check.reduced: check for check in accuracy.accuracy_checks(runs)}
    assert set(checks) == {"cpu-bf16+seed=1", "cuda-fp16+seed=1"}
    held = checks["cpu-bf16+seed=1"]
    assert held.reference == "cpu-fp32+seed=1" and held.split == "val"
    assert held.drops == {"F1": pytest.approx(0.006, abs=1e-3), "AP@.5": pytest.approx(0.003)}
    assert held.f1_change.change == pytest.approx(-0.006, abs=1e-3)
    assert -0.01 < held.f1_change.low < held.f1_change.change < held.f1_change.high
    assert held.verdict == "held"
    dropped = checks["cuda-fp16+seed=1"]
    assert dropped.drops["F1"] == pytest.approx(0.03) and dropped.verdict == "dropped"
    assert dropped.f1_change.high < -0.01


def test_a_loss_within_the_tolerance_is_undecided_where_the_images_are_too_few_to_show_it() -> None:
    """The same 0.6-point loss held on 1,000 images: on 50 the interval reaches past -1 point."""
    runs = [scored("cpu-fp32", 0.937, 0.963, images=50), scored("cpu-bf16", 0.931, 0.960, 50)]
    (check,) = accuracy.accuracy_checks(runs)
    assert check.f1_change.images == 50
    assert check.f1_change.low < -0.01 < check.f1_change.high
    assert check.verdict == "undecided"


def test_an_f1_that_held_with_an_ap50_that_fell_more_than_the_tolerance_is_undecided() -> None:
    runs = [scored("cpu-fp32", 0.937, 0.963), scored("cpu-bf16", 0.937, 0.940)]
    (check,) = accuracy.accuracy_checks(runs)
    assert check.f1_change.verdict == "held" and check.verdict == "undecided"


def with_matches(run: load.RunResults, recall: float | None = None) -> load.RunResults:
    """The run with pycocotools' matches kept (`ap50_matches`), whose AP@.5 is `recall` (the
    fixture's AP@.5 is the recall; by default that of the run's own counts)."""
    metrics = run.evaluation["metrics"]
    counts = (
        metrics["per_image"]
        if recall is None
        else per_image_counts(recall, len(metrics["per_image"]["tp"]))
    )
    metrics["ap50_matches"] = ap50_matches(counts)
    return run


def test_ap50_is_paired_too_where_the_evaluations_keep_pycocotools_matches() -> None:
    """F1 held within the tolerance in both; AP@.5 (here the recall, in COCO's steps of 0.01)
    held with it in one, and fell 3 points in the other, which no paired interval over 1,000
    images lets through; on 50 images a 1-point fall is undecided."""
    reference = with_matches(scored("cpu-fp32", 0.937, 0.963))
    same = with_matches(scored("cpu-bf16", 0.934, 0.96), recall=0.937)
    (held,) = accuracy.accuracy_checks([reference, same])
    assert held.ap50_change.change == 0.0
    assert held.ap50_change.verdict == "held" and held.verdict == "held"
    fell = with_matches(scored("cpu-bf16", 0.934, 0.96), recall=0.907)
    (check,) = accuracy.accuracy_checks([reference, fell])
    assert check.f1_change.verdict == "held"
    assert check.ap50_change.change == pytest.approx(-0.03, abs=1e-3)
    assert check.ap50_change.high < -0.01 and check.verdict == "dropped"
    few = [scored("cpu-fp32", 0.937, 0.963, 50), scored("cpu-bf16", 0.937, 0.96, 50)]
    (near,) = accuracy.accuracy_checks([with_matches(few[0]), with_matches(few[1], recall=0.92)])
    assert near.f1_change.verdict == "held"
    assert near.ap50_change.low < -0.01 < near.ap50_change.high
    assert near.verdict == "undecided"


def test_ap50_matches_that_do_not_pair_fall_back_to_the_unpaired_rule() -> None:
    reference = with_matches(scored("cpu-fp32", 0.937, 0.963))
    broken = with_matches(scored("cpu-bf16", 0.937, 0.940))
    broken.evaluation["metrics"]["ap50_matches"]["classes"][0]["detections"] = [5000]
    (check,) = accuracy.accuracy_checks([reference, broken])
    assert check.ap50_change is None
    assert check.f1_change.verdict == "held" and check.verdict == "undecided"  # AP@.5 fell 2.3


def test_an_accuracy_check_without_per_image_counts_has_no_verdict_and_says_why() -> None:
    runs = [load.RunResults("cpu-fp32"), load.RunResults("cpu-bf16")]
    (check,) = accuracy.accuracy_checks(runs)
    assert check.verdict == "not comparable" and check.split == "validation during training"
    assert "no per-image counts to pair them by" in check.why_unpaired
    older = scored("cpu-bf16", 0.931, 0.960)
    del older.evaluation["metrics"]["per_image"]  # an eval JSON of an earlier version
    (check,) = accuracy.accuracy_checks([scored("cpu-fp32", 0.937, 0.963), older])
    assert check.verdict == "not comparable" and check.f1_change is None


def test_runs_scored_on_different_images_are_not_compared() -> None:
    runs = [scored("cpu-fp32", 0.937, 0.963, images=100), scored("cpu-bf16", 0.931, 0.96, 90)]
    (check,) = accuracy.accuracy_checks(runs)
    assert check.verdict == "not comparable"
    assert check.why_unpaired == "the two evaluations scored different images (100 and 90)"


def run(name: str, **parts: Any) -> load.RunResults:
    return load.RunResults(name, **parts)


def test_run_scores_come_from_the_evaluation_else_from_the_last_validation() -> None:
    summary = train_summary("cpu", "fp32", 0.5)
    assert accuracy.run_scores(run("cpu-fp32", summary=summary)) == {
        "f1": summary["final_val"]["f1"],
        "f1_interval": None,
        "best_f1": 0.5,
        "ap50": pytest.approx(0.45),
        "ap50_interval": None,
        "ap50_matches": None,
        "split": "validation during training",
        "per_image": None,
    }
    counts = per_image_counts(0.65, images=20)
    interval = {"low": 0.6, "high": 0.7, "confidence": 0.95, "images": 20}
    evaluation = {
        "split": "test",
        "metrics": {
            "f1": 0.65,
            "f1_interval": interval,
            "best_f1": 0.7,
            "ap50": 0.6,
            "ap50_matches": ap50_matches(counts),
            "per_image": counts,
        },
    }
    assert accuracy.run_scores(run("cpu-fp32", summary=summary, evaluation=evaluation)) == {
        "f1": 0.65,
        "f1_interval": interval,
        "best_f1": 0.7,
        "ap50": 0.6,
        "ap50_interval": None,
        "ap50_matches": ap50_matches(counts),
        "split": "test",
        "per_image": counts,
    }


def test_best_f1_is_the_highest_validation_f1_else_the_summarys_monitored_metric() -> None:
    rows = metrics_rows([9.0, 8.0, 7.0, 6.0, 5.0, 4.0], [0.2, 0.6, 0.4])
    assert accuracy.best_f1(run("cpu-fp32", metrics=rows)) == (0.6, 2)
    summary = train_summary("cpu", "fp32", 0.5)
    assert accuracy.best_f1(run("cpu-fp32", summary=summary)) == (0.5, 3)
    summary["monitor"] = "ap50"
    assert accuracy.best_f1(run("cpu-fp32", summary=summary)) == (None, None)


def test_swept_values_come_from_the_run_name() -> None:
    assert accuracy.swept_values("cpu-fp32+seed=1+lr=0.01") == {"seed": 1, "lr": 0.01}
    assert accuracy.swept_values("cpu-fp32") == {}
    assert accuracy.swept_values("not a run name") == {}


def test_malformed_per_image_counts_leave_the_check_without_a_verdict_not_the_report() -> None:
    broken = scored("cpu-bf16", 0.931, 0.960)
    del broken.evaluation["metrics"]["per_image"]["fn"]
    (check,) = accuracy.accuracy_checks([scored("cpu-fp32", 0.937, 0.963), broken])
    assert check.verdict == "not comparable"
    assert check.why_unpaired == "their per-image counts are malformed: rerun the evaluation"


def _interleaved(record: dict[str, Any], schedule: str, machine: list[float]) -> dict[str, Any]:
    """`record` as the interleaved bench writes it: blocks of 2 steps per round, on a machine
    whose speed factor in round r is machine[r] (the fixture's steps, scaled)."""
    timing = record["timing"]
    steps = timing["samples_ms"][: 2 * len(machine)]
    rounds = [index // 2 for index in range(len(steps))]
    timing.update(
        samples_ms=[ms * machine[r] for ms, r in zip(steps, rounds, strict=True)],
        rounds=rounds,
        schedule_id=schedule,
        block_steps=2,
    )
    return record


def test_speed_ups_are_paired_by_round_where_records_were_interleaved_and_say_so_where_not() -> (
    None
):
    machine = [1.0, 1.6, 0.9, 1.3, 1.0, 1.5, 1.1, 0.8]
    fp32 = _interleaved(bench_record("cpu", "fp32", "train", 60.0), "s1", machine)
    bf16 = _interleaved(bench_record("cpu", "bf16", "train", 40.0), "s1", machine)
    paired = frame_of(fp32, bf16).iloc[1]["vs_backend_fp32"]
    assert paired.paired_rounds == len(machine) and paired.verdict == "faster"
    assert paired.ratio == pytest.approx(1.5)
    assert paired.low <= paired.ratio <= paired.high + 1e-12
    # the same figures from two schedules (or the old sequential records) are not paired:
    # the machine's speed changes between rounds make their interval far wider
    other = _interleaved(bench_record("cpu", "bf16", "train", 40.0), "s2", machine)
    unpaired = frame_of(fp32, other).iloc[1]["vs_backend_fp32"]
    old = frame_of(
        bench_record("cpu", "fp32", "train", 60.0), bench_record("cpu", "bf16", "train", 40.0)
    )
    assert unpaired.paired_rounds is None and old.iloc[1]["vs_backend_fp32"].paired_rounds is None
    assert unpaired.high - unpaired.low > 3 * (paired.high - paired.low)
    from pipeline.report import bench_views
    from pipeline.summary.build import speed

    assert "paired over 8 interleaved rounds" in bench_views.speedup(speed(paired))["text"]
    assert "unpaired" in bench_views.speedup(speed(unpaired))["text"]
