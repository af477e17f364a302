"""results/summary.json: what `python -m pipeline summarize` keeps of a results folder, what
it compares by, and that the report shows the summary instead of deciding again.

The results trees are report_fixtures' (shaped like the real files each stage writes).
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from report_fixtures import (
    BENCH,
    ap_interval,
    bench_record,
    evaluation,
    native_bf16_cpu,
    step_samples,
    write_json,
    write_results_tree,
)
from report_page import Page

from pipeline import cli, config, formats, setting_groups
from pipeline.errors import PipelineError, ResultsFileError
from pipeline.report import render, run_views
from pipeline.summary import build, load
from pipeline.summary.read import read_summary

pytestmark = pytest.mark.usefixtures("restore_pipeline_logger")
CONFIG = {
    "model": {"name": "tiny_conv"},
    "precision": "auto",
    "data": {"format": "synthetic"},
    "eval": {"score_threshold": 0.3},
}


def summarized(results: Path, settings: dict[str, Any] | None = CONFIG) -> dict[str, Any]:
    """The summary `python -m pipeline summarize` writes of `results`, read back."""
    extra = [] if settings is None else ["--config-json", json.dumps(settings)]
    assert cli.main(["summarize", "--results", str(results), *extra]) == 0
    return read_summary(results / "summary.json")


@pytest.fixture(scope="module")
def summary(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return summarized(write_results_tree(tmp_path_factory.mktemp("summary")))


def test_the_summary_file_matches_its_schema_and_format(summary: dict[str, Any]) -> None:
    assert summary["format"] == build.FORMAT == formats.format_tag("summary")
    assert formats.problem(summary, "summary") is None


def test_the_answer_is_the_setting_with_its_speed_up_interval_numerics_and_default(
    summary: dict[str, Any],
) -> None:
    chosen = summary["answer"]["chosen"]
    assert (chosen["backend"], chosen["precision"], chosen["model"]) == (
        "cuda",
        "fp16",
        "tiny_conv",
    )
    speed = chosen["vs_cpu_fp32"]
    assert speed["ratio"] == pytest.approx(25.0) and speed["verdict"] == "faster"
    assert speed["low"] < 25.0 < speed["high"] and speed["confidence"] == 0.95
    assert chosen["numerics"] == "acceptable"
    assert summary["answer"]["shipped_default"] == {"backend": "cuda", "precision": "fp16"}
    assert summary["answer"]["static_default"] == {"backend": "cuda", "precision": "fp16"}
    assert summary["answer"]["config_precision"] == "auto"
    assert chosen["is_shipped_default"] is True
    assert [(o["backend"], o["precision"]) for o in chosen["faster_unsafe"]] == [("cuda", "bf16")]


def test_the_shipped_default_follows_the_answer_where_precision_auto_would_not(
    tmp_path: Path,
) -> None:
    """precision=measured is the shipped default: on a CPU with native bf16 the defaults train
    bf16, as the answer says, where the static policy (precision=auto) trains fp32."""
    summary = summarized(native_bf16_cpu(tmp_path), {**CONFIG, "precision": "measured"})
    answer = summary["answer"]
    assert answer["shipped_default"] == {"backend": "cpu", "precision": "bf16"}
    assert answer["static_default"] == {"backend": "cpu", "precision": "fp32"}
    assert answer["config_precision"] == "measured"
    chosen = answer["chosen"]
    assert (chosen["backend"], chosen["precision"], chosen["is_shipped_default"]) == (
        "cpu",
        "bf16",
        True,
    )
    assert chosen["vs_default"]["ratio"] == pytest.approx(1.0)
    static = chosen["vs_static_default"]
    assert static["ratio"] == pytest.approx(50 / 34) and static["verdict"] == "faster"
    (policy,) = summary["amp_policy"]
    assert policy["verdict"].startswith("CPU: precision=auto trains in fp32; bf16 1.47x faster")
    assert "precision=measured, the shipped default, trains in bf16 here" in policy["verdict"]


def test_the_machine_is_what_env_json_describes(summary: dict[str, Any]) -> None:
    machine = summary["machine"]
    assert (
        machine["cpu_model"],
        machine["cpu_count"],
        machine["memory_gib"],
        machine["torch_threads"],
    ) == ("AMD EPYC", 2, 31.3, 2)
    assert machine["cpu_native"]["bf16"] == {
        "native": False,
        "evidence": "torch.cpu.get_capabilities(): avx512_bf16=no, amx_bf16=no",
    }
    assert machine["gpus"] == [
        {"name": "NVIDIA Fake H100", "memory_gib": 79.6, "capability": "9.0"}
    ]
    versions = machine["versions"]
    assert (versions["torch"], versions["cuda"], versions["cudnn"]) == (
        "2.14.1+cu130",
        "13.0",
        "91000",
    )
    assert (machine["backends"], machine["auto"]) == (["cuda", "mps", "cpu"], "cuda")


def test_every_benchmark_record_is_kept_with_its_median_iqr_and_flags(
    summary: dict[str, Any],
) -> None:
    kept = {(b["backend"], b["precision"], b["mode"]): b for b in summary["benchmarks"]}
    assert set(kept) == {(r["backend"], r["precision"], r["mode"]) for r in BENCH}
    cpu = kept[("cpu", "fp32", "train")]
    assert (cpu["median_ms"], cpu["iqr_ms"], cpu["count"]) == (100.0, 5.0, 20)
    assert cpu["flags"] == ["high load: 2.3 on 2 cores, others used 66% CPU"]
    assert kept[("cuda", "fp16", "train")]["vs_backend_fp32"]["ratio"] == pytest.approx(2.5)
    assert kept[("cuda", "bf16", "train")]["numerics"]["problem"] == "the loss is 5.0% off fp32's"
    skipped = kept[("mps", "bf16", "train")]
    assert skipped["status"] == "skipped" and skipped["median_ms"] is None


def test_every_benchmark_keeps_its_step_times_for_comparing_machines(
    summary: dict[str, Any],
) -> None:
    kept = {(b["backend"], b["precision"], b["mode"]): b for b in summary["benchmarks"]}
    for record in BENCH:
        entry = kept[(record["backend"], record["precision"], record["mode"])]
        timed = (record.get("timing") or {}).get("samples_ms") or []
        assert entry["samples_ms"] == timed and len(timed) == entry["count"]
    assert kept[("cpu", "fp32", "train")]["samples_ms"] == step_samples(100.0)
    assert kept[("mps", "bf16", "train")]["samples_ms"] == []  # skipped: none timed


def test_each_step_keeps_its_model_instance_where_the_record_names_them(tmp_path: Path) -> None:
    results = write_results_tree(tmp_path)
    path = results / "bench" / "cuda-fp16-train.json"
    document = json.loads(path.read_text())
    timing = document["records"][0]["timing"]
    timing["instances"] = [i % 3 for i in range(len(timing["samples_ms"]))]
    write_json(path, document)
    kept = {(b["backend"], b["precision"], b["mode"]): b for b in summarized(results)["benchmarks"]}
    assert kept[("cuda", "fp16", "train")]["instances"] == timing["instances"]
    assert "instances" not in kept[("cpu", "fp32", "train")]  # its record names none


def test_a_summary_made_before_it_kept_step_times_still_reads_and_bad_ones_do_not(
    summary: dict[str, Any],
) -> None:
    older = copy.deepcopy(summary)
    for entry in older["benchmarks"]:
        del entry["samples_ms"]
    assert formats.problem(older, "summary") is None
    older["benchmarks"][0]["samples_ms"] = [12.5, "slow"]
    assert "benchmarks/0/samples_ms/1" in formats.problem(older, "summary")


def test_a_benchmark_timed_on_another_cpu_than_env_json_describes_is_flagged(
    tmp_path: Path,
) -> None:
    """On a cluster partition of mixed node types, check_env and each benchmark job may land on
    different CPUs: the summary names its machine by env.json, so figures timed elsewhere say so,
    in their flags and in the answer's cautions, where the report and its reader see them."""
    results = native_bf16_cpu(tmp_path)
    path = results / "bench" / "cpu-bf16-train.json"
    document = json.loads(path.read_text())
    document["records"][0]["environment"].update(
        cpu_model="Intel Xeon Gold 6148", cpu_native={"bf16": False, "fp16": False}
    )
    write_json(path, document)
    summary = summarized(results, {**CONFIG, "precision": "measured"})
    flags = {b["precision"]: b["flags"] for b in summary["benchmarks"]}
    expected = (
        "timed on another CPU than the environment check described: Intel Xeon Gold 6148 "
        "(bf16 not native), not AMD EPYC (bf16 native); pin one node type for the whole run "
        "(docs/cluster.md)"
    )
    assert flags == {"bf16": [expected], "fp32": []}
    cautions = summary["answer"]["chosen"]["cautions"]
    assert {"setting": "CPU bf16", "flags": [expected]} in cautions


def test_a_cuda_benchmark_timed_on_another_gpu_than_env_json_lists_is_flagged(
    tmp_path: Path,
) -> None:
    results = write_results_tree(tmp_path)
    path = results / "bench" / "cuda-fp16-train.json"
    document = json.loads(path.read_text())
    document["records"][0]["device_description"] = "CUDA: Tesla V100-SXM2-32GB, 32 GiB, sm_70"
    write_json(path, document)
    flags = {
        (b["backend"], b["precision"], b["mode"]): b["flags"]
        for b in summarized(results)["benchmarks"]
    }
    assert flags[("cuda", "fp16", "train")] == [
        "timed on another GPU than the environment check described: CUDA: Tesla V100-SXM2-32GB, "
        "32 GiB, sm_70, not NVIDIA Fake H100; pin one GPU model for the whole run "
        "(cluster.gpu_model, docs/cluster.md)"
    ]
    assert not [flag for key, found in flags.items() if key[0] == "cuda" for flag in found
                if key != ("cuda", "fp16", "train") and "another GPU" in flag]  # fmt: skip


def test_each_run_keeps_its_time_and_leads_with_its_held_out_f1(tmp_path: Path) -> None:
    results = write_results_tree(tmp_path)
    document = evaluation("cpu", "fp32", 0.42)
    point = {"threshold": 0.35, "picked_on": "val", "applied_to": "test", "f1": 0.44}
    document.update(
        split="test",
        metrics_split="test",
        operating_point={**point, "f1_interval": ap_interval(0.44, 0.01)},
    )
    write_json(results / "eval" / "cpu-fp32.json", document)
    runs = {run["name"]: run for run in summarized(results)["runs"]}
    cpu = runs["cpu-fp32"]
    assert (cpu["precision"], cpu["epochs"], cpu["steps"]) == ("fp32", 3, 6)
    assert (cpu["wall_time_s"], cpu["epoch_time_s"], cpu["median_step_ms"]) == (12.5, 0.4, 100.0)
    assert cpu["scores"]["f1"] == 0.44 and cpu["scores"]["f1_threshold"] == "validation"
    assert cpu["scores"]["f1_interval"]["low"] == pytest.approx(0.43)
    assert cpu["scores"]["split"] == "test" and cpu["evaluation"]["held_out"] is True
    assert [row["name"] for row in cpu["evaluation"]["per_class"]] == [
        "circle",
        "<script>alert(1)</script>",
    ]
    # no test split: F1 at the score threshold leads, named so (not the best F1 on val)
    cuda = runs["cuda-fp16"]["scores"]
    assert (cuda["f1"], cuda["f1_threshold"], cuda["split"]) == (0.61, "score threshold", "val")
    assert runs["cuda-fp16"]["best_validation_f1"] == {"value": 0.61, "epoch": 3}


def full_config(*settings: str) -> dict[str, Any]:
    return config.load_config([], settings)


@pytest.mark.parametrize(
    "setting",
    [
        "data.num_workers=3",
        "data.cache=false",
        "eval.batch_size=7",
        "device=cpu",
        "cpu_threads=2",
        "bench.steps=9",
        "profile.repeats=9",
        "cluster.threads=8",
        "data.root=/scratch/elsewhere",  # where the built-in set is generated
    ],
)
def test_the_accuracy_hash_ignores_where_and_how_fast_a_run_went(setting: str) -> None:
    reference = build.accuracy_basis(full_config())
    assert build.accuracy_basis(full_config(setting))["hash"] == reference["hash"]


@pytest.mark.parametrize(
    "setting",
    [
        "data.synthetic.num_test=512",
        "train.epochs=3",
        "eval.score_threshold=0.55",
        "model.width=16",
        "seed=1",
        "precision=fp32",  # the shipped default is measured
    ],
)
def test_the_accuracy_hash_changes_with_what_the_figures_depend_on(setting: str) -> None:
    reference = build.accuracy_basis(full_config())
    changed = build.accuracy_basis(full_config(setting))
    assert changed["hash"] != reference["hash"]
    assert setting_groups.differing_keys(reference["settings"], changed["settings"])


def test_a_user_data_sets_summary_records_its_annotation_files_digests(tmp_path: Path) -> None:
    data = tmp_path / "coco"
    data.mkdir()
    for split in ("train", "val"):
        (data / f"instances_{split}.json").write_text(f'{{"images": [], "split": "{split}"}}')
    settings = full_config("data.format=coco", f"data.root={data}")
    summary = summarized(write_results_tree(tmp_path / "results"), settings)  # schema-checked
    digests = summary["comparison"]["accuracy"]["annotations"]
    assert set(digests) == {"train", "val"} and digests["train"] != digests["val"]
    assert summary["synthetic_data"] is False


def test_a_voc_splits_digest_changes_with_any_of_its_xml_files(tmp_path: Path) -> None:
    main = tmp_path / "ImageSets" / "Main"
    main.mkdir(parents=True)
    (tmp_path / "Annotations").mkdir()
    for split in ("train", "val"):
        (main / f"{split}.txt").write_text(f"{split}1\n")
        (tmp_path / "Annotations" / f"{split}1.xml").write_text("<annotation/>")
    settings = full_config("data.format=voc", f"data.root={tmp_path}")
    before = build.accuracy_basis(settings)
    (tmp_path / "Annotations" / "train1.xml").write_text("<annotation><object/></annotation>")
    after = build.accuracy_basis(settings)
    assert after["annotations"]["train"] != before["annotations"]["train"]
    assert after["hash"] != before["hash"]


def test_the_speed_hash_is_what_the_training_benchmarks_timed() -> None:
    records = [bench_record("cpu", "fp32", "train", 10.0)]
    frame = load.bench_frame([(record, Path("bench/a.json")) for record in records])
    basis = build.speed_basis(frame, "tiny_conv")
    assert basis["settings"]["batch_size"] == 16 and basis["settings"]["image_size"] == 128
    records[0]["batch_size"] = 4
    smaller = build.speed_basis(load.bench_frame([(records[0], Path("a.json"))]), "tiny_conv")
    assert smaller["hash"] != basis["hash"]
    assert build.speed_basis(frame, None) is None


def test_the_commit_is_the_checkouts_and_says_whether_files_differ(tmp_path: Path) -> None:
    assert load.git_state(tmp_path) == {"id": None, "changed": None, "untracked": None}
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.txt").write_text("a")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "a"], check=True)
    (tmp_path / "b.txt").write_text("b")
    state = load.git_state(tmp_path)
    assert len(state["id"]) == 40 and (state["changed"], state["untracked"]) == (0, 1)


@pytest.mark.parametrize("made", ["nothing", "a file"])
def test_a_results_folder_that_is_missing_or_a_file_is_named_as_such(
    tmp_path: Path, made: str
) -> None:
    root = tmp_path / "results"
    if made == "a file":
        root.write_text("not a folder\n")
    what = "is a file, not a folder" if made == "a file" else "does not exist"
    with pytest.raises(PipelineError) as raised:
        load.load_results(root)
    assert str(raised.value) == (
        f"Results folder {root} {what}: run the workflow first (snakemake --cores 1), or pass "
        "--results DIR."
    )


def test_without_a_config_the_summary_has_no_accuracy_basis(tmp_path: Path) -> None:
    summary = summarized(write_results_tree(tmp_path), settings=None)
    assert summary["comparison"]["accuracy"] is None and summary["synthetic_data"] is None
    assert summary["comparison"]["speed"] is not None


def test_the_report_shows_the_summarys_decisions_instead_of_deciding_again(
    tmp_path: Path,
) -> None:
    results = write_results_tree(tmp_path)
    summary = summarized(results)
    summary["answer"]["chosen"]["vs_cpu_fp32"]["text"] = "edited in the summary"
    summary["amp_policy"][0]["verdict"] = "an edited verdict"
    (results / "summary.json").write_text(json.dumps(summary))
    render.build(results, tmp_path / "report.html")
    page = Page()
    page.feed((tmp_path / "report.html").read_text(encoding="utf-8"))
    assert "train with CUDA fp16: edited in the summary than CPU fp32" in page.text("answer")
    assert "an edited verdict" in page.text("amp-policy")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist"),
        ("{not json", "is not a summary: it is not valid JSON"),
        (json.dumps({"format": "pipeline.eval/1"}), "is a file of format pipeline.eval/1, where"),
        (json.dumps({"format": "pipeline.summary/2"}), "is a file of format pipeline.summary/2"),
        (json.dumps([1]), "is not a pipeline summary, where a summary of format"),
        (
            json.dumps({"format": "pipeline.summary/1"}),
            "is not a summary this version reads: it does not match summary.schema.yaml",
        ),
    ],
)
def test_a_file_that_is_not_a_summary_is_refused_naming_it(
    tmp_path: Path, content: str | None, message: str
) -> None:
    path = tmp_path / "machine.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ResultsFileError, match=message) as raised:
        read_summary(path)
    assert str(path) in str(raised.value)


def test_boxes_are_drawn_above_the_evaluations_threshold_else_the_configs() -> None:
    evaluated = {"evaluation": {"score_threshold": 0.5}}
    assert run_views.score_threshold(evaluated, {"eval": {"score_threshold": 0.4}}) == 0.5
    assert (
        run_views.score_threshold({"evaluation": None}, {"eval": {"score_threshold": 0.4}}) == 0.4
    )
    assert run_views.score_threshold(None, None) == run_views.DEFAULT_SCORE_THRESHOLD
