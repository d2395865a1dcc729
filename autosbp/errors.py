"""The few error classes users see. Each message says what failed, why, and how to fix it.

Lives here: the error hierarchy of the planner side, and every user-facing error re-exported for
users; the root (`AutosbpError`) lives in `terminal.errors`, `ExecutionError` in
`launching.errors` and `ProfileError` in `costmodel.errors`, beside the code that raises them,
so that no layer imports upward. Raise these for bad user input (models, SBPs, profiles,
plans, CLI arguments); use `assert` for internal invariants. The CLI prints `AutosbpError`
messages without a traceback and exits non-zero.
"""

from __future__ import annotations

from costmodel.errors import ProfileError
from launching.errors import ExecutionError
from terminal.errors import AutosbpError

__all__ = [
    "AutosbpError", "CaptureError", "DataError", "ExecutionError", "MicroBatchError",
    "NoFitError", "NonFiniteError", "PlanError", "ProfileError", "SbpError",
]  # fmt: skip


class SbpError(AutosbpError, ValueError):
    """An SBP, nD SBP or mesh that does not fit a tensor (bad dim, non-divisible split, rank)."""


class CaptureError(AutosbpError):
    """A model that cannot be captured into an operator graph."""


class DataError(AutosbpError):
    """A training or evaluation data set that cannot feed the model: a data function that
    fails, returns something else than a data set or batches, items or batches whose count,
    shapes or dtypes differ from the model's example inputs, too few samples, a data position
    (from a checkpoint) that does not fit the data set (`runtime.data`)."""


class MicroBatchError(CaptureError):
    """The model runs on the whole batch but not on a micro-batch of it (BatchNorm on one
    sample, a batch-size assumption in its code): a search skips that micro-batch count and
    names the reason when no count is left."""


class PlanError(AutosbpError):
    """No plan fits (memory), or a plan does not match the model, world size or profile."""


class NoFitError(PlanError):
    """No plan of the searched space fits in the memory limit (the message names the floor)."""


class NonFiniteError(ExecutionError):
    """A training step whose loss or a gradient is not finite (nan or inf): the step stopped
    before the optimizer's update. `what` names it ("the loss is nan", "the gradient of
    `fc.weight` is not finite"); the job adds the step and what to do."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what
