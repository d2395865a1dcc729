"""A matmul and the reduction of its partial sums, pipelined: tensor-parallel communication hidden
behind compute, forward and backward.

Lives here: `overlapped_instruction` (the instruction that runs an op the plan overlaps,
`NodePlan.overlap_chunks`: its chunks one after another, each chunk's all-reduce or
reduce-scatter started asynchronously as soon as the chunk is computed, every one waited, with
the world's timeout, before the consumer reads the result; in backward, the reduction's dual
started chunk by chunk and each waited just before its chunk's gradient matmuls). Lives
elsewhere: which ops and how they are cut (`autosbp.tp_overlap`), the price
(`autosbp.planner.timing.tp_overlap`), the builder that emits it in place of the op and its
output's boxing (`runtime.execute.builder`), the collectives (`runtime.execute.collectives.
start_step`).

Invariants:
- Every rank of the group starts the same chunks' collectives in the same order (the cut is a
  function of the plan and shapes), so async collectives match. Forward, each is waited before
  the instruction returns, so nothing is in flight beyond it.
- Forward equals the op followed by its conversion (the sum commutes with the cut). Backward,
  the conversion's dual (an all-reduce, or the all-gather of a reduce-scatter) runs on each
  chunk of the gradient along the cut (the cut never splits the dim the dual gathers, so the
  chunks' duals are the whole dual's chunks): the reduction's backward starts every chunk's,
  last chunk first (the order autograd reaches the chunks: the latest made first), and each
  chunk's backward waits for its own before its matmuls run, while the next ones travel.
- Spans: "tp_overlap" around the chunks and their collectives in flight, "tp_wait" around the
  wait for the ones still running after the last chunk (what stays exposed), and in backward
  around each chunk's wait.
Reference: torch/distributed/_symmetric_memory (micro-pipelined matmul -> reduce-scatter);
Megatron-LM's tp_comm_overlap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from autosbp.boxing.steps import BoxingStep, dual_step
from autosbp.rules import LocalOp
from autosbp.timeline import SpanHook
from autosbp.tp_overlap import ChunkPlan
from runtime.execute.collectives import Started, start_step
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
        duals = _Duals(dual_step(step), comm, cut.chunks)
        with _span(comm.span_hook, "tp_overlap"):
            for k in range(cut.chunks):
                (y,) = op([piece[k] for piece in pieces])
                outputs.append(_Awaited.apply(y, duals, k))
                with torch.no_grad():
                    started.append(start_step(y.detach(), step, comm.groups))
        with _span(comm.span_hook, "tp_wait"):
            reduced = torch.cat([s.result(comm.timeout) for s in started], dim=cut.dim)
        values[dst] = _Reduced.apply([reduced], cut.dim, duals, *outputs)

    return run


class _Duals:
    """One overlapped op's backward collectives: the dual of its reduction on each chunk of the
    gradient, started together by the reduction's backward and waited chunk by chunk."""

    def __init__(self, step: BoxingStep, comm: GroupComm, chunks: int) -> None:
        self.step, self.comm = step, comm
        self.started: list[Started | None] = [None] * chunks

    def start(self, grads: Sequence[torch.Tensor]) -> None:
        for k in reversed(range(len(grads))):  # the order autograd will wait for them
            self.started[k] = start_step(grads[k].contiguous(), self.step, self.comm.groups)

    def result(self, k: int) -> torch.Tensor:
        started = self.started[k]
        assert started is not None, "the reduction's backward starts every chunk's dual first"
        self.started[k] = None
        with _span(self.comm.span_hook, "tp_wait"):
            return started.result(self.comm.timeout)


class _Reduced(torch.autograd.Function):
    """The chunks' outputs, converted (computed beforehand, asynchronously, and handed in a list
    so that autograd does not take it for an input); backward: the conversion's dual started on
    each chunk of the gradient (`_Duals`), which each chunk's `_Awaited` waits for. What this
    returns for a chunk stands in for the dual's result: a zero of its shape, never read."""

    @staticmethod
    def forward(
        ctx: Any, reduced: list[torch.Tensor], dim: int, duals: _Duals, *outputs: torch.Tensor
    ) -> torch.Tensor:
        ctx.dim, ctx.duals = dim, duals
        ctx.shapes = [y.shape for y in outputs]
        return reduced[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.duals.start(grad.split([shape[ctx.dim] for shape in ctx.shapes], dim=ctx.dim))
        stand_in = grad.new_zeros(())
        return (None, None, None, *(stand_in.expand(shape) for shape in ctx.shapes))


class _Awaited(torch.autograd.Function):
    """Chunk `k`'s output as computed; backward: the dual of its reduction on its gradient's
    chunk, waited for here, just before autograd runs the chunk's own backward."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, duals: _Duals, k: int) -> torch.Tensor:
        ctx.duals, ctx.k = duals, k
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, stand_in: torch.Tensor) -> tuple[Any, ...]:
        return ctx.duals.result(ctx.k), None, None


@contextlib.contextmanager
def _span(hook: SpanHook | None, kind: str) -> Iterator[None]:
    if hook is None:
        yield
    else:
        with hook.span(kind):
            yield
