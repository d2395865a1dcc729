"""Tensor-parallel reductions hidden behind their matmul: what may be overlapped, and how it is cut.

Lives here: `reduce_step` (the one collective of a conversion that can be overlapped: partial sums
all-reduced, P -> B, or reduce-scattered, P -> S(d), on one mesh dim), `ChunkPlan` and
`chunk_plan` (how a matmul-like op is cut into chunks along a free dim of its output, each
chunk's inputs a slice of the op's), `fits` (whether a reduction can run chunk by chunk on a cut),
and `TP_OVERLAP_CHUNKS` (the chunks the planner offers).
Lives elsewhere: the price (`autosbp.planner.timing.tp_overlap`, hidden with `overlap.hidden_sync_s`),
the plan's statement (`plan.values.NodePlan.overlap_chunks`), the runtime that runs it
(`runtime.parallel.tp_overlap`), the einsum letters of each op (`rules.matmul.EINSUM`).

Model (Megatron-LM's `tp_comm_overlap`, torch's micro-pipelined async tensor parallelism,
Wang et al. 2022 "Overlap communication with dependent computation via decomposition"): a
row-parallel matmul's output holds partial sums on the tensor-parallel mesh dim; its consumer
reads them summed (all-reduce) or summed and split along the sequence (reduce-scatter). Cut
along an output dim the collective does not split (a batch or sequence dim of the rows), each
chunk of the output is the matmul of a slice of the inputs, and its collective may run while
the next chunk computes. The sum commutes with the cut, so the result is the same tensor, up to
the rounding of the smaller collectives' sums (none on gloo's fp32 sums in rank order).
Backward mirrors it: the conversion's dual (all-reduce, or all-gather) runs on each chunk of the
gradient, all started at once, each waited just before its chunk's matmul backward, so the
next chunks' travel beside it.

Invariants: a chunk plan slices only operands that hold the chunked letter at full size (a
size-1 broadcast dim is read whole), and an addend (a linear's bias) where its right-aligned dim
is the chunked one; the chunked dim is never the dim a reduce-scatter splits; a chunk plan
exists only where every chunk is non-empty (the local size along the dim is at least the chunk
count).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autosbp.boxing.steps import BoxingStep, StepKind
from autosbp.capturing.graph import OpNode
from autosbp.rules import NdSignature
from autosbp.rules.core import tensor_slots
from autosbp.rules.matmul import EINSUM, letters_of
from autosbp.sbp import Split, local_shape

__all__ = ["TP_OVERLAP_CHUNKS", "ChunkPlan", "chunk_plan", "fits", "reduce_step"]

# The chunks the planner offers an overlapped matmul: torch's async tensor parallelism cuts a
# matmul -> reduce-scatter into as many chunks as the group has ranks (2 to 8); 4 hides up to
# 3/4 of the shorter of compute and communication (`overlap.hidden_sync_s`) for 4 launches.
TP_OVERLAP_CHUNKS = 4


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """A matmul-like op cut into `chunks` along output dim `dim`: per tensor input (InputRef
    order), the dim of it sliced alike (None: read whole by every chunk)."""

    dim: int
    chunks: int
    input_dims: tuple[int | None, ...]


def reduce_step(steps: Sequence[BoxingStep]) -> BoxingStep | None:
    """The one step of a conversion that sums partial sums on one mesh dim (all-reduce, or
    reduce-scatter), its relabels aside; None for any other conversion."""
    real = [s for s in steps if not (s.kind is StepKind.LOCAL and s.group_size == 1)]
    if len(real) != 1 or real[0].kind not in (StepKind.ALL_REDUCE, StepKind.REDUCE_SCATTER):
        return None
    return real[0]


def chunk_plan(
    node: OpNode, sig: NdSignature, mesh_shape: tuple[int, ...], chunks: int
) -> ChunkPlan | None:
    """How op `node` under `sig` is cut into `chunks` along a free dim of its output: the
    outermost one whose local size is at least `chunks`. None where the op is not matmul-like
    or no dim qualifies. The cut serves a reduction that does not split that dim (`fits`)."""
    einsum = EINSUM.get(node.op)
    if einsum is None or chunks < 2 or len(node.outputs) != 1:
        return None
    slots = tensor_slots(node)
    shapes = [tuple(node.inputs[_index(slots[name])].shape) for name in einsum.operands]
    letters, out_letters = letters_of(einsum, shapes)
    out_global = tuple(node.outputs[0].shape)
    out_local = local_shape(out_global, sig.outputs[0], mesh_shape)
    for dim, letter in enumerate(out_letters):
        if out_local[dim] < chunks:
            continue
        dims: list[int | None] = [None] * len(node.inputs)
        for name, lt, shape in zip(einsum.operands, letters, shapes, strict=True):
            if letter in lt and shape[lt.index(letter)] == out_global[dim]:
                dims[_index(slots[name])] = lt.index(letter)
        if einsum.addend is not None and einsum.addend in slots:
            index = _index(slots[einsum.addend])
            addend = tuple(node.inputs[index].shape)
            at = dim - (len(out_global) - len(addend))
            if at >= 0 and addend[at] == out_global[dim]:
                dims[index] = at
        return ChunkPlan(dim, chunks, tuple(dims))
    return None


def fits(cut: ChunkPlan, step: BoxingStep) -> bool:
    """Can `step` (a `reduce_step`) run chunk by chunk on `cut`: it does not split the cut dim
    (a reduce-scatter along it would hand each rank pieces of every chunk, not its piece)?"""
    return not (isinstance(step.dst_sbp, Split) and step.dst_sbp.dim == cut.dim)


def _index(slot: int | tuple[int, ...]) -> int:
    assert isinstance(slot, int), "a matmul's operands are single tensors"
    return slot
