"""Mixed precision as the plan prices it: fp32 masters, weights cast down, fp32 gradients.

Lives here: `Weights` (this rank's compute weights: the tensors its programs read, and, under a
mixed recipe, the bridge from their gradients to the fp32 masters' gradients), `GradientHook`
(the seam through which the gradient sync and the distributed optimizer learn that a master's
gradient is final for a backward) and `LossScale` (fp16's dynamic loss scaling). Lives
elsewhere: the recipe itself (`autosbp.plan.Precision`, the plan's), the masters (the
parameters of `runtime.state.shards`, fp32 under a mixed recipe), the sync that sums the
masters' gradients (`runtime.parallel.grad_sync`, in the plan's reduce dtype), the gathers that
reduce-scatter them (`runtime.parallel.prefetch`), the step that unscales, clips and updates
(`runtime.engine`).

The recipe (FSDP2's `MixedPrecisionPolicy`, Megatron-Core's `main_grad`):
- A parameter's master is an fp32 leaf in the parameter's layout: what the optimizer steps,
  what checkpoints save and what `Engine.full_state_dict` assembles. Where the plan splits
  the optimizer's states (ZeRO-1/2), the master is the optimizer's fp32 shard instead, cut
  from it at the start: the leaf in the parameter's layout gives up its storage (`release`),
  keeping only the fp32 gradient, and the shards gather into the compute copies
  (`runtime.parallel.sharded_update`; Megatron-Core's distributed optimizer).
- The ops read a compute copy: a leaf in the compute dtype (bf16, fp16) of the same layout,
  written from the master (or gathered from its shards) after every update (`refresh`).
  Parameter gathers (FSDP) gather the compute copies: in the compute dtype, as FSDP2 does.
- Autograd accumulates a micro-batch's gradient of a compute copy in the compute dtype (within
  one backward: a weight read twice sums its two parts there); at the end of that backward the
  bridge adds it into the master's fp32 gradient and frees it. So the gradient is accumulated
  over micro-batches in fp32, and summed across devices in fp32 by the sync (or in the plan's
  reduce dtype): what the planner prices, 2 + 4 + 4 bytes per element beside the optimizer's
  (2 + 4 where the master is a shard).
- fp32 plans have no copies: the compute weights are the masters themselves, and the hooks
  are autograd's own (`register_post_accumulate_grad_hook`).
Reference: Micikevicius et al. 2018, "Mixed Precision Training" (fp32 master weights, loss
scaling); torch/distributed/fsdp/_fully_shard/_fsdp_api.py (MixedPrecisionPolicy);
megatron/core/distributed/param_and_grad_buffer.py (main_grad); torch.amp.GradScaler (the
dynamic scale's constants).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

__all__ = ["GradientHook", "LossScale", "Weights", "build_weights"]

GradientHook = Callable[[torch.Tensor, Callable[[torch.Tensor], None]], None]
"""`hook(master, fn)`: call `fn(master)` each time a backward has finished adding into
`master.grad`."""


class Weights:
    """This rank's compute weights over its `masters` (name -> fp32 leaf in its layout).

    `compute[name]` is what the programs read: the master itself in an fp32 recipe, else a
    leaf of `dtype` that `refresh` writes from the master. `register(master, fn)` is the
    gradient hook the sync and the distributed optimizer use."""

    def __init__(self, masters: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.masters = dict(masters)
        self.mixed = any(m.dtype != dtype for m in self.masters.values())
        self.compute: dict[str, torch.Tensor] = {}
        self._hooks: dict[torch.Tensor, list[Callable[[torch.Tensor], None]]] = {}
        self._master_of: dict[torch.Tensor, torch.Tensor] = {}
        self.released: frozenset[str] = frozenset()  # masters held as their shards (`release`)
        # Where a master's gradient lives already, if anywhere (the gradient sync's bucket
        # view): the step's first gradient is cast straight into it, no tensor of its own.
        self.destination: Callable[[torch.Tensor], torch.Tensor | None] = lambda master: None
        for name, master in self.masters.items():
            if master.dtype == dtype:
                self.compute[name] = master
                continue
            copy = master.detach().to(dtype).requires_grad_(True)
            copy.register_post_accumulate_grad_hook(self._bridge)
            self.compute[name] = copy
            self._master_of[copy] = master
            self._hooks[master] = []

    def register(self, master: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> None:
        """`fn(master)` after each backward that finishes adding into `master.grad`."""
        if master in self._hooks:
            self._hooks[master].append(fn)
        else:
            master.register_post_accumulate_grad_hook(fn)

    def master_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The master of a compute weight (itself where the recipe keeps no copy)."""
        return self._master_of.get(tensor, tensor)

    def masters_of(self, tensors: Iterable[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """`master_of` each (None stays None: "every one", in the gradient sync's `arm`)."""
        return None if tensors is None else [self.master_of(t) for t in tensors]

    def add_gradient(self, master: torch.Tensor, grad: torch.Tensor) -> None:
        """Add a gradient into `master.grad` in the master's dtype (a tensor of its own at the
        step's first), then run the master's hooks."""
        with torch.no_grad():
            if master.grad is None:
                into = self.destination(master)
                if into is None:
                    master.grad = grad.to(master.dtype, copy=True)
                else:
                    master.grad = into.copy_(grad)
            else:
                master.grad.add_(grad)
        for fn in self._hooks.get(master, ()):
            fn(master)

    def release(self, names: Iterable[str]) -> None:
        """The masters of `names`, held from now on only as the distributed optimizer's fp32
        shards (which gather into the compute copies: `sharded_update`), give up their storage:
        each stays the leaf whose `grad` is the fp32 gradient the sync sums, its value one NaN
        expanded to its shape (4 bytes: a read is NaN, a write an error, never a read of freed
        memory). Their values are read from the shards, and `refresh` skips them."""
        names = frozenset(names)
        for name in names:
            master = self.masters[name]
            assert self.compute[name] is not master, "an fp32 recipe's master is its weight"
            nan = torch.full((), math.nan, dtype=master.dtype, device=master.device)
            master.data = nan.expand(master.shape)
        self.released |= names

    def refresh(self, names: Iterable[str] | None = None) -> None:
        """After the masters changed (an update, a checkpoint loaded): every compute copy (of
        `names`, default all) written from its master, cast down (but the `released`', which
        their shards' gather writes)."""
        if not self.mixed:
            return
        with torch.no_grad():
            for name in self.masters if names is None else names:
                copy = self.compute[name]
                if copy is not self.masters[name] and name not in self.released:
                    copy.copy_(self.masters[name])

    def _bridge(self, copy: torch.Tensor) -> None:
        """A compute copy's gradient, final for this backward: into its master's, in fp32."""
        grad = copy.grad
        copy.grad = None
        if grad is not None:
            self.add_gradient(self._master_of[copy], grad)


def build_weights(
    masters: Mapping[str, torch.Tensor], compute_dtype: torch.dtype | None
) -> Weights:
    """`Weights` over `masters` for a plan computing in `compute_dtype` (None: the masters'
    own dtypes, no copies)."""
    if compute_dtype is None:
        return Weights(masters, next(iter(masters.values())).dtype if masters else torch.float32)
    return Weights(masters, compute_dtype)


# torch.amp.GradScaler's defaults: start at 2^16, double after 2000 steps without an overflow,
# halve at each overflow (its documentation; Micikevicius et al. 2018, section 3.2).
INITIAL_SCALE = 2.0**16
GROWTH_INTERVAL = 2000


@dataclass(slots=True)
class LossScale:
    """fp16's dynamic loss scale: the loss's seed is multiplied by `scale`, the gradients divided
    by it before they are read; a step whose gradients overflow is skipped and halves it, and
    `GROWTH_INTERVAL` steps in a row without one double it."""

    scale: float = INITIAL_SCALE
    good_steps: int = 0
    skipped: int = field(default=0)

    def update(self, overflowed: bool) -> None:
        if overflowed:
            self.scale /= 2.0
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps == GROWTH_INTERVAL:
            self.scale *= 2.0
            self.good_steps = 0

    def state(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    @classmethod
    def from_state(cls, state: Mapping[str, float | int]) -> LossScale:
        return cls(float(state["scale"]), int(state["good_steps"]), int(state["skipped"]))
