"""Machines side by side: several summary.json files (one per machine, cluster partition or GPU
model) as one comparison, which `python -m pipeline compare` writes as an HTML page and as
Markdown, both from the same tables.

Figures are set side by side only where they are comparable: speed where the summaries timed
the same configuration (their speed hash: model, batch, image size, memory format; there each
machine's speed against the reference's, the first by name, with its interval:
machine_speed.py), training time and accuracy where they ran the same settings on the same
data (their accuracy hash: of a user's data set, its annotation files' digests, not their
paths); otherwise the comparison says what differs and keeps them apart. Machines are ordered
by name, so the same summaries always give the same tables (docs embed the Markdown and a test
regenerates it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import ResultsFileError
from pipeline.machine_names import distinguished, memory_text, threads_text
from pipeline.machine_speed import (
    against,
    answer_against,
    answer_entry,
    carries_step_times,
    speed_cell,
    speed_text,
    timed_in,
    without_step_times,
)
from pipeline.report.formatting import (
    backend_label,
    fmt_seconds,
    fmt_with_interval,
    setting_label,
)
from pipeline.setting_groups import differing_keys
from pipeline.summary.annotations import USER_FORMATS, identity
from pipeline.summary.read import read_summary

MAX_DIFFERENCES = 6  # differing keys named before "and N more"


@dataclass(frozen=True)
class Machine:
    """One summary, named for the columns and rows that show it."""

    name: str
    path: str
    summary: dict[str, Any]


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]


@dataclass
class Section:
    """A part of the comparison: its tables and the notes that say what is not compared."""

    id: str
    title: str
    intro: str
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def read_machines(paths: Sequence[str | Path]) -> list[Machine]:
    """The summaries in `paths` (each checked: a bad one is a ResultsFileError naming it),
    ordered by machine name and path. Machines of one name are told apart by what they are
    (`distinguished`), and where even that is the same, by their paths."""
    summaries = [(str(path), read_summary(path)) for path in paths]
    refuse_repeated(summaries)
    named = distinguished([summary for _, summary in summaries])
    found = sorted(
        ((name, path, summary) for name, (path, summary) in zip(named, summaries, strict=True)),
        key=lambda item: item[:2],
    )
    names = [name for name, _, _ in found]
    return [
        Machine(f"{name} ({path})" if names.count(name) > 1 else name, path, summary)
        for name, path, summary in found
    ]


def refuse_repeated(summaries: list[tuple[str, dict[str, Any]]]) -> None:
    """A summary named twice (or a copy of one) would be set beside itself, every figure
    "matching": a ResultsFileError naming both, since a typo in a list of paths is the likely
    cause."""
    for index, (path, summary) in enumerate(summaries):
        for earlier, seen in summaries[:index]:
            if Path(earlier).resolve() == Path(path).resolve():
                why = "names the same file"
            elif seen == summary:
                why = "holds the same summary (a copy of it)"
            else:
                continue
            raise ResultsFileError(
                f"{path} {why} as {earlier}: compare sets different runs side by side, so "
                "name each summary.json once (one per machine, cluster partition or GPU model)."
            )


def compare(machines: list[Machine]) -> list[Section]:
    """The comparison's sections: the machines, their answers, speed, training and accuracy."""
    return [machines_section(machines), answers_section(machines), *speed_and_training(machines)]


# ---- the machines and their answers -----------------------------------------------------------


def machines_section(machines: list[Machine]) -> Section:
    facts = [
        ("Summary", lambda m, s: m.path),
        ("CPU", cpu_text),
        ("Native bf16 / fp16", native_text),
        ("GPUs", gpu_text),
        ("torch, CUDA, cuDNN", versions_text),
        ("OS", lambda m, s: (s["machine"] or {}).get("os") or "n/a"),
        ("Commit", commit_text),
        ("Timed configuration", lambda m, s: timed_text(s["comparison"]["speed"])),
        ("Accuracy settings (hash)", lambda m, s: hash_text(s["comparison"]["accuracy"])),
    ]
    rows = [[name, *(describe(m, m.summary) for m in machines)] for name, describe in facts]
    return Section(
        "machines",
        "Machines",
        "Each column is one summary.json: the machine as its environment check described it.",
        [Table("", ["", *(m.name for m in machines)], rows)],
    )


def cpu_text(machine: Machine, summary: dict[str, Any]) -> str:
    found = summary["machine"]
    if found is None:
        return "n/a (no env.json)"
    memory = found.get("memory_gib")  # absent in summaries made before it was recorded
    return (
        f"{found['cpu_model'] or 'n/a'}, {found['cpu_count'] or 'n/a'} cores, "
        + ("" if memory is None else f"{memory_text(memory)} memory, ")
        + threads_text(found["torch_threads"])
    )


def native_text(machine: Machine, summary: dict[str, Any]) -> str:
    native = (summary["machine"] or {}).get("cpu_native") or {}
    return " / ".join(
        "n/a" if precision not in native else ("yes" if native[precision]["native"] else "no")
        for precision in ("bf16", "fp16")
    )


def gpu_text(machine: Machine, summary: dict[str, Any]) -> str:
    gpus = (summary["machine"] or {}).get("gpus") or []
    if not gpus:
        return "none"
    return "; ".join(
        f"{gpu['name']} ({memory_text(gpu['memory_gib'])}, compute capability "
        f"{gpu['capability'] or 'n/a'})"
        for gpu in gpus
    )


def versions_text(machine: Machine, summary: dict[str, Any]) -> str:
    versions = (summary["machine"] or {}).get("versions") or {}
    return ", ".join(versions.get(key) or "none" for key in ("torch", "cuda", "cudnn"))


def commit_text(machine: Machine, summary: dict[str, Any]) -> str:
    commit = summary["commit"]
    if commit["id"] is None:
        return "unknown"
    dirty = changed_files(commit)
    return commit["id"][:12] + (f" ({dirty} file(s) changed or untracked)" if dirty else "")


def changed_files(commit: dict[str, Any]) -> int:
    return (commit["changed"] or 0) + (commit["untracked"] or 0)


def timed_text(speed: dict[str, Any] | None) -> str:
    if speed is None:
        return "no training benchmark"
    settings = speed["settings"]
    layout = "channels_last" if settings["channels_last"] else "contiguous"
    return (
        f"{settings['model'].get('name', 'n/a')}, batch {settings['batch_size']}, "
        f"{settings['image_size']} px, {layout}"
    )


def hash_text(basis: dict[str, Any] | None) -> str:
    return "not recorded (no config given)" if basis is None else basis["hash"][:12]


def answers_section(machines: list[Machine]) -> Section:
    rows = [[m.name, *answer_cells(m.summary["answer"])] for m in machines]
    section = Section(
        "answers",
        "What each machine should train with",
        "Each machine's answer, its speed-up against its own CPU fp32 (95% interval) and "
        "whether the shipped defaults of config/config.yaml already train that way.",
        [
            Table(
                "",
                [
                    "Machine",
                    "Train with",
                    "Speed-up against its CPU fp32 (95% interval)",
                    "Numerics",
                    "Shipped defaults train this way",
                ],
                rows,
            )
        ],
    )
    section.notes += other_code(machines)
    section.notes += not_compared(machines, "speed", "timed different configurations")
    return section


def answer_cells(answer: dict[str, Any]) -> list[str]:
    chosen = answer["chosen"]
    if chosen is None:
        why = (
            "no training benchmark"
            if answer["model"] is None
            else "nothing with acceptable numerics"
        )
        return [f"no answer: {why}", "n/a", "n/a", "n/a"]
    speed = (
        "1.00× (the baseline itself)"
        if chosen["is_cpu_fp32"]
        else speed_text(chosen["vs_cpu_fp32"])
    )
    numerics = "fp32 (the reference)" if chosen["numerics"] == "reference" else "acceptable"
    shipped = answer["shipped_default"]
    if chosen["is_shipped_default"] is None:
        default = "n/a"
    elif chosen["is_shipped_default"]:
        default = "yes"
    else:
        default = f"no: they train with {setting_label(shipped['backend'], shipped['precision'])}"
    return [setting_label(chosen["backend"], chosen["precision"]), speed, numerics, default]


# ---- speed, training and accuracy, each within its comparable group ----------------------------


def groups(machines: list[Machine], aspect: str) -> list[list[Machine]]:
    """Machines whose `aspect` basis (speed or accuracy) is equal, in order; one without a
    basis is a group of its own."""
    found: dict[Any, list[Machine]] = {}
    for index, machine in enumerate(machines):
        basis = machine.summary["comparison"][aspect]
        found.setdefault(index if basis is None else basis["hash"], []).append(machine)
    return list(found.values())


def not_compared(machines: list[Machine], aspect: str, what: str) -> list[str]:
    """A note per group after the first: which machines are kept apart, and what differs."""
    found = groups(machines, aspect)
    if len(found) < 2:
        return []
    first = found[0][0].summary["comparison"][aspect]
    against = " and ".join(m.name for m in found[0])
    notes = []
    for group in found[1:]:
        basis = group[0].summary["comparison"][aspect]
        names = " and ".join(m.name for m in group)
        if basis is None or first is None:
            sides = ((against, first), (names, basis))
            missing = " and ".join(side for side, recorded in sides if recorded is None)
            verb = "records" if missing in (against, names) else "record"
            why = f"{missing} {verb} no settings to compare by (summarised without a config)"
        else:
            why = f"they {what} ({differences(compared(first), compared(basis))})"
        notes.append(f"Not compared: {against} with {names}: {why}.")
    return notes


def compared(basis: dict[str, Any]) -> dict[str, Any]:
    """A basis's settings as they are compared: for a user's data set recorded with its
    annotation files' digests (shortened as hashes are shown), the digests in place of paths."""
    digests = basis.get("annotations")
    if digests is None:
        return basis["settings"]
    return identity(basis["settings"], {split: digest[:12] for split, digest in digests.items()})


def identified_by_paths(machines: list[Machine]) -> list[str]:
    """A note per summary of a user's data set without its annotations' digests (made before
    summaries recorded them, or where the files could not be read): its data are told apart by
    paths, which is wrong both ways across machines."""
    return [
        f"{m.name} records no digest of its annotation files (a summary made before they were "
        "recorded, or where they could not be read): its data set is told apart by its paths "
        "alone, so the same data at another path are not compared with it, and other data at "
        "the same path would be. Summarize it again where its annotation files are to compare "
        "it by their content."
        for m in machines
        if (basis := m.summary["comparison"]["accuracy"]) is not None
        and (basis["settings"].get("data") or {}).get("format") in USER_FORMATS
        and "annotations" not in basis
    ]


def other_code(group: list[Machine]) -> list[str]:
    """A note where machines set side by side were summarised at different commits or from a
    checkout with changes: their figures may differ by the code, not only by the machine. Two
    without a commit (results outside a git checkout) are not flagged: nothing tells."""
    commits = [commit_text(m, m.summary) for m in group]
    dirty = any(changed_files(m.summary["commit"]) for m in group)
    if len(set(commits)) < 2 and not dirty:
        return []
    made = "; ".join(f"{m.name}: commit {c}" for m, c in zip(group, commits, strict=True))
    return [
        f"The code may differ ({made}): these figures may differ by the code, "
        "not only by the machine."
    ]


def differences(first: dict[str, Any], other: dict[str, Any]) -> str:
    keys = differing_keys(first, other)
    shown = [
        f"{key}: {lookup(first, key)} vs {lookup(other, key)}" for key in keys[:MAX_DIFFERENCES]
    ]
    more = len(keys) - len(shown)
    return "; ".join(shown) + (f"; and {more} more" if more > 0 else "")


def lookup(settings: dict[str, Any], dotted: str) -> str:
    value: Any = settings
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return "(not set)"
        value = value[part]
    return str(value)


def speed_and_training(machines: list[Machine]) -> list[Section]:
    speed = Section(
        "speed",
        "Speed of every backend and precision",
        "Median milliseconds per step and the speed-up against the same machine's CPU fp32 of "
        "the same mode, with its 95% interval; side by side only where the machines timed the "
        "same configuration. There each machine is also set against the reference (the first "
        "by name): its answer against the reference's, and each backend and precision against "
        "the same there, as a speed-up with its 95% interval (above 1: faster). That interval "
        "resamples each summary's one benchmark run (its model instances, then their steps), "
        "not how much a rerun on the same machine would differ (on a virtual or shared "
        "machine, maybe more): a verdict is one between these runs.",
    )
    for group in groups(machines, "speed"):
        if len(group) > 1 or len(machines) == 1:
            speed.tables.append(speed_table(group))
            speed.notes += other_code(group)
        if len(group) > 1:
            speed.tables += against_reference(group)
            speed.notes += without_step_times(
                m.name for m in group if not carries_step_times(m.summary)
            )
    speed.notes += not_compared(machines, "speed", "timed different configurations")
    training = Section(
        "training",
        "Training time and accuracy",
        "Each trained run: time per epoch, time to the end of training, and its leading F1 "
        "(at the threshold picked on validation, applied to the held-out test split, where there "
        "is one) and AP@.5, with 95% intervals; side by side only where the machines ran the same "
        "settings.",
    )
    for group in groups(machines, "accuracy"):
        if len(group) > 1 or len(machines) == 1:
            training.tables.append(training_table(group))
            training.notes += other_code(group)
    training.notes += not_compared(machines, "accuracy", "ran different settings")
    training.notes += identified_by_paths(machines)
    return [speed, training]


def speed_table(group: list[Machine]) -> Table:
    entries, keys = timed_in([m.summary for m in group])
    rows = [
        [mode, backend_label(backend), precision]
        + [speed_cell(found.get((mode, backend, precision))) for found in entries]
        for mode, backend, precision in keys
    ]
    basis = group[0].summary["comparison"]["speed"]
    return Table(
        timed_text(basis), ["Mode", "Backend", "Precision", *(m.name for m in group)], rows
    )


def against_reference(group: list[Machine]) -> list[Table]:
    """Each machine against the reference, the group's first by name (not by the order given:
    the same summaries give the same tables): its answer against the reference's answer, then
    each backend and precision against the same on the reference."""
    first, answers = group[0], [answer_entry(m.summary) for m in group]
    rows = [
        [m.name, *answer_against(entry, answers[0], m is first)]
        for m, entry in zip(group, answers, strict=True)
    ]
    answers_table = Table(
        f"Each machine's answer against {first.name}'s answer",
        ["Machine", "Train with", "Median per step", f"Against {first.name} (95% interval)"],
        rows,
    )
    if not carries_step_times(first.summary) or not any(
        carries_step_times(m.summary) for m in group[1:]
    ):  # every cell would say that no interval can be given: the note says it once
        return [answers_table]
    entries, keys = timed_in([m.summary for m in group])
    settings = [
        [key[0], backend_label(key[1]), key[2]]
        + [against(entries[0].get(key), found.get(key)) for found in entries[1:]]
        for key in keys
    ]
    return [
        answers_table,
        Table(
            f"Each backend and precision against the same on {first.name} (95% interval)",
            ["Mode", "Backend", "Precision", *(m.name for m in group[1:])],
            settings,
        ),
    ]


def training_table(group: list[Machine]) -> Table:
    rows = []
    for machine in group:
        for run in machine.summary["runs"]:
            scores = run["scores"]
            where = scores["split"] + (
                ", threshold picked on validation" if scores["f1_threshold"] == "validation" else ""
            )
            rows.append(
                [
                    machine.name,
                    run["name"],
                    str(run["epochs"]) if run["epochs"] is not None else "n/a",
                    fmt_seconds(run["epoch_time_s"]),
                    fmt_seconds(run["wall_time_s"]),
                    f"{fmt_with_interval(scores['f1'], scores['f1_interval'])} ({where})",
                    fmt_with_interval(scores["ap50"], scores["ap50_interval"]),
                ]
            )
    basis = group[0].summary["comparison"]["accuracy"]
    title = "settings " + hash_text(basis) if basis else "settings not recorded"
    headers = [
        "Machine",
        "Run",
        "Epochs",
        "Time per epoch",
        "To the end of training",
        "F1 (95% interval)",
        "AP@.5 (95% interval)",
    ]
    return Table(title, headers, rows)


# ---- Markdown -------------------------------------------------------------------------------


def markdown(paths: Sequence[str | Path]) -> str:
    """The comparison of the summaries in `paths` as Markdown: the same for the same files,
    whatever their order."""
    return markdown_text(compare(read_machines(paths)))


def markdown_text(sections: list[Section]) -> str:
    """Level-3 headings, so that the text sits under a page's own sections when embedded."""
    lines: list[str] = []
    for section in sections:
        lines += [f"### {section.title}", "", section.intro, ""]
        for table in section.tables:
            if table.title:
                lines += [f"{escaped(table.title)}:", ""]
            lines.append("| " + " | ".join(escaped(cell) for cell in table.headers) + " |")
            lines.append("|" + " --- |" * len(table.headers))
            lines += ["| " + " | ".join(escaped(cell) for cell in row) + " |" for row in table.rows]
            lines.append("")
        for note in section.notes:  # a paragraph each: lines of one paragraph would run together
            lines += [escaped(note), ""]
    return "\n".join(lines).rstrip() + "\n"


def escaped(text: str) -> str:
    """A table cell's text as Markdown shows it literally: pipes, angle brackets, line breaks."""
    return (
        text.replace("\\", "\\\\")
        .replace("|", "\\|")
        .replace("<", "&lt;")
        .replace(">", "&gt;")
        .replace("\n", " ")
    )
