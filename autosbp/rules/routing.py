"""Mixture-of-experts routing: top-k and sort, one-hot masks, histograms, scatters, and the
grouped matmul of per-expert weights.

Lives here: the rules of the ops that route tokens to experts and run them. Lives elsewhere:
gather / index (`indexing`), cumsum (`reduction`), the batched matmuls of capacity-based
dispatch (`matmul`: bmm and matmul split their expert dim like any batch dim).

Rows, for one mesh dim:
  topk / sort                 S(i) -> S(i) on both outputs for every i but the sorted dim (each
                              row is ranked alone; indices count positions along that dim, which
                              no split cuts); no P (the ranking of a sum is not a sum)
  one_hot (num_classes given) S(i) -> S(i): each element becomes its own row; no P (integers)
  histc (min < max given)     S(i) -> P: counts of disjoint parts add up (with min = max = 0
                              the range is the data's own, which a part does not know: B only)
  scatter / scatter_add /     any dim d other than `dim` split in self, index and src alike,
  index_add                   where index, self and src have the same size there (chunk k of
                              each then holds the same positions; index_add's index is 1-D
                              along `dim` and stays B); the accumulating ones are linear in
                              (self, src) together: self P, src P, index B -> P; scatter of a
                              value 0 likewise (self P -> P)
  index_put                   with index tensors for the leading dims only, a trailing dim may
                              be split in self and values (values follow by broadcasting);
                              accumulate=True is linear: self P, values P, indices B -> P
  grouped matmul              (transformers' grouped_mm_fallback, aten._grouped_mm of a 2-D
  (input [S, K], weight       input): the rows of input are sorted by expert and `offs` ends
  [E, K, N], offs [E])        each expert's rows. weight S(2) -> output S(1) (columns); input
                              S(1), weight S(1) -> P (K contracted); input or weight P, the
                              other B -> P (bilinear); and expert parallelism: weight S(0),
                              input B -> P, each device computing its experts' rows with its
                              weights and exact zeros elsewhere (`ExpertRows`), so the sum over
                              devices is the output (each row belongs to exactly one expert).
                              The rows themselves are never split: where one expert's rows end
                              is data, and shapes are static. aten._grouped_mm's kernel wants
                              16-byte strides: its column and K splits are listed only where
                              the local sizes keep them.
Without a capacity, routing decides how many rows each device computes; the planner prices the
expert split at 1/n of the rows (`planner.timing.candidates`: the smallest local share), i.e.
balanced routing, the average of the step time, not its worst case. Capacity-based dispatch (the
zoo's `moe`) has no such gap: every expert computes its capacity, full or not. Ties: a top-k or sort
of values equal within rounding may pick another element on another device's kernel or in another
precision (runtime/verify/step_check.py states this limit). References: Lepikhin et al. 2020
(GShard) section 2.2; Megatron-Core's all-gather token dispatcher (experts split, tokens replicated,
outputs summed); transformers.integrations.moe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from autosbp.rules.core import (
    LocalOp,
    NdSignature,
    Node,
    OpRule,
    Shape,
    Signature,
    all_broadcast,
    arg_shape,
    bound_args,
    default_local_op,
    in_shapes,
    local_op_with,
    make_signature,
    norm_dim,
    shard_range,
    slot_of,
    uniform,
)
from autosbp.rules.pointwise import aligned_sbp
from autosbp.sbp import B, P, S, Sbp, is_split


def ranked_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    """topk / sort: every dim but the ranked one may be split; no P."""
    rank = len(in_shapes(node)[0])
    dim = norm_dim(bound_args(node).get("dim", -1), rank)
    return [all_broadcast(node), *(uniform(node, S(i)) for i in range(rank) if i != dim)]


def one_hot_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    if bound_args(node)["num_classes"] < 0:  # the class count is the data's maximum + 1
        return [all_broadcast(node)]
    rank = len(in_shapes(node)[0])
    return [all_broadcast(node), *(uniform(node, S(i)) for i in range(rank))]


def histc_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    args = bound_args(node)
    if not args["min"] < args["max"]:  # the range is the data's own: a part has another
        return [all_broadcast(node)]
    rank = len(in_shapes(node)[0])
    return [all_broadcast(node), *(Signature((S(i),), (P,)) for i in range(rank))]


# scatter-like op -> (the name of its source argument, or None for a scalar value; whether the
# op is linear in self and source together)
SCATTERS: dict[str, tuple[str | None, bool]] = {
    "aten.scatter.src": ("src", False),
    "aten.scatter.value": (None, False),
    "aten.scatter_add.default": ("src", True),
    "aten.index_add.default": ("source", True),
}


def scatter_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    """See the module header. scatter's index has self's rank and splits with it; index_add's
    is 1-D along `dim` and stays whole (B)."""
    source, linear = SCATTERS[node.op]
    self_shape = arg_shape(node, "self")
    dim = norm_dim(bound_args(node)["dim"], len(self_shape))
    per_position = node.op != "aten.index_add.default"
    aligned = [self_shape, *([arg_shape(node, source)] if source else [])]
    aligned += [arg_shape(node, "index")] if per_position else []

    def sig(sbp: Sbp, index: Sbp) -> Signature:
        by_name = {"self": sbp, "index": index, **({source: sbp} if source else {})}
        return make_signature(node, by_name, (sbp,))

    sigs = [all_broadcast(node)]
    for d in range(len(self_shape)):
        if d != dim and len({shape[d] for shape in aligned}) == 1:
            sigs.append(sig(S(d), S(d) if per_position else B))
    if linear or (source is None and bound_args(node)["value"] == 0):
        sigs.append(sig(P, B))
    return sigs


def index_put_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    args = bound_args(node)
    self_shape, values_shape = arg_shape(node, "self"), arg_shape(node, "values")
    indices = list(args["indices"])
    sigs = [all_broadcast(node)]
    if all(index is not None for index in indices):  # indexed dims 0..k-1, the rest kept
        index_shapes = [node.inputs[index.index].shape for index in indices]
        indexed = tuple(torch.broadcast_shapes(*index_shapes)) + tuple(self_shape[len(indices) :])
        for d in range(len(indices), len(self_shape)):
            into = len(indexed) - len(self_shape) + d  # the dim of the indexed result
            values = aligned_sbp(values_shape, indexed, into)
            by_name: dict[str, Sbp] = {"self": S(d), "indices": B, "values": values}
            sigs.append(make_signature(node, by_name, (S(d),)))
    if args["accumulate"]:
        sigs.append(make_signature(node, {"self": P, "indices": B, "values": P}, (P,)))
    return sigs


@dataclass(frozen=True, slots=True)
class GroupedMatmul:
    """The argument names of a grouped matmul: input [S, K] rows sorted by expert, weight
    [E, K, N], offs [E] the end of each expert's rows."""

    input: str
    weight: str


GROUPED: dict[str, GroupedMatmul] = {
    "transformers.grouped_mm_fallback.default": GroupedMatmul("input", "weight"),
    "aten._grouped_mm.default": GroupedMatmul("self", "mat2"),
}


def _is_expert_rows(node: Node, names: GroupedMatmul) -> bool:
    """The mode this family knows: a 2-D input, 3-D weights, offsets, no bias."""
    args = bound_args(node)
    return (
        len(arg_shape(node, names.input)) == 2
        and len(arg_shape(node, names.weight)) == 3
        and slot_of(node, "offs") is not None
        and args.get("bias") is None
    )


def _keeps_strides(node: Node, dim_size: int, mesh_dim_size: int) -> bool:
    """aten._grouped_mm's kernel wants 16-byte strides: may a dim of `dim_size` elements be
    split here, and again on another mesh dim of the same size or smaller? (Splits on two mesh
    dims of sizes n1, n2 keep them when the 16-byte count divides by n1**2 and by n2**2: then
    by lcm(n1, n2)**2, a multiple of n1 * n2.)"""
    if node.op != "aten._grouped_mm.default":
        return True
    chunks, extra = divmod(dim_size * node.outputs[0].dtype.itemsize, 16)
    return not extra and chunks % mesh_dim_size**2 == 0


def grouped_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    names = GROUPED[node.op]
    if not _is_expert_rows(node, names):
        return [all_broadcast(node)]
    _, k, n = arg_shape(node, names.weight)

    def sig(input_sbp: Sbp, weight_sbp: Sbp, out: Sbp) -> Signature:
        return make_signature(
            node, {names.input: input_sbp, names.weight: weight_sbp, "offs": B}, (out,)
        )

    return [
        all_broadcast(node),
        *([sig(B, S(2), S(1))] if _keeps_strides(node, n, mesh_dim_size) else []),  # columns
        *([sig(S(1), S(1), P)] if _keeps_strides(node, k, mesh_dim_size) else []),  # K summed
        sig(P, B, P),  # linear in the input
        sig(B, P, P),  # linear in the weight
        sig(B, S(0), P),  # experts split: each device its experts' rows (ExpertRows)
    ]


def _grouped_local(node: Node, sig: NdSignature, mesh_shape: Shape, coords: Shape) -> LocalOp:
    slot = slot_of(node, GROUPED[node.op].weight)
    assert slot is not None
    weight_sbp = sig.inputs[slot]
    if not any(is_split(s, 0) for s in weight_sbp):
        return default_local_op(node)
    experts = shard_range(node.inputs[slot].shape[0], 0, weight_sbp, mesh_shape, coords)
    assert node.target is not None, f"{node.op}: no target to call"
    return local_op_with(node, ExpertRows(node.target, experts.start, len(experts)), {})


@dataclass(frozen=True, slots=True)
class ExpertRows:
    """`grouped(input, weight, offs)` on a device holding experts [first, first + count) of the
    weight: those experts' rows computed with its local weight, exact zeros in every other row
    (the other devices' addends of the P output). Reads `offs` (one host sync per call)."""

    grouped: Callable[..., torch.Tensor]
    first: int
    count: int

    def __call__(
        self, input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        ends = offs.tolist()
        lo = ends[self.first - 1] if self.first else 0
        hi = ends[self.first + self.count - 1]
        local_offs = offs[self.first : self.first + self.count] - lo
        rows = self.grouped(input[lo:hi], weight, local_offs, **kwargs)
        zeros = rows.new_zeros
        return torch.cat(
            [zeros(lo, rows.shape[1]), rows, zeros(input.shape[0] - hi, rows.shape[1])]
        )


def rules() -> dict[str, OpRule]:
    """This family's rows of the registry."""
    ranked = OpRule(ranked_signatures)
    scatter = OpRule(scatter_signatures)
    grouped = OpRule(grouped_signatures, _grouped_local)
    return {
        "aten.topk.default": ranked,
        "aten.sort.default": ranked,
        "aten.sort.stable": ranked,
        "aten.one_hot.default": OpRule(one_hot_signatures),
        "aten.histc.default": OpRule(histc_signatures),
        **dict.fromkeys(SCATTERS, scatter),
        "aten.index_put.default": OpRule(index_put_signatures),
        **dict.fromkeys(GROUPED, grouped),
    }
