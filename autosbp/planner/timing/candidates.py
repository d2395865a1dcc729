"""Price every strategy of every node and edge: the numbers the ILP chooses between.

Lives here: per node, its candidate nd-signatures with compute time (forward + backward) and the
bytes they keep on a device; per edge, the matrix of boxing times between the producer's output and
the consumer's input; for parameters, the gradient synchronisation their layout implies. Lives
elsewhere: the signatures (`rules`), boxing prices (`timing.boxing_prices`), communication inside an
op (`timing.op_exchanges`), the hardware prices (`costmodel`, behind the `Prices` protocol), the ILP
(`ilp`), the memory accounting (`memory`).

Model (every constant states where it comes from):
- compute: roofline `op_time_s(local_flops, local_bytes)`, plus the exchanges a signature runs
  inside the op (`timing.op_exchanges.exchange_cost`, the one hook: forward and backward, exposed as
  the runtime runs them, and the bytes they hold); local flops = flops x the smallest local/global
  size ratio among the op's tensors (the share of the work one device does: 1/n for data-, tensor-
  and contraction-split matmuls alike) x the fraction of it the kernel computes
  (`rules.work_fraction`: causal attention computes part of the dense product it is counted at, as
  much as the profile's `causal_skip` says); local bytes = the local tensors' bytes. Backward =
  BACKWARD_FACTOR x forward x the share of its floating inputs that require grad
  (`memory.kept.Kept.backward_share`, below 1 under frozen weights) (2: a matmul's backward is two
  matmuls of the same size; Narayanan et al. 2021 section 3.3 count 3x forward for forward +
  backward).
- an op that returns a view of its input (its schema says so and it has its own kernel, so it
  cannot decompose into a copy the way reshape, flatten or contiguous of a non-contiguous
  tensor do) moves no data: it costs the per-op overhead floor alone, forward and backward.
  Measured (torch 2.13 CPU, 1 thread, timeit min of 5 on the shared 2-core host under load ~2):
  of a 16x64x512 fp32 tensor, view 6.7 us, transpose 7.3 us, split in 4 38 us, beside a
  one-element add at 14 us; the roofline priced each as reading and writing the whole tensor
  (90-360 us: the views, transposes and splits of gpt-128 summed to 3.3 ms of a 37 ms forward).
- an edge u -> v, for each (output layout of u, input layout v needs): the forward boxing time
  plus its backward, the boxing dual(dst) -> dual(src) (B <-> P, S stays), per micro-batch
  (`edge_matrices`: that and the forward alone, in one pass over the edge's uses).
  An input v writes in place (or a view on the way to such a write: `rules.pinned_inputs`) is
  forbidden to change layout (an infinite price): a boxed copy would take the write away from
  the tensor the model reads afterwards, so a plan never asks the runtime for it.
- a parameter stored split whose consumer keeps its converted copy for backward (`memory.kept`) has
  each layout twice (FSDP's reshard_after_forward): kept (the copy stays until backward: bytes
  per micro-batch in flight, `memory`) or re-gathered (freed after forward and converted again
  before backward: the forward conversion once more per micro-batch, priced by the builder on
  the edge, `problem.stage_terms`); `NodeStrategies.regather` says which candidate is which.
- a contraction that keeps an activation it may read gathered has each such candidate once more
  per input, re-gathering it in backward instead of keeping the copy (sequence parallelism's,
  `timing.regather`: the twins' pairs priced on the edge); `NodeStrategies.regather_input`.
- a parameter in layout p pays, once per step, the gradient sync dual(p) -> p (P -> B
  all-reduce where the parameter is replicated: data parallel's all-reduce; nothing where it is
  split: FSDP's reduce-scatter is already the backward of its all-gather), as its share of a
  fused bucket's collective (`BoxingPricer.bucketed_time_s`), and its optimizer
  update on the local shard (memory-bound: `timing.param_candidates.optimizer_s`) and the runtime's
  non-finite check of its local gradient (`timing.finite_check`); with micro-batches,
  each backward after the first adds its gradient into the accumulated one (autograd's
  AccumulateGrad: read both, write one), priced per micro-batch by the builder.
- ZeRO-1 and ZeRO-2: a replicated layout has each candidate again with its optimizer states
  split (`NodeStrategies.state`), and once more with its gradient accumulated split too
  (`NodeStrategies.gradient`: reduce-scattered in every micro-batch's backward,
  `NodeStrategies.scatter_s`), priced by `timing.param_candidates.parameter_prices`.
Node times of compute ops are per micro-batch; parameter times are per step: the problem builder
scales them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from autosbp import overlap
from autosbp.capturing.graph import OpGraph, OpNode, Role, TensorMeta
from autosbp.planner.timing.boxing_prices import BoxingPricer, Prices
from autosbp.planner.timing.finite_check import gradient_check_s
from autosbp.planner.timing.op_exchanges import exchange_cost
from autosbp.planner.timing.param_candidates import parameter_prices, with_zero_states
from autosbp.planner.timing.recipe import PLAIN, Recipe
from autosbp.planner.timing.regather import regather_twins
from autosbp.planner.timing.tp_overlap import overlap_cut, overlapped_s, twin_may_pay
from autosbp.rules import NdSignature, nd_signatures, pinned_inputs, work_fraction
from autosbp.sbp import Broadcast, NdSbp, Partial, local_shape
from autosbp.tp_overlap import ChunkPlan

__all__ = [
    "BACKWARD_FACTOR", "BoxingPricer", "NodeStrategies", "Prices", "edge_matrices",
    "edge_matrix", "node_strategies", "returns_view", "sync_bucket_bytes",
]  # fmt: skip

BACKWARD_FACTOR = 2.0  # backward time / forward time (derived: two matmuls per matmul)


@dataclass(frozen=True)
class NodeStrategies:
    """A node's candidates and their per-micro-batch compute time (forward + backward); for a
    parameter, its per-step gradient sync + optimizer time, `sync_s` the sync part alone,
    `accumulate_s` the time to add one micro-batch's gradient into the accumulated one, and
    `regather` whether a candidate frees its converted copies after forward and converts again
    before backward (a layout may appear twice: kept, then re-gathered)."""

    name: str
    candidates: tuple[NdSignature, ...]
    compute_s: np.ndarray
    sync_s: np.ndarray | None = None  # parameters only
    accumulate_s: np.ndarray | None = None  # parameters only
    pinned: frozenset[int] = frozenset()  # inputs that must arrive unboxed (`pinned_inputs`)
    regather: np.ndarray | None = None  # parameters only: bool per candidate
    forward_s: np.ndarray | None = None  # compute ops: the forward part of compute_s
    held_bytes: np.ndarray | None = None  # compute ops: what exchanges hold until backward
    # parameters only: per candidate, its optimizer states' layout (None: the parameter's own)
    state: tuple[NdSbp | None, ...] | None = None
    # parameters only: per candidate, the layout its gradient is accumulated in (ZeRO-2: the
    # states'; None: the parameter's own), and what each micro-batch's backward adds for it
    gradient: tuple[NdSbp | None, ...] | None = None
    scatter_s: np.ndarray | None = None
    # compute ops only: per candidate, the input its backward gathers again instead of keeping
    # the gathered copy (`timing.regather`), -1 for a candidate that keeps every copy
    regather_input: np.ndarray | None = None
    # compute ops only: per candidate, the cut it runs in beside its output's reduction
    # (`timing.tp_overlap`), None for a candidate that runs whole
    overlap_cuts: tuple[ChunkPlan | None, ...] | None = None

    def restricted(self, keep: Sequence[int]) -> NodeStrategies:
        """Only the candidates at `keep`."""

        def pick(values: np.ndarray | None) -> np.ndarray | None:
            return values[keep] if values is not None else None

        candidates = tuple(self.candidates[i] for i in keep)
        state = tuple(self.state[i] for i in keep) if self.state is not None else None
        grad = tuple(self.gradient[i] for i in keep) if self.gradient is not None else None
        return NodeStrategies(
            self.name, candidates, self.compute_s[keep], pick(self.sync_s),
            pick(self.accumulate_s), self.pinned, pick(self.regather), pick(self.forward_s),
            pick(self.held_bytes), state, grad, pick(self.scatter_s), pick(self.regather_input),
            None if self.overlap_cuts is None else tuple(self.overlap_cuts[i] for i in keep),
        )  # fmt: skip

    def per_micro_batch_s(self, micro_batches: int) -> np.ndarray:
        """A parameter's busy time per micro-batch, per candidate: every backward but the first
        adds into the gradient (`accumulate_s`), and ZeRO-2 reduce-scatters in every one."""
        busy = np.zeros(len(self.candidates))
        if micro_batches > 1:
            assert self.accumulate_s is not None, f"{self.name}: priced without its accumulate"
            busy = busy + (micro_batches - 1) / micro_batches * self.accumulate_s
        if self.scatter_s is not None:
            busy = busy + self.scatter_s
        return busy

    def forward_part_s(self) -> np.ndarray:
        """Per candidate, the forward's share of `compute_s` (1 / (1 + BACKWARD_FACTOR) of it
        where the candidates state none)."""
        if self.forward_s is not None:
            return self.forward_s
        return self.compute_s / (1.0 + BACKWARD_FACTOR)

    def state_of(self, index: int) -> NdSbp | None:
        """Candidate `index`'s optimizer-state layout where it differs from the parameter's
        (ZeRO-1), else None."""
        return self.state[index] if self.state is not None else None

    def gradient_of(self, index: int) -> NdSbp | None:
        """Candidate `index`'s gradient layout where it differs from the parameter's (ZeRO-2),
        else None."""
        return self.gradient[index] if self.gradient is not None else None

    def regathers(self, index: int) -> bool:
        """Does candidate `index` free its converted copies after forward (a parameter: FSDP's
        reshard_after_forward; an op: the kept activation it read gathered, converted again in
        its backward: `regathered_input`)?"""
        if self.regather_input is not None:
            return bool(self.regather_input[index] >= 0)
        return self.regather is not None and bool(self.regather[index])

    def chunks_of(self, index: int) -> int:
        """The chunks candidate `index` runs in beside its output's reduction (0: whole)."""
        cut = None if self.overlap_cuts is None else self.overlap_cuts[index]
        return 0 if cut is None else cut.chunks

    def regathered_input(self, index: int) -> int | None:
        """The input candidate `index` of an op gathers again in backward (None: it keeps)."""
        if self.regather_input is None or self.regather_input[index] < 0:
            return None
        return int(self.regather_input[index])


def sync_bucket_bytes(graph: OpGraph) -> int:
    """The bucket a gradient is priced inside: DDP's cap (`overlap.GRAD_BUCKET_BYTES`), or
    all the graph's parameters where they fill less (the runtime fuses them into one; where a
    plan splits some of them, or stages divide them, the real bucket is smaller and slower per
    byte: an estimate)."""
    total = sum(attrs.outputs[0].nbytes for _, attrs in graph.nodes(Role.PARAMETER))
    return max(1, min(overlap.GRAD_BUCKET_BYTES, total))


def node_strategies(
    graph: OpGraph,
    name: str,
    pricer: BoxingPricer,
    bucket_bytes: int,
    regatherable: bool = False,
    backward_share: float = 1.0,
    allow: Callable[[OpGraph, str, NdSignature], bool] | None = None,
    recipe: Recipe = PLAIN,
    regather_inputs: frozenset[int] = frozenset(),
    overlap: int | None = None,
) -> NodeStrategies:
    """Candidates of node `name`: per micro-batch compute time, or per step for parameters (their
    gradient sync priced inside buckets of `bucket_bytes`: `sync_bucket_bytes`). `regatherable` (a
    parameter some consumer keeps, `memory.kept.Kept.regatherable`): each layout that is not B on
    every mesh dim comes twice, kept and re-gathered (the module header). `backward_share`: of an
    op's floating inputs, the share whose gradient backward computes
    (`memory.kept.Kept.backward_share`: under frozen weights, less than 1). `allow(graph, name,
    sig)`: of a node that is not a parameter, the candidates to price (the others are dropped
    unpriced; each candidate is priced alone); a parameter's are all priced
    (`problem.priced._restricted`). `recipe`: what the step runs around a parameter
    (`timing.recipe`). `regather_inputs` (an op's kept activations, `memory.kept.Kept.
    regather_inputs`): each candidate that may read one of them gathered comes once more per
    such input, re-gathering it in backward instead of keeping its copy (`timing.regather`).
    `overlap`: the chunks of an op's overlapped twins (`timing.tp_overlap.overlap_cut`: None
    the search's, K a hand plan's, 0 none)."""
    attrs = graph.node(name)
    mesh_shape = pricer.mesh.shape
    candidates = tuple(_candidates(attrs, mesh_shape))
    if attrs.role is Role.PARAMETER:
        return _parameter_strategies(name, attrs.outputs[0], candidates, pricer, bucket_bytes,
                                     regatherable, recipe)  # fmt: skip
    if allow is not None:
        candidates = tuple(sig for sig in candidates if allow(graph, name, sig))
    forward, backward, held = [], [], []
    roofline = _Roofline(attrs, mesh_shape, pricer.prices)
    for sig in candidates:  # the op's compute, and its exchanges through one hook (`op_exchanges`)
        fwd = roofline.forward_s(sig)
        bwd = BACKWARD_FACTOR * fwd * backward_share
        comm = exchange_cost(attrs, sig, pricer.mesh, pricer.prices, fwd, bwd)
        forward.append(fwd + comm.forward_s)
        backward.append(bwd + comm.backward_s)
        held.append(comm.held_bytes)
    found = NodeStrategies(
        name, candidates, np.array(forward) + np.array(backward), pinned=pinned_inputs(graph, name),
        forward_s=np.array(forward), held_bytes=np.array(held) if any(held) else None,
    )  # fmt: skip
    twins = regather_twins(attrs, candidates, regather_inputs, mesh_shape)
    if twins:
        again = found.restricted([*range(len(candidates)), *(j for j, _ in twins)])
        inputs = np.array([-1] * len(candidates) + [i for _, i in twins], dtype=int)
        found = replace(again, regather_input=inputs)
    return _with_overlap_twins(graph, name, found, roofline, backward_share, pricer, overlap)


def _with_overlap_twins(
    graph: OpGraph,
    name: str,
    found: NodeStrategies,
    roofline: _Roofline,
    backward_share: float,
    pricer: BoxingPricer,
    chunks: int | None,
) -> NodeStrategies:
    """`found` with each candidate that may run beside its output's reduction once more, run in
    `chunks` chunks (`timing.tp_overlap`: its compute chunked here, its edge in `edge_matrices`)."""
    twins: list[tuple[int, ChunkPlan]] = []
    priced: list[float] = []
    assert found.forward_s is not None or not found.candidates, "compute ops state their forward"
    for i, sig in enumerate(found.candidates):
        cut = None if found.regathers(i) else overlap_cut(graph, name, sig, pricer.mesh.shape,
                                                          pricer.prices, chunks)  # fmt: skip
        if cut is None:
            continue
        fwd = roofline.chunked_forward_s(sig, cut)
        bwd = BACKWARD_FACTOR * fwd * backward_share
        extra = fwd + bwd - float(found.compute_s[i])
        meta = graph.node(name).outputs[0]
        if chunks or twin_may_pay(sig.outputs[0], meta, cut, (fwd, bwd), extra, pricer.mesh,
                                  pricer.prices):  # fmt: skip
            twins.append((i, cut))
            priced.append(fwd)
    if not twins:
        return found
    n = len(found.candidates)
    again = found.restricted([*range(n), *(i for i, _ in twins)])
    forward = np.array(priced)
    backward = BACKWARD_FACTOR * forward * backward_share
    assert again.forward_s is not None, "compute ops state their forward"
    return replace(
        again,
        compute_s=np.concatenate([found.compute_s, forward + backward]),
        forward_s=np.concatenate([again.forward_s[:n], forward]),
        overlap_cuts=(None,) * n + tuple(cut for _, cut in twins),
    )


def without_dominated_kernels(found: NodeStrategies) -> NodeStrategies:
    """Of several kernels of one layout (`NdSignature.kernel`), drop each that another beats or
    ties on forward, total and held bytes: the layouts, hence every edge and every kept byte,
    are the same, so it can never be the better choice (a smaller problem, the same optimum).
    Applied after a hand plan's restriction (which may allow one kernel only)."""
    if not any(sig.kernel for sig in found.candidates):
        return found
    held = found.held_bytes if found.held_bytes is not None else np.zeros(len(found.candidates))
    cost = np.stack([found.forward_part_s(), found.compute_s, held], axis=1)
    keep = [
        i
        for i, sig in enumerate(found.candidates)
        if not any(
            j != i
            and (other.inputs, other.outputs) == (sig.inputs, sig.outputs)
            and found.regathered_input(j) == found.regathered_input(i)  # twins: edges differ
            and found.chunks_of(j) == found.chunks_of(i)
            and bool(np.all(cost[j] <= cost[i]))
            and (bool(np.any(cost[j] < cost[i])) or j < i)
            for j, other in enumerate(found.candidates)
        )
    ]
    return found.restricted(keep) if len(keep) < len(found.candidates) else found


def _parameter_strategies(
    name: str,
    meta: TensorMeta,
    candidates: tuple[NdSignature, ...],
    pricer: BoxingPricer,
    bucket_bytes: int,
    regatherable: bool,
    recipe: Recipe,
) -> NodeStrategies:
    """A parameter's candidates (the module header): each layout, its re-gathered twin where a
    consumer keeps it, each of those again with ZeRO-1's states where it has any; per step,
    sync + update + the non-finite check's read of its gradient (`compute_s`), the sync that
    backward may hide (`sync_s`), the add of one micro-batch's gradient."""
    mesh_shape = pricer.mesh.shape
    again = tuple(
        s
        for s in candidates
        if regatherable and not all(isinstance(x, Broadcast) for x in s.outputs[0])
    )
    regather = [False] * len(candidates) + [True] * len(again)
    candidates, regather, states, grads = with_zero_states(
        candidates + again, regather, meta.shape, mesh_shape
    )
    found = parameter_prices(
        meta, candidates, states, grads, pricer.bucketed_time_s, pricer.prices, mesh_shape,
        bucket_bytes, recipe,
    )  # fmt: skip
    sync_s = np.array(found.sync_s)
    zero2 = any(g is not None for g in grads)
    grad = TensorMeta(meta.shape, Recipe.gradient_dtype(meta.dtype))  # what the check reads
    check = [gradient_check_s(grad, s.outputs[0], pricer.prices, mesh_shape) for s in candidates]
    return NodeStrategies(
        name, candidates, sync_s + np.array(found.update_s) + check, sync_s,
        np.array(found.accumulate_s),
        regather=np.array(regather, dtype=bool),
        state=tuple(states) if any(q is not None for q in states) else None,
        gradient=tuple(grads) if zero2 else None,
        scatter_s=np.array(found.scatter_s) if zero2 else None,
    )  # fmt: skip


def _candidates(attrs: OpNode, mesh_shape: tuple[int, ...]) -> list[NdSignature]:
    sigs = nd_signatures(attrs, mesh_shape)
    if attrs.role is Role.BUFFER:
        # A buffer is state, not trained: keep it replicated (the runtime materializes it whole).
        sigs = [s for s in sigs if all(isinstance(x, Broadcast) for x in s.outputs[0])]
    return sigs


class _Roofline:
    """One node's roofline forward time per candidate (the module header's compute model),
    with what every candidate shares read once: the node's tensors, whether it returns a view,
    the profile's causal skip, each tensor's shape, size and item size."""

    def __init__(self, attrs: OpNode, mesh_shape: tuple[int, ...], prices: Prices) -> None:
        self.attrs, self.mesh_shape, self.prices = attrs, mesh_shape, prices
        self.free = attrs.role is not Role.COMPUTE or (not attrs.flops and not attrs.bytes)
        metas = (*attrs.inputs, *attrs.outputs)
        self.sizes = tuple((m.shape, m.numel, m.dtype.itemsize) for m in metas)
        self.view = not self.free and returns_view(attrs.target)
        self.skip = prices.causal_skip
        self.dtype = attrs.outputs[0].dtype if attrs.outputs else torch.float32

    def forward_s(self, sig: NdSignature) -> float:
        if self.free:
            return 0.0
        attrs, layouts = self.attrs, (*sig.inputs, *sig.outputs)
        share = 1.0
        local_bytes = 0.0
        for (shape, numel, itemsize), nd in zip(self.sizes, layouts, strict=True):
            local = math.prod(local_shape(shape, nd, self.mesh_shape))
            if numel:  # an empty tensor tells nothing of the share of the work
                share = min(share, local / numel)
            local_bytes += local * itemsize
        if self.view:
            local_bytes = 0.0  # metadata only: the overhead floor prices it
        share *= work_fraction(attrs, sig, self.mesh_shape, self.skip)
        special = attrs.transcendentals * share
        return self.prices.op_time_s(attrs.flops * share, local_bytes, self.dtype, special)

    def chunked_forward_s(self, sig: NdSignature, cut: ChunkPlan) -> float:
        """The forward of `sig` run in the chunks of `cut` (`timing.tp_overlap`): per chunk, the
        share of the work over the chunks, the sliced tensors' bytes over the chunks and the
        others' whole (each chunk reads them again); the chunks' times summed."""
        attrs, k = self.attrs, cut.chunks
        sliced = (*(d is not None for d in cut.input_dims), *(True for _ in attrs.outputs))
        layouts = (*sig.inputs, *sig.outputs)
        share, chunk_bytes = 1.0, 0.0
        for (shape, numel, itemsize), nd, cut_here in zip(self.sizes, layouts, sliced, strict=True):
            local = math.prod(local_shape(shape, nd, self.mesh_shape))
            if numel:
                share = min(share, local / numel)
            chunk_bytes += local * itemsize / (k if cut_here else 1)
        share *= work_fraction(attrs, sig, self.mesh_shape, self.skip) / k
        special = attrs.transcendentals * share
        return k * self.prices.op_time_s(attrs.flops * share, chunk_bytes, self.dtype, special)


def _forward_s(
    attrs: OpNode, sig: NdSignature, mesh_shape: tuple[int, ...], prices: Prices
) -> float:
    """One candidate's roofline forward time (`_Roofline`)."""
    return _Roofline(attrs, mesh_shape, prices).forward_s(sig)


def returns_view(target: Any) -> bool:
    """Does the aten op return a view of an input without ever copying? Its schema aliases the
    output to an input (`is_view`) and it is not CompositeImplicitAutograd (reshape, flatten,
    contiguous are, and copy when their input is not contiguous)."""
    if not isinstance(target, torch._ops.OpOverload) or not target.is_view:
        return False
    return not torch._C._dispatch_has_kernel_for_dispatch_key(
        target.name(), "CompositeImplicitAutograd"
    )


def edge_matrix(
    producer: NodeStrategies,
    consumer: NodeStrategies,
    uses: Sequence[tuple[int, int]],
    metas: Sequence[TensorMeta],
    pricer: BoxingPricer,
    *,
    forward_only: bool = False,
) -> np.ndarray:
    """Per micro-batch time of the boxings on edge producer -> consumer (forward and backward,
    or the forward alone) for every pair of their candidates. `uses` lists (producer output
    index, consumer input index); `metas[k]` describes the tensor of use k."""
    both, forward = edge_matrices(producer, consumer, uses, metas, pricer)
    return forward if forward_only else both


def edge_matrices(
    producer: NodeStrategies,
    consumer: NodeStrategies,
    uses: Sequence[tuple[int, int]],
    metas: Sequence[TensorMeta],
    pricer: BoxingPricer,
    collectives: bool = True,
    scattered_on: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`edge_matrix` forward and backward, and forward alone, from one pass over the uses
    (each summed use by use as `edge_matrix` sums it); without `collectives`, a pair whose
    forward conversion exchanges data is forbidden (a parameter's gather where the runtime
    runs none: `problem.priced.Priced.gathers`); with `scattered_on` (a mesh dim: sequence
    parallelism's tp), a pair that all-reduces there (P to B) a tensor some dim of which that
    mesh dim divides is forbidden: its partial sums are reduce-scattered into a split instead."""
    both = np.zeros((len(producer.candidates), len(consumer.candidates)))
    forward_only = np.zeros_like(both)
    for (out_idx, in_idx), meta in zip(uses, metas, strict=True):
        # Candidates share layouts: price each distinct (output, input) pair once (the pricer
        # keeps the tables for every edge that carries such a tensor between such layouts).
        srcs, src_of = _distinct(sig.outputs[out_idx] for sig in producer.candidates)
        dsts, dst_of = _distinct(sig.inputs[in_idx] for sig in consumer.candidates)
        forward, backward = pricer.tables(
            tuple(map(pricer.layout_id, srcs)), tuple(map(pricer.layout_id, dsts)), meta
        )
        tables = [forward + backward, forward]
        if in_idx in consumer.pinned:  # no boxing into an in-place write (module header)
            same = np.equal.outer(np.arange(len(srcs)), _same_as(srcs, dsts))
            tables = [np.where(same, table, np.inf) for table in tables]
        if not collectives:
            ids = tuple(map(pricer.layout_id, srcs)), tuple(map(pricer.layout_id, dsts))
            exchanged = pricer.collectives(*ids, meta)
            tables = [np.where(exchanged, np.inf, table) for table in tables]
        if scattered_on is not None:
            reduced = _all_reduced(srcs, dsts, meta, scattered_on, pricer.mesh.shape)
            tables = [np.where(reduced, np.inf, table) for table in tables]
        pick = np.ix_(src_of, dst_of)
        both_use, forward_use = tables[0][pick], tables[1][pick]
        for i, cut in enumerate(producer.overlap_cuts or ()):
            if cut is not None:  # an overlapped twin: its reduction and dual beside its chunks
                row = _overlapped_row(producer, i, cut, dsts, meta, pricer)[dst_of]
                forward_use[i] = np.where(np.isinf(forward_use[i]), np.inf, row)
                dual = _overlapped_row(producer, i, cut, dsts, meta, pricer, backward=True)
                both_use[i] = forward_use[i] + dual[dst_of]
        both += both_use
        forward_only += forward_use
    return both, forward_only


def _overlapped_row(
    producer: NodeStrategies,
    i: int,
    cut: ChunkPlan,
    dsts: Sequence[NdSbp],
    meta: TensorMeta,
    pricer: BoxingPricer,
    backward: bool = False,
) -> np.ndarray:
    """Per distinct consumer layout, the time of overlapped twin `i`'s output reduction run
    beside its chunks, or with `backward` of the reduction's dual beside the chunks' backward
    (`timing.tp_overlap`)."""
    sig = producer.candidates[i]
    assert producer.forward_s is not None, "compute ops state their forward"
    forward = float(producer.forward_s[i])
    compute = float(producer.compute_s[i]) - forward if backward else forward
    return overlapped_s(
        sig.outputs[0], dsts, meta, cut, compute, pricer.mesh, pricer.prices, backward
    )


def _all_reduced(
    srcs: Sequence[NdSbp],
    dsts: Sequence[NdSbp],
    meta: TensorMeta,
    mesh_dim: int,
    mesh_shape: tuple[int, ...],
) -> np.ndarray:
    """[i, j]: does srcs[i] -> dsts[j] take partial sums whole (P to B) on `mesh_dim`, where a
    dim of the tensor divides by its size (so a reduce-scatter into a split could take them)?"""
    size = mesh_shape[mesh_dim]
    if size == 1 or not any(n % size == 0 and n >= size for n in meta.shape):
        return np.zeros((len(srcs), len(dsts)), dtype=bool)
    partial = np.array([isinstance(src[mesh_dim], Partial) for src in srcs], dtype=bool)
    whole = np.array([isinstance(dst[mesh_dim], Broadcast) for dst in dsts], dtype=bool)
    return np.logical_and.outer(partial, whole)


def _same_as(srcs: Sequence[NdSbp], dsts: Sequence[NdSbp]) -> np.ndarray:
    """For each destination layout, the index of the equal source layout (-1 where none)."""
    index = {layout: i for i, layout in enumerate(srcs)}
    return np.array([index.get(layout, -1) for layout in dsts], dtype=int)


def _distinct(layouts: Iterable[NdSbp]) -> tuple[list[NdSbp], np.ndarray]:
    """The distinct layouts, and for each given one its index among them."""
    index: dict[NdSbp, int] = {}
    of = [index.setdefault(layout, len(index)) for layout in layouts]
    return list(index), np.array(of, dtype=int)
