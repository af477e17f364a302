"""The device layer: backend choice, likely reasons, AMP policy, descriptions and memory.

The first group runs against the real hardware and adapts to it; the rest simulates CUDA and
MPS with the fixtures of conftest.py, so every branch runs on a CPU-only machine.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import pytest
import torch

from pipeline import device as dev
from pipeline.device import (
    BACKEND_PRIORITY,
    DeviceNotAvailableError,
    PeakMemory,
    amp_supported,
    autocast_dtype,
    autocast_unsupported_reason,
    available_backends,
    default_amp,
    describe_device,
    host_peak_rss_mb,
    memory_stats,
    pin_memory_supported,
    resolve_amp,
    resolve_device,
    synchronize,
)
from pipeline.errors import ConfigError, PipelineError

MB = 1024 * 1024

pytestmark = pytest.mark.usefixtures("no_backend_env")


def _torch_sees_cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def _missing_real_backends() -> list[str]:
    present = {"cuda": _torch_sees_cuda(), "mps": torch.backends.mps.is_available()}
    return [name for name, available in present.items() if not available]


cpu_only = pytest.mark.skipif(
    bool({"cuda", "mps"} - set(_missing_real_backends())), reason="needs a machine without GPU"
)


# --- the real hardware -------------------------------------------------------------------


def test_backend_priority_is_cuda_then_mps_then_cpu() -> None:
    assert BACKEND_PRIORITY == ("cuda", "mps", "cpu")


def test_available_backends_match_what_torch_reports() -> None:
    expected = [name for name in ("cuda", "mps") if name not in _missing_real_backends()]
    backends = available_backends()
    assert backends == [*expected, "cpu"]
    assert backends[-1] == "cpu"
    assert backends.count("cpu") == 1


@cpu_only
def test_cpu_only_machine_offers_only_cpu_and_auto_picks_it() -> None:
    assert available_backends() == ["cpu"]
    assert resolve_device("auto") == torch.device("cpu")


@pytest.mark.parametrize("spec", [None, "", "auto", "AUTO", "  auto "])
def test_auto_spellings_resolve_to_the_best_available_backend(spec: str | None) -> None:
    assert resolve_device(spec) == torch.device(available_backends()[0])


def test_resolve_device_defaults_to_auto() -> None:
    assert resolve_device() == torch.device(available_backends()[0])


@pytest.mark.parametrize("spec", ["cpu", "CPU", " cpu ", torch.device("cpu")])
def test_cpu_resolves_from_strings_and_torch_devices(spec: str | torch.device) -> None:
    assert resolve_device(spec) == torch.device("cpu")


@pytest.mark.parametrize("backend", ["cuda", "mps"])
def test_missing_real_backend_raises_naming_it_and_listing_what_is_available(backend: str) -> None:
    if backend not in _missing_real_backends():
        pytest.skip(f"{backend} is present on this machine")
    with pytest.raises(DeviceNotAvailableError) as caught:
        resolve_device(backend)
    message = str(caught.value)
    assert f"'{backend}'" in message
    assert "not available" in message
    assert str(available_backends()) in message
    assert dev.backend_status(backend).reason in message


@cpu_only
def test_cpu_only_machine_lists_exactly_cpu_when_cuda_is_asked_for() -> None:
    with pytest.raises(DeviceNotAvailableError, match=r"Available backends: \['cpu'\]"):
        resolve_device("cuda")


def test_device_not_available_error_is_a_runtime_error_and_a_user_error() -> None:
    assert issubclass(DeviceNotAvailableError, RuntimeError)
    assert issubclass(DeviceNotAvailableError, PipelineError)


@pytest.mark.parametrize("spec", ["tpu", "gpu", "cuda:x", "cuda:-1", "mps:", "xla"])
def test_unknown_device_names_it_and_lists_the_valid_choices(spec: str) -> None:
    with pytest.raises(DeviceNotAvailableError) as caught:
        resolve_device(spec)
    message = str(caught.value)
    assert "unknown device" in message.lower()
    assert repr(spec) in message
    assert "auto, cpu, cuda, cuda:N, mps" in message


def test_backend_name_strips_the_index_and_accepts_torch_devices() -> None:
    assert dev.backend_name("cuda:1") == "cuda"
    assert dev.backend_name(" MPS ") == "mps"
    assert dev.backend_name(torch.device("cuda", 3)) == "cuda"
    with pytest.raises(DeviceNotAvailableError, match=r"(?i)unknown device"):
        dev.backend_name("tpu")


# --- simulated hardware: choice and priority ------------------------------------------------


def test_auto_prefers_cuda_when_cuda_and_mps_are_present(fake_cuda, fake_mps) -> None:
    assert available_backends() == ["cuda", "mps", "cpu"]
    assert resolve_device("auto") == torch.device("cuda")


def test_auto_picks_mps_when_it_is_the_only_accelerator(no_cuda, fake_mps) -> None:
    assert available_backends() == ["mps", "cpu"]
    assert resolve_device("auto") == torch.device("mps")


def test_present_backends_resolve_by_name(fake_cuda, fake_mps) -> None:
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("MPS") == torch.device("mps")
    assert resolve_device(torch.device("cuda", 1)) == torch.device("cuda", 1)


def test_cuda_index_within_the_visible_devices_resolves(fake_cuda) -> None:
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_cuda_index_out_of_range_says_how_many_devices_are_visible(fake_cuda) -> None:
    with pytest.raises(DeviceNotAvailableError) as caught:
        resolve_device("cuda:7")
    message = str(caught.value)
    assert "index 7 is out of range" in message
    assert "only 2 cuda device(s)" in message
    assert "cuda:0 to cuda:1" in message


def test_mps_has_only_index_zero(fake_mps) -> None:
    assert resolve_device("mps:0") == torch.device("mps", 0)
    with pytest.raises(DeviceNotAvailableError, match="index 1 is out of range"):
        resolve_device("mps:1")


# --- simulated hardware: the likely reason a backend is missing ------------------------------


def _reason(name: str) -> str:
    status = dev.backend_status(name)
    assert status.available is False
    assert status.reason
    with pytest.raises(DeviceNotAvailableError) as caught:
        resolve_device(name)
    assert status.reason in str(caught.value)
    return status.reason


def test_cuda_reason_when_torch_is_built_without_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    reason = _reason("cuda")
    assert "no CUDA support" in reason
    assert "install a CUDA build" in reason


@pytest.mark.parametrize("value", ["", "-1", " "])
def test_cuda_reason_when_cuda_visible_devices_hides_every_gpu(
    fake_cuda, monkeypatch, value
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    reason = _reason("cuda")
    assert "CUDA_VISIBLE_DEVICES" in reason
    assert repr(value) in reason
    assert "hides every CUDA device" in reason


def test_cuda_visible_devices_naming_a_gpu_keeps_cuda_available(fake_cuda, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert dev.backend_status("cuda").available


def test_cuda_reason_when_no_device_is_visible(fake_cuda) -> None:
    fake_cuda.names = []
    reason = _reason("cuda")
    assert "no CUDA device is visible" in reason
    assert "CUDA 12.4" in reason


def test_mps_reason_when_not_built_off_a_mac(no_mps, monkeypatch) -> None:
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    reason = _reason("mps")
    assert "MPS is not built" in reason
    assert "needs an Apple-silicon Mac and this is Linux" in reason


def test_mps_reason_when_not_built_on_a_mac(no_mps, monkeypatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    reason = _reason("mps")
    assert "MPS is not built" in reason
    assert "Apple-silicon" not in reason


def test_mps_reason_when_built_but_not_available_on_macos(monkeypatch) -> None:
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(platform, "mac_ver", lambda: ("12.1", ("", "", ""), "x86_64"))
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    reason = _reason("mps")
    assert "built but not available" in reason
    assert "macOS 12.3 or newer" in reason
    assert "this is macOS 12.1 on x86_64" in reason


def test_mps_reason_when_built_but_not_a_mac(monkeypatch) -> None:
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(platform, "system", lambda: "Windows")
    assert _reason("mps") == "MPS needs an Apple-silicon Mac and this is Windows"


# --- the disable switch ----------------------------------------------------------------------


def test_disable_switch_hides_present_cuda_and_mps(fake_cuda, fake_mps, monkeypatch) -> None:
    monkeypatch.setenv("PIPELINE_DISABLE_BACKENDS", " cuda, MPS ")
    assert available_backends() == ["cpu"]
    assert resolve_device("auto") == torch.device("cpu")
    for name in ("cuda", "mps"):
        reason = _reason(name)
        assert reason == "disabled by the environment variable PIPELINE_DISABLE_BACKENDS"


def test_disable_switch_hides_only_the_backends_it_names(fake_cuda, fake_mps, monkeypatch) -> None:
    monkeypatch.setenv("PIPELINE_DISABLE_BACKENDS", "cuda")
    assert available_backends() == ["mps", "cpu"]
    assert resolve_device("auto") == torch.device("mps")


@pytest.mark.parametrize("value", ["", " , "])
def test_empty_disable_switch_hides_nothing(fake_cuda, fake_mps, monkeypatch, value) -> None:
    monkeypatch.setenv("PIPELINE_DISABLE_BACKENDS", value)
    assert available_backends() == ["cuda", "mps", "cpu"]


@pytest.mark.parametrize(("value", "named"), [("cpu", "cpu"), ("tpu", "tpu"), ("cuda,gpu", "gpu")])
def test_disable_switch_rejects_cpu_and_unknown_names(monkeypatch, value, named) -> None:
    monkeypatch.setenv("PIPELINE_DISABLE_BACKENDS", value)
    for probe in (
        dev.disabled_backends,
        available_backends,
        lambda: resolve_device("auto"),
        lambda: resolve_device("cpu"),
    ):
        with pytest.raises(ConfigError) as caught:
            probe()
        assert "PIPELINE_DISABLE_BACKENDS" in str(caught.value)
        assert f"names {named}" in str(caught.value)


# --- AMP policy ------------------------------------------------------------------------------

BACKEND_SPECS = {
    "cuda": ["cuda", "cuda:1", torch.device("cuda", 1)],
    "mps": ["mps", torch.device("mps")],
    "cpu": ["cpu", "CPU", torch.device("cpu")],
}
ALL_SPECS = [(name, spec) for name, specs in BACKEND_SPECS.items() for spec in specs]


@pytest.mark.parametrize(("name", "spec"), ALL_SPECS)
def test_amp_defaults_on_for_cuda_only_and_is_never_allowed_on_cpu(name, spec) -> None:
    assert default_amp(spec) is (name == "cuda")
    assert amp_supported(spec) is (name in ("cuda", "mps"))


@pytest.mark.parametrize(("name", "spec"), ALL_SPECS)
@pytest.mark.parametrize("requested", ["auto", None])
def test_resolve_amp_auto_follows_the_backend_default(name, spec, requested) -> None:
    assert resolve_amp(requested, spec) is (name == "cuda")


@pytest.mark.parametrize(("name", "spec"), ALL_SPECS)
def test_resolve_amp_true_enables_amp_only_where_supported(name, spec) -> None:
    assert resolve_amp(True, spec) is (name in ("cuda", "mps"))


@pytest.mark.parametrize(("name", "spec"), ALL_SPECS)
def test_resolve_amp_false_disables_amp_everywhere(name, spec) -> None:
    assert resolve_amp(False, spec) is False


@pytest.mark.parametrize("requested", ["false", "true", "no", "off", "", "Auto"])
@pytest.mark.parametrize("backend", ["cuda", "mps", "cpu"])
def test_resolve_amp_rejects_strings_other_than_auto_in_todays_vocabulary(
    requested, backend
) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_amp(requested, backend)
    message = str(caught.value)
    assert repr(requested) in message
    assert "amp=" not in message  # the key it named was replaced by precision
    assert "precision=fp32" in message and "measured" in message


@pytest.mark.parametrize(("name", "spec"), ALL_SPECS)
def test_pin_memory_only_for_cuda(name, spec) -> None:
    assert pin_memory_supported(spec) is (name == "cuda")


def test_policy_functions_reject_unknown_backends() -> None:
    for function in (default_amp, amp_supported, pin_memory_supported, memory_stats, synchronize):
        with pytest.raises(DeviceNotAvailableError, match=r"(?i)unknown device"):
            function("tpu")


# --- autocast --------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["cpu", "cuda", "mps", torch.device("cpu")])
def test_fp32_needs_no_autocast_on_any_backend(backend) -> None:
    assert autocast_unsupported_reason(backend, "fp32") is None


@pytest.mark.parametrize(
    ("version", "precision", "expected"),
    [
        ((2, 4), "fp16", "fp16 autocast on MPS needs torch >= 2.5"),
        ((2, 4), "bf16", "bf16 autocast on MPS needs torch >= 2.6"),
        ((2, 5), "bf16", "bf16 autocast on MPS needs torch >= 2.6"),
        ((2, 5), "fp16", "needs GradScaler('mps'), which needs torch >= 2.8"),
        ((2, 7), "fp16", "needs GradScaler('mps'), which needs torch >= 2.8"),
    ],
)
def test_old_torch_gives_a_reason_for_mps_autocast(
    fake_mps, monkeypatch, version, precision, expected
) -> None:
    monkeypatch.setattr(dev, "_torch_version", lambda: version)
    reason = autocast_unsupported_reason("mps", precision)
    assert reason is not None
    assert expected in reason
    assert torch.__version__ in reason


def test_cuda_without_bf16_gives_a_reason_for_bf16_autocast(fake_cuda) -> None:
    fake_cuda.bf16 = False
    reason = autocast_unsupported_reason("cuda", "bf16")
    assert reason is not None
    assert "no bf16 support" in reason


@pytest.mark.parametrize("backend", ["cpu", "cuda", "mps"])
@pytest.mark.parametrize("precision", ["fp8", "fp64", "FP16", "amp"])
def test_unknown_precision_is_a_config_error(backend, precision) -> None:
    with pytest.raises(ConfigError, match=f"Unknown precision {precision!r}"):
        autocast_unsupported_reason(backend, precision)
    with pytest.raises(ConfigError, match=f"Unknown precision {precision!r}"):
        autocast_dtype(precision)


def test_autocast_dtype_maps_precisions_to_dtypes() -> None:
    assert autocast_dtype("fp32") is None
    assert autocast_dtype("fp16") is torch.float16
    assert autocast_dtype("bf16") is torch.bfloat16


@pytest.mark.parametrize(
    ("version", "expected"),
    [("2.14.1+cu130", (2, 14)), ("2.6.0a0+git1234", (2, 6)), ("2.10.0", (2, 10)), ("3.0", (3, 0))],
)
def test_torch_version_compares_numerically(monkeypatch, version, expected) -> None:
    monkeypatch.setattr(torch, "__version__", version)
    assert dev._torch_version() == expected


# --- describe_device -------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["cpu", "CPU", torch.device("cpu")])
def test_cpu_is_described_as_exactly_cpu(spec) -> None:
    assert describe_device(spec) == "CPU"


def test_mps_description_names_mps(fake_mps) -> None:
    assert "MPS" in describe_device("mps")
    assert "MPS" in describe_device(torch.device("mps"))


def test_cuda_description_has_name_memory_and_compute_capability(fake_cuda) -> None:
    assert describe_device("cuda") == "CUDA: NVIDIA Fake A100, 80 GiB, sm_80"
    assert describe_device("cuda:1") == "CUDA: NVIDIA Fake H100, 80 GiB, sm_90"
    assert describe_device(torch.device("cuda", 1)) == "CUDA: NVIDIA Fake H100, 80 GiB, sm_90"


def test_cuda_description_survives_unreadable_device_properties(fake_cuda, monkeypatch) -> None:
    def broken(device=None):
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(torch.cuda, "get_device_properties", broken)
    assert describe_device("cuda") == "CUDA (device properties unreadable: driver exploded)"


def test_description_of_absent_backends_gives_the_reason_instead_of_raising(
    no_cuda, no_mps
) -> None:
    for name in ("cuda", "mps"):
        text = describe_device(name)
        assert text.startswith(f"{name.upper()} (not available: ")
        assert dev.backend_status(name).reason in text
    assert "unknown device 'tpu'" in describe_device("tpu")


def test_description_survives_a_broken_disable_switch(monkeypatch) -> None:
    monkeypatch.setenv("PIPELINE_DISABLE_BACKENDS", "gpu")
    assert "CUDA (unknown: " in describe_device("cuda")
    assert "PIPELINE_DISABLE_BACKENDS" in describe_device("mps")


# --- memory ----------------------------------------------------------------------------------


def test_memory_stats_are_empty_on_cpu() -> None:
    assert memory_stats("cpu") == {}
    assert memory_stats(torch.device("cpu")) == {}


def test_cuda_memory_stats_report_current_and_peak_in_mb(fake_cuda) -> None:
    fake_cuda.allocate(300 * MB)
    fake_cuda.free(100 * MB)
    for spec in ("cuda", "cuda:1", torch.device("cuda", 0)):
        assert memory_stats(spec) == {
            "allocated_mb": 200.0,
            "reserved_mb": 300.0,
            "peak_allocated_mb": 300.0,
            "peak_reserved_mb": 300.0,
        }


def test_mps_memory_stats_report_allocated_driver_and_recommended_max(fake_mps) -> None:
    fake_mps.allocated = 64 * MB
    fake_mps.driver_allocated = 256 * MB
    assert memory_stats("mps") == {
        "allocated_mb": 64.0,
        "driver_allocated_mb": 256.0,
        "recommended_max_mb": 16 * 1024.0,
    }


def test_cuda_peak_memory_is_exact_and_starts_from_a_reset(fake_cuda) -> None:
    fake_cuda.allocate(900 * MB)
    fake_cuda.free(800 * MB)  # an earlier peak of 900 MB that must not count
    peak = PeakMemory("cuda:0")
    assert fake_cuda.resets == [torch.device("cuda", 0)]
    assert peak.peak_mb == 100.0
    fake_cuda.allocate(400 * MB)
    fake_cuda.free(400 * MB)
    assert peak.peak_mb == 500.0
    assert peak.reserved_mb == 900.0
    assert peak.exact is True
    assert peak.label == "exact"
    peak.reset()
    assert len(fake_cuda.resets) == 2
    assert peak.peak_mb == 100.0
    assert peak.as_dict() == {
        "peak_mb": 100.0,
        "reserved_mb": 900.0,
        "exact": True,
        "label": "exact",
    }


def test_work_set_aside_leaves_its_peak_out_and_keeps_the_peak_before_it(fake_cuda) -> None:
    """Another model's steps amid a precision's warm-up (the bench's fp32 steps that judge
    it) do not count toward its peak; the steps before and after do."""
    peak = PeakMemory("cuda:0")
    fake_cuda.allocate(100 * MB)  # the precision's step
    fake_cuda.free(100 * MB)

    def other_model() -> str:
        fake_cuda.allocate(300 * MB)
        fake_cuda.free(300 * MB)
        return "stepped"

    assert peak.set_aside(other_model) == "stepped"
    assert peak.peak_mb == 100.0 and len(fake_cuda.resets) == 2
    fake_cuda.allocate(150 * MB)  # the precision's next step goes higher: counted
    fake_cuda.free(150 * MB)
    assert peak.peak_mb == 150.0
    peak.reset()  # a fresh span forgets what was kept too
    assert peak.peak_mb == 0.0


def test_work_set_aside_leaves_the_sampled_mps_peak_as_it_was(fake_mps) -> None:
    samples = iter([(10.0, 20.0), (50.0, 80.0), (12.0, 90.0), (30.0, 90.0)])
    peak = PeakMemory("mps", reader=lambda: next(samples))
    peak.update()
    peak.set_aside(lambda: None)  # its steps are never sampled; the reset after samples once
    peak.update()
    assert peak.peak_mb == 50.0


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux only")
def test_work_set_aside_leaves_its_host_peak_rss_out() -> None:
    peak = PeakMemory("cpu")
    assert dev.reset_host_peak_rss() is True
    before = peak.host_peak_rss_mb

    def ballast() -> None:
        held = bytearray(200 * MB)
        held[::4096] = b"x" * len(held[::4096])  # resident, not only reserved

    peak.set_aside(ballast)
    assert dev.host_peak_rss_mb() < before + 50  # reset after it
    assert before <= peak.host_peak_rss_mb < before + 50
    ballast()  # the span's own work counts
    assert peak.host_peak_rss_mb > before + 150


def test_mps_peak_memory_is_the_largest_sample_and_labelled_a_lower_bound(fake_mps) -> None:
    samples = iter([(10.0, 20.0), (50.0, 80.0), (30.0, 95.0), (5.0, 10.0)])
    peak = PeakMemory("mps", reader=lambda: next(samples))  # samples once on creation
    for _ in range(3):
        peak.update()
    assert peak.peak_mb == 50.0
    assert peak.reserved_mb == 95.0
    assert peak.exact is False
    assert "lower bound" in peak.label
    assert peak.as_dict()["label"] == peak.label
    assert peak.as_dict()["exact"] is False


def test_mps_sampled_peak_reset_forgets_earlier_samples(fake_mps) -> None:
    samples = iter([(500.0, 600.0), (7.0, 8.0), (9.0, 9.5)])
    peak = PeakMemory(torch.device("mps"), reader=lambda: next(samples))
    peak.reset()
    assert (peak.peak_mb, peak.reserved_mb) == (7.0, 8.0)
    peak.update()
    assert (peak.peak_mb, peak.reserved_mb) == (9.0, 9.5)


def test_mps_peak_memory_samples_torch_mps_without_accelerator_stats(fake_mps, monkeypatch) -> None:
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a: torch.device("mps"))
    monkeypatch.setattr(torch.accelerator, "memory_stats", lambda *a, **k: {})
    fake_mps.allocated, fake_mps.driver_allocated = 30 * MB, 40 * MB
    peak = PeakMemory("mps")
    fake_mps.allocated, fake_mps.driver_allocated = 70 * MB, 90 * MB
    peak.update()
    fake_mps.allocated, fake_mps.driver_allocated = 10 * MB, 90 * MB
    peak.update()
    assert (peak.peak_mb, peak.reserved_mb) == (70.0, 90.0)
    assert peak.exact is False


@pytest.fixture
def mps_accelerator_stats(monkeypatch, fake_mps) -> list[int]:
    """A newer torch whose torch.accelerator keeps MPS allocator statistics; returns the resets."""
    resets: list[int] = []
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a: torch.device("mps"))
    monkeypatch.setattr(
        torch.accelerator, "memory_stats", lambda *a, **k: {"allocated_bytes.all.peak": 1}
    )
    monkeypatch.setattr(torch.accelerator, "reset_peak_memory_stats", lambda *a: resets.append(1))
    monkeypatch.setattr(torch.accelerator, "max_memory_allocated", lambda *a: 256 * MB)
    monkeypatch.setattr(torch.accelerator, "max_memory_reserved", lambda *a: 512 * MB)
    return resets


def test_mps_peak_memory_uses_accelerator_stats_when_torch_has_them(mps_accelerator_stats) -> None:
    peak = PeakMemory("mps")
    assert mps_accelerator_stats == [1]
    assert (peak.peak_mb, peak.reserved_mb) == (256.0, 512.0)
    assert peak.exact is True
    assert peak.label == "exact"
    peak.reset()
    assert mps_accelerator_stats == [1, 1]


def test_injected_mps_reader_takes_precedence_over_accelerator_stats(mps_accelerator_stats) -> None:
    peak = PeakMemory("mps", reader=lambda: (3.0, 4.0))
    assert (peak.peak_mb, peak.exact) == (3.0, False)
    assert mps_accelerator_stats == []


@pytest.mark.parametrize("spec", ["cpu", torch.device("cpu")])
def test_cpu_peak_memory_is_zero_and_points_to_host_rss(spec) -> None:
    peak = PeakMemory(spec)
    peak.update()
    assert peak.peak_mb == 0.0
    assert peak.reserved_mb == 0.0
    assert "n/a" in peak.label
    assert peak.as_dict()["peak_mb"] == 0.0


def test_host_peak_rss_is_reported_in_megabytes() -> None:
    rss = host_peak_rss_mb()
    # A Python process with torch loaded holds well over 10 MB and far less than a terabyte;
    # a kilobyte/byte mix-up would land outside this range.
    assert 10 < rss < 1024 * 1024


# --- synchronize -----------------------------------------------------------------------------


def test_synchronize_is_a_no_op_on_cpu(fake_cuda, fake_mps) -> None:
    synchronize("cpu")
    synchronize(torch.device("cpu"))
    assert fake_cuda.synchronized == []
    assert fake_mps.synchronized == 0


def test_synchronize_waits_for_the_named_cuda_device(fake_cuda, fake_mps) -> None:
    synchronize("cuda:1")
    synchronize(torch.device("cuda", 0))
    assert fake_cuda.synchronized == [torch.device("cuda", 1), torch.device("cuda", 0)]
    assert fake_mps.synchronized == 0


def test_synchronize_waits_for_mps(fake_cuda, fake_mps) -> None:
    synchronize("mps")
    synchronize(torch.device("mps"))
    assert fake_mps.synchronized == 2
    assert fake_cuda.synchronized == []


# --- strings and torch.device objects alike ---------------------------------------------------


@pytest.mark.parametrize("text", ["cpu", "cuda", "cuda:1", "mps"])
def test_every_function_answers_the_same_for_a_string_and_a_torch_device(
    fake_cuda, fake_mps, text
) -> None:
    as_device = torch.device(text)
    for function in (
        dev.backend_name,
        default_amp,
        amp_supported,
        pin_memory_supported,
        describe_device,
        memory_stats,
        lambda spec: resolve_amp("auto", spec),
        lambda spec: resolve_amp(True, spec),
        lambda spec: autocast_unsupported_reason(spec, "fp32"),
        lambda spec: PeakMemory(spec, reader=lambda: (1.0, 2.0)).as_dict(),
    ):
        assert function(text) == function(as_device)
    assert resolve_device(text) == resolve_device(as_device) == as_device


def test_cpu_tensor_peak_bytes_is_the_highest_sum_of_live_tensors_while_it_runs() -> None:
    held = torch.empty(1_000_000)  # before: not counted, also when freed inside

    def work() -> None:
        nonlocal held
        first = torch.empty(250_000)  # 1 MB
        second = torch.empty(125_000)
        del first, held
        third = torch.empty(500_000)  # peak: second + third, 2.5 MB
        del second, third

    assert dev.cpu_tensor_peak_bytes(work) == 2_500_000
