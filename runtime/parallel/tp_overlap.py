"""A matmul and the reduction of its partial sums, pipelined: tensor-parallel communication hidden
behind compute.

Lives here: `overlapped_instruction` (the instruction that runs an op the plan overlaps,
`NodePlan.overlap_chunks`: its chunks one after another, each chunk's all-reduce or
reduce-scatter started asynchronously as soon as the chunk is computed, every one waited, with
the world's timeout, before the consumer reads the result). Lives elsewhere: which ops and how
they are cut (`autosbp.tp_overlap`), the price (`autosbp.planner.timing.tp_overlap`), the
builder that emits it in place of the op and its output's boxing (`runtime.execute.builder`),
the collectives (`runtime.execute.collectives.start_step`).

Invariants:
- Every rank of the group starts the same chunks' collectives in the same order (the cut is a
  function of the plan and shapes), so async collectives match; each is waited before the
  instruction returns, so nothing is in flight beyond it and no later collective can queue
  behind one it does not know of.
- Forward equals the op followed by its conversion (the sum commutes with the cut); backward
  is the conversion's dual run once on the whole gradient (an all-reduce, or the all-gather of a
  reduce-scatter), cut into the chunks' gradients: what the unoverlapped boxing's backward runs.
- Spans: "tp_overlap" around the chunks and their collectives in flight, "tp_wait" around the
  wait for the ones still running after the last chunk (what stays exposed).
Reference: torch/distributed/_symmetric_memory (micro-pipelined matmul -> reduce-scatter);
Megatron-LM's tp_comm_overlap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from autosbp.boxing.steps import BoxingStep, dual_step
from autosbp.rules import LocalOp
from autosbp.timeline import SpanHook
from autosbp.tp_overlap import ChunkPlan
from runtime.execute.collectives import run_step, start_step
from runtime.execute.instructions import Instruction, Values
from runtime.execute.op_comm import GroupComm

__all__ = ["overlapped_instruction"]


def overlapped_instruction(
    op: LocalOp,
    cut: ChunkPlan,
    step: BoxingStep,
    comm: GroupComm,
    ins: tuple[int, ...],
    dst: int,
) -> Instruction:
    """Run `op` on the tensors at `ins` in the chunks of `cut`, each chunk's `step` started as it
    is computed; store the converted output (the layout the consumer reads) at `dst`."""

    def run(values: Values) -> None:
        inputs = [values[slot] for slot in ins]
        pieces = [
            x.tensor_split(cut.chunks, dim) if dim is not None else (x,) * cut.chunks
            for x, dim in zip(inputs, cut.input_dims, strict=True)
        ]
        outputs, started = [], []
        with _span(comm.span_hook, "tp_overlap"):
            for k in range(cut.chunks):
                (y,) = op([piece[k] for piece in pieces])
                outputs.append(y)
                with torch.no_grad():
                    started.append(start_step(y.detach(), step, comm.groups))
        with _span(comm.span_hook, "tp_wait"):
            reduced = torch.cat([s.result(comm.timeout) for s in started], dim=cut.dim)
        values[dst] = _Reduced.apply([reduced], cut.dim, step, comm, *outputs)

    return run


class _Reduced(torch.autograd.Function):
    """The chunks' outputs, converted (computed beforehand, asynchronously, and handed in a list
    so that autograd does not take it for an input); backward: the conversion's dual on the
    whole gradient, cut back into the chunks'."""

    @staticmethod
    def forward(
        ctx: Any,
        reduced: list[torch.Tensor],
        dim: int,
        step: BoxingStep,
        comm: GroupComm,
        *outputs: torch.Tensor,
    ) -> torch.Tensor:
        ctx.dim, ctx.step, ctx.comm = dim, step, comm
        ctx.sizes = [y.shape[dim] for y in outputs]
        return reduced[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        whole = run_step(grad.contiguous(), dual_step(ctx.step), ctx.comm.groups)
        return (None, None, None, None, *whole.split(ctx.sizes, dim=ctx.dim))


@contextlib.contextmanager
def _span(hook: SpanHook | None, kind: str) -> Iterator[None]:
    if hook is None:
        yield
    else:
        with hook.span(kind):
            yield
