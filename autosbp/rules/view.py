"""Ops that only rearrange elements: reshape family, transpose / permute, squeeze, expand.

Lives here: `split_map` (which input dim may carry a split through a reshape, and where it lands)
and the rules of view/reshape/_unsafe_view/flatten/unflatten/squeeze/unsqueeze, transpose /
permute / t, and expand. Lives elsewhere: slicing, concatenation and splitting (`indexing`).

Rows, for one mesh dim (every op here is linear: P -> P):
  reshape family   input and output dims form groups with equal products (size-1 dims aside);
                   a split may sit only on the FIRST dim of a group and lands on the first dim of
                   the matching output group: chunk k of that dim is the k-th contiguous block of
                   the group's elements on both sides (both dims divisible, checked by the
                   registry filter). Local kernel: size arguments become the local output shape.
  squeeze          runs locally as squeeze.dims over the dims of global size 1 only: a split dim
                   of local size 1 must not disappear.
  transpose etc.   S(perm[i]) -> S(i).
  expand           a kept dim: S(j) -> S(i); an expanded (broadcast) dim: B -> S(i), each device
                   expands its own block of identical copies (local sizes, no communication).
References: OneFlow reshape_user_op_util.cpp; torch/distributed/tensor/_ops/_view_ops.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autosbp.capturing.graph import STRIDE_FREE
from autosbp.rules.core import (
    LocalOp,
    NdSignature,
    Node,
    OpRule,
    Shape,
    Signature,
    all_broadcast,
    bound_args,
    default_local_op,
    in_shapes,
    local_op_with,
    local_out_shape,
    norm_dim,
    out_shapes,
    uniform,
)
from autosbp.sbp import B, P, S, Sbp


def split_map(in_shape: Shape, out_shape: Shape) -> dict[int, int]:
    """Input dim -> output dim, for the first dim of each group of a reshape (size-1 dims aside)."""
    out: dict[int, int] = {}
    if 0 in in_shape:
        return out  # an empty tensor: nothing to split
    i = j = 0
    while i < len(in_shape) and j < len(out_shape):
        if in_shape[i] == 1:
            i += 1
            continue
        if out_shape[j] == 1:
            j += 1
            continue
        out[i] = j
        size_in, size_out = in_shape[i], out_shape[j]
        i, j = i + 1, j + 1
        while size_in != size_out:
            if size_in < size_out:
                size_in, i = size_in * in_shape[i], i + 1
            else:
                size_out, j = size_out * out_shape[j], j + 1
    return out


def reshape_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    mapping = split_map(in_shapes(node)[0], out_shapes(node)[0])
    return [
        all_broadcast(node),
        *(Signature((S(i),), (S(o),)) for i, o in mapping.items()),
        uniform(node, P),
    ]


def _sized_local(size_arg: str) -> OpRule:
    """A reshape whose `size_arg` holds the (global) output shape: rewrite it to the local one.
    A view runs as `STRIDE_FREE` says: a local shard's strides are not the global tensor's."""

    def build(node: Node, sig: NdSignature, mesh_shape: Shape, coords: Shape) -> LocalOp:
        assert node.target is not None, f"{node.op}: no target to call"
        kernel: Callable[..., Any] = STRIDE_FREE.get(node.target) or node.target
        return local_op_with(node, kernel, {size_arg: local_out_shape(node, sig, mesh_shape)})

    return OpRule(reshape_signatures, build)


def _unflatten_local(node: Node, sig: NdSignature, mesh_shape: Shape, coords: Shape) -> LocalOp:
    args = bound_args(node)
    dim = norm_dim(args["dim"], len(in_shapes(node)[0]))
    local = local_out_shape(node, sig, mesh_shape)
    return default_local_op(node, {"sizes": local[dim : dim + len(args["sizes"])]})


def _squeeze_local(node: Node, sig: NdSignature, mesh_shape: Shape, coords: Shape) -> LocalOp:
    shape = in_shapes(node)[0]
    dims = bound_args(node).get("dim")
    wanted = range(len(shape)) if dims is None else [dims] if isinstance(dims, int) else dims
    ones = [norm_dim(d, len(shape)) for d in wanted if shape[norm_dim(d, len(shape))] == 1]
    return LocalOp(torch.ops.aten.squeeze.dims, (node.args[0], ones), {}, 1)


def permutation(node: Node) -> list[int]:
    """perm[i] = the input dim that output dim i comes from."""
    rank = len(in_shapes(node)[0])
    args = bound_args(node)
    if "dims" in args:  # permute
        return [norm_dim(d, rank) for d in args["dims"]]
    if "dim0" not in args:  # t (rank <= 2) and numpy_T reverse the dims
        return list(reversed(range(rank)))
    perm = list(range(rank))
    d0, d1 = norm_dim(args["dim0"], rank), norm_dim(args["dim1"], rank)
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return perm


def permute_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    perm = permutation(node)
    return [
        all_broadcast(node),
        *(Signature((S(p),), (S(i),)) for i, p in enumerate(perm)),
        uniform(node, P),
    ]


def expand_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    in_shape, out_shape = in_shapes(node)[0], out_shapes(node)[0]
    offset = len(out_shape) - len(in_shape)
    sigs = [all_broadcast(node)]
    for i in range(len(out_shape)):
        kept = i >= offset and in_shape[i - offset] == out_shape[i]
        sbp: Sbp = S(i - offset) if kept else B
        sigs.append(Signature((sbp,), (S(i),)))
    return [*sigs, uniform(node, P)]


def _expand_local(node: Node, sig: NdSignature, mesh_shape: Shape, coords: Shape) -> LocalOp:
    return default_local_op(node, {"size": local_out_shape(node, sig, mesh_shape)})


RESHAPES: dict[str, OpRule] = {
    "aten.view.default": _sized_local("size"),
    "aten.reshape.default": _sized_local("shape"),
    "aten._unsafe_view.default": _sized_local("size"),
    "aten.flatten.using_ints": OpRule(reshape_signatures),
    "aten.unsqueeze.default": OpRule(reshape_signatures),
    "aten.unflatten.int": OpRule(reshape_signatures, _unflatten_local),
    **dict.fromkeys(
        ("aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default"),
        OpRule(reshape_signatures, _squeeze_local),
    ),
}


def rules() -> dict[str, OpRule]:
    """This family's rows of the registry."""
    permutes = (
        "aten.transpose.int",
        "aten.permute.default",
        "aten.t.default",
        "aten.numpy_T.default",
    )
    return {
        **RESHAPES,
        **dict.fromkeys(permutes, OpRule(permute_signatures)),
        "aten.expand.default": OpRule(expand_signatures, _expand_local),
    }
