"""The price of a tensor-parallel reduction hidden behind its matmul: chunked compute, exposed comm.

Lives here: `overlap_cut` (the cut an op's overlapped twin runs, where it has one) and
`overlapped_s` (per consumer layout, the time of the producer output's reduction, or in backward of
its dual, run chunk by chunk beside the twin's compute, as `runtime.parallel.tp_overlap` runs it).
Lives elsewhere: what may be cut and how (`autosbp.tp_overlap`), the twins themselves and their
chunked compute (`timing.candidates`: `NodeStrategies.overlap_chunks`, `_Roofline.
chunked_forward_s`), the edges that use these prices (`timing.candidates.edge_matrices`), the
hidden share (`autosbp.overlap.hidden_sync_s`).

Model: a twin of a candidate whose output is partial sums on one mesh dim runs its op in k chunks
(k smaller matmuls, forward and backward, priced by the same op model: each reads the unsliced
operands again and pays its launch) and starts chunk i's reduction as soon as chunk i is computed.
With k chunks of compute c / k ready at even intervals and their collectives
t_1 = collective(bytes / k) each (k launches: t = k t_1 >= the whole one's time), run one at a time
beside the chunks after them, the exposed forward time is t - a (1 - 1/k) min(t, c), a the
profile's overlap efficiency: the gradient buckets' formula (`overlap.hidden_sync_s`), the same
event argument. Backward mirrors it: the dual's k collectives (all-reduce, or all-gather) start
together, the first waited exposed, each next one beside the chunk backward before it (the twin's
backward compute, BACKWARD_FACTOR x its forward): t' - a (1 - 1/k) min(t', c'),
t' = k dual(bytes / k). A pair whose conversion is not one reduction the cut can carry (a raw read,
a chain of steps, a reduce-scatter along the cut dim) is forbidden to the twin. Twins exist only
for an op and reader of one repeated block (or of a graph without blocks), recomputed alike by
every mode (so on one stage; where both are recomputed the checkpointed run runs the chunks and
their reduction again, priced by the node's and the edge's recomputed forward as any op's). A
profile without an overlap efficiency (0) gets no twins: every price stays what it was.
Invariants: a twin's edge prices are a function of the candidate, the consumer layout and the
prices alone; the cut priced is the one the runtime runs (`autosbp.tp_overlap.chunk_plan`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from autosbp.boxing import plan_boxing
from autosbp.boxing.steps import BoxingStep, dual_step
from autosbp.capturing.graph import OpGraph, Role, TensorMeta
from autosbp.errors import SbpError
from autosbp.overlap import hidden_sync_s
from autosbp.planner.space.recomputation import RECOMPUTE_MODES, recomputed
from autosbp.planner.timing.boxing_prices import Prices
from autosbp.rules import NdSignature
from autosbp.rules.matmul import EINSUM
from autosbp.sbp import Broadcast, Mesh, NdSbp, Partial, Split, check_nd_sbp
from autosbp.tp_overlap import TP_OVERLAP_CHUNKS, ChunkPlan, chunk_plan, fits, reduce_step

__all__ = ["overlap_cut", "overlapped_s", "twin_may_pay"]


def overlap_cut(
    graph: OpGraph,
    name: str,
    sig: NdSignature,
    mesh_shape: tuple[int, ...],
    prices: Prices,
    chunks: int | None = None,
) -> ChunkPlan | None:
    """The cut of `sig`'s overlapped twin: where op `name` is matmul-like, its one output read
    once by one op of its block, recomputed alike (`_beside`), partial sums on exactly one mesh
    dim of more than one device under `sig`, and the profile hides some communication behind
    compute; else None (no twin). `chunks`:
    the search's (None: TP_OVERLAP_CHUNKS where the profile hides some), or a hand plan's
    (`megatron:...,overlap=K`: K chunks even where it hides none, 0 never)."""
    attrs = graph.node(name)
    if chunks is None:
        chunks = TP_OVERLAP_CHUNKS if prices.overlap_efficiency > 0 else 0
    if chunks < 2 or attrs.role is not Role.COMPUTE or attrs.op not in EINSUM:
        return None
    readers = graph.readers(name)
    if len(readers) != 1 or len(graph.uses(name, readers[0])) != 1:
        return None
    partial = [d for d, x in enumerate(sig.outputs[0]) if isinstance(x, Partial)]
    if len(partial) != 1 or mesh_shape[partial[0]] == 1 or not _beside(graph, name, readers[0]):
        return None
    return chunk_plan(attrs, sig, mesh_shape, chunks)


def twin_may_pay(
    src: NdSbp,
    meta: TensorMeta,
    cut: ChunkPlan,
    compute_s: tuple[float, float],
    extra_s: float,
    mesh: Mesh,
    prices: Prices,
) -> bool:
    """Can the twin of a candidate whose output is `src` beat its in-line copy on some consumer
    layout: does the most its reduction and its dual hide, beside `compute_s` (the twin's
    forward and backward), exceed `extra_s` (what its chunks cost over the op run whole, forward
    and backward)? The twin and its copy differ only there and on the edge, where a layout one
    reduction reaches costs the whole collective and its dual in line and `overlapped_s` beside
    the chunks (the other layouts: forbidden to the twin); the in-line copy may also pay
    relabels the twin's price leaves out, ignored here. So a twin this refuses never wins a
    pair: dropping it changes no plan, and keeps the search's size where chunking cannot pay
    (small ops, where k launches outweigh what is hidden)."""
    dim = next(d for d, x in enumerate(src) if isinstance(x, Partial))
    summed = [*src[:dim], Broadcast(), *src[dim + 1 :]]
    scattered = [(*src[:dim], Split(d), *src[dim + 1 :]) for d in range(len(meta.shape))]
    dsts = [tuple(summed)] + [
        dst for d, dst in enumerate(scattered) if d != cut.dim and _fits(dst, meta, mesh)
    ]
    forward = overlapped_s(src, dsts, meta, cut, compute_s[0], mesh, prices)
    backward = overlapped_s(src, dsts, meta, cut, compute_s[1], mesh, prices, backward=True)
    for dst, shown in zip(dsts, forward + backward, strict=True):
        if np.isinf(shown):
            continue
        step = _reduction(src, dst, tuple(meta.shape), mesh, meta.dtype)
        assert step is not None, "priced above"
        whole = sum(_whole_s(s, prices) for s in (step, dual_step(step)))
        if whole - shown > extra_s:
            return True
    return False


def _whole_s(step: BoxingStep, prices: Prices) -> float:
    """One collective step run whole."""
    assert step.link_class is not None, "a reduction and its dual run on one mesh dim"
    return prices.collective_time_s(
        step.kind.value, step.message_bytes, step.group_size, step.link_class
    )


@lru_cache(maxsize=16384)
def _reduction(
    src: NdSbp, dst: NdSbp, shape: tuple[int, ...], mesh: Mesh, dtype: Any
) -> BoxingStep | None:
    """The one reduction of `src` -> `dst` (`autosbp.tp_overlap.reduce_step`), cached: a search
    asks for the same pairs on every edge of every configuration."""
    return reduce_step(plan_boxing(src, dst, shape, mesh, dtype=dtype))


def _fits(nd: NdSbp, meta: TensorMeta, mesh: Mesh) -> bool:
    """Does `nd` split `meta` evenly on `mesh` (`sbp.check_nd_sbp`)?"""
    try:
        check_nd_sbp(nd, meta.shape, mesh.shape)
    except SbpError:
        return False
    return True


def _beside(graph: OpGraph, name: str, reader: str) -> bool:
    """Do op `name` and its one `reader` run alike under every configuration: on one stage
    under every split (in one repeated block, which `space.stages` deals whole, or anywhere in
    a graph without blocks, which has one stage), recomputed by every mode both or neither (a
    recomputed run with the op runs its chunks and reduction again in backward, priced as the
    twin's forward on the node and the reduction's exposed forward on the edge,
    `problem.stage_terms`; a reader recomputed alone would convert again what the runtime does
    not, an op recomputed alone its reduction unpriced)? `full:K` runs each block under full or
    none (`space.recomputation.block_modes`), so two ops of one block alike under both are
    alike under it."""
    block = graph.node(name).block
    if graph.node(reader).block != block or (block is None and _has_blocks(graph)):
        return False
    return all(
        recomputed(graph, name, mode) == recomputed(graph, reader, mode) for mode in RECOMPUTE_MODES
    )


_BLOCKED: dict[int, tuple[weakref.ref, bool]] = {}  # per live graph (as `space.recomputation`)


def _has_blocks(graph: OpGraph) -> bool:
    """Does `graph` have a repeated block (else it runs on one stage: `space.stages`)?"""
    key = id(graph)
    entry = _BLOCKED.get(key)
    if entry is None or entry[0]() is not graph:
        found = any(attrs.block is not None for _, attrs in graph.nodes())
        entry = _BLOCKED[key] = (weakref.ref(graph, lambda _: _BLOCKED.pop(key, None)), found)
    return entry[1]


def overlapped_s(
    src: NdSbp,
    dsts: Sequence[NdSbp],
    meta: TensorMeta,
    cut: ChunkPlan,
    compute_s: float,
    mesh: Mesh,
    prices: Prices,
    backward: bool = False,
) -> np.ndarray:
    """Per consumer layout in `dsts`, the exposed time of converting `src` chunk by chunk beside
    `compute_s` (the twin's forward), or with `backward` of the conversion's dual beside the
    chunks' backward (`compute_s` then that); inf where the cut cannot carry it."""
    out = np.full(len(dsts), np.inf)
    for j, dst in enumerate(dsts):
        step = _reduction(src, dst, tuple(meta.shape), mesh, meta.dtype)
        if step is None or not fits(cut, step):
            continue
        step = dual_step(step) if backward else step
        link = step.link_class
        assert link is not None, "a reduction and its dual run on one mesh dim"
        one = prices.collective_time_s(
            step.kind.value, step.message_bytes / cut.chunks, step.group_size, link
        )
        comm = cut.chunks * one
        out[j] = comm - hidden_sync_s(comm, compute_s, cut.chunks, prices.overlap_efficiency)
    return out
