"""Torch's own training loops that bench/runtime.py measures ours against, one per `Reference`.

Lives here: eager (one process), DistributedDataParallel (with Adam, or with
ZeroRedundancyOptimizer over Adam), FSDP2 (`fully_shard` per block and the
root) and torch.distributed.pipelining's Schedule1F1B (ScheduleInterleaved1F1B for an
interleaved plan: a stage per chunk, several a rank) on a stage cut where the plan cuts
(`TorchStage`), each as a step function returning its loss. Lives elsewhere: the rows, the
alternating measurement and the table (bench/runtime.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from enum import Enum
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autosbp.plan import Plan
from autosbp.zoo import build_model

LR = 1e-3


class Reference(Enum):
    """Torch's own loop that a row measures ours against."""

    EAGER = "eager"  # forward, backward, Adam in one process
    DDP = "ddp"  # DistributedDataParallel, each rank half the batch
    # DDP with torch.distributed.optim.ZeroRedundancyOptimizer over Adam: each rank steps the
    # states of its share of the parameters and broadcasts the updated ones (ZeRO-1)
    DDP_ZERO = "ddp-zero"
    FSDP2 = "fsdp2"  # torch.distributed.fsdp.fully_shard per block and the root, half the batch
    PIPELINING = "pipelining"  # torch.distributed.pipelining Schedule1F1B, one stage a rank
    WHOLE = "whole"  # eager on every rank at once, each the whole batch and sequence: one process
    INTERLEAVED = "interleaved"  # its ScheduleInterleaved1F1B, the plan's chunks on each rank
    # bf16 mixed precision as torch users run it: DDP with forward under autocast (fp32 weights
    # and Adam, bf16 compute per op), and FSDP2 with MixedPrecisionPolicy(param_dtype=bf16,
    # reduce_dtype=fp32) (fp32 shards the masters, gathered in bf16, gradients summed in fp32)
    DDP_AMP = "ddp-amp"
    FSDP2_MP = "fsdp2-mp"


def torch_step(
    zoo_name: str,
    kwargs: dict[str, Any],
    inputs: tuple[torch.Tensor, ...],
    rank: int,
    world: int,
    reference: Reference,
) -> Callable[[], float]:
    """Torch's own training step on a fresh copy of the model: eager on one process; DDP or
    FSDP2 with this rank's slice of the batch on several; WHOLE: eager, the whole batch, on
    each rank."""
    model, _ = build_model(zoo_name, seed=0, **kwargs)
    local = inputs
    if reference in (Reference.FSDP2, Reference.FSDP2_MP):
        _fully_shard(model, world, mixed=reference is Reference.FSDP2_MP)
    elif world > 1 and reference is not Reference.WHOLE:
        model = torch.nn.parallel.DistributedDataParallel(model)
    if world > 1 and reference is not Reference.WHOLE:
        local = tuple(t.chunk(world)[rank] for t in inputs)
    optimizer: torch.optim.Optimizer
    if reference is Reference.DDP_ZERO:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.Adam, lr=LR
        )
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)

    autocast = reference is Reference.DDP_AMP

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(*local)
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    return step


def _fully_shard(model: nn.Module, world: int, mixed: bool = False) -> None:
    """FSDP2 as its documentation applies it: each repeated block its own unit, then the root
    (the embeddings and head), every parameter sharded over the world, freed after forward
    (reshard_after_forward=True) and gathered again in backward; its default prefetching
    (the next unit's all-gather issued while one computes). `mixed`: bf16 compute with the
    fp32 shards as masters and gradients reduced in fp32 (`MixedPrecisionPolicy`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed
        else MixedPrecisionPolicy()
    )
    blocks = model.get_submodule("blocks") if hasattr(model, "blocks") else []
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, mp_policy=policy)


def pipelining_step(
    zoo_name: str, kwargs: dict[str, Any], inputs: tuple[torch.Tensor, ...], plan: Plan, rank: int
) -> Callable[[], float]:
    """torch.distributed.pipelining's training step on this rank's stage of a fresh copy of the
    model (the stage's parameters as `plan` places them): `Schedule1F1B` over the plan's
    micro-batches, or `ScheduleInterleaved1F1B` over this rank's chunks where the plan
    interleaves, then Adam on the stage. Returns the mean micro-batch loss on the last stage,
    NaN on the others."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleaved1F1B,
    )

    model, _ = build_model(zoo_name, seed=0, **kwargs)
    count = len(plan.stages)
    indices = [s for s, stage in enumerate(plan.stages) if rank in stage.devices]
    modules = [
        TorchStage(
            model, zoo_name, {n for n, p in plan.params.items() if p.stage == index},
            first=index == 0, last=index == count - 1,
        )
        for index in indices
    ]  # fmt: skip
    stages = [
        PipelineStage(module, index, count, torch.device("cpu"))
        for module, index in zip(modules, indices, strict=True)
    ]
    loss_fn = STAGE_PARTS[zoo_name][2]
    schedule: Any = (
        ScheduleInterleaved1F1B(stages, plan.micro_batches, loss_fn=loss_fn)
        if plan.virtual_stages > 1
        else Schedule1F1B(stages[0], plan.micro_batches, loss_fn=loss_fn)
    )
    optimizer = torch.optim.Adam([p for m in modules for p in m.parameters()], lr=LR)
    first, last = any(m.first for m in modules), any(m.last for m in modules)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        data = (inputs[0],) if first else ()
        if last:  # the targets feed the loss
            schedule.step(*data, target=inputs[-1], losses=losses, return_outputs=False)
        else:
            schedule.step(*data)
        optimizer.step()
        return float(torch.stack(losses).detach().mean()) if losses else math.nan

    return step


class TorchStage(nn.Module):
    """One pipeline stage of a zoo model for torch.distributed.pipelining: the model's own
    modules that hold `owned` parameters (names as in the model), its blocks kept under their
    own numbers (`blocks.1.fc.weight` stays so); the first stage runs the model's prologue, the
    last its head (the loss itself is the schedule's `loss_fn`)."""

    def __init__(
        self, model: nn.Module, zoo_name: str, owned: set[str], *, first: bool, last: bool
    ) -> None:
        super().__init__()
        self.run_prologue, self.run_head, _ = STAGE_PARTS[zoo_name]
        self.first, self.last = first, last
        blocks = model.get_submodule("blocks")
        assert isinstance(blocks, nn.ModuleList)
        self.blocks = nn.ModuleDict(
            {
                str(i): block
                for i, block in enumerate(blocks)
                if any(name.startswith(f"blocks.{i}.") for name in owned)
            }
        )
        for child, module in model.named_children():
            if child != "blocks" and any(name.startswith(f"{child}.") for name in owned):
                self.add_module(child, module)
        kept = {name for name, _ in self.named_parameters()}
        if kept != owned:
            raise RuntimeError(
                f"{zoo_name}: torch's stage holds {sorted(kept ^ owned)} unlike the plan's stage "
                "(the stage cut must fall between blocks, the prologue and head whole)."
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.run_prologue(self, x)
        for block in self.blocks.values():
            x = block(x)
        return self.run_head(self, x) if self.last else x


def _gpt_embed(stage: Any, idx: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(idx.shape[1], device=idx.device)
    return stage.wte(idx) + stage.wpe(pos)


def _gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# Zoo model -> (first stage's prologue, last stage's head, loss of (head's output, target)): the
# zoo's forward (autosbp/zoo/models.py) in three pieces around its blocks.
StagePart = Callable[[Any, torch.Tensor], torch.Tensor]  # (the stage, its input)
STAGE_PARTS: dict[str, tuple[StagePart, StagePart, Callable[..., torch.Tensor]]] = {
    "gpt": (_gpt_embed, lambda s, x: s.head(s.ln_f(x)), _gpt_loss),
    "mlp": (lambda s, x: F.gelu(s.inp(x)), lambda s, x: s.head(x), F.mse_loss),
}
