"""`python -m pipeline report`: a self-contained, escaped HTML page with the right answer on top.

The results tree comes from `report_fixtures`; the HTML is read back with the standard
library's parser, so the assertions see what a browser would, not string fragments. The
decisions behind the page are tested without HTML in test_report_decisions.py, the templates
in test_report_templates.py.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from report_fixtures import (
    SCRIPT_CLASS,
    ap_interval,
    evaluation,
    native_bf16_cpu,
    predictions,
    write_json,
    write_results_tree,
)
from report_golden import swept_tree
from report_page import SECTION_IDS, Page, assert_self_contained

from pipeline import cli, formats
from pipeline.errors import ResultsFileError
from pipeline.report import render

pytestmark = pytest.mark.usefixtures("restore_pipeline_logger")
REPORT_PACKAGE = Path(render.__file__).parent
SCRIPT = "<script>alert(1)</script>"
CONFIG = {
    "model": {"name": "tiny_conv"},
    "precision": "auto",
    "eval": {"score_threshold": 0.3},
    "note": "</pre><script>x()</script>",
}


def build_report(tmp_path: Path, config: dict = CONFIG) -> tuple[str, Page]:
    results = write_results_tree(tmp_path)
    out = tmp_path / "out" / "report.html"
    code = cli.main(
        [
            "report",
            "--results",
            str(results),
            "--out",
            str(out),
            "--config-json",
            json.dumps(config),
        ]
    )
    assert code == 0
    source = out.read_text(encoding="utf-8")
    page = Page()
    page.feed(source)
    return source, page


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Page]:
    """One report for the read-only tests (building takes a second); the logger is put back after."""
    logger = logging.getLogger("pipeline")
    saved = logger.handlers[:], logger.level, logger.propagate
    try:
        return build_report(tmp_path_factory.mktemp("report"))
    finally:
        for handler in logger.handlers:
            if handler not in saved[0]:
                handler.close()
        logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]


def test_every_section_is_present_with_a_heading(built: tuple[str, Page]) -> None:
    source, page = built
    ids = [attrs.get("id") for tag, attrs in page.tags if tag == "section"]
    assert ids == SECTION_IDS
    assert source.count("<h2>") == len(SECTION_IDS)


def test_every_image_is_an_embedded_png_that_decodes_and_nothing_is_fetched(
    built: tuple[str, Page],
) -> None:
    source, page = built
    assert_self_contained(source, page, min_images=4)  # benchmark, training, grid, latency


def test_names_from_files_are_escaped_and_no_script_tag_exists(built: tuple[str, Page]) -> None:
    source, page = built
    assert "script" not in [tag for tag, _ in page.tags]
    assert html_escaped(SCRIPT_CLASS) in source
    assert SCRIPT_CLASS in page.text("evaluation")  # shown as text in the per-class table
    assert "</pre><script>x()</script>" in page.text("provenance")  # the config, escaped in <pre>


def test_a_script_tag_in_a_config_value_is_shown_as_text(tmp_path: Path) -> None:
    _, page = build_report(tmp_path, {**CONFIG, "precision": SCRIPT})
    assert "script" not in [tag for tag, _ in page.tags]
    assert f"your config sets precision={SCRIPT}." in page.text("amp-policy")
    assert f"precision: {SCRIPT}" in page.text("provenance")


def test_a_script_tag_in_a_file_name_is_shown_as_text(tmp_path: Path) -> None:
    """A results file and an image file whose names hold a script tag: both listed as text."""
    results = write_results_tree(tmp_path)
    bench = results / "bench"
    (bench / "cpu-fp32-infer.json").rename(bench / "<script>alert(1).json")
    # a folder '<script>alert(1)<' holding 'script>.png'
    image = tmp_path / "<script>alert(1)</script>.png"
    write_json(results / "eval" / "cpu-fp32_predictions.json", predictions([str(image)]))
    out = tmp_path / "report.html"
    assert cli.main(["report", "--results", str(results), "--out", str(out)]) == 0
    page = Page()
    page.feed(out.read_text(encoding="utf-8"))
    assert "script" not in [tag for tag, _ in page.tags]
    assert "bench/<script>alert(1).json" in page.text("provenance")
    assert f"could not be read and are left out: {image}." in page.text("evaluation")


def html_escaped(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def test_answer_names_the_fastest_setting_with_acceptable_numerics(built: tuple[str, Page]) -> None:
    _, page = built
    answer = page.text("answer")
    assert (
        "On this machine, train with CUDA fp16: 25.00x faster (95% interval 24.23-25.74x) than "
        "CPU fp32, numerics acceptable" in answer
    )
    assert "train with CUDA bf16" not in answer
    # the faster but unacceptable record is explained, not chosen
    assert "No faster choice is safe: CUDA bf16 is 1.33x faster (95% interval" in answer
    assert "but the loss is 5.0% off fp32's" in answer
    assert (
        "The shipped defaults (device=auto, precision=measured) train with CUDA fp16 here: they "
        "follow this answer." in answer
    )
    assert "config sets precision=auto instead" not in answer  # auto trains CUDA fp16 too
    assert "CPU fp32 25.00x slower (95% interval" in answer
    # no fp32 run of equal settings: the page says how to make one
    assert (
        "snakemake --cores 1 results/report.html --config 'sweep={precision: [fp32, measured]}' "
        "trains both" in answer
    )
    assert "cpu-fp32: F1 0.420 (95% interval 0.412–0.427) at the score threshold" in answer
    assert "cuda-fp16: F1 0.610 (95% interval 0.602–0.618) at the score threshold" in answer
    assert "best F1" not in answer  # picked on the images it scores: not beside the runs


def test_benchmarks_mark_the_mps_lower_bound_skips_and_flags(built: tuple[str, Page]) -> None:
    _, page = built
    text = page.text("benchmarks")
    assert "≥ 123 MB (sampled lower bound)" in text
    assert "812 MB (exact)" in text
    assert "host RSS 716 MB" in text
    assert "skipped: bf16 autocast on MPS needs torch >= 2.6" in text
    assert "high load: 2.3 on 2 cores, others used 66% CPU" in text
    assert "2.50×" in text  # CUDA fp16 against CUDA fp32


def test_the_precision_policy_sets_auto_beside_what_the_shipped_measured_trains_in(
    built: tuple[str, Page],
) -> None:
    _, page = built
    text = page.text("amp-policy")
    assert (
        "CUDA: precision=auto trains in fp16; fp16 2.50x faster (95% interval 2.42-2.57x); bf16 "
        "3.33x faster (95% interval 3.23-3.43x) (numerics not acceptable): precision=measured, the "
        "shipped default, trains in fp16 too, so the two agree." in text
    )
    assert (
        "MPS: precision=auto trains in fp32; fp16 1.33x faster (95% interval 1.29-1.37x): "
        "precision=measured, the shipped default, trains in fp16 here, 1.33x faster (95% interval "
        "1.29-1.37x) than fp32." in text
    )
    assert (
        "CPU: precision=auto trains in fp32; only fp32 was measured: precision=measured, the shipped "
        "default, trains in fp32 too" in text
    )
    assert "AMP on" not in text and "AMP off" not in text
    assert (
        "precision=auto (static policy)" in text
        and "precision=measured (shipped default) trains in" in text
    )


def test_training_evaluation_and_profile_sections_show_each_run(built: tuple[str, Page]) -> None:
    _, page = built
    training = page.text("training")
    assert "cuda-fp16" in training and "cpu-fp32" in training
    assert "0.610 (3, weight average)" in training  # trained with train.ema
    assert "weight average" not in training.replace("0.610 (3, weight average)", "")
    evaluation = page.text("evaluation")
    assert "1 image file(s) named in cpu-fp32_predictions.json could not be read" in evaluation
    assert "missing.png" in evaluation
    profile = page.text("profile")
    assert "aten::op10" in profile and "aten::op11" not in profile  # top 10 only
    assert "results/profile/cpu-fp32/trace.json" in profile


def test_trace_link_is_relative_to_the_report(built: tuple[str, Page]) -> None:
    _, page = built
    links = [
        attrs["href"]
        for tag, attrs in page.tags
        if tag == "a" and (attrs.get("href") or "").endswith("trace.json")
    ]
    assert links == ["../results/profile/cpu-fp32/trace.json"]


def test_provenance_lists_job_stats_and_the_reproducing_commands(built: tuple[str, Page]) -> None:
    _, page = built
    text = page.text("provenance")
    assert "train/cpu-fp32" in text and "798" in text
    assert "snakemake --cores 1 results/report.html" in text
    assert "snakemake report -R report" in text
    assert "git commit" in text


def test_missing_pieces_render_as_notes(tmp_path: Path) -> None:
    results = tmp_path / "results"
    write_json(
        results / "bench" / "mps-bf16-train.json",
        {"format": "pipeline.bench/2", "records": [skipped_record()]},
    )
    out = tmp_path / "report.html"
    assert cli.main(["report", "--results", str(results), "--out", str(out)]) == 0
    page = Page()
    page.feed(out.read_text(encoding="utf-8"))
    assert "No successful training benchmark yet" in page.text("answer")
    assert "No env.json" in page.text("environment")
    assert "No training runs" in page.text("training")
    assert "No inference profile" in page.text("profile")
    assert "No configuration was given" in page.text("provenance")


def skipped_record() -> dict:
    from report_fixtures import BENCH

    return next(record for record in BENCH if record["status"] == "skipped")


@pytest.mark.parametrize(
    "relative, content",
    [
        ("eval/cpu-fp32.json", "{ not json"),
        ("bench/cuda-fp16-train.json", '{"format": "pipeline.bench/2", "records": [{}]}'),
        ("train/cpu-fp32/metrics.jsonl", '{"type": "step"}\nnot json\n{"type": "step"}\n'),
        ("env.json", "[1, 2]"),
    ],
)
def test_malformed_input_exits_2_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], relative: str, content: str
) -> None:
    results = write_results_tree(tmp_path)
    (results / relative).write_text(content, encoding="utf-8")
    with pytest.raises(ResultsFileError, match=relative.split("/")[-1]):
        render.build(results, tmp_path / "report.html")
    assert (
        cli.main(["report", "--results", str(results), "--out", str(tmp_path / "report.html")]) == 2
    )
    assert str(results / relative) in capsys.readouterr().err
    assert not (tmp_path / "report.html").exists()


def test_missing_results_folder_is_a_user_error(tmp_path: Path) -> None:
    assert cli.main(["report", "--results", str(tmp_path / "nowhere")]) == 2


def test_config_file_is_resolved_with_defaults(tmp_path: Path) -> None:
    results = write_results_tree(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text("model:\n  name: tiny_conv\n", encoding="utf-8")
    assert cli.main(["report", "--results", str(results), "--configfile", str(config)]) == 0
    page = Page()
    page.feed((results / "report.html").read_text(encoding="utf-8"))
    assert "iou_threshold: 0.5" in page.text("provenance")  # a default the file did not set


def test_the_resolved_config_lists_data_synthetic_only_for_the_synthetic_set(
    tmp_path: Path,
) -> None:
    results = write_results_tree(tmp_path)
    listed = {}
    for data_format in ("synthetic", "coco"):
        config = tmp_path / f"{data_format}.yaml"
        config.write_text(f"data:\n  format: {data_format}\n", encoding="utf-8")
        out = tmp_path / f"{data_format}.html"
        argv = ["report", "--results", str(results), "--configfile", str(config), "--out"]
        assert cli.main([*argv, str(out)]) == 0
        page = Page()
        page.feed(out.read_text(encoding="utf-8"))
        listed[data_format] = page.text("provenance")
    assert "synthetic:" in listed["synthetic"] and "num_train:" in listed["synthetic"]
    assert "synthetic:" not in listed["coco"] and "num_train:" not in listed["coco"]
    assert "format: coco" in listed["coco"] and "val_fraction:" in listed["coco"]


def test_report_and_summary_modules_do_not_import_torch() -> None:
    """The summary and the report run after every heavy step and on machines without an
    accelerator: they must start fast."""
    summary_package = REPORT_PACKAGE.parent / "summary"
    modules = ", ".join(
        ["pipeline.commands.report", "pipeline.commands.summarize", "pipeline.report"]
        + ["pipeline.compare", "pipeline.commands.compare"]
        + [f"pipeline.report.{path.stem}" for path in REPORT_PACKAGE.glob("[!_]*.py")]
        + [f"pipeline.summary.{path.stem}" for path in summary_package.glob("[!_]*.py")]
    )
    code = f"import sys, {modules}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120, check=False).returncode == 0


def test_several_runs_are_compared_with_their_swept_values(tmp_path: Path) -> None:
    results, _ = swept_tree(tmp_path)
    out = tmp_path / "report.html"
    assert cli.main(["report", "--results", str(results), "--out", str(out)]) == 0
    page = Page()
    page.feed(out.read_text())
    text = page.text("training")
    assert "Runs compared" in text and "Training wall time against AP@.5" in out.read_text()
    row = text.split("cpu-fp32+seed=1+lr=0.01", 2)[2]  # the comparison table's row
    assert row.split()[:2] == ["0.01", "1"]  # lr, seed: the swept columns, sorted by key


def native_bf16_cpu_tree(tmp_path: Path, bf16_f1: float) -> Path:
    """A CPU with native bf16 where bf16 trains faster, and fp32 and bf16 runs of equal settings."""
    results = native_bf16_cpu(tmp_path)
    for precision, f1 in (("fp32", 0.937), ("bf16", bf16_f1)):
        write_json(results / "eval" / f"cpu-{precision}.json", evaluation("cpu", precision, f1))
    return results


def test_the_commands_repeat_the_config_files_and_settings_the_workflow_was_called_with(
    tmp_path: Path,
) -> None:
    """A report of the user's own data must not send them back to the defaults: its commands
    keep their --configfile files and --config settings; precision and the device are replaced."""
    results = native_bf16_cpu_tree(tmp_path, bf16_f1=0.931)
    invocation = {
        "configfiles": ["config/presets/photographs.yaml", "my data.yaml"],
        "config": {"precision": "fp16", "train": {"epochs": 5}, "cpu_threads": "auto"},
    }
    render.build(results, tmp_path / "report.html", CONFIG, invocation)
    page = Page()
    page.feed((tmp_path / "report.html").read_text(encoding="utf-8"))
    answer = page.text("answer")
    assert (
        "snakemake --cores 1 results/report.html --configfile config/presets/photographs.yaml "
        "'my data.yaml' --config 'train={\"epochs\": 5}' cpu_threads=auto precision=measured (or "
        "python -m pipeline train --configfile config/presets/photographs.yaml 'my data.yaml' "
        "--precision measured 'cpu_threads=\"auto\"' train.epochs=5)" in answer
    )


def test_the_provenance_reproduce_commands_repeat_the_config_files_and_settings_of_the_call(
    tmp_path: Path,
) -> None:
    """Bare `snakemake --cores 1 results/report.html` under a report of the user's own data
    would retrain on the synthetic set over their results."""
    results = native_bf16_cpu_tree(tmp_path, bf16_f1=0.931)
    invocation = {"configfiles": ["config/presets/photographs.yaml", "my data.yaml"], "config": {}}
    render.build(results, tmp_path / "report.html", CONFIG, invocation)
    page = Page()
    page.feed((tmp_path / "report.html").read_text(encoding="utf-8"))
    files = "--configfile config/presets/photographs.yaml 'my data.yaml'"
    text = page.text("provenance")
    assert f"everything, then this report: snakemake --cores 1 results/report.html {files}" in text
    assert f"from the results already there: snakemake report -R report {files}" in text
    assert "--config" not in text.replace("--configfile", "")  # no bare --config: nothing set


def test_a_run_evaluated_by_the_voc_devkits_protocol_is_labelled_so_beside_cocos(
    tmp_path: Path,
) -> None:
    """Pascal VOC data are evaluated by the devkit's protocol by default: the report must not
    present their AP@.5 as COCO's."""
    results = native_bf16_cpu_tree(tmp_path, bf16_f1=0.931)
    document = evaluation("cpu", "fp32", 0.937)
    document["metrics"]["protocol"] = "voc"
    write_json(results / "eval" / "cpu-fp32.json", document)
    render.build(results, tmp_path / "report.html", CONFIG)
    page = Page()
    page.feed((tmp_path / "report.html").read_text(encoding="utf-8"))
    text = page.text("evaluation")
    assert "cpu-fp32 (VOC devkit protocol;" in text
    assert "cpu-bf16 (VOC" not in text
    assert "except where a run's settings name the VOC devkit's protocol" in text


def test_the_report_command_rejects_an_invocation_that_is_not_a_json_object(
    tmp_path: Path, capsys: pytest.CaptureFixture, restore_pipeline_logger
) -> None:
    code = cli.main(["report", "--results", str(tmp_path), "--invocation-json", "[1]"])
    assert code == 2
    assert "--invocation-json must be a JSON object, not a list." in capsys.readouterr().err


def test_the_shipped_defaults_follow_a_faster_answer_that_precision_auto_misses_with_its_interval(
    tmp_path: Path,
) -> None:
    results = native_bf16_cpu_tree(tmp_path, bf16_f1=0.931)
    render.build(results, tmp_path / "report.html", CONFIG)
    page = Page()
    page.feed((tmp_path / "report.html").read_text(encoding="utf-8"))
    answer = page.text("answer")
    assert "On this machine, train with CPU bf16: 1.47x faster (95% interval" in answer
    assert (
        "The shipped defaults (device=auto, precision=measured) train with CPU bf16 here: they follow "
        "this answer, where precision=auto, the static policy, would train in CPU fp32 (CPU bf16 is "
        "1.47x faster (95% interval" in answer
    )
    assert (  # CONFIG sets precision=auto, which trains CPU fp32 here
        "These results' config sets precision=auto instead: snakemake --cores 1 results/report.html "
        "--config precision=measured (or python -m pipeline train --precision measured) trains with "
        "the answer." in answer
    )
    assert "cpu-bf16 against cpu-fp32 (val): F1 0.931 vs 0.937" in answer
    assert (
        "bf16 held up (F1 −0.6 points, 95% interval −0.8 to −0.4 over 1000 images; "
        "AP@.5 +0.0 points, 95% interval −1.0 to +0.0)." in answer
    )
    assert "CPU native bf16 yes (avx512_bf16=yes)" in page.text("environment")
    policy = page.text("amp-policy")
    assert "precision=measured, the shipped default, trains in bf16 here" in policy


def test_a_reduced_precision_that_lost_accuracy_says_by_how_much(tmp_path: Path) -> None:
    results = native_bf16_cpu_tree(tmp_path, bf16_f1=0.90)
    render.build(results, tmp_path / "report.html", CONFIG)
    page = Page()
    page.feed((tmp_path / "report.html").read_text(encoding="utf-8"))
    assert (
        "bf16 did not hold up (F1 −3.7 points, 95% interval −4.3 to −3.2 over 1000 images; "
        "AP@.5 −3.0 points, 95% interval −4.0 to −3.0)." in page.text("answer")
    )


def test_a_loss_the_images_cannot_settle_is_called_so_and_says_what_would_settle_it(
    tmp_path: Path,
) -> None:
    """F1 0.929 against 0.937 on 1,000 images: the interval straddles -1 point. On the
    built-in data the page gives the command that evaluates on a larger test split, keeping
    the caller's data settings; on the user's own data it asks for more test images."""
    results = native_bf16_cpu_tree(tmp_path, bf16_f1=0.929)
    invocation = {"config": {"data": {"root": "my data", "synthetic": {"seed": 3}}, "seed": 1}}
    synthetic = {**CONFIG, "data": {"format": "synthetic"}}
    render.build(results, tmp_path / "report.html", synthetic, invocation)
    page = Page()
    page.feed((tmp_path / "report.html").read_text(encoding="utf-8"))
    assert (
        "not settled (F1 −0.8 points, 95% interval −1.1 to −0.5 over 1000 images; AP@.5 −1.0 "
        "points, 95% interval −1.0 to +0.0): these images "
        "cannot tell whether bf16 lost more than 1 point. More images narrow the interval (4 "
        "times the images about halve it): about 1792 test images would settle it were the "
        "change to stay where it is; snakemake --cores 1 results/report.html --config seed=1 "
        '\'data={"root": "my data", "synthetic": {"seed": 3, "num_test": 1792}}\' '
        "makes that test split and evaluates every run on it, retraining nothing."
        in page.text("answer")
    )
    own_data = {**CONFIG, "data": {"format": "coco"}}
    render.build(results, tmp_path / "report.html", own_data, invocation)
    page = Page()
    page.feed((tmp_path / "report.html").read_text(encoding="utf-8"))
    assert "about halve it): a larger test split of your data." in page.text("answer")


def held_out_evaluation(**interval: str) -> dict[str, Any]:
    """cpu-fp32's evaluation on the test split: F1 0.44 at the threshold 0.35 picked on
    validation, its interval with `interval`'s keys on top."""
    document = evaluation("cpu", "fp32", 0.42)
    document.update(
        split="test",
        metrics_split="test",
        operating_point={
            "threshold": 0.35,
            "picked_on": "val",
            "applied_to": "test",
            "f1": 0.44,
            "f1_interval": {**ap_interval(0.44, 0.01), **interval},
        },
    )
    return document


def evaluation_section(results: Path, document: dict[str, Any]) -> str:
    """The evaluation section's text of a report built with `document` as cpu-fp32's evaluation."""
    write_json(results / "eval" / "cpu-fp32.json", document)
    render.build(results, results.parent / "report.html")
    page = Page()
    page.feed((results.parent / "report.html").read_text(encoding="utf-8"))
    return page.text("evaluation")


def test_evaluation_leads_with_f1_at_the_validation_threshold_on_the_held_out_split(
    tmp_path: Path,
) -> None:
    results = write_results_tree(tmp_path)
    document = held_out_evaluation(method="percentile bootstrap")
    text = evaluation_section(results, document)
    assert (
        "Run Split F1 (95% interval) at the validation threshold F1 (95% interval) at the score "
        "threshold Precision (95% interval) Recall (95% interval) AP@.5 (95% interval) "
        "AP@[.5:.95] (95% interval) AP@.75 (95% interval) Best F1 on these images, at its "
        "threshold (optimistic)" in text
    )
    assert (
        "cpu-fp32 (score threshold set by eval.score_threshold) test (held out) 0.440 "
        "(0.430–0.450) at 0.35 0.420 (0.412–0.427) at 0.30 0.420 (0.412–0.427)" in text
    )
    assert "0.210 (0.190–0.230) 0.140 (0.120–0.160)" in text  # AP@[.5:.95], AP@.75
    assert "0.470 at 0.25" in text  # the best F1 on the test images themselves, last


def test_beside_each_run_are_the_flip_test_the_score_floor_and_where_the_threshold_came_from(
    tmp_path: Path,
) -> None:
    """The evaluation settings that shaped a run's figures: eval.flip_test, eval.min_score
    (detections below it dropped before any figure), and whether the score threshold is the
    checkpoint's, eval.score_threshold's or picked on validation. Five runs of one report, each
    evaluated with other settings: each is labelled by its own file."""
    results = write_results_tree(tmp_path)
    floor, words = {"flip_test": True, "min_score": 0.05}, "flip test; score floor 0.05; "
    no_floor = {"flip_test": False, "min_score": 0.0}
    old = {"flip_test": False}  # an eval file from before eval.min_score
    variants = {  # run: its evaluation's settings and threshold source, and its label
        "cpu-fp32": (floor, "checkpoint", words + "score threshold saved in the checkpoint"),
        "cpu-fp16": (
            floor,
            "eval.score_threshold",
            words + "score threshold set by eval.score_threshold",
        ),
        "cpu-bf16": (floor, "validation", words + "score threshold picked on validation"),
        "mps-fp32": (
            no_floor,
            "validation",
            "no score floor; score threshold picked on validation",
        ),
        "mps-fp16": (old, "validation", "score threshold picked on validation"),
    }
    for run, (settings, source, _) in variants.items():
        backend, precision = run.split("-")
        document = evaluation(backend, precision, 0.42)
        document["metrics"].update(settings)
        document["score_threshold_source"] = source
        write_json(results / "eval" / f"{run}.json", document)
    render.build(results, results.parent / "report.html")
    page = Page()
    page.feed((results.parent / "report.html").read_text(encoding="utf-8"))
    text = page.text("evaluation")
    for run, (_, _, label) in variants.items():
        assert f"{run} ({label}) val " in text


def test_each_run_leads_with_its_held_out_f1_and_the_optimistic_ones_say_so(
    tmp_path: Path,
) -> None:
    """Beside each run: F1 at the threshold picked on validation and applied to the test
    split, with its interval; not the best F1 on the test images themselves, and the training
    table's highest validation F1 over the epochs is labelled optimistic."""
    results = write_results_tree(tmp_path)
    document = held_out_evaluation()
    write_json(results / "eval" / "cpu-fp32.json", document)
    render.build(results, tmp_path / "report.html")
    page = Page()
    page.feed((tmp_path / "report.html").read_text(encoding="utf-8"))
    answer = page.text("answer")
    assert (
        "cpu-fp32: F1 0.440 (95% interval 0.430–0.450) at the threshold picked on validation, "
        "AP@.5 0.378 (95% interval 0.358–0.398) (test, held out)" in answer
    )
    assert "best F1" not in answer and "0.470" not in answer  # 0.47: picked on the test images
    training = page.text("training")
    assert "Best validation F1 over epochs (epoch), optimistic" in training
    assert (
        "cpu-fp32 cpu fp32 12.5 s 0.440 (0.430–0.450) (test; threshold picked on validation)"
        in training
    )


def test_size_buckets_line_up_by_bucket_and_an_older_file_without_them_shows_na() -> None:
    from pipeline.report.run_views import size_view
    from pipeline.summary.load import RunResults

    with_sizes = RunResults("a", evaluation=evaluation("cpu", "fp32", 0.5))
    older = evaluation("cpu", "bf16", 0.5)
    del older["metrics"]["size_buckets"]
    view = size_view([with_sizes, RunResults("b", evaluation=older)])
    assert view["runs"] == ["a", "b"]
    assert [bucket["name"] for bucket in view["buckets"]] == ["small", "medium", "large"]
    assert view["buckets"][2]["range_px"] == [64.0, None]
    small = view["buckets"][0]["cells"]
    assert small[0]["num_gt"] == 50 and small[1] is None


def test_a_class_with_few_objects_in_a_size_bucket_is_named_under_its_figures(
    tmp_path: Path,
) -> None:
    """COCO's bucket AP is a mean over classes: two missed rings pull a bucket of hundreds of
    found objects down, and the report says which class and how few objects did it, and the
    bucket's interval how far those two objects move it."""
    results = write_results_tree(tmp_path)
    document = evaluation("cpu", "fp32", 0.9)
    document["metrics"]["size_buckets"]["medium"].update(
        num_gt=302,
        ap50=0.55,
        ap50_interval={**ap_interval(0.55, 0.0), "high": 0.98},
        ap_interval=None,  # as an older file has none: the figure alone
        recall_interval=ap_interval(0.9, 0.02),
        per_class=[
            {"label": 0, "name": "circle", "num_gt": 300, "ap50": 0.98},
            {"label": 1, "name": "ring", "num_gt": 2, "ap50": 0.12},
            {"label": 2, "name": "star", "num_gt": 0, "ap50": None},
        ],
    )
    text = evaluation_section(results, document)
    assert (
        "0.550 (0.550–0.980) / 0.450 / 0.900 (0.880–0.920) (302) ring: 2 objects, AP@.5 0.120"
        in text
    )
    assert "circle: 300" not in text and "star:" not in text
    assert "fewer than 10 objects in a bucket is named under its figures" in text


def test_a_class_without_objects_in_the_split_says_so_and_that_the_mean_leaves_it_out(
    tmp_path: Path,
) -> None:
    """A class with a single training box may have none in the test split: its AP is not a
    zero, and the class means (COCO's mAP) do not count it; the table says so, not 'n/a'."""
    results = write_results_tree(tmp_path)
    document = evaluation("cpu", "fp32", 0.9)
    empty = document["metrics"]["per_class"][-1]
    empty.update(num_gt=0, ap=None, ap50=None, ap_interval=None, ap50_interval=None)
    empty.update(precision=None, recall=None, f1=None, tp=0, fp=0, fn=0)
    assert formats.problem(document, "eval") is None
    text = evaluation_section(results, document)
    assert "0.305 (0.275–0.335) no objects in this split: not in the class means" in text
    assert (
        f"{empty['name']} has no objects in this split: its AP and recall are undefined (null "
        "in the evaluation JSON), not zero, and the class means (AP@.5, AP@[.5:.95]) leave it "
        "out." in text
    )
