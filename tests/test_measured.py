"""`precision: measured`: the precision chosen from benchmark records, and training with it.

The choice is tested on fabricated records (so CUDA, MPS and CPUs with and without native
bf16 are all covered on any machine); training with it runs for real on this CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tiny_runs import make_data, one_cpu_thread, tiny_config, tiny_settings

from pipeline import cli, measured
from pipeline import device as dev
from pipeline.config import load_config
from pipeline.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("no_backend_env", "restore_pipeline_logger")
SAFE = {"bf16": None, "fp16": None}  # the device layer lets measured mode use both


def record(
    backend: str,
    precision: str,
    median_ms: float,
    *,
    model: str = "tiny_conv",
    acceptable: bool = True,
    status: str = "ok",
    count: int = 30,
    seed: int = 0,
) -> dict[str, Any]:
    """A training benchmark record with the fields the choice reads."""
    rng = np.random.default_rng([seed, int(median_ms * 10)])
    samples = list(median_ms * (1 + 0.02 * rng.standard_normal(count)))
    numerics = None
    if precision != "fp32":
        numerics = {
            "acceptable": acceptable,
            "problem": None if acceptable else "the loss is 9.0% off fp32's",
        }
    return {
        "status": status,
        "reason": None if status == "ok" else "bf16 autocast is not supported here",
        "backend": backend,
        "precision": precision,
        "mode": "train",
        "model": model,
        "configuration": {"batch_size": 16},
        "timing": {"samples_ms": samples} if status == "ok" else None,
        "numerics": numerics if status == "ok" else None,
    }


def records(backend: str, **medians: float) -> list[tuple[dict[str, Any], str]]:
    return [
        (record(backend, precision, ms), f"{backend}-{precision}-train.json")
        for precision, ms in medians.items()
    ]


# --- the choice ------------------------------------------------------------------------------


def test_a_reduced_precision_clearly_faster_with_acceptable_numerics_is_chosen() -> None:
    choice = measured.choose_precision(
        records("cpu", fp32=50, bf16=34, fp16=800), "cpu", "tiny_conv", SAFE
    )
    assert choice.precision == "bf16"
    assert choice.speedup["verdict"] == "faster"
    assert choice.speedup["low"] > 1.05 and choice.speedup["ratio"] == pytest.approx(50 / 34, 0.05)
    assert choice.reason.startswith("bf16 trains 1.4")
    assert "faster than fp32 (95% interval" in choice.reason
    assert choice.reference == "cpu-fp32-train.json"
    verdicts = {c.precision: c.eligible for c in choice.candidates}
    assert verdicts == {"bf16": True, "fp16": False}


def test_on_a_cpu_without_native_bf16_a_faster_bf16_is_still_refused() -> None:
    refused = {"bf16": "this CPU has no native bf16 instructions (...)", "fp16": "no fp16 (...)"}
    choice = measured.choose_precision(
        records("cpu", fp32=50, bf16=34, fp16=800), "cpu", "tiny_conv", refused
    )
    assert choice.precision == "fp32"
    assert "measured mode may not use it: this CPU has no native bf16" in choice.reason
    assert choice.speedup is None


def test_a_slower_precision_on_a_cpu_without_it_says_both_why() -> None:
    refused = {"bf16": "this CPU has no native bf16 instructions (...)", "fp16": "no fp16 (...)"}
    choice = measured.choose_precision(
        records("cpu", fp32=50, bf16=400, fp16=800), "cpu", "tiny_conv", refused
    )
    assert choice.precision == "fp32"
    bf16 = next(c for c in choice.candidates if c.precision == "bf16")
    assert bf16.reason.startswith("not faster: 8.0")
    assert bf16.reason.endswith("measured mode may not use it anyway: " + refused["bf16"])


@pytest.mark.parametrize(
    ("medians", "expected"),
    [
        ({"fp32": 10.0, "fp16": 4.0, "bf16": 5.0}, "fp16"),
        ({"fp32": 10.0, "fp16": 6.0, "bf16": 4.0}, "bf16"),
        ({"fp32": 10.0, "fp16": 10.1, "bf16": 9.9}, "fp32"),
    ],
)
def test_on_cuda_measured_can_pick_fp16_bf16_or_fp32(
    medians: dict[str, float], expected: str
) -> None:
    choice = measured.choose_precision(records("cuda", **medians), "cuda", "tiny_conv", SAFE)
    assert choice.precision == expected


def test_between_reduced_precisions_timed_alike_bf16_wins_and_both_say_why() -> None:
    """fp16 ahead in the median by 2%: not faster than bf16 beyond the tolerance, so bf16."""
    choice = measured.choose_precision(
        records("cpu", fp32=50, fp16=30, bf16=30.6), "cpu", "tiny_conv", SAFE
    )
    assert choice.precision == "bf16"
    assert choice.speedup["ratio"] < 50 / 30.3  # bf16's own speed-up, not fp16's
    tie = "fp16 against bf16 is indistinguishable (1.02x"
    assert tie in choice.reason and choice.reason.endswith("bf16 needs no loss scaling")
    fp16 = next(c for c in choice.candidates if c.precision == "fp16")
    assert fp16.eligible and fp16.reason.startswith("fp16 trains 1.6") and tie in fp16.reason
    clearly = measured.choose_precision(
        records("cpu", fp32=50, fp16=25, bf16=30.6), "cpu", "tiny_conv", SAFE
    )
    assert clearly.precision == "fp16" and "against" not in clearly.reason


def test_on_mps_an_autocast_slower_than_fp32_keeps_fp32() -> None:
    choice = measured.choose_precision(
        records("mps", fp32=76, fp16=90, bf16=108), "mps", "tiny_conv", SAFE
    )
    assert choice.precision == "fp32"
    assert "fp16: not faster: 1.18x slower" in choice.reason


def test_numerics_that_are_not_acceptable_rule_a_precision_out_whatever_its_speed() -> None:
    found = [
        (record("cuda", "fp32", 10), "f32"),
        (record("cuda", "fp16", 4, acceptable=False), "f16"),
        (record("cuda", "bf16", 5), "b16"),
    ]
    choice = measured.choose_precision(found, "cuda", "tiny_conv", SAFE)
    assert choice.precision == "bf16"
    fp16 = next(c for c in choice.candidates if c.precision == "fp16")
    assert not fp16.eligible and "but the loss is 9.0% off fp32's" in fp16.reason


def test_a_skipped_record_and_a_missing_one_are_named_as_such() -> None:
    found = [(record("cuda", "fp32", 10), "a"), (record("cuda", "bf16", 5, status="skipped"), "b")]
    choice = measured.choose_precision(found, "cuda", "tiny_conv", SAFE)
    assert choice.precision == "fp32"
    reasons = {c.precision: c.reason for c in choice.candidates}
    assert reasons == {
        "bf16": "could not run: bf16 autocast is not supported here",
        "fp16": "not benchmarked",
    }


def test_a_speed_up_from_too_few_steps_is_not_enough_to_choose() -> None:
    found = [(record("cuda", "fp32", 10, count=30), "a"), (record("cuda", "fp16", 5, count=1), "b")]
    choice = measured.choose_precision(found, "cuda", "tiny_conv", SAFE)
    assert choice.precision == "fp32" and "too few timed steps" in choice.reason


def test_without_an_fp32_timing_nothing_can_be_shown_faster() -> None:
    found = [(record("cuda", "fp16", 5), "b")]
    choice = measured.choose_precision(found, "cuda", "tiny_conv", SAFE)
    assert choice.precision == "fp32" and "no fp32 timing" in choice.reason


def test_the_choice_is_per_model() -> None:
    found = [
        (record("cuda", "fp32", 10, model="resnet18"), "a"),
        (record("cuda", "fp16", 4, model="resnet18"), "b"),
        (record("cuda", "fp32", 10), "c"),
        (record("cuda", "fp16", 10), "d"),
    ]
    assert measured.choose_precision(found, "cuda", "resnet18", SAFE).precision == "fp16"
    assert measured.choose_precision(found, "cuda", "tiny_conv", SAFE).precision == "fp32"


def test_no_records_for_the_backend_is_an_error_saying_how_to_make_them() -> None:
    with pytest.raises(ConfigError, match="needs training benchmarks of tiny_conv on mps"):
        measured.choose_precision(records("cpu", fp32=50), "mps", "tiny_conv", SAFE)


def test_a_choice_file_round_trips(tmp_path: Path) -> None:
    choice = measured.choose_precision(
        records("cuda", fp32=10, fp16=4, bf16=5), "cuda", "tiny_conv", SAFE
    )
    path = tmp_path / "cuda.json"
    path.write_text(json.dumps(measured.choices_document("cuda", [choice])))
    assert measured.read_choices(path) == {"tiny_conv": choice}
    with pytest.raises(ConfigError, match="covers \\['tiny_conv'\\], not 'resnet18'"):
        measured.choice_for_model(path, "resnet18")


# --- the device layer's part -----------------------------------------------------------------


@pytest.fixture
def cpu_with(monkeypatch: pytest.MonkeyPatch):
    """Make torch report the given CPU features (the others absent)."""

    def make(*features: str) -> None:
        report = {key: key in features for key in ("avx2", "avx512_f", "avx512_bf16", "amx_bf16")}
        report.update({key: key in features for key in ("avx512_fp16", "amx_fp16")})
        monkeypatch.setattr(dev.torch.cpu, "get_capabilities", lambda: report, raising=False)

    monkeypatch.delenv(dev.HIDE_CPU_NATIVE_ENV, raising=False)
    return make


@pytest.mark.parametrize(
    ("features", "native"),
    [
        (("avx2",), False),
        (("avx2", "avx512_f"), False),
        (("avx512_bf16",), True),
        (("amx_bf16",), True),
    ],
)
def test_native_bf16_comes_from_the_cpu_features_not_from_avx512_alone(
    cpu_with, features: tuple[str, ...], native: bool
) -> None:
    cpu_with(*features)
    found = dev.cpu_native_precision("bf16")
    assert found.native is native
    assert found.evidence.startswith("torch.cpu.get_capabilities(): avx512_bf16=")
    assert (dev.measured_precision_refused_reason("cpu", "bf16") is None) is native


def test_the_environment_variable_hides_native_bf16(
    cpu_with, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu_with("avx512_bf16")
    monkeypatch.setenv(dev.HIDE_CPU_NATIVE_ENV, "bf16")
    found = dev.cpu_native_precision("bf16")
    assert found.native is False and found.hidden is True
    assert f"hidden by {dev.HIDE_CPU_NATIVE_ENV}" in found.evidence
    assert "no native bf16" in dev.measured_precision_refused_reason("cpu", "bf16")


def test_an_unknown_name_in_the_hiding_variable_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(dev.HIDE_CPU_NATIVE_ENV, "bf16,fp8")
    with pytest.raises(ConfigError, match="names fp8: it may list only bf16, fp16"):
        dev.cpu_native_precision("bf16")


def test_older_torch_falls_back_to_its_private_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(dev.torch.cpu, "get_capabilities", raising=False)
    monkeypatch.setattr(dev.torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    monkeypatch.setattr(dev.torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(dev.torch.cpu, "_is_amx_fp16_supported", lambda: False, raising=False)
    found = dev.cpu_native_precision("bf16")
    assert found.native is True and found.evidence.startswith("torch.cpu private probes")


def test_a_torch_without_any_cpu_query_reports_no_native_support(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(dev.torch.cpu, "get_capabilities", raising=False)
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        monkeypatch.delattr(dev.torch.cpu, probe, raising=False)
    found = dev.cpu_native_precision("bf16")
    assert found.native is False and "has no CPU capability query" in found.evidence


def test_the_static_cpu_policy_is_unchanged_whatever_the_cpu_has(cpu_with) -> None:
    cpu_with("avx512_bf16", "amx_bf16")
    assert dev.amp_supported("cpu") is False
    assert dev.resolve_amp(True, "cpu") is False
    assert dev.training_precision("auto", "cpu") == "fp32"


def test_an_explicit_precision_trains_in_it_where_the_cpu_computes_it_natively(cpu_with) -> None:
    cpu_with("avx512_bf16")
    assert dev.training_precision("bf16", "cpu") == "bf16"
    assert dev.run_precision("bf16", "cpu") == "bf16"
    assert dev.training_precision("fp16", "cpu") == "fp32"  # no native fp16 here
    cpu_with()
    assert dev.training_precision("bf16", "cpu") == "fp32"


def test_auto_trains_fp16_where_amp_is_on_by_default_and_fp32_elsewhere(fake_cuda) -> None:
    assert dev.training_precision("auto", "cuda") == dev.AUTO_DTYPE == "fp16"
    assert dev.training_precision("bf16", "cuda") == "bf16"
    assert dev.training_precision("fp32", "cuda") == "fp32"
    assert dev.training_precision("auto", "cpu") == "fp32"
    with pytest.raises(ConfigError, match="precision='true' is not understood"):
        dev.training_precision("true", "cpu")


def test_run_precision_takes_the_measured_precision_only_where_measured_may_use_it(
    cpu_with,
) -> None:
    cpu_with("avx512_bf16")
    assert dev.run_precision("measured", "cpu", "bf16") == "bf16"
    assert dev.run_precision("measured", "cpu", "fp32") == "fp32"
    assert dev.run_precision("fp32", "cpu", "bf16") == "fp32"  # measured is not asked for
    with pytest.raises(
        ConfigError, match="cannot train in fp16 on cpu: this CPU has no native fp16"
    ):
        dev.run_precision("measured", "cpu", "fp16")
    with pytest.raises(ConfigError, match="takes its precision from benchmark records"):
        dev.run_precision("measured", "cpu", None)


def test_simulated_gpus_let_measured_use_what_autocast_runs(fake_cuda) -> None:
    assert dev.measured_refusals("cuda") == {"fp16": None, "bf16": None}
    fake_cuda.bf16 = False
    assert "no bf16 support" in dev.measured_refusals("cuda")["bf16"]


# --- training with the choice, for real on this CPU ------------------------------------------


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("measured-data"))


def write_bench(folder: Path, backend: str, **medians: float) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for precision, ms in medians.items():
        document = {"format": measured.BENCH_FORMAT, "records": [record(backend, precision, ms)]}
        (folder / f"{backend}-{precision}-train.json").write_text(json.dumps(document))
    return folder


def train(data_root: Path, out: Path, *args: str) -> int:
    with one_cpu_thread():
        return cli.main(
            ["train", "--cpu-threads", "1", "--out", str(out), *args, *tiny_settings(data_root)]
        )


@pytest.fixture
def unchecked_bench_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fabricated records hold only what the choice reads, not a whole schema-valid record."""
    monkeypatch.setattr(
        measured,
        "read_bench_file",
        lambda path: json.loads(Path(path).read_text())["records"],
    )


def test_train_with_measured_and_an_empty_bench_folder_fails_saying_how_to_make_them(
    data_root: Path, tmp_path: Path, capsys
) -> None:
    code = train(data_root, tmp_path / "run", "--precision", "measured", "--bench", str(tmp_path))
    assert code == 2
    err = capsys.readouterr().err
    assert "precision=measured needs training benchmarks of tiny_conv on cpu" in err
    assert "--precision fp32,fp16,bf16 --mode train --out-dir results/bench." in err
    assert not (tmp_path / "run").exists()


def test_choose_precision_with_the_env_json_decides_as_the_device_would_without_importing_torch(
    tmp_path: Path,
) -> None:
    """The workflow passes results/env.json: one job less that pays torch's import."""
    from report_fixtures import bench_record, env_json

    env = env_json()
    env["backends"]["cpu"]["measured_refused"]["bf16"] = None  # a CPU with native bf16
    (tmp_path / "env.json").write_text(json.dumps(env))
    bench = tmp_path / "bench"
    bench.mkdir()
    for precision, ms in (("fp32", 50.0), ("bf16", 34.0), ("fp16", 20.0)):
        document = {
            "format": "pipeline.bench/2",
            "records": [bench_record("cpu", precision, "train", ms)],
        }
        (bench / f"cpu-{precision}-train.json").write_text(json.dumps(document))
    code = (
        "import sys; from pipeline import cli; "
        f"status = cli.main(['choose-precision', '--device', 'cpu', '--bench', {str(bench)!r}, "
        f"'--env', {str(tmp_path / 'env.json')!r}, '--out', {str(tmp_path / 'choice.json')!r}, "
        "'bench.models=[tiny_conv]']); "
        "print('torch imported:', 'torch' in sys.modules); sys.exit(status)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torch imported: False" in done.stdout
    (choice,) = json.loads((tmp_path / "choice.json").read_text())["choices"]
    assert choice["precision"] == "bf16"  # fp16 is faster, but env.json refuses it on this CPU
    fp16 = next(c for c in choice["candidates"] if c["precision"] == "fp16")
    assert "no native fp16" in fp16["reason"]


def test_choose_precision_refuses_an_env_json_where_the_backend_is_absent(
    tmp_path: Path, capsys
) -> None:
    from report_fixtures import env_json

    env = env_json()
    env["backends"]["mps"]["available"] = False
    env["backends"]["mps"]["reason"] = "MPS not built"
    (tmp_path / "env.json").write_text(json.dumps(env))
    argv = ["choose-precision", "--device", "mps", "--env", str(tmp_path / "env.json")]
    assert cli.main([*argv, "--bench", str(tmp_path)]) == 2
    assert "Backend 'mps' is not available by" in capsys.readouterr().err


def test_the_shipped_default_is_measured_in_the_schema_and_the_repository_config() -> None:
    assert load_config(None)["precision"] == "measured"
    assert load_config(REPO / "config" / "config.yaml")["precision"] == "measured"


def test_train_with_measured_and_no_benchmarks_at_the_default_place_trains_as_auto_and_says_so(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """`python -m pipeline train` outside the workflow, before any benchmark: precision=measured
    (the shipped default) finds no results/bench here and trains in what auto gives."""
    monkeypatch.chdir(tmp_path)  # no results/bench here
    assert train(data_root, tmp_path / "run", "--precision", "measured") == 0
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    auto = dev.training_precision("auto", "cpu")
    assert summary["precision"] == auto
    choice = summary["precision_choice"]
    assert choice["precision"] == auto and choice["speedup"] is None
    assert "as precision=auto does" in choice["reason"]
    err = capsys.readouterr().err
    assert "WARNING precision=measured had no training benchmarks of tiny_conv on cpu" in err


def test_a_trainer_given_measured_and_no_choice_trains_as_auto_and_records_why(
    data_root: Path, tmp_path: Path
) -> None:
    """The library's Trainer follows the command's rule (benchmarks/ scripts build one from
    the defaults)."""
    from pipeline.engine.trainer import Trainer

    trainer = Trainer(tiny_config(data_root, "precision=measured"), tmp_path / "run")
    assert trainer.precision == dev.training_precision("auto", "cpu")
    assert "as precision=auto does" in trainer.precision_choice.reason


@pytest.mark.usefixtures("unchecked_bench_files")
def test_train_with_measured_chooses_from_results_bench_where_it_exists(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpu_with
) -> None:
    cpu_with("avx512_bf16")
    monkeypatch.chdir(tmp_path)
    write_bench(tmp_path / "results" / "bench", "cpu", fp32=50, bf16=34)
    assert train(data_root, tmp_path / "run", "--precision", "measured") == 0
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["precision"] == "bf16"
    assert summary["precision_choice"]["reference"].endswith("cpu-fp32-train.json")


@pytest.mark.usefixtures("unchecked_bench_files")
def test_train_with_precision_measured_trains_the_chosen_bf16_on_a_cpu_with_native_bf16(
    data_root: Path, tmp_path: Path, cpu_with
) -> None:
    cpu_with("avx512_bf16")
    bench = write_bench(tmp_path / "bench", "cpu", fp32=50, bf16=34)
    assert train(data_root, tmp_path / "run", "--precision", "measured", "--bench", str(bench)) == 0
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["precision"] == "bf16" and summary["amp"] is True
    choice = summary["precision_choice"]
    assert choice["precision"] == "bf16" and choice["speedup"]["verdict"] == "faster"
    assert choice["reference"].endswith("cpu-fp32-train.json")


@pytest.mark.usefixtures("unchecked_bench_files")
def test_with_native_bf16_hidden_the_same_records_train_fp32_and_say_why(
    data_root: Path, tmp_path: Path, cpu_with, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu_with("avx512_bf16")
    monkeypatch.setenv(dev.HIDE_CPU_NATIVE_ENV, "bf16")
    bench = write_bench(tmp_path / "bench", "cpu", fp32=50, bf16=34)
    assert train(data_root, tmp_path / "run", "--precision", "measured", "--bench", str(bench)) == 0
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["precision"] == "fp32"
    assert "no native bf16 instructions" in summary["precision_choice"]["reason"]
