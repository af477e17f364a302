"""The report's outline for six results trees, kept in tests/data/report_golden.json.

`test_report_golden.py` builds the same reports and compares their outlines (sections, headings,
tables cell by cell, figures by alt text and caption, and each section's text) with the file,
so a change of the report's code that changes what it shows fails there. After a change of the
report's content made on purpose, regenerate the file and review its diff:

    PYTHONPATH=src .venv/bin/python tests/report_golden.py
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))  # report_fixtures and report_page, run as a script

from report_fixtures import (
    BENCH,
    bench_record,
    env_json,
    evaluation,
    metrics_rows,
    predictions,
    profile,
    train_summary,
    write_json,
    write_results_tree,
)
from report_page import Outline

from pipeline import cli

GOLDEN = Path(__file__).parent / "data" / "report_golden.json"
CONFIG = {
    "model": {"name": "tiny_conv"},
    "precision": "auto",
    "eval": {"score_threshold": 0.3},
    "note": "</pre><script>x()</script>",
}
# what differs from one build to the next: clock times (the summary's 'created' among them),
# the git state, the temporary folder
VOLATILE = (
    (re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} UTC"), "<time>"),
    (re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\+00:00"), "<created>"),
    (re.compile(r"\b[0-9a-f]{40}\b"), "<commit>"),
    (
        re.compile(r"working tree (clean|dirty: \d+ changed and \d+ untracked file\(s\)|unknown)"),
        "working tree <state>",
    ),
)


def full_tree(root: Path) -> tuple[Path, list[str]]:
    """The fixture tree, with the test config: every section has something to show."""
    return write_results_tree(root), ["--config-json", json.dumps(CONFIG)]


def swept_tree(root: Path) -> tuple[Path, list[str]]:
    """The fixture tree plus a copy of the cpu-fp32 run as a swept run: runs are compared."""
    results = write_results_tree(root)
    source = results / "train" / "cpu-fp32"
    swept = results / "train" / "cpu-fp32+seed=1+lr=0.01"
    swept.mkdir()
    for item in source.iterdir():
        (swept / item.name).write_bytes(item.read_bytes())
    return results, []


def sparse_tree(root: Path) -> tuple[Path, list[str]]:
    """One skipped benchmark and nothing else: every section says what is missing."""
    results = root / "results"
    skipped = next(record for record in BENCH if record["status"] == "skipped")
    write_json(
        results / "bench" / "mps-bf16-train.json",
        {"format": "pipeline.bench/2", "records": [skipped]},
    )
    return results, []


def write_bench(results: Path, records: list[dict[str, Any]]) -> None:
    for index, record in enumerate(records):
        name = f"{record['backend']}-{record['precision']}-{record['mode']}-{index}.json"
        write_json(results / "bench" / name, {"format": "pipeline.bench/2", "records": [record]})


def cpu_policy_tree(root: Path) -> tuple[Path, list[str]]:
    """A CPU-only machine where bf16 is faster but the AMP policy rules it out, two models,
    flagged timings, and runs with pieces missing (no summary, a cut-off metrics line, no
    per-class results, a missing trace, no operator profile, many unreadable images)."""
    results = root / "results"
    env = env_json()
    env["backends"]["cuda"].update(available=False, reason="torch was built without CUDA")
    env["backends"]["mps"].update(available=False, reason="MPS needs an Apple-silicon Mac")
    env.update(auto="cpu", available=["cpu"], cuda={"built": False}, mps={"built": False})
    write_json(results / "env.json", env)
    fp32 = bench_record("cpu", "fp32", "train", 100.0)
    fp32["timing"].update(noisy=True, iqr_ratio=0.18, budget_limited=True, count=7)
    fp16 = bench_record("cpu", "fp16", "train", 1500.0)
    fp16["numerics"] = None
    bf16_infer = bench_record("cpu", "bf16", "infer", 12.0)
    bf16_infer["numerics"]["outputs"]["heatmap"]["max_rel_diff"] = None
    other_model = bench_record("cpu", "fp32", "train", 400.0)
    other_model["model"] = "resnet18"
    records = [fp32, fp16, bench_record("cpu", "bf16", "train", 60.0), bf16_infer, other_model]
    write_bench(results, records)
    run = results / "train" / "cpu-fp32"
    write_json(run / "train_summary.json", train_summary("cpu", "fp32", 0.5))
    rows = metrics_rows([9.0, 8.0, 7.0, 6.0], [0.3, 0.5])
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps(row) + "\n" for row in rows) + '{"type": "st', encoding="utf-8"
    )
    unsummarised = results / "train" / "cpu-bf16"
    (unsummarised / "metrics.jsonl").parent.mkdir(parents=True)
    (unsummarised / "metrics.jsonl").write_text(
        "".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8"
    )
    for name in ("cpu-fp32", "cpu-bf16"):
        scores = evaluation("cpu", name.split("-")[1], 0.5)
        del scores["metrics"]["per_class"]
        write_json(results / "eval" / f"{name}.json", scores)
    images = [str(root / "images" / f"missing_{index}.png") for index in range(7)]
    write_json(results / "eval" / "cpu-bf16_predictions.json", predictions(images))
    without_operators = profile("cpu", "fp32")
    del without_operators["profiler"]
    write_json(results / "profile" / "cpu-fp32" / "profile.json", without_operators)
    noted = profile("cpu", "bf16")
    noted["profiler"].update(top_operators=[], note="torch.profiler has no MPS activity")
    noted["settings"]["flip_test"] = True
    write_json(results / "profile" / "cpu-bf16" / "profile.json", noted)
    config = {"precision": "fp16", "model": {"name": "absent"}, "bench": {"models": ["tiny_conv"]}}
    return results, ["--config-json", json.dumps(config)]


def nothing_safe_tree(root: Path) -> tuple[Path, list[str]]:
    """Every training benchmark failed the numerics check, and one backend has no AMP policy."""
    results = root / "results"
    env = env_json()
    del env["backends"]["mps"]["resolved_amp"], env["backends"]["mps"]["precisions"]
    write_json(results / "env.json", env)
    nonfinite = bench_record("cuda", "bf16", "train", 3.0)
    nonfinite["numerics"].update(finite=False, acceptable=False)
    records = [bench_record("cuda", "fp16", "train", 4.0, loss_rel_diff=0.3), nonfinite]
    records += [bench_record("mps", "fp16", "train", 15.0, loss_rel_diff=0.1)]
    write_bench(results, records)
    write_json(results / "eval" / "cuda-fp16.json", evaluation("cuda", "fp16", 0.4))
    write_json(results / "eval" / "cuda-fp16_predictions.json", predictions([]))
    return results, []


def no_baseline_tree(root: Path) -> tuple[Path, list[str]]:
    """MPS benchmarks only: the answer has no CPU fp32 to compare with, and fp32 is slower."""
    results = root / "results"
    write_bench(
        results, [bench_record("mps", p, "train", ms) for p, ms in (("fp32", 20.0), ("fp16", 15.0))]
    )
    return results, []


TREES = {
    "full": full_tree,
    "swept": swept_tree,
    "sparse": sparse_tree,
    "cpu_policy": cpu_policy_tree,
    "nothing_safe": nothing_safe_tree,
    "no_baseline": no_baseline_tree,
}


def normalised(value: Any, root: Path) -> Any:
    if isinstance(value, str):
        value = value.replace(str(root), "<tmp>")
        for pattern, replacement in VOLATILE:
            value = pattern.sub(replacement, value)
        return value
    if isinstance(value, list):
        return [normalised(item, root) for item in value]
    if isinstance(value, dict):
        return {key: normalised(item, root) for key, item in value.items()}
    return value


def outline_of(tree: str) -> list[dict[str, Any]]:
    """Build the report of one tree as the workflow does, `python -m pipeline summarize` then
    `python -m pipeline report`, and outline it."""
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder).resolve()
        results, extra = TREES[tree](root)
        out = root / "out" / "report.html"
        for command in (["summarize"], ["report", "--out", str(out)]):
            code = cli.main([*command, "--results", str(results), *extra])
            if code != 0:
                raise RuntimeError(f"{command[0]} of tree {tree!r} failed with exit code {code}")
        page = Outline()
        page.feed(out.read_text(encoding="utf-8"))
        return normalised(page.outline(), root)


def main() -> None:
    golden = {tree: outline_of(tree) for tree in TREES}
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
