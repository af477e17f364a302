"""What this machine offers: versions, CPU, and every backend with the reason it is missing.

The workflow reads the JSON written from `collect()` to decide the benchmark matrix and
to name run folders after the backend that 'auto' picks, without probing torch itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from pipeline import device as dev
from pipeline.cpus import usable_cpu_count

FORMAT = "pipeline.env/1"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU's marketing name where the OS tells it, else the architecture."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    if sys.platform == "darwin":
        import subprocess

        try:
            return (
                subprocess.run(
                    ["sysctl", "-n", "machdep.cpu.brand_string"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout.strip()
                or platform.machine()
            )
        except OSError:
            pass
    return platform.processor() or platform.machine()


def _backend_entry(name: str) -> dict[str, Any]:
    status = dev.backend_status(name)
    entry: dict[str, Any] = {
        "available": status.available,
        "reason": status.reason,
        "description": dev.describe_device(name),
        "amp_default": dev.default_amp(name),
        "amp_supported": dev.amp_supported(name),
        "resolved_amp": {
            key: dev.resolve_amp(value, name)
            for key, value in (("auto", "auto"), ("true", True), ("false", False))
        },
        "precisions": {
            requested: dev.training_precision(requested, name)
            for requested in ("auto", *dev.PRECISIONS)
        },
        "pin_memory": dev.pin_memory_supported(name),
        # why precision=measured may not train in each reduced precision here (null: it may)
        "measured_refused": dev.measured_refusals(name) if status.available else None,
        "error": None,
    }
    if not status.available:
        try:
            dev.resolve_device(name)
        except dev.DeviceNotAvailableError as error:
            entry["error"] = str(error)
    return entry


def _cuda_details() -> dict[str, Any]:
    details: dict[str, Any] = {
        "built": torch.version.cuda is not None,
        "version": torch.version.cuda,
        "cudnn": None,
        "devices": [],
        "visible_devices_env": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    if not dev.backend_status("cuda").available:
        return details
    details["cudnn"] = torch.backends.cudnn.version()
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        details["devices"].append(
            {
                "index": index,
                "name": props.name,
                "total_memory_gib": round(props.total_memory / 1024**3, 1),
                "capability": f"{props.major}.{props.minor}",
                "multiprocessors": props.multi_processor_count,
            }
        )
    return details


def memory_gib() -> float | None:
    """The machine's physical memory: with its CPU model, cores and native precisions, what
    tells two machines apart whose CPUs read the same (compare names them by it); None where
    the OS does not say (Windows has no sysconf)."""
    try:
        return round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1024**3, 1)
    except (AttributeError, ValueError, OSError):
        return None


def collect(requested_device: str | None = None) -> dict[str, Any]:
    """Everything check-env reports; with `requested_device`, also resolve it (raises if absent)."""
    backends = {name: _backend_entry(name) for name in dev.BACKEND_PRIORITY}
    info: dict[str, Any] = {
        "format": FORMAT,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torchvision": _version("torchvision"),
            "snakemake": _version("snakemake"),
            "pipeline": _version("pipeline"),
        },
        "platform": {
            "os": platform.platform(),
            "system": platform.system(),
            "machine": platform.machine(),
            "cpu_model": cpu_model(),
            "cpu_count": os.cpu_count(),
            "memory_gib": memory_gib(),
            "torch_threads": torch.get_num_threads(),
        },
        "backends": backends,
        "cpu_native": {
            precision: {"native": found.native, "evidence": found.evidence, "hidden": found.hidden}
            for precision in ("bf16", "fp16")
            for found in [dev.cpu_native_precision(precision)]
        },
        "available": dev.available_backends(),
        "auto": dev.resolve_device("auto").type,
        "cuda": _cuda_details(),
        "mps": {
            "built": torch.backends.mps.is_built(),
            "available": backends["mps"]["available"],
            "macos": platform.mac_ver()[0] or None,
        },
    }
    if requested_device is not None:
        resolved = dev.resolve_device(requested_device)
        info["requested"] = {
            "device": requested_device,
            "resolved": str(resolved),
            "description": dev.describe_device(resolved),
        }
    return info


def machine() -> dict[str, Any]:
    """The machine a measured figure belongs to, in the keys that tell one machine from another.

    A figure is only meaningful beside the CPU (model, instruction-set level, the features native
    bf16/fp16 rest on), the CPUs and threads it ran with, the GPUs and the software versions.
    """
    native = {precision: dev.cpu_native_precision(precision) for precision in ("bf16", "fp16")}
    gpus = [
        {"name": gpu["name"], "memory_gib": gpu["total_memory_gib"]}
        for gpu in _cuda_details()["devices"]
    ]
    return {
        "cpu_model": cpu_model(),
        "architecture": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_native": {
            precision: {
                "native": found.native,
                "features": sorted(key for key, on in found.features.items() if on),
                "hidden": found.hidden,
            }
            for precision, found in native.items()
        },
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpus": gpus,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


def machine_id(description: dict[str, Any]) -> str:
    """A short, stable name for a machine description: the CPU model and a hash of what differs.

    Two machines with the same CPU model but other features, CPU counts or GPUs get other ids;
    software versions are left out, so an upgraded torch stays the same machine.
    """
    hardware = {
        key: description[key]
        for key in ("cpu_model", "architecture", "cpu_capability", "usable_cpus", "gpus")
    }
    hardware["cpu_native"] = {
        precision: found["features"] for precision, found in description["cpu_native"].items()
    }
    digest = hashlib.sha1(json.dumps(hardware, sort_keys=True).encode()).hexdigest()[:8]
    words = "".join(c if c.isalnum() else " " for c in description["cpu_model"].lower())
    slug = "-".join(w for w in words.split() if w not in {"r", "tm", "cpu", "processor"})
    return f"{slug or 'cpu'}-{digest}"


def format_table(info: dict[str, Any]) -> str:
    """A readable summary of `collect()` for the terminal."""
    versions = ", ".join(f"{key} {value}" for key, value in info["versions"].items() if value)
    plat = info["platform"]
    lines = [
        f"Versions: {versions}",
        f"Machine:  {plat['os']}; {plat['cpu_model']}, {plat['cpu_count']} cores, "
        f"torch uses {plat['torch_threads']} threads",
        "",
        f"{'backend':<8} {'available':<10} {'AMP default':<12} {'AMP ok':<7} {'pin mem':<8} detail",
    ]
    for name, entry in info["backends"].items():
        detail = entry["description"] if entry["available"] else f"missing: {entry['reason']}"
        lines.append(
            f"{name:<8} {'yes' if entry['available'] else 'no':<10} "
            f"{'on' if entry['amp_default'] else 'off':<12} "
            f"{'yes' if entry['amp_supported'] else 'no':<7} "
            f"{'yes' if entry['pin_memory'] else 'no':<8} {detail}"
        )
    lines += ["", f"auto resolves to: {info['auto']}"]
    for precision, native in info["cpu_native"].items():
        lines.append(
            f"CPU native {precision}: {'yes' if native['native'] else 'no'} ({native['evidence']})"
        )
    cuda = info["cuda"]
    if cuda["built"]:
        lines.append(f"CUDA: torch built for {cuda['version']}, cuDNN {cuda['cudnn']}")
        for gpu in cuda["devices"]:
            lines.append(
                f"  cuda:{gpu['index']} {gpu['name']}, {gpu['total_memory_gib']} GiB, "
                f"sm {gpu['capability']}, {gpu['multiprocessors']} SMs"
            )
    if info["mps"]["built"] or info["mps"]["macos"]:
        lines.append(
            f"MPS: built {info['mps']['built']}, available {info['mps']['available']}, "
            f"macOS {info['mps']['macos']}"
        )
    if "requested" in info:
        req = info["requested"]
        lines.append(
            f"requested {req['device']!r} resolves to {req['resolved']}: {req['description']}"
        )
    return "\n".join(lines)
