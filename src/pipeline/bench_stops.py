"""When a precision's own steps show that it cannot be faster than fp32 (same backend, model
and mode, in one bench run: on a CPU across its forked children): the rules that end its
warm-up and its timing early, so that a CPU autocast many times slower costs a few steps, and
a busy machine condemns nothing."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from pipeline import stats, timing

# A new model's first steps run slower than its settled ones (oneDNN builds its primitives,
# the allocator grows), by well under this factor from its second step on (the first builds
# the primitives, or compiles the kernels, and can take many times longer): a precision whose
# fastest step since is further behind fp32's median than this cannot catch up by settling.
SETTLING_GAIN_LIMIT = 3.0
FEWEST_STEPS_TO_JUDGE = 2  # warm-up steps the first of which is not judged alone


# fp32 steps run right after a precision's warm-up step that looks far behind fp32's earlier
# warm-up: the precision is judged against them, fp32 at the same moment of the machine.
FRESH_REFERENCE_STEPS = 2
# ... and run again where the precision's fastest step has since fallen below this share of
# the one they judged: the machine has changed, so the fp32 steps of then no longer tell.
FRESH_AGAIN_BELOW = 0.5


class FarBehind:
    """Whether a precision's fastest warm-up step is beyond SETTLING_GAIN_LIMIT x fp32's
    median step at the same moment: more than settling can gain.

    fp32's settled warm-up (its last SETTLE_WINDOW steps), taken seconds earlier, only
    screens: where the precision is beyond it, `fp32_now` runs FRESH_REFERENCE_STEPS steps of
    fp32's warm model right away, and the precision is far behind only if beyond those too.
    They stand for the steps after until the precision's fastest step falls below
    FRESH_AGAIN_BELOW x the one they judged (a busy spell has passed). A machine that became
    busy since fp32's warm-up slows both alike and condemns nothing; a precision far slower
    at every moment (CPU fp16 without native support) costs its two judged steps and these
    fp32 steps. Never far behind without fp32 steps to compare with; judged against the
    warm-up alone where `fp32_now` is None or returns no steps.

    A later model instance of the precision is never far behind where its steps are beyond
    SETTLING_GAIN_LIMIT x its own first instance's settled warm-up (`first_instance_s`, not
    far behind, or there would be no other): a burst of other work slowed this one, and no
    fp32 steps are run for it.
    """

    def __init__(
        self,
        reference_warmup_s: list[float],
        fp32_now: Callable[[], list[float]] | None = None,
        first_instance_s: list[float] | None = None,
    ) -> None:
        self.warmup_s = list(reference_warmup_s[-stats.SETTLE_WINDOW :])
        self.first_instance_s = list((first_instance_s or [])[-stats.SETTLE_WINDOW :])
        self.fresh_s: list[float] = []  # fp32's steps run right after the last judged one
        self._fp32_now = fp32_now
        self._fresh_for = math.inf  # the fastest step fresh_s judged

    @property
    def reference_text(self) -> str:
        """What the precision was last judged against, for its record."""
        if self.fresh_s:
            what, steps = f"median of {len(self.fresh_s)} steps run right after it", self.fresh_s
        else:
            what, steps = "median warm-up step", self.warmup_s
        return f"fp32's {what} ({_median(steps) * 1000:.1f} ms)"

    def __call__(self, step_times: list[float]) -> bool:
        if not step_times:
            return False
        fastest = min(step_times)
        if fastest <= SETTLING_GAIN_LIMIT * _median(self.warmup_s):
            return False
        if self.first_instance_s and fastest > SETTLING_GAIN_LIMIT * _median(self.first_instance_s):
            return False
        if self._fp32_now is not None and fastest < FRESH_AGAIN_BELOW * self._fresh_for:
            fresh = self._fp32_now()
            if fresh:
                self.fresh_s, self._fresh_for = fresh, fastest
        return not self.fresh_s or fastest > SETTLING_GAIN_LIMIT * _median(self.fresh_s)


def _median(steps: list[float]) -> float:
    return float(np.median(steps)) if steps else math.inf


def slower_than(
    far_behind: FarBehind, reference: timing.Timed, precision: str
) -> tuple[timing.StopRule, Callable[[timing.Timed], str | None]]:
    """The rules that end a precision's warm-up and timing once its own steps show that it is
    slower than fp32 (same backend, model and mode): `far_behind` judges its warm-up steps
    against fp32's steps at the same moment, `reference` holds fp32's timed steps in the
    interleaved schedule, growing as they are timed.

    A precision many times slower (every step beyond SETTLING_GAIN_LIMIT x fp32's median, as
    a CPU without native fp16 or bf16 is) cannot be the faster one however it settles: its
    warm-up ends as soon as FEWEST_STEPS_TO_JUDGE steps show it (against fp32's steps at
    that moment, `FarBehind`), and where they did, its timing as soon as
    `stats.MIN_STEPS_APART` timed steps (its first block, timed right after fp32's in the
    first round) show it too, the fewest from which `stats.speedup` draws a verdict at all:
    two moments seconds apart, each against fp32's steps, so that a burst of other work in
    one of them stops nothing (though one that hits its first instance's judged warm-up step
    and spares the fp32 steps right after it still denies it further model instances).
    Otherwise timing stops only on `stats.speedup`'s own verdict 'slower' (the whole interval
    below 1 by more than the tolerance) after the fewest steps a claim needs: the verdict the
    choice reads from the same samples, so a precision that could still be chosen is never
    stopped. Before MIN_ROUNDS_TO_PAIR rounds can be paired, that verdict stops only a
    precision every one of whose steps is beyond SETTLING_GAIN_LIMIT x fp32's median: a few
    blocks taken seconds apart see the machine's drift. The warm-up only loses its wait for
    settling: the timed steps still decide.
    """
    warmed_far_behind = False  # the warm-up these rules end showed it far behind

    def end_warmup(step_times: list[float]) -> str | None:
        nonlocal warmed_far_behind
        warmed_far_behind = len(step_times) >= FEWEST_STEPS_TO_JUDGE and far_behind(step_times)
        if not warmed_far_behind:
            return None
        return (
            f"its fastest warm-up step took {min(step_times) * 1000:.1f} ms, more than "
            f"{SETTLING_GAIN_LIMIT:g}x {far_behind.reference_text}: more than settling gains"
        )

    def stop(own: timing.Timed) -> str | None:
        samples = own.samples
        if len(samples) < stats.MIN_STEPS_APART or not reference.samples:
            return None
        fp32_median = float(np.median(reference.samples))
        far = min(samples) > SETTLING_GAIN_LIMIT * fp32_median
        if far and warmed_far_behind:
            return (
                f"after {len(samples)} timed steps, {precision} is "
                f"{np.median(samples) / fp32_median:.2f}x slower than fp32's median so far "
                f"({fp32_median * 1000:.1f} ms), every step more than {SETTLING_GAIN_LIMIT:g}x "
                "it as in its warm-up, beyond what settling gains, so it cannot be the faster "
                "precision"
            )
        if len(samples) < stats.MIN_SAMPLES_FOR_A_CLAIM:
            return None
        if np.median(samples) <= fp32_median * (1 + stats.SPEEDUP_TOLERANCE):
            return None  # not even its median is behind: spare the bootstrap
        paired = reference.instances and own.instances
        instances = (reference.instances, own.instances) if paired else None
        speed = stats.speedup(
            reference.samples,
            samples,
            rounds=(reference.rounds, own.rounds),
            instances=instances,
        )
        if speed.verdict != "slower":
            return None
        if speed.paired_rounds is None and not far:
            return None  # unpaired blocks of a few rounds see the machine's drift: wait to pair
        return (
            f"after {len(samples)} timed steps, {precision} is {speed.text} against fp32, "
            "so it cannot be the faster precision"
        )

    return end_warmup, stop
