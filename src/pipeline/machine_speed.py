"""Speed as `compare` shows it: each benchmark's median and speed-up against its own machine's
CPU fp32, and one machine's speed against another's: the ratio of their median step times with
its 95% interval and verdict, from the function that gives each machine's own speed-ups
(stats.speedup_between), resampling the step times each summary carries.

A summary made before summaries carried step times gives no figure across machines: a ratio of
medians without its interval is no verdict, so the cell says why none is given instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pipeline.report.formatting import fmt_ms, fmt_speedup, setting_label
from pipeline.runs import PRECISIONS
from pipeline.stats import speedup_between
from pipeline.summary.load import BACKENDS, MODES

Setting = tuple[str, str, str]  # mode, backend, precision
NO_STEP_TIMES = "no interval can be given: a summary holds no step times (see below)"


def speed_text(speed: dict[str, Any] | None) -> str:
    """'0.07× (0.07–0.07), slower' and the like: a speed-up with its interval and verdict,
    the verdict left unsaid where it is 'faster' (the ratio says it)."""
    if speed is None:
        return "n/a"
    verdict = speed["verdict"]
    return f"{fmt_speedup(speed)}{'' if verdict == 'faster' else f', {verdict}'}"


def timed(summary: dict[str, Any], model: str | None) -> dict[Setting, dict[str, Any]]:
    """A summary's benchmarks of `model`, by mode, backend and precision."""
    return {
        (entry["mode"], entry["backend"], entry["precision"]): entry
        for entry in summary["benchmarks"]
        if entry["model"] == model
    }


def timed_in(
    summaries: list[dict[str, Any]],
) -> tuple[list[dict[Setting, dict[str, Any]]], list[Setting]]:
    """Each summary's benchmarks of the model their speed basis names (the group's: they timed
    the same configuration), by setting, and every setting any of them timed, in order."""
    basis = summaries[0]["comparison"]["speed"]
    model = None if basis is None else basis["settings"]["model"].get("name")
    entries = [timed(summary, model) for summary in summaries]
    keys = sorted(
        {key for found in entries for key in found},
        key=lambda key: (rank(MODES, key[0]), rank(BACKENDS, key[1]), rank(PRECISIONS, key[2])),
    )
    return entries, keys


def rank(order: Sequence[str], value: str) -> int:
    return order.index(value) if value in order else len(order)


def speed_cell(entry: dict[str, Any] | None) -> str:
    """A benchmark's median and its speed-up against its own machine's CPU fp32."""
    if entry is None:
        return "not run"
    if entry["status"] != "ok":
        return "skipped"
    if (entry["backend"], entry["precision"]) == ("cpu", "fp32"):
        return f"{fmt_ms(entry['median_ms'])} ms, the baseline"
    unsafe = "" if entry["safe"] else ", numerics not acceptable"
    return f"{fmt_ms(entry['median_ms'])} ms, {speed_text(entry['vs_cpu_fp32'])}{unsafe}"


def answer_entry(summary: dict[str, Any]) -> dict[str, Any] | None:
    """The training benchmark of the setting the summary's answer chose; None without one."""
    chosen = summary["answer"]["chosen"]
    if chosen is None:
        return None
    return timed(summary, chosen["model"]).get(("train", chosen["backend"], chosen["precision"]))


def answer_against(
    entry: dict[str, Any] | None, reference: dict[str, Any] | None, is_reference: bool
) -> list[str]:
    """A machine's answer (`answer_entry`), its median step and its speed against the
    reference machine's answer."""
    if is_reference:
        speed = "the reference"
    elif entry is None or reference is None:
        speed = "n/a: no answer on one of the two"
    else:
        speed = against(reference, entry)
    if entry is None:
        return ["no answer", "n/a", speed]
    label = setting_label(entry["backend"], entry["precision"])
    return [label, f"{fmt_ms(entry['median_ms'])} ms", speed]


def carries_step_times(summary: dict[str, Any]) -> bool:
    """Whether each benchmark holds its step times (summaries made before they did hold none)."""
    return all("samples_ms" in entry for entry in summary["benchmarks"])


def against(reference: dict[str, Any] | None, candidate: dict[str, Any] | None) -> str:
    """The candidate benchmark's speed-up over the reference's (another machine's) as a cell,
    '1.40× (1.32–1.49)' above 1 where the candidate stepped faster; else why there is none.
    The two ran in different processes on different machines (no schedule in common), so
    `stats.speedup_between` resamples the sets independently, each over its model instances
    where both summaries name them: a model's steps share its speed mode."""
    if reference is None or candidate is None:
        return "not run on both"
    if "skipped" in (reference["status"], candidate["status"]):
        return "skipped on one"
    if not reference.get("samples_ms") or not candidate.get("samples_ms"):
        return NO_STEP_TIMES
    return speed_text(speedup_between(reference, candidate).as_dict())


def without_step_times(names: Iterable[str]) -> list[str]:
    """The note that says why machines' speed against another machine's is not given."""
    listed = list(names)
    if not listed:
        return []
    one = len(listed) == 1
    return [
        f"No speed against another machine is given for {' and '.join(listed)}: "
        f"{'its summary predates' if one else 'their summaries predate'} summaries carrying "
        "each benchmark's step times, without which the ratio of median step times has no "
        "interval, and a ratio without its interval is no verdict. Rerun python -m pipeline "
        f"summarize on {'that machine' if one else 'each machine'}'s results folder (its "
        f"bench/*.json hold the step times) to compare {'it' if one else 'them'}."
    ]
