"""Scaled dot-product attention: aten.scaled_dot_product_attention on (..., L, E) tensors.

Lives here: the rows of SDPA (query (..., L, E), key (..., S, E), value (..., S, Ev), optional
attn_mask broadcastable to (..., L, S); output (..., L, Ev)). Lives elsewhere: attention written
out as matmul + softmax (`matmul`, `reduction`), which composes from those rules.

Rows, for one mesh dim:
  batch dims (b, h, ...)   query, key, value S(i), mask S(i) or B where it broadcasts -> S(i):
                           heads and sequences of the batch are independent (GQA: key / value
                           heads split the same way; the divisibility filter checks their count)
  query rows (L)           query S(-2), key and value B, mask S(-2) or B -> S(-2), only when not
                           causal: every query row attends to all keys independently. With
                           is_causal the mask depends on the global row index: that is the
                           next row's kernel.
  sequence (L, context     query, key, value S(-2) -> S(-2): keys and values all-gathered
  parallelism)             inside the op, causal load-balanced (`context`, which holds the row,
                           its exchanges and its kernel); on one mesh dim without a mask, a
                           second kernel of the same layouts passes them around a ring instead,
                           each step's exchange beside that step's compute (`ring`)
  linearity in value       query B, key B, value P, mask B -> P: out = softmax(q k^T) v
  E (head dim)             never split: the scores need the whole dot product before softmax
dropout_p > 0 draws a random mask: the rows hold in distribution, not bit for bit.

Work (`sdpa_work`, what the planner prices of the counted dense flops, `capturing.flops`):
is_causal keeps a fraction k of the scores (top-left aligned, as torch's is_causal: row i sees
keys 0..i; k = (L+1)/2L for L = S); a kernel computes a fraction c of the dense product (1 on
the whole sequence; the sequence-split kernel reads only the keys up to each half's last row:
c = (2N+1)/4N on N chunks, keeping the same k, its halves balanced) and skips the profile's
`causal_skip` s of what it computes but masks: work = c - s (c - k). A math kernel has s = 0;
flash kernels skip the blocks above the diagonal (torch 2.13's CPU flash kernel too, in part:
the cpu-gloo profile does not state it, so 0). An explicit mask is data no kernel skips: dense
(work 1), also for a mask that is causal.
"""

from __future__ import annotations

from autosbp.rules import context, ring
from autosbp.rules.comm import Exchange, OpContext
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
    make_signature,
    out_shapes,
)
from autosbp.rules.pointwise import aligned_sbp
from autosbp.sbp import B, P, S, Sbp


def sdpa_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    args = bound_args(node)
    out_shape = out_shapes(node)[0]
    rank = len(out_shape)
    mask_shape = arg_shape(node, "attn_mask")  # () without a mask: never consulted then
    scores_shape = (*out_shape[:-1], arg_shape(node, "key")[-2])

    def sig(q: Sbp, kv: Sbp, mask: Sbp, out: Sbp, value: Sbp | None = None) -> Signature:
        by_name = {
            "query": q,
            "key": kv,
            "value": kv if value is None else value,
            "attn_mask": mask,
        }
        return make_signature(node, by_name, (out,))

    sigs = [all_broadcast(node)]
    for dim in range(rank - 2):
        sigs.append(sig(S(dim), S(dim), aligned_sbp(mask_shape, scores_shape, dim), S(dim)))
    if not args["is_causal"]:
        sigs.append(
            sig(S(rank - 2), B, aligned_sbp(mask_shape, scores_shape, rank - 2), S(rank - 2))
        )
    sigs.append(sig(B, B, B, P, value=P))
    return sigs + context.cp_signatures(node, mesh_dim_size)


def sdpa_work(node: Node, sig: NdSignature | None, mesh_shape: Shape, causal_skip: float) -> float:
    """The fraction of its even share of the dense flops the kernel computes (module header);
    `sig` None: the least over every signature (every kernel computes at least the kept k)."""
    if not bound_args(node)["is_causal"]:
        return 1.0
    rows, keys = node.inputs[0].shape[-2], node.inputs[1].shape[-2]
    seen = min(rows, keys)
    kept = (seen * (seen + 1) / 2 + (rows - seen) * keys) / (rows * keys)
    if sig is None:
        return kept
    computed = context.cp_computed(node, sig, mesh_shape)
    if sig.kernel == ring.RING:  # plain matmuls: every score of the blocks it computes
        return computed
    return computed - causal_skip * (computed - kept)


def sdpa_exchanges(node: Node, sig: NdSignature, mesh_shape: Shape) -> tuple[Exchange, ...]:
    if sig.kernel == ring.RING:
        return ring.ring_exchanges(node, sig, mesh_shape)
    return context.cp_exchanges(node, sig, mesh_shape)


def build_sdpa_comm(node: Node, sig: NdSignature, ctx: OpContext) -> LocalOp:
    if sig.kernel == ring.RING:
        return ring.build_ring_attention(node, sig, ctx)
    return context.build_cp_attention(node, sig, ctx)


def rules() -> dict[str, OpRule]:
    """This family's rows of the registry."""
    return {
        "aten.scaled_dot_product_attention.default": OpRule(
            sdpa_signatures,
            exchanges=sdpa_exchanges,
            build_comm=build_sdpa_comm,
            work=sdpa_work,
            variants=ring.ring_variants,
        )
    }
