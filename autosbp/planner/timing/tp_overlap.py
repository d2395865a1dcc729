"""The price of a tensor-parallel reduction hidden behind its matmul: chunked compute, exposed comm.

Lives here: `overlap_cut` (the cut an op's overlapped twin runs, where it has one) and
`overlapped_forward_s` (per consumer layout, the forward time of the producer output's
reduction run chunk by chunk beside the twin's compute, as `runtime.parallel.tp_overlap` runs
it). Lives elsewhere: what may be cut and how (`autosbp.tp_overlap`), the twins themselves and
their chunked compute (`timing.candidates`: `NodeStrategies.overlap_chunks`, `_Roofline.
chunked_forward_s`), the edges that use these prices (`timing.candidates.edge_matrices`), the hidden share
(`autosbp.overlap.hidden_sync_s`).

Model: a twin of a candidate whose output is partial sums on one mesh dim runs its op in k
chunks (k smaller matmuls, forward and backward, priced by the same op model: each reads the
unsliced operands again and pays its launch) and starts chunk i's reduction as soon as chunk i
is computed. With k chunks of compute c / k ready at even intervals and their collectives t_1
= collective(bytes / k) each (k launches: t = k t_1 >= the whole one's time), run one at a time
beside the chunks after them, the exposed forward time is t - a (1 - 1/k) min(t, c), a the
profile's overlap efficiency: the gradient buckets' formula (`overlap.hidden_sync_s`), the same
event argument. Backward runs the reduction's dual once, in line (priced as the edge's
unoverlapped backward). A pair whose conversion is not one reduction the cut can carry (a raw
read, a chain of steps, a reduce-scatter along the cut dim) is forbidden to the twin. A profile
without an overlap efficiency (0) gets no twins: every price stays what it was.
Invariants: a twin's edge prices are a function of the candidate, the consumer layout and the
prices alone; the cut priced is the one the runtime runs (`autosbp.tp_overlap.chunk_plan`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autosbp.boxing import plan_boxing
from autosbp.capturing.graph import OpGraph, Role, TensorMeta
from autosbp.overlap import hidden_sync_s
from autosbp.planner.timing.boxing_prices import Prices
from autosbp.rules import NdSignature
from autosbp.rules.matmul import EINSUM
from autosbp.sbp import Mesh, NdSbp, Partial
from autosbp.tp_overlap import TP_OVERLAP_CHUNKS, ChunkPlan, chunk_plan, fits, reduce_step

__all__ = ["overlap_cut", "overlapped_forward_s"]


def overlap_cut(
    graph: OpGraph, name: str, sig: NdSignature, mesh_shape: tuple[int, ...], prices: Prices
) -> ChunkPlan | None:
    """The cut of `sig`'s overlapped twin: where op `name` is matmul-like, its one output read
    once by one op, partial sums on exactly one mesh dim of more than one device under `sig`,
    and the profile hides some communication behind compute; else None (no twin)."""
    attrs = graph.node(name)
    if prices.overlap_efficiency <= 0 or attrs.role is not Role.COMPUTE or attrs.op not in EINSUM:
        return None
    readers = graph.readers(name)
    if len(readers) != 1 or len(graph.uses(name, readers[0])) != 1:
        return None
    partial = [d for d, x in enumerate(sig.outputs[0]) if isinstance(x, Partial)]
    if len(partial) != 1 or mesh_shape[partial[0]] == 1:
        return None
    return chunk_plan(attrs, sig, mesh_shape, TP_OVERLAP_CHUNKS)


def overlapped_forward_s(
    src: NdSbp,
    dsts: Sequence[NdSbp],
    meta: TensorMeta,
    cut: ChunkPlan,
    compute_s: float,
    mesh: Mesh,
    prices: Prices,
) -> np.ndarray:
    """Per consumer layout in `dsts`, the exposed forward time of converting `src` chunk by
    chunk beside `compute_s` (the twin's forward), inf where the cut cannot carry it."""
    out = np.full(len(dsts), np.inf)
    for j, dst in enumerate(dsts):
        step = reduce_step(plan_boxing(src, dst, meta.shape, mesh, dtype=meta.dtype))
        if step is None or not fits(cut, step):
            continue
        link = step.link_class
        assert link is not None, "a reduction runs on one mesh dim"
        one = prices.collective_time_s(
            step.kind.value, step.message_bytes / cut.chunks, step.group_size, link
        )
        comm = cut.chunks * one
        out[j] = comm - hidden_sync_s(comm, compute_s, cut.chunks, prices.overlap_efficiency)
    return out
