"""Per-device memory of a strategy: model states by their layout, what backward keeps by its.

Lives here: bytes per parameter element for each optimizer and dtype, and the bytes the ILP's memory
constraints sum: per node candidate (`candidate_bytes`: model states, user inputs and buffers, the
outputs and intermediates a node keeps for backward) and per edge pair (`pair_bytes`: what a kept
use holds once its value is converted to the consumer's layout, a table per use from each layout's
bytes and a view mask cached per layout lists; `wire_pair_bytes`: the gathered gradient a weight's
reduce-scatter holds). Lives elsewhere: what is kept (`memory.kept`: read
off the graph with autograd's own facts, `memory.autograd_probe`), time prices
(`timing.candidates`), the constraints themselves (`ilp.formulation.MemoryConstraint`, summed per
stage with the micro-batches in flight by `problem.stage_terms`).

Model (Rajbhandari et al. 2020, ZeRO, section 3.1, for model states; for activations, what
autograd saves, as `memory.kept` derives it, where Korthikanti et al. 2022 section 4 count by hand):
- a parameter element costs its value in the training dtype, its gradient, and its optimizer
  states in fp32 (Adam: 2, SGD with momentum: 1, SGD: 0); below fp32 the recipe is mixed
  (`runtime.parallel.precision`): an fp32 master beside the value, the gradient accumulated in
  fp32: 18 bytes per element for Adam in bf16 or fp16, 16 in fp32. With its states in a ZeRO-1
  layout (`timing.param_candidates.zero_state_layout`), value (and master) and gradient by the
  parameter's layout, states, the fp32 shard the optimizer updates and its fp32 gradient (held
  from the reduce-scatter to the next step; none where it is a view of the synced fp32
  gradient) by the states' layout, as `runtime.parallel.sharded_update` holds them; with its
  gradient in that layout too (ZeRO-2) the gradient in the parameter's layout is not held
  (each is reduce-scattered into the shard's as backward makes it and freed);
- a kept output counts its local tensor in the node's layout; a kept intermediate (a norm's
  mean, a dropout mask) its whole bytes times the node's share of the work (the smallest
  local/global ratio of its tensors, as `timing.candidates` prices the work);
- a kept use counts, on its edge, the converted copy where the conversion makes one (any
  collective, or a zero fill), and nothing where it is a view (a slice of B, or no conversion),
  unless the use is its value's only holder: then the producer's own tensor is what it keeps;
- a parameter use that a collective gathers counts the gathered gradient its reduce-scatter
  holds, in the dtype it is reduced in (`wire_pair_bytes`).
All of it is per device: a device holds its local shard only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch

from autosbp.capturing.graph import OpNode, Role, TensorMeta
from autosbp.plan.values import master_dtype
from autosbp.planner.memory.gather_buffers import gathers_in_bucket
from autosbp.planner.memory.kept import KeptUse
from autosbp.rules import NdSignature
from autosbp.sbp import Broadcast, NdSbp, Split, local_shape

OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd_momentum": 1, "sgd": 0}


def parameter_bytes_per_element(dtype: torch.dtype, optimizer: str) -> int:
    """The value in `dtype`; below fp32 (the mixed recipe, `runtime.parallel.precision`) an
    fp32 master beside it and the gradient accumulated in fp32, else the gradient in `dtype`;
    the optimizer's states in fp32. Adam: 16 bytes in fp32, 18 in bf16 or fp16 (Megatron-Core's
    18 without its distributed optimizer; with it, states sharded: `candidate_bytes`)."""
    return value_bytes(dtype) + gradient_bytes(dtype) + 4 * OPTIMIZER_STATES[optimizer]


def value_bytes(dtype: torch.dtype) -> int:
    """A parameter element's value as the runtime holds it in the parameter's layout: the
    compute weight, and below fp32 its fp32 master beside it."""
    return dtype.itemsize + (4 if dtype.itemsize < 4 else 0)


def gradient_bytes(dtype: torch.dtype) -> int:
    """A parameter element's accumulated gradient: fp32 below fp32 (the mixed recipe)."""
    return master_dtype(dtype).itemsize


def candidate_bytes(
    attrs: OpNode,
    signature: NdSignature,
    mesh_shape: tuple[int, ...],
    *,
    optimizer: str,
    outputs: frozenset[int] = frozenset(),
    extra_bytes: int = 0,
    state: NdSbp | None = None,
    gradient: NdSbp | None = None,
) -> float:
    """Bytes one device keeps for this node under `signature` with one micro-batch in flight:
    a parameter's states (optimizer states in `state` where given: ZeRO-1; its gradient too
    where `gradient` is given, the same layout: ZeRO-2), a buffer's or
    input's tensor, or a compute node's kept `outputs` and intermediates (`extra_bytes`, whole;
    `memory.kept.Kept` says which)."""
    role = attrs.role
    if role is Role.PARAMETER:
        meta = attrs.outputs[0]
        local = math.prod(local_shape(meta.shape, signature.outputs[0], mesh_shape))
        if state is None:
            return float(local * parameter_bytes_per_element(meta.dtype, optimizer))
        shard = math.prod(local_shape(meta.shape, state, mesh_shape))
        # The weight in p; the fp32 master is the shard (a mixed recipe's whole master gives
        # up its storage: `runtime.parallel.precision.Weights.release`). ZeRO-2 holds no gradient
        # in p across a step:
        held = meta.dtype.itemsize
        held += gradient_bytes(meta.dtype) if gradient is None else 0
        shard_grad = (
            0 if _grad_is_slot(meta, signature.outputs[0], state, gradient, mesh_shape) else 4
        )
        return float(local * held + shard * (4 + shard_grad + 4 * OPTIMIZER_STATES[optimizer]))
    if role is Role.BUFFER or role is Role.INPUT:
        return local_bytes(attrs.outputs[0], signature.outputs[0], mesh_shape)
    if role is not Role.COMPUTE:
        return 0.0
    kept = sum(local_bytes(attrs.outputs[o], signature.outputs[o], mesh_shape) for o in outputs)
    return kept + extra_bytes * work_share(attrs, signature, mesh_shape)


def _grad_is_slot(
    meta: TensorMeta,
    layout: NdSbp,
    state: NdSbp,
    gradient: NdSbp | None,
    mesh_shape: tuple[int, ...],
) -> bool:
    """Whether ZeRO-1's fp32 shard gradient is a view of the synced gradient, not a tensor of
    its own (`runtime.parallel.sharded_update._as_grad`): fp32 training, and the shard a
    contiguous slot of the piece (`gathers_in_bucket` says so where one mesh dim differs; where
    more differ the copy is counted: an upper bound)."""
    return (
        gradient is None
        and gradient_bytes(meta.dtype) == 4  # the synced gradient is fp32: fp32 or mixed
        and gathers_in_bucket(layout, state, meta.shape, mesh_shape)
    )


@functools.lru_cache(maxsize=1 << 16)
def local_bytes(meta: TensorMeta, layout: NdSbp, mesh_shape: tuple[int, ...]) -> float:
    """One device's bytes of `meta` in `layout` (cached: a search asks for the same ones on
    every mesh and count)."""
    return float(math.prod(local_shape(meta.shape, layout, mesh_shape)) * meta.dtype.itemsize)


def work_share(attrs: OpNode, signature: NdSignature, mesh_shape: tuple[int, ...]) -> float:
    """The share of a node's work one device does: the smallest local/global size ratio among
    its tensors (empty tensors tell nothing)."""
    share = 1.0
    metas = (*attrs.inputs, *attrs.outputs)
    for meta, layout in zip(metas, (*signature.inputs, *signature.outputs), strict=True):
        if meta.numel:
            share = min(share, math.prod(local_shape(meta.shape, layout, mesh_shape)) / meta.numel)
    return share


@functools.lru_cache(maxsize=1 << 14)
def is_view_conversion(src: NdSbp, dst: NdSbp) -> bool:
    """Is converting `src` to `dst` a view of the local tensor (no copy)? Only where every mesh
    dim keeps its SBP or slices a broadcast tensor (B -> S)."""
    return all(
        a == b or (isinstance(a, Broadcast) and isinstance(b, Split))
        for a, b in zip(src, dst, strict=True)
    )


def use_bytes(
    src: NdSbp,
    dst: NdSbp,
    meta: TensorMeta,
    mesh_shape: tuple[int, ...],
    sole: bool,
    converted: bool = True,
) -> float:
    """What one kept use holds on a device: the converted copy, or (no copy made, or the value
    kept as produced: `converted` False) the producer's tensor where the use is its only
    holder, else nothing beyond it."""
    if converted and not is_view_conversion(src, dst):
        return local_bytes(meta, dst, mesh_shape)
    return local_bytes(meta, src, mesh_shape) if sole else 0.0


def pair_bytes(
    producer_outputs: Sequence[Sequence[NdSbp]],
    consumer_inputs: Sequence[Sequence[NdSbp]],
    uses: Sequence[KeptUse],
    metas: Sequence[TensorMeta],
    mesh_shape: tuple[int, ...],
) -> np.ndarray:
    """Per pair (producer candidate i, consumer candidate j), the bytes the kept `uses` of an
    edge hold with one micro-batch in flight: `producer_outputs[i][o]` is candidate i's layout
    of output o, `consumer_inputs[j][k]` candidate j's of input k, `metas[n]` the tensor of
    `uses[n]`. Each distinct (layout, layout) pair is priced once."""
    matrix = np.zeros((len(producer_outputs), len(consumer_inputs)))
    for use, meta in zip(uses, metas, strict=True):
        srcs, src_of = distinct_layouts([outs[use.out_idx] for outs in producer_outputs])
        dsts, dst_of = distinct_layouts([ins[use.in_idx] for ins in consumer_inputs])
        table = _use_table(srcs, dsts, meta, mesh_shape, use.sole, use.converted)
        matrix += table[np.ix_(src_of, dst_of)]
    return matrix


def wire_pair_bytes(
    producer_outputs: Sequence[Sequence[NdSbp]],
    consumer_inputs: Sequence[Sequence[NdSbp]],
    uses: Sequence[tuple[int, int]],
    metas: Sequence[TensorMeta],
    wires: Sequence[torch.dtype],
    mesh_shape: tuple[int, ...],
    *,
    less_gradient: bool,
) -> np.ndarray:
    """Per pair (parameter candidate i, consumer candidate j), the gradient a gathered weight's
    reduce-scatter holds: each use (out_idx, in_idx) of the parameter `metas[n]` that a
    collective gathers (to a piece larger than the shard) has its gradient, the piece's size, sent in
    `wires[n]` (`timing.recipe.Recipe.wire`: fp32 under a mixed recipe, a copy of the bf16
    gradient; else the gradient itself) and held until the reduce-scatter is waited for, at the
    next unit's (`runtime.parallel.prefetch.GatherSchedule.reduce`). `less_gradient`: the
    parameter's own gradient (its piece, priced with its states) is made only then (a step of
    one micro-batch; with more, it exists from the first): less its bytes, at least 0."""
    matrix = np.zeros((len(producer_outputs), len(consumer_inputs)))
    for (out_idx, in_idx), meta, wire in zip(uses, metas, wires, strict=True):
        srcs, src_of = distinct_layouts([outs[out_idx] for outs in producer_outputs])
        dsts, dst_of = distinct_layouts([ins[in_idx] for ins in consumer_inputs])
        pieces = np.array([math.prod(local_shape(meta.shape, d, mesh_shape)) for d in dsts])
        shards = np.array([math.prod(local_shape(meta.shape, p, mesh_shape)) for p in srcs])
        made = shards * gradient_bytes(meta.dtype) if less_gradient else np.zeros(len(srcs))
        held = np.maximum(pieces[None, :] * wire.itemsize - made[:, None], 0.0)
        gathers = (pieces[None, :] > shards[:, None]) & ~_views(tuple(srcs), tuple(dsts))
        table = np.where(gathers, held, 0.0)
        matrix += table[np.ix_(src_of, dst_of)]
    return matrix


def _use_table(
    srcs: list[NdSbp],
    dsts: list[NdSbp],
    meta: TensorMeta,
    mesh_shape: tuple[int, ...],
    sole: bool,
    converted: bool,
) -> np.ndarray:
    """`use_bytes` of every (src, dst) pair, from each layout's local bytes and which pairs
    convert by a view (`_views`): the same numbers, without a call per pair."""
    held = np.array([local_bytes(meta, src, mesh_shape) if sole else 0.0 for src in srcs])
    table = np.broadcast_to(held[:, None], (len(srcs), len(dsts)))
    if not converted:
        return table
    copies = np.array([local_bytes(meta, dst, mesh_shape) for dst in dsts])
    return np.where(_views(tuple(srcs), tuple(dsts)), table, copies[None, :])


@functools.lru_cache(maxsize=1 << 12)
def _views(srcs: tuple[NdSbp, ...], dsts: tuple[NdSbp, ...]) -> np.ndarray:
    """[i, j]: `is_view_conversion(srcs[i], dsts[j])` (read-only: shared by the callers)."""
    views = np.array([[is_view_conversion(a, b) for b in dsts] for a in srcs], dtype=bool)
    views = views.reshape(len(srcs), len(dsts))
    views.flags.writeable = False
    return views


def distinct_layouts(layouts: Sequence[NdSbp]) -> tuple[list[NdSbp], np.ndarray]:
    """The distinct layouts, and for each given one its index among them."""
    index: dict[NdSbp, int] = {}
    of = [index.setdefault(layout, len(index)) for layout in layouts]
    return list(index), np.array(of, dtype=int)
