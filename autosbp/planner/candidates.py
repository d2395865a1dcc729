"""Price every strategy of every node and edge: the numbers the ILP chooses between.

Lives here: per node, its candidate nd-signatures with compute time (forward + backward) and the
bytes they keep on a device; per edge, the matrix of boxing times between the producer's output
and the consumer's input; for parameters, the gradient synchronisation their layout implies.
Lives elsewhere: the signatures (`rules`), the boxing chains (`boxing`), the hardware prices
(`costmodel`, behind the `Prices` protocol), the ILP (`ilp`), the memory accounting (`memory`).

Model (every constant states where it comes from):
- compute: roofline `op_time_s(local_flops, local_bytes)`; local flops = flops x the smallest
  local/global size ratio among the op's tensors (the share of the work one device does: 1/n for
  data-, tensor- and contraction-split matmuls alike); local bytes = the local tensors' bytes.
  Backward = BACKWARD_FACTOR x forward (2: a matmul's backward is two matmuls of the same size;
  Narayanan et al. 2021 section 3.3 count 3x forward for forward + backward).
- an op that returns a view of its input (its schema says so and it has its own kernel, so it
  cannot decompose into a copy the way reshape, flatten or contiguous of a non-contiguous
  tensor do) moves no data: it costs the per-op overhead floor alone, forward and backward.
  Measured (torch 2.13 CPU, 1 thread, timeit min of 5 on the shared 2-core host under load ~2):
  of a 16x64x512 fp32 tensor, view 6.7 us, transpose 7.3 us, split in 4 38 us, beside a
  one-element add at 14 us; the roofline priced each as reading and writing the whole tensor
  (90-360 us: the views, transposes and splits of gpt-128 summed to 3.3 ms of a 37 ms forward).
- an edge u -> v, for each (output layout of u, input layout v needs): the forward boxing time
  plus its backward, the boxing dual(dst) -> dual(src) (B <-> P, S stays), per micro-batch.
  An input v writes in place (or a view on the way to such a write: `rules.pinned_inputs`) is
  forbidden to change layout (an infinite price): a boxed copy would take the write away from
  the tensor the model reads afterwards, so a plan never asks the runtime for it.
- a parameter stored split whose consumer keeps its converted copy for backward (`kept`) has
  each layout twice (FSDP's reshard_after_forward): kept (the copy stays until backward: bytes
  per micro-batch in flight, `memory`) or re-gathered (freed after forward and converted again
  before backward: the forward conversion once more per micro-batch, priced by the builder on
  the edge, `stage_terms`); `NodeStrategies.regather` says which candidate is which.
- a parameter in layout p pays, once per step, the gradient sync dual(p) -> p (P -> B
  all-reduce where the parameter is replicated: data parallel's all-reduce; nothing where it is
  split: FSDP's reduce-scatter is already the backward of its all-gather), as its share of a
  fused bucket's collective (`BoxingPricer.bucketed_time_s`), and its optimizer
  update on the local shard (memory-bound: `param_candidates.optimizer_s`); with micro-batches,
  each backward after the first adds its gradient into the accumulated one (autograd's
  AccumulateGrad: read both, write one), priced per micro-batch by the builder.
- ZeRO-1: a replicated layout has each candidate again with its optimizer states split
  (`NodeStrategies.state`), priced by `param_candidates.parameter_prices`.
Node times of compute ops are per micro-batch; parameter times are per step: the problem builder
scales them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from autosbp import schedule
from autosbp.boxing import StepPrice, canonical_shape, price_boxing
from autosbp.boxing.steps import BoxingStep, StepKind, dual_nd_sbp
from autosbp.capturing.graph import OpGraph, OpNode, Role, TensorMeta
from autosbp.errors import SbpError
from autosbp.planner.param_candidates import parameter_prices, with_zero_states
from autosbp.rules import NdSignature, nd_signatures, pinned_inputs
from autosbp.sbp import Broadcast, Mesh, NdSbp, local_shape

BACKWARD_FACTOR = 2.0  # backward time / forward time (derived: two matmuls per matmul)


class Prices(Protocol):
    """What the planner needs from a hardware profile (costmodel's cluster provides it)."""

    def op_time_s(
        self, flops: float, nbytes: float, dtype: torch.dtype, transcendentals: float = 0.0
    ) -> float: ...

    def collective_time_s(
        self, kind: str, message_bytes: float, group_size: int, link_class: str
    ) -> float: ...

    def p2p_time_s(self, nbytes: float, link_class: str) -> float: ...

    @property
    def overlap_efficiency(self) -> float:
        """The fraction of communication time that running beside compute hides, in [0, 1]."""
        ...


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
    # parameters only: per candidate, its optimizer states' layout (None: the parameter's own)
    state: tuple[NdSbp | None, ...] | None = None

    def restricted(self, keep: Sequence[int]) -> NodeStrategies:
        """Only the candidates at `keep`."""
        sync = self.sync_s[keep] if self.sync_s is not None else None
        accumulate = self.accumulate_s[keep] if self.accumulate_s is not None else None
        regather = self.regather[keep] if self.regather is not None else None
        state = tuple(self.state[i] for i in keep) if self.state is not None else None
        candidates = tuple(self.candidates[i] for i in keep)
        return NodeStrategies(
            self.name, candidates, self.compute_s[keep], sync, accumulate, self.pinned, regather,
            state,
        )  # fmt: skip

    def state_of(self, index: int) -> NdSbp | None:
        """Candidate `index`'s optimizer-state layout where it differs from the parameter's
        (ZeRO-1), else None."""
        return self.state[index] if self.state is not None else None

    def regathers(self, index: int) -> bool:
        """Does candidate `index` free its converted copies after forward (FSDP's
        reshard_after_forward)?"""
        return self.regather is not None and bool(self.regather[index])


class BoxingPricer:
    """Boxing time between two layouts of one tensor on a mesh, cached: a GPT-3 search asks for
    ~440k prices and only ~55k differ (profiled; edges repeat tensors between the same layouts).

    Caches, each keyed by all its value depends on besides the pricer's fixed mesh and prices:
    - layouts interned as small ints (`layout_id`, with each one's dual), so keys hash fast;
    - per (src, dst, canonical shape, dtype), the chain: one plan per divisibility pattern, its
      step bytes scaled to each tensor's (exact: they are the tensor's bytes over an integer);
    - per (src, dst, shape, dtype), the price; per `StepPrice`, a step's;
    - per (distinct src layouts, distinct dst layouts, shape, dtype), an edge use's forward and
      backward tables (`tables`), shared by every edge that carries such a tensor.
    """

    def __init__(self, prices: Prices, mesh: Mesh) -> None:
        self.prices = prices
        self.mesh = mesh
        self._ids: dict[NdSbp, int] = {}
        self._layouts: list[NdSbp] = []  # by id
        self._duals: list[int | None] = []  # by id: the id of the dual layout, once asked
        self._chains: dict[tuple, tuple[tuple[StepPrice, ...], int] | None] = {}
        self._times: dict[tuple[int, int, tuple[int, ...], torch.dtype], float] = {}
        self._step_times: dict[StepPrice, float] = {}
        self._tables: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def time_s(self, src: NdSbp, dst: NdSbp, meta: TensorMeta) -> float:
        return self._pair_time_s(self.layout_id(src), self.layout_id(dst), meta.shape, meta.dtype)

    def layout_id(self, nd_sbp: NdSbp) -> int:
        """A small int standing for `nd_sbp` in this pricer's caches."""
        found = self._ids.get(nd_sbp)
        if found is None:
            found = self._ids[nd_sbp] = len(self._layouts)
            self._layouts.append(nd_sbp)
            self._duals.append(None)
        return found

    def tables(
        self, src_ids: tuple[int, ...], dst_ids: tuple[int, ...], meta: TensorMeta
    ) -> tuple[np.ndarray, np.ndarray]:
        """Read-only [i, j] boxing times of the tensor `meta` from layout src_ids[i] to
        dst_ids[j] (forward), and from dual(dst_ids[j]) to dual(src_ids[i]) (its backward)."""
        key = (src_ids, dst_ids, meta.shape, meta.dtype)
        found = self._tables.get(key)
        if found is None:
            found = self._tables[key] = (
                self._table(src_ids, dst_ids, meta, backward=False),
                self._table(src_ids, dst_ids, meta, backward=True),
            )
        return found

    def _table(
        self, src_ids: tuple[int, ...], dst_ids: tuple[int, ...], meta: TensorMeta, backward: bool
    ) -> np.ndarray:
        shape, dtype = meta.shape, meta.dtype
        if backward:
            pairs = [[(self._dual_id(d), self._dual_id(s)) for d in dst_ids] for s in src_ids]
        else:
            pairs = [[(s, d) for d in dst_ids] for s in src_ids]
        times = [[self._pair_time_s(a, b, shape, dtype) for a, b in row] for row in pairs]
        table = np.array(times).reshape(len(src_ids), len(dst_ids))
        table.flags.writeable = False  # shared by every edge use with this key
        return table

    def _dual_id(self, layout: int) -> int:
        dual = self._duals[layout]
        if dual is None:
            dual = self._duals[layout] = self.layout_id(dual_nd_sbp(self._layouts[layout]))
        return dual

    def _pair_time_s(self, src: int, dst: int, shape: tuple[int, ...], dtype: torch.dtype) -> float:
        key = (src, dst, shape, dtype)
        found = self._times.get(key)
        if found is None:
            found = self._times[key] = self._price_pair(src, dst, shape, dtype)
        return found

    def _price_pair(
        self, src: int, dst: int, shape: tuple[int, ...], dtype: torch.dtype, scale: float = 1.0
    ) -> float:
        """The chain src -> dst of this tensor; with `scale`, each step priced at `scale` times
        its bytes and the tensor paying 1 / scale of it (its share of a fused bucket)."""
        if src == dst:
            return 0.0
        planned = self._chain(src, dst, shape, dtype)
        if planned is None:
            return math.inf
        steps, planned_bytes = planned
        nbytes = math.prod(shape) * dtype.itemsize
        return (
            sum(
                self._step_time_s(
                    (kind, round(message * nbytes // max(planned_bytes, 1) * scale), group, link)
                )
                for kind, message, group, link in steps
            )
            / scale
        )

    def _chain(
        self, src: int, dst: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[tuple[StepPrice, ...], int] | None:
        """The chain src -> dst planned for the first tensor of `shape`'s divisibility pattern,
        and that tensor's bytes; None where no chain exists (e.g. out of P(max)): forbidden.
        An empty tensor (a dim of 0: HF's empty KV-cache constants) is planned apart: its steps
        move 0 bytes and scale to no other tensor's (0 divides like any size)."""
        empty = 0 in shape
        key = (src, dst, canonical_shape(shape, self.mesh), dtype, empty)
        if key not in self._chains:
            try:
                steps = price_boxing(
                    self._layouts[src], self._layouts[dst], shape, self.mesh, dtype
                )
            except SbpError:
                self._chains[key] = None
            else:
                self._chains[key] = (steps, math.prod(shape) * dtype.itemsize)
        return self._chains[key]

    def bucketed_time_s(self, src: NdSbp, dst: NdSbp, meta: TensorMeta, bucket_bytes: int) -> float:
        """Like `time_s`, for a gradient synced inside a fused bucket of `bucket_bytes`
        (`sync_bucket_bytes`; the tensor alone where it is bigger): each collective is priced
        at the bucket's size, and the tensor pays its share of it (its bytes over the
        bucket's). Collectives cost far from linearly in their size (on cpu-gloo 64 KiB took
        two thirds of 1 MiB's time), so pricing each tensor as its own collective, less a
        latency, had put a 2.7 MB bucket of 40 tensors at 18 ms where it took 4.5 ms."""
        if meta.nbytes == 0:
            return 0.0
        scale = max(bucket_bytes, meta.nbytes) / meta.nbytes
        src_id, dst_id = self.layout_id(src), self.layout_id(dst)
        return self._price_pair(src_id, dst_id, meta.shape, meta.dtype, scale)

    def step_time_s(self, step: BoxingStep) -> float:
        return self._step_time_s((step.kind, step.message_bytes, step.group_size, step.link_class))

    def _step_time_s(self, step: StepPrice) -> float:
        found = self._step_times.get(step)
        if found is None:
            kind, message_bytes, group_size, link_class = step
            if kind is StepKind.LOCAL:
                found = 0.0  # a slice or a zero fill: negligible beside the ops around it
            elif kind is StepKind.SEND_RECV:
                found = self.prices.p2p_time_s(message_bytes, "inter_node")
            else:
                assert link_class is not None
                found = self.prices.collective_time_s(
                    kind.value, message_bytes, group_size, link_class
                )
            self._step_times[step] = found
        return found


def sync_bucket_bytes(graph: OpGraph) -> int:
    """The bucket a gradient is priced inside: DDP's cap (`schedule.GRAD_BUCKET_BYTES`), or
    all the graph's parameters where they fill less (the runtime fuses them into one; where a
    plan splits some of them, or stages divide them, the real bucket is smaller and slower per
    byte: an estimate)."""
    total = sum(attrs.outputs[0].nbytes for _, attrs in graph.nodes(Role.PARAMETER))
    return max(1, min(schedule.GRAD_BUCKET_BYTES, total))


def node_strategies(
    graph: OpGraph, name: str, pricer: BoxingPricer, bucket_bytes: int, regatherable: bool = False
) -> NodeStrategies:
    """Candidates of node `name`: per micro-batch compute time, or per step for parameters
    (their gradient sync priced inside buckets of `bucket_bytes`: `sync_bucket_bytes`).
    `regatherable` (a parameter some consumer keeps, `kept.Kept.regatherable`): each layout that
    is not B on every mesh dim comes twice, kept and re-gathered (the module header)."""
    attrs = graph.node(name)
    mesh_shape = pricer.mesh.shape
    candidates = tuple(_candidates(attrs, mesh_shape))
    if attrs.role is Role.PARAMETER:
        return _parameter_strategies(name, attrs.outputs[0], candidates, pricer, bucket_bytes,
                                     regatherable)  # fmt: skip
    times = [_compute_s(attrs, sig, mesh_shape, pricer.prices) for sig in candidates]
    return NodeStrategies(name, candidates, np.array(times), pinned=pinned_inputs(graph, name))


def _parameter_strategies(
    name: str,
    meta: TensorMeta,
    candidates: tuple[NdSignature, ...],
    pricer: BoxingPricer,
    bucket_bytes: int,
    regatherable: bool,
) -> NodeStrategies:
    """A parameter's candidates (the module header): each layout, its re-gathered twin where a
    consumer keeps it, each of those again with ZeRO-1's states where it has any; per step,
    sync + update (`compute_s`), the sync that backward may hide (`sync_s`), the add of one
    micro-batch's gradient."""
    mesh_shape = pricer.mesh.shape
    again = tuple(
        s
        for s in candidates
        if regatherable and not all(isinstance(x, Broadcast) for x in s.outputs[0])
    )
    regather = [False] * len(candidates) + [True] * len(again)
    candidates, regather, states = with_zero_states(
        candidates + again, regather, meta.shape, mesh_shape
    )
    sync, update, accumulate = parameter_prices(
        meta, candidates, states, pricer.bucketed_time_s, pricer.prices, mesh_shape, bucket_bytes
    )
    sync_s = np.array(sync)
    return NodeStrategies(
        name, candidates, sync_s + np.array(update), sync_s, np.array(accumulate),
        regather=np.array(regather, dtype=bool),
        state=tuple(states) if any(q is not None for q in states) else None,
    )  # fmt: skip


def _candidates(attrs: OpNode, mesh_shape: tuple[int, ...]) -> list[NdSignature]:
    sigs = nd_signatures(attrs, mesh_shape)
    if attrs.role is Role.BUFFER:
        # A buffer is state, not trained: keep it replicated (the runtime materializes it whole).
        sigs = [s for s in sigs if all(isinstance(x, Broadcast) for x in s.outputs[0])]
    return sigs


def _compute_s(
    attrs: OpNode, sig: NdSignature, mesh_shape: tuple[int, ...], prices: Prices
) -> float:
    if attrs.role is not Role.COMPUTE or (not attrs.flops and not attrs.bytes):
        return 0.0
    metas = (*attrs.inputs, *attrs.outputs)
    layouts = (*sig.inputs, *sig.outputs)
    share = 1.0
    local_bytes = 0.0
    for meta, nd in zip(metas, layouts, strict=True):
        local = math.prod(local_shape(meta.shape, nd, mesh_shape))
        if meta.numel:  # an empty tensor tells nothing of the share of the work
            share = min(share, local / meta.numel)
        local_bytes += local * meta.dtype.itemsize
    dtype = attrs.outputs[0].dtype if attrs.outputs else torch.float32
    if returns_view(attrs.target):
        local_bytes = 0.0  # metadata only: the overhead floor prices it
    special = attrs.transcendentals * share
    forward = prices.op_time_s(attrs.flops * share, local_bytes, dtype, special)
    return forward * (1.0 + BACKWARD_FACTOR)


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
    matrix = np.zeros((len(producer.candidates), len(consumer.candidates)))
    for (out_idx, in_idx), meta in zip(uses, metas, strict=True):
        # Candidates share layouts: price each distinct (output, input) pair once (the pricer
        # keeps the tables for every edge that carries such a tensor between such layouts).
        srcs, src_of = _distinct(sig.outputs[out_idx] for sig in producer.candidates)
        dsts, dst_of = _distinct(sig.inputs[in_idx] for sig in consumer.candidates)
        forward, backward = pricer.tables(
            tuple(map(pricer.layout_id, srcs)), tuple(map(pricer.layout_id, dsts)), meta
        )
        table = forward if forward_only else forward + backward
        if in_idx in consumer.pinned:  # no boxing into an in-place write (module header)
            table = np.where(
                np.equal.outer(np.arange(len(srcs)), _same_as(srcs, dsts)), table, np.inf
            )
        matrix += table[np.ix_(src_of, dst_of)]
    return matrix


def _same_as(srcs: Sequence[NdSbp], dsts: Sequence[NdSbp]) -> np.ndarray:
    """For each destination layout, the index of the equal source layout (-1 where none)."""
    index = {layout: i for i, layout in enumerate(srcs)}
    return np.array([index.get(layout, -1) for layout in dsts], dtype=int)


def _distinct(layouts: Iterable[NdSbp]) -> tuple[list[NdSbp], np.ndarray]:
    """The distinct layouts, and for each given one its index among them."""
    index: dict[NdSbp, int] = {}
    of = [index.setdefault(layout, len(index)) for layout in layouts]
    return list(index), np.array(of, dtype=int)
