"""What the report concludes, tested on frames and records alone: no HTML is built here.

Records come from `report_fixtures.bench_record` (shaped like the bench step's files) and go
through `load.bench_frame`, as the report reads them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from report_fixtures import BENCH, bench_record, env_json, metrics_rows, train_summary

from pipeline.report import decisions, load
from pipeline.report.decisions import SPEEDUP_TOLERANCE


def frame_of(*records: dict[str, Any]) -> pd.DataFrame:
    return load.bench_frame(
        [(record, Path(f"bench/{index}.json")) for index, record in enumerate(records)]
    )


def cpu_only_env(amp_supported: bool = False) -> dict[str, Any]:
    env = env_json()
    env["backends"]["cpu"]["amp_supported"] = amp_supported
    return env


def test_the_answer_is_the_fastest_setting_with_acceptable_numerics() -> None:
    choice = decisions.choose_setting(frame_of(*BENCH), "tiny_conv", env_json())
    assert (choice.best["backend"], choice.best["precision"]) == ("cuda", "fp16")
    assert list(choice.faster_unsafe["precision"]) == ["bf16"]  # faster, but 5% off fp32
    assert choice.speedup_vs_cpu_fp32 == pytest.approx(100.0 / 4.0)
    assert not choice.is_cpu_fp32
    assert choice.faster_off_policy.empty


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


def test_a_faster_setting_the_amp_policy_rules_out_is_reported_not_chosen() -> None:
    frame = frame_of(
        bench_record("cpu", "fp32", "train", 100.0), bench_record("cpu", "bf16", "train", 60.0)
    )
    choice = decisions.choose_setting(frame, "tiny_conv", cpu_only_env(amp_supported=False))
    assert choice.is_cpu_fp32 and choice.speedup_vs_cpu_fp32 == 1.0
    assert list(choice.faster_off_policy["precision"]) == ["bf16"]
    allowed = decisions.choose_setting(frame, "tiny_conv", cpu_only_env(amp_supported=True))
    assert allowed.best["precision"] == "bf16" and allowed.faster_off_policy.empty


def test_without_a_setting_with_acceptable_numerics_there_is_no_answer() -> None:
    frame = frame_of(bench_record("cuda", "fp16", "train", 4.0, loss_rel_diff=0.3))
    choice = decisions.choose_setting(frame, "tiny_conv", env_json())
    assert choice.best is None and choice.speedup_vs_cpu_fp32 is None
    assert list(choice.faster_unsafe["precision"]) == ["fp16"]


def test_numerics_problems_are_named() -> None:
    unacceptable = bench_record("cuda", "bf16", "train", 3.0, loss_rel_diff=0.05)
    assert "differs from fp32 by 5.00e-02 relative" in decisions.numerics_problem(unacceptable)
    unacceptable["numerics"]["finite"] = False
    assert decisions.numerics_problem(unacceptable) == "it produced non-finite outputs or loss"
    unacceptable["numerics"] = None
    assert "were not measured" in decisions.numerics_problem(unacceptable)


def test_timings_to_trust_less_are_flagged() -> None:
    record = bench_record("cuda", "fp32", "train", 10.0, high_load=True)
    record["timing"].update(noisy=True, iqr_ratio=0.18, budget_limited=True, count=7)
    assert decisions.flags_of(record) == [
        "noisy: IQR 18% of median",
        "budget-limited: 7 of 20 steps",
        "high load: 2.3 on 2 cores, others used 66% CPU",
        "TF32 allowed: cuDNN",
    ]
    assert decisions.flags_of(bench_record("cpu", "fp32", "train", 10.0)) == []


def test_answer_cautions_cover_the_choice_and_the_cpu_baseline() -> None:
    frame = frame_of(*BENCH)
    choice = decisions.choose_setting(frame, "tiny_conv", env_json())
    assert decisions.answer_cautions(choice.best, frame) == [
        ("CPU fp32", ["high load: 2.3 on 2 cores, others used 66% CPU"])
    ]


@pytest.mark.parametrize(
    ("speedup", "verdict"),
    [
        (1 + 2 * SPEEDUP_TOLERANCE, "faster"),
        (1 + SPEEDUP_TOLERANCE / 2, None),
        (1 - SPEEDUP_TOLERANCE / 2, None),
        (1 - 2 * SPEEDUP_TOLERANCE, "slower"),
        (None, None),
        (float("nan"), None),
    ],
)
def test_speed_ups_within_the_tolerance_are_noise(
    speedup: float | None, verdict: str | None
) -> None:
    assert decisions.speed_verdict(speedup) == verdict


def test_the_default_precision_follows_the_recorded_policy_and_amp_dtype() -> None:
    env = env_json()
    assert decisions.default_precision(env, "cuda", None) == "fp16"
    assert decisions.default_precision(env, "cuda", {"amp_dtype": "bf16"}) == "bf16"
    assert decisions.default_precision(env, "mps", None) == "fp32"
    del env["backends"]["mps"]["resolved_amp"]
    assert decisions.default_precision(env, "mps", None) is None


def verdict(frame: pd.DataFrame, backend: str, default: str | None, allowed: bool = True) -> str:
    return decisions.amp_verdict(frame, backend, default, "tiny_conv", allowed)


def test_amp_verdicts_confirm_or_question_each_default() -> None:
    frame = frame_of(*BENCH)
    assert verdict(frame, "cuda", "fp16").endswith("default confirmed.")
    assert "fp32 measured 2.50× slower than fp16" in verdict(frame, "cuda", "fp16")
    assert verdict(frame, "mps", "fp32").endswith(
        "fp16 measured 1.33× faster than fp32 with acceptable numerics: consider amp=true amp_dtype=fp16."
    )
    assert verdict(frame, "cpu", "fp32") == (
        "CPU: AMP off by default; only fp32 was measured: default confirmed."
    )
    assert verdict(frame, "mps", None) == "MPS: no AMP policy recorded in env.json."


def test_an_amp_verdict_within_the_tolerance_keeps_the_default() -> None:
    near = 100.0 / (1 + SPEEDUP_TOLERANCE / 2)
    frame = frame_of(
        bench_record("mps", "fp32", "train", 100.0), bench_record("mps", "fp16", "train", near)
    )
    assert f"within {SPEEDUP_TOLERANCE:.0%} of the fastest, so the default is confirmed" in verdict(
        frame, "mps", "fp32"
    )


def test_an_amp_verdict_where_the_policy_forbids_amp_says_the_policy_is_not_confirmed() -> None:
    frame = frame_of(
        bench_record("cpu", "fp32", "train", 100.0), bench_record("cpu", "bf16", "train", 60.0)
    )
    text = verdict(frame, "cpu", "fp32", allowed=False)
    assert text.startswith("CPU: AMP off by policy (amp_supported is false")
    assert "bf16 measured 1.67× faster than fp32" in text and "default not confirmed" in text


def test_an_amp_verdict_on_a_default_that_failed_or_was_not_measured_suggests_another() -> None:
    failed = frame_of(
        bench_record("cuda", "fp32", "train", 10.0),
        bench_record("cuda", "fp16", "train", 4.0, loss_rel_diff=0.3),
    )
    assert "but fp16 failed the numerics check" in verdict(failed, "cuda", "fp16")
    assert verdict(failed, "cuda", "fp16").endswith("consider amp=false.")
    missing = frame_of(bench_record("cuda", "fp32", "train", 10.0))
    assert "fp16 was not measured (skipped or not run)" in verdict(missing, "cuda", "fp16")
    unsafe = frame_of(bench_record("cuda", "fp16", "train", 4.0, loss_rel_diff=0.3))
    assert "no precision passed the numerics check" in verdict(unsafe, "cuda", "fp16")
    assert "no training benchmark ran" in verdict(frame_of(BENCH[5]), "mps", "fp32")


def test_the_policy_table_has_a_record_or_none_per_precision_and_the_fastest_safe_one() -> None:
    rows = decisions.policy_rows(frame_of(*BENCH), "cuda", "tiny_conv")
    records = decisions.precision_records(rows)
    assert list(records) == ["fp32", "fp16", "bf16"]
    assert records["bf16"]["median_ms"] == 3.0
    assert decisions.fastest_safe_precision(rows) == "fp16"  # bf16 is faster but unsafe
    mps = decisions.precision_records(decisions.policy_rows(frame_of(*BENCH), "mps", "tiny_conv"))
    assert mps["bf16"]["status"] == "skipped"
    assert (
        decisions.precision_records(decisions.policy_rows(frame_of(*BENCH), "cpu", None))["fp16"]
        is None
    )


def run(name: str, **parts: Any) -> load.RunResults:
    return load.RunResults(name, **parts)


def test_run_scores_come_from_the_evaluation_else_from_the_last_validation() -> None:
    summary = train_summary("cpu", "fp32", 0.5)
    assert decisions.run_scores(run("cpu-fp32", summary=summary)) == {
        "best_f1": 0.5,
        "ap50": pytest.approx(0.45),
    }
    evaluation = {"metrics": {"best_f1": 0.7, "ap50": 0.6}}
    assert decisions.run_scores(run("cpu-fp32", summary=summary, evaluation=evaluation)) == {
        "best_f1": 0.7,
        "ap50": 0.6,
    }


def test_best_f1_is_the_highest_validation_f1_else_the_summarys_monitored_metric() -> None:
    rows = metrics_rows([9.0, 8.0, 7.0, 6.0, 5.0, 4.0], [0.2, 0.6, 0.4])
    assert decisions.best_f1(run("cpu-fp32", metrics=rows)) == (0.6, 2)
    summary = train_summary("cpu", "fp32", 0.5)
    assert decisions.best_f1(run("cpu-fp32", summary=summary)) == (0.5, 3)
    summary["monitor"] = "ap50"
    assert decisions.best_f1(run("cpu-fp32", summary=summary)) == (None, None)


def test_swept_values_come_from_the_run_name() -> None:
    assert decisions.swept_values("cpu-fp32+seed=1+lr=0.01") == {"seed": 1, "lr": 0.01}
    assert decisions.swept_values("cpu-fp32") == {}
    assert decisions.swept_values("not a run name") == {}


def test_the_score_threshold_is_the_evaluations_else_the_configs_else_the_default() -> None:
    evaluated = run("cpu-fp32", evaluation={"metrics": {"score_threshold": 0.5}})
    assert decisions.score_threshold(evaluated, {"eval": {"score_threshold": 0.4}}) == 0.5
    assert decisions.score_threshold(run("cpu-fp32"), {"eval": {"score_threshold": 0.4}}) == 0.4
    assert decisions.score_threshold(run("cpu-fp32"), None) == decisions.DEFAULT_SCORE_THRESHOLD
