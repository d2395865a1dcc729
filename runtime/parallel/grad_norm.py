"""The gradients' global norm, and whether each is finite: asked of every rank at once, before
the update, and clipping by that norm.

Lives here: `GradientReport` (the 2-norm of the whole model's gradient, over every parallel
dimension, and the first parameter whose gradient holds a nan or an inf), `report_gradients`
(its collective) and `clip_gradients`. Lives elsewhere: what a non-finite step does
(`runtime.verify.finite.NonFinite`, the Engine's step), the tensors it reads (the ones the
optimizer steps: `Engine.optimized`, each in its layout), the price of the check
(`autosbp.planner.finite_check`).

Invariants:
- Every element of the model's gradient is counted once: a tensor's local squares are
  counted by the ranks at coordinate 0 of every mesh dim where its layout is B (replicas:
  data parallelism, a norm weight beside tensor parallelism), and by every rank where it is
  split (tensor, expert, context, ZeRO shards: the pieces partition it); each stage counts its
  own parameters (a tied weight is its owner's). So the norm is one device's, whatever the
  plan (torchtitan's `clip_grad_norm_` over DTensors does the same by reduction).
- One collective over the whole world: an all-reduce of the squares' sum and of one flag per
  parameter (every stage's, in graph order), so every rank reaches the same norm and the same
  first non-finite parameter; no rank waits for an update that never comes.
- Each gradient is read once, by its 2-norm (`torch._foreach_norm`, one fused pass;
  non-finite whenever an element is); only a gradient whose 2-norm is not finite is read
  again by its max-norm (nan or inf exactly when an element is, never overflowing), so the
  answer is exact and no mask the size of the gradients is made. Squares are summed in
  float64 (an fp32 norm squared overflows at 1.8e19).
Reference: torch.nn.utils.clip_grad_norm_ (the 1e-6 in its coefficient); torchtitan
torchtitan/distributed/utils.py `clip_grad_norm_` (the norm over every parallel dimension).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autosbp.sbp import Broadcast, NdSbp

__all__ = ["GradientReport", "clip_gradients", "report_gradients"]


@dataclass(frozen=True, slots=True)
class GradientReport:
    """The whole gradient's 2-norm (inf where an element is nan or inf), and the first
    parameter of the plan's order whose gradient is not finite (None when all are)."""

    norm: float
    first_non_finite: str | None

    def problem(self) -> str | None:
        """Why the step may not update, as a phrase (None: it may): a parameter's gradient holds
        a nan or an inf, or the norm itself overflows (elements past about 1e19, whose squares
        fp32 cannot hold: clipping would zero every gradient)."""
        if self.first_non_finite is not None:
            return f"the gradient of `{self.first_non_finite}` is not finite (nan or inf)"
        if not math.isfinite(self.norm):
            return "the gradients' 2-norm overflows fp32 (an element past about 1e19)"
        return None


def report_gradients(
    tensors: Mapping[str, torch.Tensor],
    layouts: Mapping[str, NdSbp],
    coords: Sequence[int],
    mesh_shape: Sequence[int],
    order: Sequence[str],
) -> GradientReport:
    """The report over `tensors` (name -> the tensor whose `.grad` is this rank's piece, in
    `layouts` on this rank's stage mesh at `coords`), every stage's `order` (graph order: the
    same list on every rank). A collective over the world."""
    position = {name: k for k, name in enumerate(order)}
    named = [(n, t.grad) for n, t in tensors.items() if t.grad is not None]
    flags = torch.zeros(len(order) + 1, dtype=torch.float64)
    if named:
        norms = torch.stack([n.double() for n in torch._foreach_norm([g for _, g in named], 2)])
        counted = torch.tensor(
            [_counts_here(layouts[n], coords, mesh_shape) for n, _ in named], dtype=torch.bool
        )
        flags[0] = (norms[counted] ** 2).sum() if counted.any() else 0.0
        for k in _not_finite([g for _, g in named], norms):
            flags[1 + position[named[k][0]]] = 1.0
    flags[0] = torch.nan_to_num(flags[0], nan=math.inf)  # the flags say which; the norm: inf
    summed = flags.to(_device(named))
    dist.all_reduce(summed)
    summed = summed.cpu()
    bad = (summed[1:] > 0).nonzero().flatten()
    first = order[int(bad[0])] if len(bad) else None
    return GradientReport(math.sqrt(float(summed[0])), first)


def clip_gradients(tensors: Mapping[str, torch.Tensor], norm: float, max_norm: float) -> float:
    """Scale every gradient by max_norm / (norm + 1e-6) where that is below 1 (torch's
    `clip_grad_norm_`); returns the factor applied (1.0: none)."""
    factor = max_norm / (norm + 1e-6)
    if factor >= 1.0:
        return 1.0
    grads = [t.grad for t in tensors.values() if t.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)
    return factor


def _counts_here(layout: NdSbp, coords: Sequence[int], mesh_shape: Sequence[int]) -> bool:
    """Whether this rank counts a tensor in `layout`: at coordinate 0 of its replicated dims."""
    return all(
        coords[d] == 0
        for d, sbp in enumerate(layout)
        if isinstance(sbp, Broadcast) and mesh_shape[d] > 1
    )


def _not_finite(grads: list[torch.Tensor], norms: torch.Tensor) -> list[int]:
    """The indices of the gradients holding a nan or inf: a finite 2-norm clears its gradient
    (measured about 18x cheaper on CPU than the max-norm); a non-finite one is confirmed by the
    max-norm (a finite gradient whose squares overflow is not reported)."""
    flagged = (~torch.isfinite(norms)).nonzero().flatten().tolist()
    if not flagged:
        return []
    exact = torch._foreach_norm([grads[k] for k in flagged], math.inf)
    return [k for k, n in zip(flagged, exact, strict=True) if not math.isfinite(float(n))]


def _device(named: list[tuple[str, torch.Tensor]]) -> torch.device:
    """Where the all-reduce runs: the gradients' device (NCCL carries CUDA tensors only)."""
    if named:
        return named[0][1].device
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
