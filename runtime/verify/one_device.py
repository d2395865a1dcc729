"""The step on one device, as `--check`'s reference evaluates it: float64, fp32, nudged fp32.

Lives here: `evaluate` (a model's loss, gradients and updated buffers at given weights, on the
plan's micro-batches, widened to float64), `nudged` (weights and inputs moved one ulp at
random: another draw of every rounding), `Float32Fallback` (ops without a float64 kernel run
in fp32 inside the float64 reference, and are named), `disable_dropout` and
`require_deterministic` (a model the check can compare: no mask drawn per rank) and `widen`.
Lives elsewhere: why these draws and what bounds they give, and the comparison itself
(`runtime.verify.step_check`, whose header derives them), the verdict (`runtime.verify.verdict`).

Invariants: evaluating never changes the weights it is given (it copies them into the model it
runs); a failure of the model outside one op's missing float64 kernel propagates.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from autosbp.capturing.batches import split_micro_batches
from autosbp.errors import ExecutionError

__all__ = [
    "DROPOUT_MODULES",
    "Evaluation",
    "Float32Fallback",
    "disable_dropout",
    "evaluate",
    "inexact",
    "nudged",
    "require_deterministic",
    "widen",
]

State = Mapping[str, torch.Tensor]
DROPOUT_MODULES = (
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
)  # fmt: skip


def disable_dropout(model: nn.Module) -> tuple[str, ...]:
    """Set p = 0 on every torch.nn dropout module of `model` that draws a mask; their names.
    The graph keeps its ops (the fingerprint holds no probabilities), so a plan made with
    dropout runs without it."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, DROPOUT_MODULES) and module.p > 0:
            module.p = 0.0
            names.append(name)
    return tuple(names)


@dataclass(frozen=True, slots=True)
class Evaluation:
    """The loss, gradients and updated buffers of one step at given weights, in float64."""

    loss: torch.Tensor
    gradients: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


def evaluate(
    model: nn.Module,
    state: State,
    inputs: Sequence[torch.Tensor],
    micro_batches: int,
    weights: Sequence[float] | None = None,
) -> Evaluation:
    """`model`'s step at the weights and buffers `state` on `micro_batches` pieces of `inputs`
    (each loss scaled by 1/micro_batches, or by `weights`: the plan's, where a mean
    cross-entropy's micro-batches were weighed by their kept targets), in the model's dtype;
    results widened to float64.
    A model below fp32 runs the mixed recipe (`autosbp.plan.Precision`): each micro-batch's
    gradients, and losses, are accumulated in fp32."""
    first = next(model.parameters())
    dtype = first.dtype
    summed = torch.float32 if dtype.itemsize < 4 else dtype  # the recipe's accumulation
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state[name])
            p.grad = None
        for name, b in buffers.items():
            if name in state:
                b.copy_(state[name])
    total = torch.zeros((), dtype=summed, device=first.device)
    grads: dict[str, torch.Tensor] = {}
    m = micro_batches
    for k, piece in enumerate(split_micro_batches(inputs, m)):
        loss = model(*(x.to(dtype) if x.is_floating_point() else x for x in piece))
        loss = loss * weights[k] if weights is not None else loss / m
        loss.backward()
        total += loss.detach().to(summed)
        if summed != dtype:  # into fp32, each micro-batch's own gradient freed
            for name, p in model.named_parameters():
                if p.grad is not None:
                    grads[name] = (
                        grads[name] + p.grad.to(summed) if name in grads else p.grad.to(summed)
                    )
                    p.grad = None
    if summed == dtype:
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    gradients = {
        name: widen(grads[name] if name in grads else torch.zeros_like(p))
        for name, p in model.named_parameters()
        if p.requires_grad  # a frozen one has none (torch trains it not)
    }
    kept = {name: widen(b.detach()) for name, b in buffers.items() if name in state}
    return Evaluation(widen(total), gradients, kept)


def nudged(
    state: State, inputs: Sequence[torch.Tensor], seed: int
) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
    """`state` and `inputs` with every floating value moved one ulp up or down at random: the
    size of one rounding, which sends every rounding inside the step to another draw."""
    generator = torch.Generator().manual_seed(seed)

    def nudge(x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            return x
        up = torch.rand(x.shape, generator=generator) < 0.5
        return torch.nextafter(x, torch.where(up, torch.inf, -torch.inf).to(x.dtype))

    return {n: nudge(t) for n, t in state.items()}, tuple(nudge(x) for x in inputs)


def inexact(x: torch.Tensor) -> bool:
    """Does `x` hold rounded values (floating or complex), not exact ones (bool, integer)?"""
    return x.is_floating_point() or x.is_complex()


def widen(x: torch.Tensor) -> torch.Tensor:
    """`x` in double precision where it rounds (float64, complex128), as it is where exact."""
    if x.is_complex():
        return x.detach().to(torch.complex128)
    return x.detach().to(torch.float64) if x.is_floating_point() else x.detach()


def require_deterministic(
    model: nn.Module, inputs: Sequence[torch.Tensor], dropout: tuple[str, ...]
) -> None:
    """Refuse a model whose loss still depends on the random seed (header: Dropout)."""
    losses = []
    for seed in (1, 2):
        with torch.random.fork_rng(), torch.no_grad():
            torch.manual_seed(seed)
            losses.append(copy.deepcopy(model)(*inputs).detach())
    if not torch.equal(losses[0], losses[1]) and not losses[0].isnan().all():
        values = [float(x) for x in losses]
        off = f" (dropout modules set to p = 0: {', '.join(dropout)})" if dropout else ""
        raise ExecutionError(
            f"--check compares deterministic steps, but the model's loss depends on the random "
            f"seed: {values[0]!r} and {values[1]!r} under two seeds{off}. Functional dropout "
            "(F.dropout with its own probability, SDPA's dropout_p, a Hugging Face config's "
            "attention_dropout) or another random op remains; set those probabilities to 0 for "
            "the check."
        )


class Float32Fallback(TorchDispatchMode):
    """Inside the float64 reference: an op that has no float64 kernel runs in fp32 (inputs
    rounded, outputs widened) and is remembered in `ops`; any other failure is the model's own
    and propagates."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if str(func) not in self.ops:
            try:
                return func(*args, **kwargs)
            except (RuntimeError, NotImplementedError):
                if func._schema.is_mutable or not _holds_float64((args, kwargs)):
                    raise
        out = func(*tree_map(_narrow, args), **tree_map(_narrow, kwargs))
        self.ops.add(str(func))
        return tree_map(_widen_fp32, out)


def _holds_float64(tree: Any) -> bool:
    found: list[bool] = []
    tree_map(lambda x: found.append(isinstance(x, torch.Tensor) and x.dtype == torch.float64), tree)
    return any(found)


def _narrow(x: Any) -> Any:
    return x.float() if isinstance(x, torch.Tensor) and x.dtype == torch.float64 else x


def _widen_fp32(x: Any) -> Any:
    return x.double() if isinstance(x, torch.Tensor) and x.dtype == torch.float32 else x
