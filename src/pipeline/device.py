"""The one device layer: which backend to run on, its AMP policy, and how to measure it.

Every stage chooses, describes and measures its device through this module, so a
requested backend that is missing fails loudly, in the same words, everywhere. There is
never a silent fallback to CPU.
"""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from pipeline.cpus import usable_cpu_count
from pipeline.errors import ConfigError, PipelineError

BACKEND_PRIORITY = ("cuda", "mps", "cpu")
DISABLE_ENV = "PIPELINE_DISABLE_BACKENDS"
HIDE_CPU_NATIVE_ENV = "PIPELINE_HIDE_CPU_NATIVE"
PRECISIONS = ("fp32", "fp16", "bf16")
# What `precision: auto` trains in where AMP is on by default (CUDA).
AUTO_DTYPE = "fp16"
# CPU features (torch.cpu.get_capabilities() keys) that compute in each reduced precision
# natively: x86 AVX-512 and AMX, Arm's bf16/fp16 extensions. Merely having oneDNN kernels for
# a dtype (torch.ops.mkldnn._is_mkldnn_bf16_supported) is not on the list: it is true on any
# AVX-512 CPU, where bf16 is emulated and slower than fp32.
CPU_NATIVE_FEATURES = {
    "bf16": ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16"),
    "fp16": ("avx512_fp16", "amx_fp16", "fp16_arith"),
}
# Older torch has only private probes, and for x86 only.
_CPU_PRIVATE_PROBES = {
    "bf16": ("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
    "fp16": ("_is_amx_fp16_supported",),
}
_MB = 1024 * 1024
_T = TypeVar("_T")
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# First torch releases with MPS autocast for each dtype, and with GradScaler("mps").
_MPS_AUTOCAST_SINCE = {"fp16": (2, 5), "bf16": (2, 6)}
_MPS_GRAD_SCALER_SINCE = (2, 8)

DeviceLike = str | torch.device


class DeviceNotAvailableError(PipelineError, RuntimeError):
    """A backend was asked for by name and is not usable here (or the name is unknown)."""


@dataclass(frozen=True)
class BackendStatus:
    """Whether a backend can be used in this process, and if not, the likely reason."""

    name: str
    available: bool
    reason: str | None = None


def backend_name(backend: DeviceLike) -> str:
    """The backend part of a device spec ('cuda:1' -> 'cuda'); unknown names raise."""
    text = backend.type if isinstance(backend, torch.device) else str(backend).strip().lower()
    name = text.partition(":")[0]
    if name not in BACKEND_PRIORITY:
        raise DeviceNotAvailableError(
            f"Unknown device {str(backend)!r}: valid choices are {_valid_choices()}."
        )
    return name


def as_device(device: DeviceLike) -> torch.device:
    """A torch.device from a spec in any letter case ('CUDA:1' works as well as 'cuda:1')."""
    return device if isinstance(device, torch.device) else torch.device(str(device).strip().lower())


def disabled_backends() -> frozenset[str]:
    """Backends hidden by the environment switch, so users and tests can force the absent case."""
    names = {part.strip().lower() for part in os.environ.get(DISABLE_ENV, "").split(",")}
    names.discard("")
    hideable = {"cuda", "mps"}
    unknown = sorted(names - hideable)
    if unknown:
        raise ConfigError(
            f"{DISABLE_ENV}={os.environ[DISABLE_ENV]!r} names {', '.join(unknown)}, which cannot be "
            f"disabled: it may list only {', '.join(sorted(hideable))} (cpu is always available)."
        )
    return frozenset(names)


def backend_status(name: str) -> BackendStatus:
    """Probe one backend; the reason says what a user would have to change to get it."""
    name = backend_name(name)
    hidden = disabled_backends()  # validated on every probe, so a bad switch fails for cpu too
    if name == "cpu":
        return BackendStatus("cpu", True)
    if name in hidden:
        return BackendStatus(name, False, f"disabled by the environment variable {DISABLE_ENV}")
    reason = _cuda_missing_reason() if name == "cuda" else _mps_missing_reason()
    return BackendStatus(name, reason is None, reason)


def _cuda_missing_reason() -> str | None:
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return (
            f"this torch build ({torch.__version__}) has no CUDA support; install a CUDA build of "
            "PyTorch to use an NVIDIA GPU"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES is set to {visible!r}, which hides every CUDA device"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        driver = (
            "" if os.path.exists("/proc/driver/nvidia/version") else " (no NVIDIA driver is loaded)"
        )
        return f"no CUDA device is visible{driver}: torch {torch.__version__} built for CUDA {torch.version.cuda} found no usable GPU"
    return None


def cuda_build_without_gpu() -> bool:
    """A CUDA build of torch that finds no usable GPU here (as `backend_status` tells it: none
    visible, or every one hidden): most Linux CPU machines, since pip's default torch for Linux
    is a CUDA build."""
    return torch.version.cuda is not None and _cuda_missing_reason() is not None


def _mps_missing_reason() -> str | None:
    if not torch.backends.mps.is_built():
        where = (
            ""
            if sys.platform == "darwin"
            else f"; MPS needs an Apple-silicon Mac and this is {platform.system()}"
        )
        return f"MPS is not built into this torch build ({torch.__version__}){where}"
    if not torch.backends.mps.is_available():
        if sys.platform != "darwin":
            return f"MPS needs an Apple-silicon Mac and this is {platform.system()}"
        return (
            f"MPS is built but not available: it needs macOS 12.3 or newer on Apple silicon "
            f"(this is macOS {platform.mac_ver()[0] or 'unknown'} on {platform.machine()})"
        )
    return None


def available_backends() -> list[str]:
    """Usable backends in priority order; 'cpu' is always present and last."""
    return [name for name in BACKEND_PRIORITY if backend_status(name).available]


def _valid_choices() -> str:
    return "auto, cpu, cuda, cuda:N, mps"


def resolve_device(spec: DeviceLike | None = "auto") -> torch.device:
    """Turn a device spec into a usable device, or raise DeviceNotAvailableError saying why not."""
    text = "auto" if spec is None else str(spec).strip().lower()
    if text in ("", "auto"):
        return torch.device(available_backends()[0])
    name, has_index, index_text = text.partition(":")
    if name not in BACKEND_PRIORITY or (has_index and not index_text.isdigit()):
        raise DeviceNotAvailableError(
            f"Unknown device {str(spec)!r}: valid choices are {_valid_choices()}."
        )
    status = backend_status(name)
    if not status.available:
        raise DeviceNotAvailableError(
            f"Device {str(spec)!r} is not available: {status.reason}. Available backends: "
            f"{available_backends()}. Ask for one of those, or 'auto' to take the best one."
        )
    if not has_index:
        return torch.device(name)
    index = int(index_text)
    count = torch.cuda.device_count() if name == "cuda" else 1
    if index >= count:
        visible = f"{name}:0" if count == 1 else f"{name}:0 to {name}:{count - 1}"
        raise DeviceNotAvailableError(
            f"Device {str(spec)!r} is not available: index {index} is out of range, only {count} "
            f"{name} device(s) are visible ({visible}). Available backends: {available_backends()}."
        )
    return torch.device(name, index)


def default_amp(backend: DeviceLike) -> bool:
    """AMP policy: on for CUDA; off for MPS (autocast measured slower there) and CPU."""
    return backend_name(backend) == "cuda"


def amp_supported(backend: DeviceLike) -> bool:
    """Whether the static policy may switch AMP on: never on CPU, where autocast is slower than
    fp32 without native bf16/fp16 (`precision: measured` may choose it where it measured faster)."""
    return backend_name(backend) in ("cuda", "mps")


def resolve_amp(requested: str | bool | None, backend: DeviceLike) -> bool:
    """Whether a run uses AMP: 'auto'/None follow the backend's default; True needs support."""
    if requested is None or requested == "auto":
        return default_amp(backend)
    if requested is True:
        return amp_supported(backend)
    if requested is False:
        return False
    raise ConfigError(
        f"Autocast switch {requested!r} is not understood: it is 'auto', True or False. The "
        "config key amp was replaced by precision (auto, fp32, fp16, bf16 or measured): "
        "precision=fp32 is AMP off, fp16 or bf16 is AMP on in that precision."
    )


def training_precision(requested: str, backend: DeviceLike) -> str:
    """The precision a run really trains in for the config's `precision` (not measured).

    auto follows the backend's AMP default (AUTO_DTYPE where it is on). fp16 or bf16 is
    honoured where AMP may be switched on, and on a CPU that computes it natively (by the test
    `precision: measured` applies there), though AMP stays off by default on every CPU
    (`default_amp`, `amp_supported`); elsewhere the run trains in fp32.
    """
    if requested == "auto":
        return AUTO_DTYPE if resolve_amp("auto", backend) else "fp32"
    if requested not in PRECISIONS:
        raise ConfigError(
            f"precision={requested!r} is not understood: use auto, fp32, fp16, bf16 or measured."
        )
    if requested == "fp32" or resolve_amp(True, backend):
        return requested
    if (
        backend_name(backend) == "cpu"
        and measured_precision_refused_reason(backend, requested) is None
    ):
        return requested
    return "fp32"


def run_precision(
    requested: str, backend: DeviceLike, measured: str | None = None, action: str = "train"
) -> str:
    """The precision a run trains, evaluates and profiles in, `precision: measured` included.

    With 'measured' the precision comes from the benchmarks (`pipeline.measured`), and must be
    one the backend may train in when measured; every other value follows `training_precision`.
    `action` (train, evaluate, predict, profile) words the error: a checkpoint is most often
    evaluated on another machine than the one that chose its precision.
    """
    if requested != "measured":
        return training_precision(requested, backend)
    if measured is None:
        raise ConfigError(
            "precision=measured takes its precision from benchmark records, and none was given "
            "(python -m pipeline train reads them from --bench DIR, default results/bench)."
        )
    reason = measured_precision_refused_reason(backend, measured)
    if reason:
        advice = "" if action == "train" else f" Give --precision fp32 to {action} in fp32 here."
        raise ConfigError(
            f"precision=measured cannot {action} in {measured} on {backend}: {reason}.{advice}"
        )
    return measured


@dataclass(frozen=True)
class CpuNativePrecision:
    """Whether this CPU computes in a reduced precision natively, and what says so."""

    precision: str
    native: bool
    evidence: str
    hidden: bool = False
    features: Mapping[str, bool] = field(default_factory=dict)


def hidden_cpu_precisions() -> frozenset[str]:
    """Reduced precisions whose native CPU support the environment hides (to try the absent case)."""
    names = {part.strip().lower() for part in os.environ.get(HIDE_CPU_NATIVE_ENV, "").split(",")}
    names.discard("")
    unknown = sorted(names - set(CPU_NATIVE_FEATURES))
    if unknown:
        raise ConfigError(
            f"{HIDE_CPU_NATIVE_ENV}={os.environ[HIDE_CPU_NATIVE_ENV]!r} names {', '.join(unknown)}: "
            f"it may list only {', '.join(CPU_NATIVE_FEATURES)}."
        )
    return frozenset(names)


def _cpu_capabilities() -> tuple[dict[str, bool], str] | None:
    """CPU features from torch's own query (newest torch), else its private x86 probes."""
    query = getattr(torch.cpu, "get_capabilities", None)
    if query is not None:
        try:
            found = dict(query())
        except (RuntimeError, AttributeError, TypeError, ValueError):
            found = None
        if found is not None:
            return {
                key: value is True for key, value in found.items()
            }, "torch.cpu.get_capabilities()"
    probes = {name for names in _CPU_PRIVATE_PROBES.values() for name in names}
    present = {
        name: getattr(torch.cpu, name) for name in sorted(probes) if hasattr(torch.cpu, name)
    }
    if not present:
        return None
    return {name: bool(probe()) for name, probe in present.items()}, "torch.cpu private probes"


def cpu_native_precision(precision: str) -> CpuNativePrecision:
    """Native bf16/fp16 compute on this CPU, from torch's capability queries (never from oneDNN)."""
    if precision not in CPU_NATIVE_FEATURES:
        raise ConfigError(f"Unknown reduced precision {precision!r}: choose bf16 or fp16.")
    hidden = precision in hidden_cpu_precisions()
    queried = _cpu_capabilities()
    if queried is None:
        return CpuNativePrecision(
            precision,
            False,
            f"unknown: torch {torch.__version__} has no CPU capability query",
            hidden,
        )
    capabilities, source = queried
    keys = CPU_NATIVE_FEATURES[precision] + _CPU_PRIVATE_PROBES[precision]
    features = {key: capabilities[key] for key in keys if key in capabilities}
    native = any(features.values())
    listed = ", ".join(f"{key}={'yes' if on else 'no'}" for key, on in features.items())
    evidence = f"{source}: {listed or 'no ' + precision + ' feature reported'}"
    if hidden:
        evidence += f"; hidden by {HIDE_CPU_NATIVE_ENV}"
    return CpuNativePrecision(precision, native and not hidden, evidence, hidden, features)


def measured_precision_refused_reason(backend: DeviceLike, precision: str) -> str | None:
    """Why `precision: measured` may not train in `precision` here, or None.

    On CUDA and MPS any precision autocast can run qualifies (the benchmark then decides). On a
    CPU a reduced precision qualifies only where the CPU computes in it natively: elsewhere CPU
    autocast is far slower than fp32, whatever one noisy benchmark might suggest.
    """
    if precision == "fp32":
        return None
    reason = autocast_unsupported_reason(backend, precision)
    if reason:
        return reason
    if backend_name(backend) == "cpu":
        native = cpu_native_precision(precision)
        if not native.native:
            return f"this CPU has no native {precision} instructions ({native.evidence})"
    return None


def measured_refusals(backend: DeviceLike) -> dict[str, str | None]:
    """For each reduced precision, why `precision: measured` may not train in it here (None: it may)."""
    return {
        precision: measured_precision_refused_reason(backend, precision) for precision in _DTYPES
    }


def require_precision(device: DeviceLike, precision: str, stage: str) -> None:
    """Fail before any work when `stage` (training, evaluation, profiling) cannot run `precision`."""
    reason = autocast_unsupported_reason(device, precision)
    if reason:
        raise ConfigError(
            f"Cannot run {stage} in {precision} on {device}: {reason}. Set precision to fp32, "
            "or to another precision."
        )


def autocast(device: DeviceLike, precision: str) -> contextlib.AbstractContextManager:
    """The autocast context of a precision on a device: nothing for fp32.

    The one place that turns a precision name into autocast, for training, evaluation, the
    benchmarks and the profiler alike, so all four run the same arithmetic.
    """
    dtype = autocast_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=backend_name(device), dtype=dtype)


def set_kernel_flags(device: DeviceLike, deterministic: bool) -> None:
    """Kernel selection as training uses it: deterministic kernels, or cuDNN's autotuner on CUDA."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    elif backend_name(device) == "cuda":
        torch.backends.cudnn.benchmark = True


def autocast_unsupported_reason(backend: DeviceLike, precision: str) -> str | None:
    """Why autocast in this precision cannot run on this backend with this torch, or None."""
    if precision == "fp32":
        return None
    if precision not in _DTYPES:
        raise ConfigError(
            f"Unknown precision {precision!r}: choose one of {', '.join(PRECISIONS)}."
        )
    name = backend_name(backend)
    version = torch.__version__
    if name == "mps" and _torch_version() < _MPS_AUTOCAST_SINCE[precision]:
        since = ".".join(map(str, _MPS_AUTOCAST_SINCE[precision]))
        return f"{precision} autocast on MPS needs torch >= {since} (this is {version})"
    if name == "mps" and precision == "fp16" and _torch_version() < _MPS_GRAD_SCALER_SINCE:
        since = ".".join(map(str, _MPS_GRAD_SCALER_SINCE))
        return f"fp16 training on MPS needs GradScaler('mps'), which needs torch >= {since} (this is {version})"
    if name == "cuda" and precision == "bf16" and _cuda_bf16_unsupported():
        return "this GPU has no bf16 support (compute capability below 8.0)"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autocast(device_type=name, dtype=_DTYPES[precision]):
                pass
        except (RuntimeError, ValueError) as error:
            return f"torch {version} cannot autocast to {precision} on {name}: {error}"
    disabled = [str(w.message) for w in caught if "autocast" in str(w.message).lower()]
    if disabled:
        return f"torch {version} disables {precision} autocast on {name}: {disabled[0]}"
    return None


def _cuda_bf16_unsupported() -> bool:
    try:
        return not torch.cuda.is_bf16_supported()
    except (RuntimeError, AssertionError):
        return False


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a precision name; None for fp32 (no autocast)."""
    if precision == "fp32":
        return None
    if precision not in _DTYPES:
        raise ConfigError(
            f"Unknown precision {precision!r}: choose one of {', '.join(PRECISIONS)}."
        )
    return _DTYPES[precision]


def pin_memory_supported(backend: DeviceLike) -> bool:
    """Pinned host memory only speeds up copies to a CUDA device."""
    return backend_name(backend) == "cuda"


def describe_device(backend: DeviceLike) -> str:
    """A one-line human description; never raises, also when the backend is absent."""
    try:
        name = backend_name(backend)
    except DeviceNotAvailableError:
        return f"unknown device {str(backend)!r}"
    if name == "cpu":
        return "CPU"
    try:
        status = backend_status(name)
    except PipelineError as error:
        return f"{name.upper()} (unknown: {error})"
    if not status.available:
        return f"{name.upper()} (not available: {status.reason})"
    if name == "mps":
        return f"MPS (Apple GPU, macOS {platform.mac_ver()[0] or 'unknown'})"
    try:
        props = torch.cuda.get_device_properties(as_device(backend).index or 0)
        gib = props.total_memory / 1024**3
        return f"CUDA: {props.name}, {gib:.0f} GiB, sm_{props.major}{props.minor}"
    except Exception as error:  # a broken driver must not break a description
        return f"CUDA (device properties unreadable: {error})"


def memory_stats(device: DeviceLike) -> dict[str, float]:
    """Current device memory in MB; {} on CPU, where device memory is host memory."""
    name = backend_name(device)
    if name == "cuda":
        dev = as_device(device)
        return {
            "allocated_mb": torch.cuda.memory_allocated(dev) / _MB,
            "reserved_mb": torch.cuda.memory_reserved(dev) / _MB,
            "peak_allocated_mb": torch.cuda.max_memory_allocated(dev) / _MB,
            "peak_reserved_mb": torch.cuda.max_memory_reserved(dev) / _MB,
        }
    if name == "mps":
        stats = {
            "allocated_mb": torch.mps.current_allocated_memory() / _MB,
            "driver_allocated_mb": torch.mps.driver_allocated_memory() / _MB,
        }
        if hasattr(torch.mps, "recommended_max_memory"):
            stats["recommended_max_mb"] = torch.mps.recommended_max_memory() / _MB
        return stats
    return {}


MemoryReader = Callable[[], tuple[float, float]]


def _read_mps_memory() -> tuple[float, float]:
    return torch.mps.current_allocated_memory() / _MB, torch.mps.driver_allocated_memory() / _MB


def _mps_accelerator_peak_available() -> bool:
    """Newer torch wires MPS into torch.accelerator's allocator statistics; use them if present."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not hasattr(accelerator, "memory_stats"):
        return False
    try:
        current = accelerator.current_accelerator()
        return (
            current is not None
            and current.type == "mps"
            and ("allocated_bytes.all.peak" in accelerator.memory_stats())
        )
    except (RuntimeError, AttributeError, TypeError, ValueError):
        return False


@dataclass(frozen=True)
class _Kept:
    """The peaks a span reached before the work a `PeakMemory` set aside."""

    peak_mb: float = 0.0
    reserved_mb: float = 0.0
    host_peak_rss_mb: float = 0.0


class PeakMemory:
    """Peak device memory over a span of work, and whether the figure is exact.

    CUDA reads torch's own peak counters (exact). MPS has no peak API up to torch 2.14, so
    it keeps the largest of the samples taken at each `update()`: a lower bound
    (`exact=False`) that every output must label as such. CPU has no device memory: 0.0.

    `exclude_mb`: memory that other work holds throughout the span (the bench's other
    precisions' models, kept for interleaved timing), left out of `peak_mb`; the reserved
    pool cannot be told apart, so `reserved_mb` keeps it.
    """

    def __init__(
        self, device: DeviceLike, reader: MemoryReader | None = None, exclude_mb: float = 0.0
    ) -> None:
        self.device = as_device(device)
        self.exclude_mb = exclude_mb
        self.backend = backend_name(self.device)
        self._accelerator = (
            self.backend == "mps" and reader is None and _mps_accelerator_peak_available()
        )
        self._reader = reader or _read_mps_memory
        self.exact = self.backend != "mps" or self._accelerator
        self._sampled_peak = 0.0
        self._sampled_reserved = 0.0
        self._kept = _Kept()
        self.reset()

    @property
    def label(self) -> str:
        """How to read `peak_mb` in a table: exact, a sampled lower bound, or not applicable."""
        if self.backend == "cpu":
            return "n/a (CPU: see host RSS)"
        return "exact" if self.exact else "lower bound (sampled)"

    def reset(self) -> None:
        self._sampled_peak = 0.0
        self._sampled_reserved = 0.0
        self._kept = _Kept()
        if self.backend == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._accelerator:
            torch.accelerator.reset_peak_memory_stats()
        elif self.backend == "mps":
            self.update()

    def update(self) -> None:
        """Take a sample (MPS); call it where memory is highest, e.g. after optimizer.step()."""
        if self.backend == "mps" and not self._accelerator:
            allocated, reserved = self._reader()
            self._sampled_peak = max(self._sampled_peak, allocated)
            self._sampled_reserved = max(self._sampled_reserved, reserved)

    def set_aside(self, work: Callable[[], _T]) -> _T:
        """Run `work` (another model's steps, amid this span) without its memory in the span's
        peaks: the peaks so far are kept, and the counters, and this process's host peak RSS
        where the system can reset it, start afresh after it."""
        kept = _Kept(
            max(self._kept.peak_mb, self._counted_peak_mb()),
            max(self._kept.reserved_mb, self.reserved_mb),
            max(self._kept.host_peak_rss_mb, host_peak_rss_mb()),
        )
        try:
            return work()
        finally:
            self.reset()
            reset_host_peak_rss()
            self._kept = kept

    def _counted_peak_mb(self) -> float:
        if self.backend == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / _MB
        if self._accelerator:
            return torch.accelerator.max_memory_allocated() / _MB
        return self._sampled_peak

    @property
    def peak_mb(self) -> float:
        peak = max(self._kept.peak_mb, self._counted_peak_mb())
        return max(0.0, peak - self.exclude_mb) if peak else peak

    @property
    def reserved_mb(self) -> float:
        if self.backend == "cuda":
            reserved = torch.cuda.max_memory_reserved(self.device) / _MB
        elif self._accelerator:
            reserved = torch.accelerator.max_memory_reserved() / _MB
        else:
            reserved = self._sampled_reserved
        return max(self._kept.reserved_mb, reserved)

    @property
    def host_peak_rss_mb(self) -> float:
        """This process's peak resident memory (`host_peak_rss_mb()`), less what work set
        aside added where the system could reset the peak after it."""
        return max(self._kept.host_peak_rss_mb, host_peak_rss_mb())

    def as_dict(self) -> dict[str, float | bool | str]:
        return {
            "peak_mb": round(self.peak_mb, 2),
            "reserved_mb": round(self.reserved_mb, 2),
            "exact": self.exact,
            "label": self.label,
        }


def host_peak_rss_mb() -> float:
    """This process's peak resident memory, so CPU runs still report memory."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / _MB if sys.platform == "darwin" else peak / 1024


def reset_host_peak_rss() -> bool:
    """Start the peak resident memory afresh from what is resident now (Linux: clear_refs).

    So that several measurements in one process each report their own peak rather than the
    largest so far; False where the system cannot reset it (the peak then spans the process).
    """
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


def cpu_tensor_peak_bytes(run: Callable[[], object]) -> int:
    """The peak of torch's CPU allocations while `run` runs, above what was held before it.

    From the profiler's memory events (every allocation and free of torch's CPU allocator,
    kernels' own buffers and autograd's included), so it is exact for torch's memory on the
    CPU, where there is no `max_memory_allocated`; Python objects and other libraries are not
    counted (peak RSS sees those, blurred by the C allocator's reuse).
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        run()
    cpu = torch.autograd.DeviceType.CPU
    events = [
        event
        for event in profiler.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type() == cpu
    ]
    held = peak = 0
    for event in sorted(events, key=lambda event: event.start_ns()):
        held += event.nbytes()
        peak = max(peak, held)
    return peak


class DeviceTimer:
    """GPU-side time of a region from device events (CUDA or MPS); `None` where there are none.

    Wall-clock time around a synchronized region includes launch and driver overhead;
    events measure what the GPU itself spent, which is what differs between backends.
    CUDA events are recorded on the current stream of the timed device itself: recorded
    without a stream they go to the current *device's* stream, and nothing makes cuda:1
    current for a run on cuda:1, so they would time an idle stream on cuda:0.
    """

    def __init__(self, device: DeviceLike) -> None:
        self.device = as_device(device)
        name = backend_name(self.device)
        self._events = None
        if name == "cuda":
            self._events = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
        elif name == "mps" and hasattr(torch.mps, "Event"):
            self._events = (
                torch.mps.Event(enable_timing=True),
                torch.mps.Event(enable_timing=True),
            )

    @property
    def available(self) -> bool:
        return self._events is not None

    def _record(self, event) -> None:
        if self.device.type == "cuda":
            event.record(torch.cuda.current_stream(self.device))
        else:
            event.record()

    def start(self) -> None:
        if self._events:
            self._record(self._events[0])

    def stop_ms(self) -> float | None:
        """Milliseconds between start() and now, after waiting for the device; None without events."""
        if not self._events:
            return None
        self._record(self._events[1])
        self._events[1].synchronize()
        return float(self._events[0].elapsed_time(self._events[1]))


def set_cpu_threads(requested: int | str = "auto") -> int:
    """Set torch's intra-op threads; 'auto' takes every CPU this process may use.

    Snakemake sets OMP_NUM_THREADS to a job's `threads` (1 under `--cores 1`), which would
    time and train CPU runs on one core. The workflow runs those jobs one at a time, so
    they take the cores they may run on, and every record says how many that was.
    """
    try:
        count = usable_cpu_count() if requested in ("auto", None) else int(requested)
    except ValueError:
        count = 0  # refused below, with the value given
    if count < 1:
        raise ConfigError(f"cpu_threads must be 'auto' or a positive integer, got {requested!r}.")
    torch.set_num_threads(count)
    return count


def synchronize(device: DeviceLike) -> None:
    """Wait for queued device work; timings on accelerators mean nothing without it."""
    name = backend_name(device)
    if name == "cuda":
        torch.cuda.synchronize(as_device(device))
    elif name == "mps":
        torch.mps.synchronize()
