"""Convolutions and pooling: conv1d/2d/3d, max/avg/adaptive pooling.

Lives here: the rows of aten.conv{1,2,3}d (input, weight, bias, stride, padding, dilation, groups)
and of the pooling ops. Lives elsewhere: batch_norm (`norm`), a mean over spatial dims
(`reduction`).

Rows, for one mesh dim (x is (N, C_in, *spatial), weight (C_out, C_in / groups, *kernel)):
  data parallel       x S(0), weight B, bias B -> S(0)
  output channels     x B, weight S(0), bias S(0) -> S(1)         (groups == 1: a group's
                                                                   channels stay together)
  input channels      x S(1), weight S(1), bias P -> P            (groups == 1: the sum over
                                                                   input channels splits into
                                                                   partial sums; bias added once)
  linearity           x P, weight B, bias P -> P; x B, weight P, bias P -> P
  pooling             split N or C (any dim but the pooled, trailing ones); avg pooling is
                      linear (P -> P), max pooling is not. max_pool2d_with_indices' indices
                      are positions inside each (N, C) plane, so they split the same way.
Spatial splits are not offered: they need halo exchange at the borders.
References: OneFlow conv_op.cpp (data parallel only); Megatron-style channel splits.
"""

from __future__ import annotations

from autosbp.rules.core import (
    Node,
    OpRule,
    Signature,
    all_broadcast,
    bound_args,
    in_shapes,
    make_signature,
    uniform,
)
from autosbp.sbp import B, P, S, Sbp

CONVS = ("aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default")

# pooling op -> number of trailing (pooled) dims
POOLS: dict[str, int] = {
    "aten.max_pool1d.default": 1,
    "aten.max_pool2d.default": 2,
    "aten.max_pool3d.default": 3,
    "aten.max_pool2d_with_indices.default": 2,
    "aten.avg_pool1d.default": 1,
    "aten.avg_pool2d.default": 2,
    "aten.avg_pool3d.default": 3,
    "aten.adaptive_avg_pool1d.default": 1,
    "aten.adaptive_avg_pool2d.default": 2,
    "aten.adaptive_avg_pool3d.default": 3,
    "aten.adaptive_max_pool2d.default": 2,
}


def conv_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    groups = bound_args(node)["groups"]
    batched = len(in_shapes(node)[0]) == len(in_shapes(node)[1])  # unbatched input: (C, *spatial)
    channel = 1 if batched else 0

    def sig(x: Sbp, weight: Sbp, bias: Sbp, out: Sbp) -> Signature:
        return make_signature(node, {"input": x, "weight": weight, "bias": bias}, (out,))

    sigs = [all_broadcast(node)]
    if batched:
        sigs.append(sig(S(0), B, B, S(0)))
    if groups == 1:
        sigs += [sig(B, S(0), S(0), S(channel)), sig(S(channel), S(1), P, P)]
    return [*sigs, sig(P, B, P, P), sig(B, P, P, P)]


def pool_signatures(node: Node, mesh_dim_size: int, pooled: int, linear: bool) -> list[Signature]:
    rank = len(in_shapes(node)[0])
    sigs = [all_broadcast(node), *(uniform(node, S(i)) for i in range(rank - pooled))]
    return [*sigs, uniform(node, P)] if linear else sigs


def rules() -> dict[str, OpRule]:
    """This family's rows of the registry."""

    def pool(pooled: int, linear: bool) -> OpRule:
        return OpRule(lambda node, size: pool_signatures(node, size, pooled, linear))

    table = dict.fromkeys(CONVS, OpRule(conv_signatures))
    table.update({op: pool(pooled, linear="avg" in op) for op, pooled in POOLS.items()})
    return table
