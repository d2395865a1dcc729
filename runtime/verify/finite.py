"""What a step whose loss or a gradient is nan or inf does.

Lives here: `NonFinite` (stop the job, or skip the update as large-scale trainers do). Lives
elsewhere: the check, agreed by every rank before the update (`runtime.parallel.grad_norm`:
the gradients' global norm and the first parameter whose gradient is not finite), the step
that asks (`runtime.engine.Engine.step`), the job's message with the step and its checkpoint
(`runtime.jobs`).
"""

from __future__ import annotations

import enum

__all__ = ["NonFinite"]


class NonFinite(enum.Enum):
    """What a step whose loss or a gradient is nan or inf does."""

    STOP = "stop"  # raise NonFiniteError before the update: the parameters stay the last step's
    SKIP = "skip"  # no update (no optimizer step): the next step starts from the same weights
