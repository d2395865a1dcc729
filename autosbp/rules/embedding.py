"""Embedding lookups: aten.embedding (weight first, then indices).

Lives here: the rows of embedding and the vocabulary-parallel local kernel. Lives elsewhere:
the matmul that reuses a tied embedding table (`matmul`; a tied table keeps one SBP because it is
one placeholder node).

Rows, for one mesh dim (out = weight[indices], shape indices.shape + (D,)):
  S(i) indices, B weight -> S(i)        each device looks up its own indices
  B indices, S(1) weight -> S(last)     each device holds some columns of every row
  B indices, S(0) weight -> P           vocabulary parallel: each device holds some rows; the
                                        kernel looks up indices in its row range (shifted by the
                                        range start) and writes zeros for the others, so the sum
                                        over devices is the lookup (OneFlow gather_op.cpp)
  B indices, P weight -> P              the lookup is linear in the table
Split indices (S(i)) only when scale_grad_by_freq is false: the gradient would count index
frequencies per device instead of globally.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    local_op_with,
    make_signature,
    shard_range,
    slot_of,
)
from autosbp.sbp import B, P, S, Sbp, Split


def embedding_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    args = bound_args(node)
    index_rank = len(arg_shape(node, "indices"))

    def sig(weight: Sbp, indices: Sbp, out: Sbp) -> Signature:
        return make_signature(node, {"weight": weight, "indices": indices}, (out,))

    sigs = [all_broadcast(node)]
    if not args["scale_grad_by_freq"]:
        sigs += [sig(B, S(i), S(i)) for i in range(index_rank)]
        sigs.append(sig(S(0), B, P))  # remapped indices would count toward row 0's frequency
    sigs += [sig(S(1), B, S(index_rank)), sig(P, B, P)]
    return sigs


def embedding_local(node: Node, sig: NdSignature, mesh_shape: Shape, coords: Shape) -> LocalOp:
    weight_slot = slot_of(node, "weight")
    assert weight_slot is not None
    weight_sbp = sig.inputs[weight_slot]
    if not any(isinstance(s, Split) and s.dim == 0 for s in weight_sbp):
        return default_local_op(node)
    vocab = arg_shape(node, "weight")[0]
    rows = shard_range(vocab, 0, weight_sbp, mesh_shape, coords)
    padding_idx = bound_args(node)["padding_idx"]
    local_padding = padding_idx - rows.start if padding_idx in rows else -1
    overrides = {"padding_idx": local_padding}
    return local_op_with(node, VocabShardEmbedding(rows.start, rows.stop), overrides)


@dataclass(frozen=True, slots=True)
class VocabShardEmbedding:
    """embedding() of the rows [start, stop): other indices read zeros (vocabulary parallel)."""

    start: int
    stop: int

    def __call__(
        self,
        weight: torch.Tensor,
        indices: torch.Tensor,
        padding_idx: int = -1,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
    ) -> torch.Tensor:
        inside = (indices >= self.start) & (indices < self.stop)
        local = torch.where(inside, indices - self.start, 0)
        out = torch.ops.aten.embedding.default(
            weight, local, padding_idx, scale_grad_by_freq, sparse
        )
        return out * inside.unsqueeze(-1).to(out.dtype)


def rules() -> dict[str, OpRule]:
    """This family's rows of the registry."""
    return {"aten.embedding.default": OpRule(embedding_signatures, embedding_local)}
