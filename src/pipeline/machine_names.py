"""What a machine is called where summaries are set side by side: its GPUs, else its CPU
model, and, where two machines would read the same, what tells them apart.
"""

from __future__ import annotations

from typing import Any


def machine_name(summary: dict[str, Any]) -> str:
    """The GPUs where the machine has any, else the CPU: what a reader knows it by."""
    machine = summary["machine"]
    if machine is None:
        return "unknown machine"
    gpus = [gpu["name"] or "GPU" for gpu in machine["gpus"]]
    if gpus:
        counted = [f"{gpus.count(n)}× {n}" if gpus.count(n) > 1 else n for n in dict.fromkeys(gpus)]
        return " + ".join(counted)
    return machine["cpu_model"] or "unknown CPU"


def distinguished(summaries: list[dict[str, Any]]) -> list[str]:
    """Each summary's machine name, followed, where another machine has the same name, by the
    facts that tell them apart (`machine_facts` that differ among them): a VM's CPU reads as
    "Intel(R) Xeon(R) Processor" on many a different machine."""
    bases = [machine_name(summary) for summary in summaries]
    facts = [machine_facts(summary) for summary in summaries]
    names = []
    for base, own in zip(bases, facts, strict=True):
        alike = [other for name, other in zip(bases, facts, strict=True) if name == base]
        telling = [
            fact for index, fact in enumerate(own) if len({other[index] for other in alike}) > 1
        ]
        names.append(f"{base} ({', '.join(telling)})" if telling else base)
    return names


def machine_facts(summary: dict[str, Any]) -> list[str]:
    """What tells machines of one name apart, in the order a reader weighs it: the CPU's native
    bf16/fp16, its cores, the memory, torch's threads, the GPUs' memory and capability, the CPU
    behind the GPUs, the architecture."""
    machine = summary["machine"] or {}
    native = machine.get("cpu_native") or {}
    fast = [precision for precision in ("bf16", "fp16") if native.get(precision, {}).get("native")]
    gpus = machine.get("gpus") or []
    return [
        f"native {' and '.join(fast)}" if fast else "no native bf16 or fp16",
        f"{machine.get('cpu_count') or 'n/a'} cores",
        memory_fact(machine.get("memory_gib")),
        threads_text(machine.get("torch_threads")),
        "; ".join(
            f"{memory_text(gpu['memory_gib'])}, capability {gpu['capability'] or 'n/a'}"
            for gpu in gpus
        )
        or "no GPU",
        f"CPU {machine.get('cpu_model') or 'n/a'}",
        machine.get("architecture") or "architecture n/a",
    ]


def threads_text(threads: int | None) -> str:
    return f"torch uses {threads or 'n/a'} thread{'' if threads == 1 else 's'}"


def memory_fact(gib: float | None) -> str:
    """'23.6 GiB memory', or that a summary made before env.json recorded it has none."""
    return "memory not recorded" if gib is None else f"{memory_text(gib)} memory"


def memory_text(gib: float | None) -> str:
    return "n/a GiB" if gib is None else f"{gib:.1f} GiB"
