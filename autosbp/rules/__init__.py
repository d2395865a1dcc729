"""SBP signature rules: which SBPs an op accepts, and how it runs on one device's shards.

Lives here: the public queries the planner and runtime use.
  has_rule(op)                          is there a rule for this ATen op name?
  signatures_1d(node, mesh_dim_size)    the op's signatures for one mesh dim
  nd_signatures(node, mesh_shape)       product over mesh dims, filtered by divisibility
  exchanges(node, nd_sig, mesh)         the collectives the op runs inside itself (`comm`)
  local_op(node, nd_sig, mesh, coords)  the local kernel, built once per node and device
                                        (with `comm=` where the signature exchanges)
  local_call(...)                       local_op(...)(local_inputs), for one-off calls
  warn_unknown_ops(ops)                 one warning naming every op without a rule
  derives_splits(node)                  an op without a rule, split by checked signatures?
  mutated_inputs(node)                  inputs the op updates in place (keep their producer's SBP)
  pinned_inputs(graph, name)            inputs that must reach the node unboxed (in-place writes)
Lives elsewhere: the rules, one module per op family (`pointwise`, `matmul`, `attention`,
`reduction`, `norm`, `embedding`, `view`, `indexing`, `conv`, `loss`, `factory`, `boundary`,
`routing`),
the registry that lists them (`registry`), the vocabulary (`core`, and `comm` for communication
inside an op), the test oracle (`oracle`).

Invariants: every list holds the all-B signature first (for ops with tensors); no signature
splits a dim that the mesh dim does not divide; no signature puts P on a tensor that is not
floating point; lists are deduplicated and their order is deterministic. An op without a rule
gets the signatures checked against the op itself (`derived`: all-B at least) and runs
unchanged on every device's shards, never an error.
For the planner and runtime: placeholders (parameters, buffers, inputs) list B and every S(d),
never P, and have no local kernel (the runtime shards their values); the output node accepts B
or P. P means a sum, except amax / amin which give P(max) / P(min). An input in
`mutated_inputs` is updated in place, so it must reach the op without boxing (a buffer may: the
runtime writes its boxed copy back), and so must every view on the way from the written tensor
to it: `pinned_inputs` lists them, the planner forbids boxing there, the runtime refuses it.
Call `local_op` once per node and device and reuse the LocalOp; `nd_signatures` is memoized on
what rules read.
References: docs/architecture.md ("Contracts": rules); OneFlow operator.cpp (`GetSbpSignaturesIf`, nD product and filter).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import torch

from autosbp.capturing.graph import OpGraph, Role
from autosbp.errors import ExecutionError
from autosbp.rules.comm import Exchange, OpComm, OpContext
from autosbp.rules.core import (
    LocalOp,
    NdSignature,
    Node,
    Signature,
    default_local_op,
    in_eval_mode,
    mutated_inputs,
    tensor_slots,
)
from autosbp.rules.derived import derived_signatures
from autosbp.rules.loss import MeanOverTargets, kept_targets, mean_over_targets
from autosbp.rules.registry import RULES
from autosbp.sbp import Broadcast, NdSbp, Partial, Sbp, divisibility_shape, split_factors

__all__ = [
    "Exchange",
    "LocalOp",
    "MeanOverTargets",
    "NdSignature",
    "OpComm",
    "OpContext",
    "Signature",
    "UnknownOpWarning",
    "derives_splits",
    "exchanges",
    "find_signature",
    "has_rule",
    "in_eval_mode",
    "kept_targets",
    "local_call",
    "local_op",
    "mean_over_targets",
    "mutated_inputs",
    "nd_signatures",
    "pinned_inputs",
    "signatures_1d",
    "warn_unknown_ops",
    "work_fraction",
]


class UnknownOpWarning(UserWarning):
    """Ops without an SBP rule: they get the all-B signature (correct, but never sharded)."""


def has_rule(op: str) -> bool:
    return op in RULES


def signatures_1d(node: Node, mesh_dim_size: int) -> list[Signature]:
    """The op's signatures on one mesh dim of `mesh_dim_size` devices (all-B first); memoized
    on what a rule reads, as `nd_signatures` (meshes sharing a dim size share the list)."""
    key = _memo_key(node, (mesh_dim_size,))
    cached = _1D_MEMO.get(key) if key is not None else None
    if cached is None:
        cached = _signatures_1d(node, mesh_dim_size)
        if key is not None:
            _remember(_1D_MEMO, key, cached)
    return list(cached)


def _signatures_1d(node: Node, mesh_dim_size: int) -> tuple[Signature, ...]:
    rule = RULES.get(node.op)
    if rule is None:  # checked against the op itself (`derived`): all-B where nothing passes
        listed = derived_signatures(node, mesh_dim_size, _memo_key(node, (mesh_dim_size,)))
    else:
        listed = rule.signatures(node, mesh_dim_size)
    out: dict[Signature, None] = {}
    for sig in listed:
        as_nd = ([(s,) for s in sig.inputs], [(s,) for s in sig.outputs])
        if _admissible(node, *as_nd, (mesh_dim_size,)):
            out.setdefault(sig, None)
    return tuple(out)


def nd_signatures(node: Node, mesh_shape: Sequence[int]) -> list[NdSignature]:
    """Product of the per-mesh-dim lists, filtered by divisibility on the whole mesh, deduplicated.

    Order: itertools.product order of the 1D lists (outer mesh dim varies slowest), so the all-B
    signature comes first. Memoized on what a rule reads (op, args, kwargs, tensor metas), so
    the repeated layers of a model cost one computation; the product and its filter, on what
    they read (`_product_key`), so a node of another micro-batch size whose 1D lists and
    divisibility are the same costs none.
    """
    mesh_shape = tuple(mesh_shape)
    key = _memo_key(node, mesh_shape)
    cached = _ND_MEMO.get(key) if key is not None else None
    if cached is None:
        lists = tuple(tuple(signatures_1d(node, size)) for size in mesh_shape)
        shared = _product_key(node, lists, mesh_shape) if key is not None else None
        cached = _PRODUCT_MEMO.get(shared) if shared is not None else None
        if cached is None:
            cached = _product(node, lists, mesh_shape)
            if shared is not None:
                _remember(_PRODUCT_MEMO, shared, cached)
        if key is not None:
            _remember(_ND_MEMO, key, cached)
    return list(cached)


def _product(
    node: Node, lists: tuple[tuple[Signature, ...], ...], mesh_shape: tuple[int, ...]
) -> tuple[NdSignature, ...]:
    rule = RULES.get(node.op)
    out: dict[NdSignature, None] = {}
    for combo in itertools.product(*lists):
        nd = NdSignature.from_1d(combo)
        if nd not in out and _admissible(node, nd.inputs, nd.outputs, mesh_shape):
            out[nd] = None
            if rule is not None and rule.variants is not None:
                out.update(dict.fromkeys(rule.variants(node, nd, mesh_shape)))
    return tuple(out)


def _product_key(
    node: Node, lists: tuple[tuple[Signature, ...], ...], mesh_shape: tuple[int, ...]
) -> Hashable:
    """All `_product` reads: the 1D lists; of each tensor, its rank, dtype and which products
    of mesh dim sizes divide each dim (`_admissible` asks only that: `split_factors` multiplies
    the sizes of the mesh dims that split a dim, `divisibility_shape` keeps exactly it); the
    op, args and kwargs (a rule's `variants` reads arguments, ranks and the signature)."""
    metas = tuple(
        (divisibility_shape(meta.shape, mesh_shape), meta.dtype)
        for meta in (*node.inputs, *node.outputs)
    )
    return (node.op, _freeze((node.args, node.kwargs)), lists, metas, mesh_shape)


def find_signature(
    node: Node,
    layouts: tuple[tuple[NdSbp, ...], tuple[NdSbp, ...]],
    stated: tuple[str, ...],
    mesh_shape: Sequence[int],
) -> NdSignature | None:
    """The offered nd-signature with these (inputs, outputs) layouts whose exchanges a plan
    states as `stated` (`Exchange.describe`): of several kernels of one layout, the plan's; the
    rule's own where none states them (the caller compares); None where no signature has
    these layouts."""
    inputs, outputs = layouts
    offered = [
        s for s in nd_signatures(node, mesh_shape) if (s.inputs, s.outputs) == (inputs, outputs)
    ]
    for sig in offered:
        if tuple(e.describe() for e in exchanges(node, sig, mesh_shape)) == stated:
            return sig
    return offered[0] if offered else None


# (op, args, kwargs, inputs, outputs, mesh shape) -> signatures (nD; 1D, keyed by one mesh dim
# size); `_product_key` -> the product. Each is cleared when it grows past the limit (a bound on
# memory, far above the distinct nodes of one model: repeated layers repeat keys).
_ND_MEMO: dict[Hashable, tuple[NdSignature, ...]] = {}
_1D_MEMO: dict[Hashable, tuple[Signature, ...]] = {}
_PRODUCT_MEMO: dict[Hashable, tuple[NdSignature, ...]] = {}
_ND_MEMO_LIMIT = 100_000


def _remember(memo: dict[Hashable, Any], key: Hashable, value: Any) -> None:
    if len(memo) >= _ND_MEMO_LIMIT:
        memo.clear()
    memo[key] = value


def _memo_key(node: Node, mesh_shape: tuple[int, ...]) -> Hashable | None:
    parts = (node.args, node.kwargs)
    key = (node.op, _freeze(parts), tuple(node.inputs), tuple(node.outputs), mesh_shape)
    try:
        hash(key)
    except TypeError:  # an unhashable argument (e.g. a tensor constant): compute every time
        return None
    return key


def _freeze(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


def exchanges(
    node: Node, nd_signature: NdSignature, mesh_shape: Sequence[int]
) -> tuple[Exchange, ...]:
    """The collectives the op runs inside itself under `nd_signature`, per micro-batch and
    device (empty for almost every signature: their communication is boxing, on edges)."""
    rule = RULES.get(node.op)
    return () if rule is None else rule.exchanges(node, nd_signature, tuple(mesh_shape))


def work_fraction(
    node: Node, nd_signature: NdSignature | None, mesh_shape: Sequence[int], causal_skip: float
) -> float:
    """The fraction of its even share of the node's counted flops (`capturing.flops`) the
    kernel computes under `nd_signature` (None: the least over every signature), on a device
    whose attention kernel skips `causal_skip` of a causal mask's masked scores."""
    rule = RULES.get(node.op)
    return 1.0 if rule is None else rule.work(node, nd_signature, tuple(mesh_shape), causal_skip)


def local_op(
    node: Node,
    nd_signature: NdSignature,
    mesh_shape: Sequence[int],
    coords: Sequence[int],
    comm: OpComm | None = None,
) -> LocalOp:
    """The op bound to the device at `coords`: call it with that device's local inputs.

    Build it once per (node, signature, mesh, device) and call it every step: all argument
    rewriting (local sizes, shard offsets, rescale factors) happens here, not in the call.
    A signature that communicates inside the op (`exchanges`) needs `comm`, this device's
    collectives on its mesh groups.
    """
    rule = RULES.get(node.op)
    if rule is None:  # a derived signature runs the op unchanged, as it was checked
        for mesh_dim, size in enumerate(mesh_shape):
            assert nd_signature.mesh_dim(mesh_dim) in signatures_1d(node, size), (
                f"{node.op} has no rule and {nd_signature} was not derived for it"
            )
        return default_local_op(node)
    mesh_shape, coords = tuple(mesh_shape), tuple(coords)
    if rule.build_comm is not None and rule.exchanges(node, nd_signature, mesh_shape):
        if comm is None:
            raise ExecutionError(
                f"node {node.name!r} ({node.op}) under {nd_signature} communicates inside the "
                "op, and its kernel was built without process groups. Build it where the "
                "runtime holds the mesh's groups (runtime.execute.op_comm.GroupComm)."
            )
        return rule.build_comm(node, nd_signature, OpContext(mesh_shape, coords, comm))
    return rule.build_local(node, nd_signature, mesh_shape, coords)


def local_call(
    node: Node,
    nd_signature: NdSignature,
    mesh_shape: Sequence[int],
    coords: Sequence[int],
    local_inputs: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, ...]:
    """Run the op on this device's shards and return its local outputs under `nd_signature`."""
    return local_op(node, nd_signature, mesh_shape, coords)(local_inputs)


def derives_splits(node: Node) -> bool:
    """Does an op without a rule have a derived signature other than all-B here?"""
    return len(signatures_1d(node, 2)) > 1


def warn_unknown_ops(ops: Iterable[str]) -> tuple[str, ...]:
    """Issue one UnknownOpWarning naming every op in `ops` without a rule (registered, or
    derived for each of its nodes: the caller leaves those out); return those ops."""
    unknown = tuple(sorted({op for op in ops if not has_rule(op)}))
    if unknown:
        message = (
            f"{len(unknown)} op(s) have no SBP rule and will run replicated (all-B) on every "
            f"device: {', '.join(unknown)}. The plan is correct but cannot shard them; add a rule "
            "in autosbp/rules/ to do better."
        )
        warnings.warn(message, UnknownOpWarning, stacklevel=2)
    return unknown


def pinned_inputs(graph: OpGraph, name: str) -> frozenset[int]:
    """The inputs of node `name` that must arrive in their producer's layout, unboxed: those it
    writes in place (unless a buffer: the runtime writes a buffer's boxed copy back), and the
    input a view op aliases when its output is written in place, directly or through more views
    (a boxed copy would take the write away from the tensor the model reads afterwards)."""
    attrs = graph.node(name)
    pinned = set()
    producers = graph.producers(name)
    for index in mutated_inputs(attrs):
        found = producers[index]
        if found is not None and graph.node(found[0]).role is not Role.BUFFER:
            pinned.add(index)
    aliased = _aliased_inputs(attrs)
    if aliased and any(_written_through(graph, name, out) for out in range(len(attrs.outputs))):
        pinned |= aliased
    return frozenset(pinned)


def _aliased_inputs(attrs: Node) -> set[int]:
    """InputRef indices of the inputs a view op's output aliases (schema `Tensor(a)`, not a
    write); empty for other ops."""
    schema = attrs.schema
    if schema is None or not any(r.alias_info is not None for r in schema.returns):
        return set()
    names = {a.name for a in schema.arguments if a.alias_info and not a.alias_info.is_write}
    slots = tensor_slots(attrs)
    return {slot for key, slot in slots.items() if key in names and isinstance(slot, int)}


def _written_through(graph: OpGraph, name: str, out: int) -> bool:
    """Is output `out` of `name` written in place by a reader, or by one through views of it?"""
    for reader in graph.graph.successors(name):
        uses = [i for o, i in graph.uses(name, reader) if o == out]
        attrs = graph.node(reader)
        if set(uses) & set(mutated_inputs(attrs)):
            return True
        if set(uses) & _aliased_inputs(attrs) and any(
            _written_through(graph, reader, k) for k in range(len(attrs.outputs))
        ):
            return True
    return False


def _is_distributed(nd_sbp: Sequence[Sbp]) -> bool:
    return any(not isinstance(s, Broadcast) for s in nd_sbp)


def _admissible(
    node: Node, inputs: Sequence[NdSbp], outputs: Sequence[NdSbp], mesh_shape: tuple[int, ...]
) -> bool:
    """Every split divides its dim; no P on a tensor that is not floating point."""
    pairs = zip((*node.inputs, *node.outputs), (*inputs, *outputs), strict=True)
    for meta, nd_sbp in pairs:
        if any(isinstance(s, Partial) for s in nd_sbp) and not meta.dtype.is_floating_point:
            return False
        for dim, parts in split_factors(nd_sbp, mesh_shape).items():
            if dim >= len(meta.shape) or meta.shape[dim] % parts:
                return False
    return True
