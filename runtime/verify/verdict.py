"""What `--check` found: one tensor's deviation, one step's check, and the job's verdict.

Lives here: `Kind`, `Deviation` (one compared tensor: its error against its bound), `StepCheck`
(one step: the worst deviation of each kind, the failures, what was left out and why) and
`judge` (the verdict over all steps, as the text the CLI prints: what was compared and how, what
was left out, and on failure the tensors that differ most, with a likely cause only where the
evidence points to one). Lives elsewhere: the comparison and the derivation of every bound
(`runtime.verify.step_check`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

__all__ = ["Deviation", "Kind", "Notes", "StepCheck", "Verdict", "judge"]

KEPT_FAILURES = 8  # failing tensors a step keeps for the report, worst first (a display choice)
SHOWN_FAILURES = 5  # of those, lines in the verdict (a display choice)
# A fitted scale reads as the integer k (or 1/k) this close, relative: far above a doubled sum's
# rounding (about 1e-6) and below the relative gap to the next integer (1/k) for k up to 1000.
FIT_TOLERANCE = 1e-3


class Kind(Enum):
    """What a deviation compares, in the order a step computes them."""

    LOSS = "loss"
    GRADIENT = "gradient"
    BUFFER = "buffer"  # updated by the forward: BatchNorm's running statistics
    UPDATE = "update"  # the optimizer's step


@dataclass(frozen=True, slots=True)
class Deviation:
    """The plan's value of one tensor against the reference: `error` (a norm, or for an update
    the worst element's difference) and its `bound`; `size` is the reference's norm; `scale`,
    when one number explains the difference (plan = scale x reference within the bound), is it."""

    kind: Kind
    name: str
    shape: tuple[int, ...]
    error: float
    bound: float
    size: float
    scale: float | None = None

    @property
    def ratio(self) -> float:
        """error / bound: at most 1 passes (0 / 0 passes, x / 0 does not)."""
        if self.error == 0:
            return 0.0
        return self.error / self.bound if self.bound > 0 else math.inf

    @property
    def passed(self) -> bool:
        return self.ratio <= 1.0

    def describe(self) -> str:
        what = "the loss" if self.kind is Kind.LOSS else f"{self.kind.value} of {self.name}"
        shape = f" {list(self.shape)}" if self.shape else ""
        of = "the step" if self.kind is Kind.UPDATE else "its size"
        relative = f" ({self.error / self.size:.1e} of {of})" if self.size > 0 else ""
        line = (
            f"{what}{shape}: off by {self.error:.2e}{relative}, bound {self.bound:.2e}: "
            f"{self.ratio:.3g}x the bound"
        )
        if not self.passed and self.scale is not None:
            line += f"; it is {self.scale:.6g} times one device's"
        return line


@dataclass(frozen=True, slots=True)
class Notes:
    """What a step's comparison left out or changed, for the verdict."""

    excluded: tuple[str, ...] = ()  # gradients exactly 0 in float64: rounding noise only
    dropout: tuple[str, ...] = ()  # torch.nn dropout modules set to p = 0 on both sides
    fp32_ops: tuple[str, ...] = ()  # ops run in fp32 inside the float64 reference
    frozen: tuple[str, ...] = ()  # parameters that do not require grad on one device
    updates_compared: bool = True  # False: the optimizer's state came from a checkpoint
    dtype: str = "fp32"  # the plan's compute dtype: whose rounding bounds the forward/backward


@dataclass(frozen=True, slots=True)
class StepCheck:
    """One step of the plan against one device at the same weights: the worst deviation of each
    kind, the failing ones (worst first), how many tensors of each kind were compared, the
    `notes`, and `rounding`: the step's relative fp32 rounding of the gradients on one device."""

    step: int
    reference_loss: float
    rounding: float
    worst: tuple[Deviation, ...]
    failures: tuple[Deviation, ...]
    counts: tuple[tuple[Kind, int], ...]
    notes: Notes = Notes()

    @classmethod
    def of(
        cls,
        step: int,
        reference_loss: float,
        rounding: float,
        rows: Sequence[Deviation],
        notes: Notes,
    ) -> StepCheck:
        """Keep the worst of each kind and the worst failures of `rows`."""
        worst = tuple(
            max(same, key=lambda d: d.ratio)
            for kind in Kind
            if (same := [d for d in rows if d.kind is kind])
        )
        failures = sorted((d for d in rows if not d.passed), key=lambda d: -d.ratio)
        counts = tuple((kind, sum(d.kind is kind for d in rows)) for kind in Kind)
        return cls(
            step, reference_loss, rounding, worst, tuple(failures[:KEPT_FAILURES]), counts, notes
        )

    @property
    def passed(self) -> bool:
        return not self.failures

    def ratio(self, kind: Kind) -> float | None:
        """The worst error / bound of `kind` at this step (None: nothing of that kind)."""
        return next((d.ratio for d in self.worst if d.kind is kind), None)


@dataclass(frozen=True, slots=True)
class Verdict:
    passed: bool
    text: str


def judge(checks: Sequence[StepCheck]) -> Verdict:
    """The verdict over every checked step: on success what was compared and the closest call;
    on failure the first failing step's worst tensors and, where the evidence says, why."""
    failing = [c for c in checks if not c.passed]
    notes = _notes(checks)
    if not failing:
        closest = max(
            ((c.step, d) for c in checks for d in c.worst), key=lambda p: p[1].ratio, default=None
        )
        worst = f"; closest: {closest[1].describe()}, at step {closest[0]}" if closest else ""
        return Verdict(True, "\n".join([f"matches single-device training{worst}.", *notes]))
    first = failing[0]
    lines = [
        f"the plan's training differs from one device beyond {first.notes.dtype} rounding at "
        f"{len(failing)} of "
        f"{len(checks)} steps; at step {first.step}, the tensors that differ most:",
        *(f"  {d.describe()}" for d in first.failures[:SHOWN_FAILURES]),
        _cause(first),
        *notes,
        "Please report it with the plan JSON.",
    ]
    return Verdict(False, "\n".join(lines))


def _notes(checks: Sequence[StepCheck]) -> list[str]:
    """What was compared, how, and what was left out or changed."""
    if not checks:
        return []
    counts = ", ".join(
        "the loss" if kind is Kind.LOSS else f"{n} {kind.value}s"
        for kind, n in checks[0].counts
        if n
    )
    updates = (
        ", each update against the same optimizer on one device within rounding"
        if checks[-1].notes.updates_compared
        else ""
    )
    low, high = min(c.rounding for c in checks), max(c.rounding for c in checks)
    dtype = checks[-1].notes.dtype
    recipe = (
        f" (the same recipe: {dtype} compute, fp32 masters and gradient accumulation)"
        if dtype != "fp32"
        else ""
    )
    notes = [
        f"Compared at every step, at the plan's own weights: {counts}; each forward/backward "
        f"value against one device in float64 within 16x one device's own {dtype} rounding"
        f"{recipe}{updates} (runtime/verify/step_check.py derives the bounds). One device's "
        f"{dtype} rounding of the gradients was "
        f"{low:.1e} to {high:.1e} of their size over the steps: differences 16x that pass as "
        "rounding."
    ]
    excluded = sorted({name for c in checks for name in c.notes.excluded})
    if excluded:
        notes.append(
            f"Left out: {len(excluded)} gradient(s) exactly 0 in float64 (fp32 holds rounding "
            f"noise only there; their updates are still compared): {', '.join(excluded)}."
        )
    last = checks[-1].notes
    if not last.updates_compared:
        notes.append(
            "Updates not compared: the job resumed from a checkpoint, and the reference does not "
            "hold the optimizer state it restored."
        )
    if last.dropout:
        notes.append(f"Dropout set to p = 0 on both sides: {', '.join(last.dropout)}.")
    if last.fp32_ops:
        notes.append(
            f"Run in fp32 inside the float64 reference (no float64 kernel): {', '.join(last.fp32_ops)}."
        )
    return notes


def _cause(check: StepCheck) -> str:
    """A likely cause, from which kind fails first and how the failing gradients relate to one
    device's; a plain statement of what differs where the evidence names no cause."""
    kinds = {d.kind for d in check.failures}
    if Kind.LOSS in kinds:
        return (
            "The loss itself differs, so the forward differs: a rule or boxing step computes "
            "another function under this plan (the gradients listed are downstream of it)."
        )
    frozen = [d.name for d in check.failures if d.name in check.notes.frozen]
    if Kind.GRADIENT in kinds or frozen:
        gradients = [d for d in check.failures if d.kind is Kind.GRADIENT]
        if frozen:
            return (
                f"{', '.join(frozen)}: frozen on one device (requires_grad=False), but the plan "
                "changed them: the runtime trains frozen parameters."
            )
        return (
            f"The loss agrees, so the forward is right; the backward differs: {_scaling(gradients)}"
        )
    if Kind.BUFFER in kinds:
        return (
            "Loss and gradients agree, but buffers the forward updates (BatchNorm's running "
            "statistics) differ: they are updated otherwise under this plan's splits or "
            "micro-batches."
        )
    return (
        "Loss and gradients agree, but the optimizer's update differs: the sharded optimizer "
        "state or step is wrong for these parameters (an update missed, doubled or misplaced)."
    )


def _scaling(gradients: Sequence[Deviation]) -> str:
    """Name a common integer factor k (or 1/k) between the failing gradients and one device's,
    where every one of them has it."""
    factors = {_integer_factor(d.scale) for d in gradients}
    if len(factors) == 1 and (factor := factors.pop()) is not None:
        k, larger = factor
        if larger:
            return (
                f"each gradient listed is {k} times one device's: a sum counted {k} times (a "
                "partial value summed again, or the loss seeded on every device)."
            )
        return (
            f"each gradient listed is 1/{k} of one device's: a sum over {k} devices (or "
            "micro-batches) is missing."
        )
    return "the gradients listed, or their sync, are wrong under this plan."


def _integer_factor(scale: float | None) -> tuple[int, bool] | None:
    """(k, True) when `scale` is the integer k >= 2, (k, False) when it is 1/k, else None."""
    if scale is None or scale <= 0:
        return None
    larger = scale >= 1
    value = scale if larger else 1 / scale
    k = round(value)
    return (k, larger) if k >= 2 and abs(value - k) <= FIT_TOLERANCE * k else None
