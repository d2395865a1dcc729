"""The job's optimizer and learning-rate schedule: what `autosbp train` steps the masters with.

Lives here: `OptimizerRecipe` (the kind the plan was priced for, its learning rate and weight
decay; it builds the torch optimizer over an engine's tensors, with weight decay on the
parameters of two or more dimensions only) and `LrSchedule` (warmup, then constant, linear,
cosine or warmup-stable-decay down to a minimum: the learning rate of every step, a pure
function of the step, so a resumed job needs only the step count). Lives elsewhere: the
engine that steps the optimizer on its shards (`runtime.engine`; any torch optimizer and any
`torch.optim.lr_scheduler` work there too, for users' own loops), the price of the update
(`autosbp.planner`), checkpoints of the optimizer's states (`runtime.state.checkpoint`).

Invariants:
- The update is elementwise (Adam, AdamW, SGD, SGD with momentum), so stepping each rank's
  shard is the whole model's update: the engine's invariant.
- Weight decay is decided by a parameter's whole shape (the plan's), never its shard's: a
  matrix split by ZeRO or tensor parallelism decays on every rank; a bias or a norm weight (one
  dimension) never does (nanoGPT's and torchtitan's rule; Loshchilov & Hutter 2019).
Reference: torch.optim.AdamW (decoupled weight decay); torchtitan
torchtitan/components/lr_scheduler.py (warmup, linear / cosine / WSD decay to a minimum);
Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations"
(WSD with a 20% cooldown).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from autosbp.errors import ExecutionError
from runtime.defaults import OPTIMIZERS, SCHEDULES

__all__ = ["OPTIMIZERS", "SCHEDULES", "LrSchedule", "OptimizerRecipe"]

SGD_MOMENTUM = 0.9  # the plan's `sgd_momentum`: one state per parameter, as the planner counts
WSD_DECAY_FRACTION = 0.2  # of the steps after warmup (Hägele et al. 2024's cooldown)


@dataclass(frozen=True, slots=True)
class OptimizerRecipe:
    """An optimizer of `kind` (the plan's) at learning rate `lr` with decoupled `weight_decay`
    on parameters of two or more dimensions (AdamW's; for the others, their coupled L2 term)."""

    kind: str
    lr: float
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZERS:
            raise ExecutionError(
                f"the plan is for optimizer {self.kind!r}, which training does not know "
                f"({', '.join(OPTIMIZERS)}); make the plan again with `autosbp plan "
                "--optimizer adamw` (or another of these)."
            )
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise ExecutionError(f"--lr must be a positive number, got {self.lr!r}.")
        if not self.weight_decay >= 0 or not math.isfinite(self.weight_decay):
            raise ExecutionError(
                f"--weight-decay must be 0 or more, got {self.weight_decay!r} (0.1 is usual "
                "for AdamW)."
            )
        if self.weight_decay and self.kind == "adam":
            raise ExecutionError(
                "--weight-decay with adam adds an L2 term to the gradient (coupled); train "
                "with --optimizer adamw for decoupled weight decay, or leave --weight-decay out."
            )

    def build(
        self, tensors: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]]
    ) -> torch.optim.Optimizer:
        """The optimizer over `tensors` (name -> the tensor this rank steps), two parameter
        groups where weight decay applies: decayed (whole shape of 2 or more dims) and not."""
        decayed = [(n, t) for n, t in tensors.items() if len(shapes[n]) >= 2]
        plain = [(n, t) for n, t in tensors.items() if len(shapes[n]) < 2]
        groups: list[dict] = [
            {"params": [t for _, t in decayed], "weight_decay": self.weight_decay},
            {"params": [t for _, t in plain], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]] or [{"params": []}]
        if self.kind == "adam":
            return torch.optim.Adam(groups, lr=self.lr, fused=_fusable(tensors))
        if self.kind == "adamw":
            return torch.optim.AdamW(groups, lr=self.lr, fused=_fusable(tensors))
        momentum = SGD_MOMENTUM if self.kind == "sgd_momentum" else 0.0
        return torch.optim.SGD(groups, lr=self.lr, momentum=momentum, fused=_fusable(tensors))


def _fusable(tensors: Mapping[str, torch.Tensor]) -> bool | None:
    """Fused kernels (one pass per step: what the planner prices) where torch has them for the
    tensors' device; a rank holding no parameter passes None."""
    return True if tensors else None


@dataclass(frozen=True, slots=True)
class LrSchedule:
    """The learning rate of each step: `warmup_steps` rising linearly to the peak (`lr`), then
    `kind` over the rest of `steps`: constant; linear or cosine down to `min_lr` at the last
    step; wsd (warmup-stable-decay) flat until the last WSD_DECAY_FRACTION of the steps after
    warmup, then linear down to `min_lr`."""

    lr: float
    steps: int
    kind: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ExecutionError(
                f"--lr-schedule {self.kind!r} is not known; use one of {', '.join(SCHEDULES)}."
            )
        if self.warmup_steps < 0 or self.warmup_steps > self.steps:
            raise ExecutionError(
                f"--warmup-steps {self.warmup_steps} must be between 0 and --steps "
                f"({self.steps}); warm up for fewer steps than the job trains."
            )
        if not 0 <= self.min_lr <= self.lr:
            raise ExecutionError(
                f"--min-lr {self.min_lr:g} must be between 0 and --lr {self.lr:g}: the schedule "
                "decays from the peak down to the minimum."
            )
        if self.kind == "constant" and self.min_lr:
            raise ExecutionError(
                f"--min-lr {self.min_lr:g} has no effect with --lr-schedule constant; choose "
                "linear, cosine or wsd to decay to it, or leave --min-lr out."
            )

    def at(self, step: int) -> float:
        """The learning rate of `step` (0-based: the first step trained is step 0)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = self.steps - self.warmup_steps
        if self.kind == "constant" or span <= 1:
            return self.lr
        done = step - self.warmup_steps
        if self.kind == "wsd":
            decay = max(1, round(WSD_DECAY_FRACTION * span))
            progress = (done - (span - decay) + 1) / decay  # 1 at the last step
            if progress <= 0.0:
                return self.lr
            return self.min_lr + (self.lr - self.min_lr) * (1.0 - min(progress, 1.0))
        progress = min(done / (span - 1), 1.0)
        if self.kind == "linear":
            return self.lr - (self.lr - self.min_lr) * progress
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Set every group's learning rate to step `step`'s; returns it."""
        lr = self.at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
