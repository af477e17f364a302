"""`python -m pipeline compare`: machines side by side from their summaries, figures compared
only where comparable, the same Markdown for the same summaries, and bad input refused.

The summaries are hand-made from one that `summarize` wrote of report_fixtures' tree: another
machine description, other settings, another timed configuration.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from report_fixtures import write_results_tree
from report_page import Page, assert_self_contained

from pipeline import cli, config
from pipeline.compare import compare, markdown, read_machines
from pipeline.summary import build
from pipeline.summary.build import settings_hash

pytestmark = pytest.mark.usefixtures("restore_pipeline_logger")
SCRIPT = "<script>alert(1)</script>"
CONFIG = {"data": {"format": "synthetic", "synthetic": {"num_test": 16}}, "train": {"epochs": 2}}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A summary of the fixture tree: a machine with an NVIDIA Fake H100, CUDA fp16 chosen."""
    results = write_results_tree(tmp_path_factory.mktemp("base"))
    args = ["summarize", "--results", str(results), "--config-json", json.dumps(CONFIG)]
    assert cli.main(args) == 0
    return json.loads((results / "summary.json").read_text())


def cpu_machine(summary: dict[str, Any], cpu_model: str = "Intel Xeon (AMX)") -> dict[str, Any]:
    """The same results as if measured on a machine without a GPU."""
    other = copy.deepcopy(summary)
    other["machine"].update(cpu_model=cpu_model, gpus=[])
    return other


def with_settings(summary: dict[str, Any], aspect: str, path: str, value: Any) -> dict[str, Any]:
    """`summary` whose `aspect` (speed or accuracy) settings have `path` set to `value`."""
    basis = summary["comparison"][aspect]
    node = basis["settings"]
    *parents, last = path.split(".")
    for part in parents:
        node = node[part]
    node[last] = value
    basis["hash"] = settings_hash(basis["settings"])
    return summary


def write(tmp_path: Path, name: str, summary: Any) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(summary) if not isinstance(summary, str) else summary)
    return path


def sections(*paths: Path) -> dict[str, Any]:
    return {section.id: section for section in compare(read_machines(paths))}


def test_machines_of_equal_settings_are_compared_side_by_side(
    tmp_path: Path, base: dict[str, Any]
) -> None:
    found = sections(
        write(tmp_path, "gpu.json", base), write(tmp_path, "cpu.json", cpu_machine(base))
    )
    (machines,) = found["machines"].tables
    assert machines.headers == ["", "Intel Xeon (AMX)", "NVIDIA Fake H100"]  # sorted by name
    assert machines.rows[3] == [
        "GPUs",
        "none",
        "NVIDIA Fake H100 (79.6 GiB, compute capability 9.0)",
    ]
    (answers,) = found["answers"].tables
    assert answers.rows[1] == [
        "NVIDIA Fake H100",
        "CUDA fp16",
        "25.0× (24.23–25.74)",
        "acceptable",
        "yes",
    ]
    speed, _, _ = found["speed"].tables  # then each machine against the first (below)
    assert speed.rows[1] == ["train", "CUDA", "fp16", *["4.00 ms, 25.0× (24.23–25.74)"] * 2]
    assert speed.rows[6] == ["train", "CPU", "fp32", *["100 ms, the baseline"] * 2]
    (training,) = found["training"].tables
    assert [row[:2] for row in training.rows] == [
        ["Intel Xeon (AMX)", "cuda-fp16"],
        ["Intel Xeon (AMX)", "cpu-fp32"],
        ["NVIDIA Fake H100", "cuda-fp16"],
        ["NVIDIA Fake H100", "cpu-fp32"],
    ]
    assert training.rows[1][2:] == [
        "3",
        "0.4 s",
        "12.5 s",
        "0.420 (0.412–0.427) (val)",
        "0.378 (0.358–0.398)",
    ]
    assert not any(section.notes for section in found.values())


def test_accuracy_of_other_settings_is_not_compared_and_the_page_says_what_differs(
    tmp_path: Path, base: dict[str, Any]
) -> None:
    other = with_settings(cpu_machine(base), "accuracy", "data.synthetic.num_test", 24)
    other = with_settings(other, "accuracy", "train.epochs", 5)
    found = sections(write(tmp_path, "gpu.json", base), write(tmp_path, "cpu.json", other))
    assert found["training"].tables == []
    assert found["training"].notes == [
        "Not compared: Intel Xeon (AMX) with NVIDIA Fake H100: they ran different settings "
        "(data.synthetic.num_test: 24 vs 16; train.epochs: 5 vs 2)."
    ]
    assert len(found["speed"].tables) == 3 and not found["speed"].notes  # speed still is


def test_speed_of_another_timed_configuration_is_not_compared(
    tmp_path: Path, base: dict[str, Any]
) -> None:
    other = with_settings(cpu_machine(base), "speed", "batch_size", 4)
    found = sections(write(tmp_path, "gpu.json", base), write(tmp_path, "cpu.json", other))
    assert found["speed"].tables == []
    why = "they timed different configurations (batch_size: 4 vs 16)."
    assert found["speed"].notes == [f"Not compared: Intel Xeon (AMX) with NVIDIA Fake H100: {why}"]
    assert found["answers"].notes == found["speed"].notes  # the answers' speed-ups too
    assert len(found["training"].tables) == 1


def slower(summary: dict[str, Any], factor: float) -> dict[str, Any]:
    """`summary` as if every benchmark had stepped `factor` times as long."""
    for entry in summary["benchmarks"]:
        entry["samples_ms"] = [ms * factor for ms in entry["samples_ms"]]
        entry["median_ms"] = None if entry["median_ms"] is None else entry["median_ms"] * factor
    return summary


def interval_of(cell: str) -> tuple[float, float, float]:
    """'2.00× (1.95–2.05)...' as (ratio, low, high)."""
    ratio, rest = cell.split("× (")
    low, high = rest.split(")")[0].split("–")
    return float(ratio), float(low), float(high)


def test_a_machine_stepping_faster_reads_faster_than_the_reference_with_its_interval(
    tmp_path: Path, base: dict[str, Any]
) -> None:
    reference = slower(cpu_machine(base), 2.0)  # first by name, so the reference
    found = sections(write(tmp_path, "gpu.json", base), write(tmp_path, "cpu.json", reference))
    _, answers, settings = found["speed"].tables
    assert answers.title == "Each machine's answer against Intel Xeon (AMX)'s answer"
    assert [row[:3] for row in answers.rows] == [
        ["Intel Xeon (AMX)", "CUDA fp16", "8.00 ms"],
        ["NVIDIA Fake H100", "CUDA fp16", "4.00 ms"],
    ]
    assert answers.rows[0][3] == "the reference"
    ratio, low, high = interval_of(answers.rows[1][3])
    assert ratio == 2.0 and 1.05 < low < ratio < high  # faster: no verdict word, as elsewhere
    assert not answers.rows[1][3].endswith(("slower", "indistinguishable"))
    assert settings.headers == ["Mode", "Backend", "Precision", "NVIDIA Fake H100"]
    cpu_fp32 = next(row for row in settings.rows if row[:3] == ["train", "CPU", "fp32"])
    assert interval_of(cpu_fp32[3])[0] == 2.0
    assert next(row for row in settings.rows if row[1:3] == ["MPS", "bf16"])[3] == "skipped on one"
    # the other way round, the reference is the faster one: the GPU machine reads slower
    found = sections(
        write(tmp_path, "gpu.json", slower(copy.deepcopy(base), 2.0)),
        write(tmp_path, "cpu.json", cpu_machine(base)),
    )
    cell = found["speed"].tables[1].rows[1][3]
    ratio, low, high = interval_of(cell)
    assert ratio == 0.5 and low < ratio < high < 1 / 1.05 and cell.endswith(", slower")


def test_two_machines_of_the_same_step_times_read_indistinguishable(
    tmp_path: Path, base: dict[str, Any]
) -> None:
    found = sections(
        write(tmp_path, "gpu.json", base), write(tmp_path, "cpu.json", cpu_machine(base))
    )
    _, answers, settings = found["speed"].tables
    cells = [answers.rows[1][3], *(row[3] for row in settings.rows if row[3] != "skipped on one")]
    assert len(cells) == len(settings.rows)  # the answer, every setting less the skipped one
    for cell in cells:
        ratio, low, high = interval_of(cell)
        assert ratio == 1.0 and low < 1 < high and cell.endswith(", indistinguishable")


def in_instances(summary: dict[str, Any], modes: list[float]) -> dict[str, Any]:
    """`summary` as if each benchmark had timed one model instance per mode, each stepping its
    mode times the benchmark's median, its steps 1% apart."""
    for entry in summary["benchmarks"]:
        if entry["median_ms"] is not None:
            entry["samples_ms"] = [
                entry["median_ms"] * mode * (1 + 0.01 * step) for mode in modes for step in range(5)
            ]
            entry["instances"] = [k for k, _ in enumerate(modes) for _ in range(5)]
    return summary


def test_across_machines_each_benchmarks_model_instances_are_resampled(
    tmp_path: Path, base: dict[str, Any]
) -> None:
    """Models that settled in speed modes of their own: the steps of each are no independent
    draws, and the interval over instances, then steps, is wider than over the steps alone."""
    modes = [0.8, 1.0, 1.25, 0.9, 1.1, 1.2]
    gpu = in_instances(copy.deepcopy(base), modes)
    cpu = in_instances(cpu_machine(base), modes[::-1])

    def answer_interval(*summaries: dict[str, Any]) -> float:
        paths = [write(tmp_path, f"{k}.json", summary) for k, summary in enumerate(summaries)]
        _, low, high = interval_of(sections(*paths)["speed"].tables[1].rows[1][3])
        return high - low

    over_instances = answer_interval(gpu, cpu)
    for summary in (gpu, cpu):
        for entry in summary["benchmarks"]:
            entry.pop("instances", None)
    assert over_instances > 1.5 * answer_interval(gpu, cpu)


def without_step_times(summary: dict[str, Any]) -> dict[str, Any]:
    """`summary` as summaries were made before they carried each benchmark's step times."""
    for entry in summary["benchmarks"]:
        del entry["samples_ms"]
    return summary


@pytest.mark.parametrize("older_is_the_reference", [True, False])
def test_a_summary_without_step_times_gets_no_ratio_across_machines_and_says_why(
    tmp_path: Path, base: dict[str, Any], older_is_the_reference: bool
) -> None:
    older, newer = slower(cpu_machine(base), 2.0), copy.deepcopy(base)  # Intel Xeon sorts first
    older, newer = (older, newer) if older_is_the_reference else (newer, older)
    found = sections(
        write(tmp_path, "a.json", without_step_times(older)), write(tmp_path, "b.json", newer)
    )
    speed, answers = found["speed"].tables  # and no table where every cell would be the same
    assert speed.rows[6] == ["train", "CPU", "fp32", "200 ms, the baseline", "100 ms, the baseline"]
    assert (
        answers.rows[1][3] == "no interval can be given: a summary holds no step times (see below)"
    )
    assert "×" not in answers.rows[0][3] + answers.rows[1][3]  # never a bare ratio of medians
    name = "Intel Xeon (AMX)" if older_is_the_reference else "NVIDIA Fake H100"
    assert found["speed"].notes == [
        f"No speed against another machine is given for {name}: its summary predates "
        "summaries carrying each benchmark's step times, without which the ratio of median "
        "step times has no interval, and a ratio without its interval is no verdict. Rerun "
        "python -m pipeline summarize on that machine's results folder (its bench/*.json hold "
        "the step times) to compare it."
    ]


def test_a_machine_without_step_times_among_others_says_so_in_each_of_its_cells(
    tmp_path: Path, base: dict[str, Any]
) -> None:
    paths = [
        write(tmp_path, "gpu.json", base),
        write(tmp_path, "cpu.json", cpu_machine(base)),
        write(tmp_path, "old.json", without_step_times(cpu_machine(base, "Xeon W-2245"))),
    ]
    speed = sections(*paths)["speed"]
    _, answers, settings = speed.tables
    assert answers.title == "Each machine's answer against Intel Xeon (AMX)'s answer"
    assert settings.headers[3:] == ["NVIDIA Fake H100", "Xeon W-2245"]
    none = "no interval can be given: a summary holds no step times (see below)"
    assert answers.rows[2][3] == none and answers.rows[1][3].endswith(", indistinguishable")
    assert {row[4] for row in settings.rows} == {none, "skipped on one"}
    assert all(row[3].endswith(("indistinguishable", "skipped on one")) for row in settings.rows)
    assert len(speed.notes) == 1 and "given for Xeon W-2245: its summary" in speed.notes[0]


def test_a_summary_without_settings_is_compared_with_nothing(
    tmp_path: Path, base: dict[str, Any]
) -> None:
    unknown = cpu_machine(base)
    unknown["comparison"]["accuracy"] = None
    twin = cpu_machine(base, "Intel Xeon (twin)")
    twin["comparison"]["accuracy"] = None
    paths = [write(tmp_path, f"{n}.json", s) for n, s in (("a", base), ("b", unknown), ("c", twin))]
    found = sections(*paths)
    assert found["training"].tables == []
    assert found["training"].notes == [  # two without settings are not alike either
        "Not compared: Intel Xeon (AMX) with Intel Xeon (twin): Intel Xeon (AMX) and Intel Xeon "
        "(twin) record no settings to compare by (summarised without a config).",
        "Not compared: Intel Xeon (AMX) with NVIDIA Fake H100: Intel Xeon (AMX) records no "
        "settings to compare by (summarised without a config).",
    ]


def test_three_machines_two_alike_compare_the_two(tmp_path: Path, base: dict[str, Any]) -> None:
    other = with_settings(cpu_machine(base, "AMD EPYC 9654"), "accuracy", "seed", 3)
    paths = [
        write(tmp_path, "gpu.json", base),
        write(tmp_path, "cpu.json", cpu_machine(base)),
        write(tmp_path, "epyc.json", other),
    ]
    training = sections(*paths)["training"]
    (table,) = training.tables
    assert {row[0] for row in table.rows} == {"Intel Xeon (AMX)", "NVIDIA Fake H100"}
    assert training.notes == [
        "Not compared: AMD EPYC 9654 with Intel Xeon (AMX) and NVIDIA Fake H100: they ran "
        "different settings (seed: 3 vs None)."
    ]


def test_machines_of_one_cpu_model_are_named_by_what_tells_them_apart(
    tmp_path: Path, base: dict[str, Any]
) -> None:
    vm = cpu_machine(base, "Intel(R) Xeon(R) Processor")
    vm["machine"].update(
        cpu_count=2, memory_gib=7.8, cpu_native={"bf16": {"native": True, "evidence": "amx"}}
    )
    other = copy.deepcopy(vm)
    other["machine"].update(cpu_count=8, memory_gib=31.3, cpu_native={})
    other["comparison"]["accuracy"] = None  # not a copy of vm
    paths = [write(tmp_path, "a.json", vm), write(tmp_path, "b.json", other)]
    assert [m.name for m in read_machines(paths)] == [
        "Intel(R) Xeon(R) Processor (native bf16, 2 cores, 7.8 GiB memory)",
        "Intel(R) Xeon(R) Processor (no native bf16 or fp16, 8 cores, 31.3 GiB memory)",
    ]
    twin = copy.deepcopy(vm)
    twin["comparison"]["speed"] = None  # the same machine, another run
    paths.append(write(tmp_path, "c.json", twin))
    assert [m.name for m in read_machines(paths)][:2] == [
        f"Intel(R) Xeon(R) Processor (native bf16, 2 cores, 7.8 GiB memory) ({paths[0]})",
        f"Intel(R) Xeon(R) Processor (native bf16, 2 cores, 7.8 GiB memory) ({paths[2]})",
    ]
    del twin["machine"]["memory_gib"]  # an env.json made before it was recorded
    paths[2] = write(tmp_path, "c.json", twin)
    assert [m.name for m in read_machines(paths)][:2] == [
        "Intel(R) Xeon(R) Processor (native bf16, 2 cores, 7.8 GiB memory)",
        "Intel(R) Xeon(R) Processor (native bf16, 2 cores, memory not recorded)",
    ]


def at_commit(summary: dict[str, Any], commit: str, changed: int = 0) -> dict[str, Any]:
    other = copy.deepcopy(summary)
    other["commit"] = {"id": commit * 40, "changed": changed, "untracked": 0}
    return other


@pytest.mark.parametrize(
    ("gpu", "cpu", "made"),
    [
        (
            ("a", 0),
            ("b", 0),
            "Intel Xeon (AMX): commit bbbbbbbbbbbb; NVIDIA Fake H100: commit aaaaaaaaaaaa",
        ),
        (
            ("a", 0),
            ("a", 2),
            "Intel Xeon (AMX): commit aaaaaaaaaaaa (2 file(s) changed or untracked); "
            "NVIDIA Fake H100: commit aaaaaaaaaaaa",
        ),
    ],
)
def test_figures_of_different_code_side_by_side_say_so(
    tmp_path: Path, base: dict[str, Any], gpu: tuple[str, int], cpu: tuple[str, int], made: str
) -> None:
    found = sections(
        write(tmp_path, "gpu.json", at_commit(base, *gpu)),
        write(tmp_path, "cpu.json", at_commit(cpu_machine(base), *cpu)),
    )
    note = (
        f"The code may differ ({made}): these figures may differ by the code, "
        "not only by the machine."
    )
    assert [found[part].notes for part in ("answers", "speed", "training")] == [[note]] * 3


def test_figures_of_one_clean_commit_side_by_side_say_nothing_of_code(
    tmp_path: Path, base: dict[str, Any]
) -> None:
    found = sections(
        write(tmp_path, "gpu.json", at_commit(base, "a")),
        write(tmp_path, "cpu.json", at_commit(cpu_machine(base), "a")),
    )
    assert not any(section.notes for section in found.values())


def on_coco(summary: dict[str, Any], root: Path) -> dict[str, Any]:
    """`summary` as if summarised of a run on the COCO data set at `root`."""
    other = copy.deepcopy(summary)
    settings = config.load_config([], ["data.format=coco", f"data.root={root}"])
    other["comparison"]["accuracy"] = build.accuracy_basis(settings)
    other["synthetic_data"] = False
    return other


def coco_set(root: Path, category: str) -> Path:
    """A COCO data set's annotation files (no images: the digests read annotations alone)."""
    root.mkdir(parents=True, exist_ok=True)
    document = {"images": [], "annotations": [], "categories": [{"id": 1, "name": category}]}
    for split in ("train", "val"):
        (root / f"instances_{split}.json").write_text(json.dumps(document))
    return root


def test_the_same_annotations_at_other_paths_are_compared_and_other_ones_at_one_path_are_not(
    tmp_path: Path, base: dict[str, Any]
) -> None:
    here = on_coco(base, coco_set(tmp_path / "mnt" / "data", "cat"))
    there = on_coco(cpu_machine(base), coco_set(tmp_path / "scratch" / "copy", "cat"))
    (table,) = sections(write(tmp_path, "a.json", here), write(tmp_path, "b.json", there))[
        "training"
    ].tables
    assert {row[0] for row in table.rows} == {"Intel Xeon (AMX)", "NVIDIA Fake H100"}

    coco_set(tmp_path / "scratch" / "copy", "dog")  # other annotations at the same path
    relabelled = on_coco(cpu_machine(base), tmp_path / "scratch" / "copy")
    training = sections(write(tmp_path, "b.json", there), write(tmp_path, "c.json", relabelled))[
        "training"
    ]
    assert training.tables == []
    (note,) = training.notes
    new, old = relabelled["comparison"]["accuracy"], there["comparison"]["accuracy"]
    assert note.startswith("Not compared: Intel Xeon (AMX) (")
    assert note.endswith(
        f"they ran different settings (annotations.train: {old['annotations']['train'][:12]} vs "
        f"{new['annotations']['train'][:12]}; annotations.val: "
        f"{old['annotations']['val'][:12]} vs {new['annotations']['val'][:12]})."
    )


def test_a_summary_of_user_data_without_digests_says_it_compares_by_paths(
    tmp_path: Path, base: dict[str, Any]
) -> None:
    older = on_coco(cpu_machine(base), coco_set(tmp_path / "data", "cat"))
    del older["comparison"]["accuracy"]["annotations"]
    training = sections(write(tmp_path, "a.json", base), write(tmp_path, "b.json", older))[
        "training"
    ]
    assert training.notes[-1].startswith(
        "Intel Xeon (AMX) records no digest of its annotation files (a summary made before they "
        "were recorded, or where they could not be read): its data set is told apart by its "
        "paths alone"
    )


def test_the_markdown_is_the_same_for_the_same_summaries_in_any_order(
    tmp_path: Path, base: dict[str, Any]
) -> None:
    paths = [write(tmp_path, "gpu.json", base), write(tmp_path, "cpu.json", cpu_machine(base))]
    text = markdown(paths)
    assert text == markdown(paths[::-1]) == markdown(paths)
    assert "| Machine | Train with |" in text and base["created"] not in text
    # a document embedding the table between markers is regenerated to the same text
    document = f"intro\n<!-- machines:start -->\n{text}<!-- machines:end -->\n"
    embedded = document.split("<!-- machines:start -->\n")[1].split("<!-- machines:end -->")[0]
    assert embedded == markdown(paths[::-1])


def test_the_cli_writes_html_and_markdown_and_escapes_what_files_hold(
    tmp_path: Path, base: dict[str, Any], capsys: pytest.CaptureFixture
) -> None:
    paths = [
        write(tmp_path, "gpu.json", base),
        write(tmp_path, "cpu.json", cpu_machine(base, f"CPU {SCRIPT} | pipe")),
    ]
    out, table = tmp_path / "compare.html", tmp_path / "compare.md"
    assert cli.main(["compare", *map(str, paths), "--out", str(out), "--markdown", str(table)]) == 0
    source = out.read_text(encoding="utf-8")
    page = Page()
    page.feed(source)
    assert [attrs.get("id") for tag, attrs in page.tags if tag == "section"] == [
        "machines",
        "answers",
        "speed",
        "training",
    ]
    assert_self_contained(source, page, min_images=0)
    assert f"CPU {SCRIPT} | pipe" in page.text("machines")
    assert "CPU &lt;script&gt;alert(1)&lt;/script&gt; \\| pipe" in table.read_text()
    assert cli.main(["compare", *map(str, paths), "--markdown"]) == 0
    assert capsys.readouterr().out == table.read_text()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist"),
        (
            '{"format": "pipeline.summary/2"}',
            "is a file of format pipeline.summary/2, where a summary",
        ),
        ('{"format": "pipeline.env/1"}', "is a file of format pipeline.env/1"),
        ("[]", "is not a pipeline summary"),
    ],
)
def test_bad_input_exits_2_naming_the_file_and_writes_nothing(
    tmp_path: Path,
    base: dict[str, Any],
    content: str | None,
    message: str,
    capsys: pytest.CaptureFixture,
) -> None:
    good = write(tmp_path, "good.json", base)
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content)
    out = tmp_path / "compare.html"
    assert cli.main(["compare", str(good), str(bad), "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert f"{bad} {message}" in error or f"{bad} does not exist" in error
    assert message in error and len(error.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("second", ["same file", "copy"])
def test_a_summary_named_twice_or_copied_is_refused_naming_both(
    tmp_path: Path, base: dict[str, Any], second: str, capsys: pytest.CaptureFixture
) -> None:
    first = write(tmp_path, "a.json", base)
    again = tmp_path / "." / "a.json" if second == "same file" else write(tmp_path, "b.json", base)
    out = tmp_path / "compare.html"
    assert cli.main(["compare", str(first), str(again), "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert f"{again} " in error and f"as {first}: compare sets different runs" in error
    assert len(error.strip().splitlines()) == 1 and not out.exists()


def test_compare_without_an_output_is_a_user_error(
    tmp_path: Path, base: dict[str, Any], capsys: pytest.CaptureFixture
) -> None:
    assert cli.main(["compare", str(write(tmp_path, "a.json", base))]) == 2
    assert "compare writes nothing without --out FILE.html or --markdown" in capsys.readouterr().err
