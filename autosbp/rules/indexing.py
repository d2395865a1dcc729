"""Ops that take or join parts along one dim: slice, select, cat, stack, split, unbind, pad,
index_select, broadcast_tensors. (No getitem: capture folds it into edges, see capture.py.)

Lives here: one rule per op, all built on "any dim except the one being cut, joined or padded may
be split, and the op is linear (P -> P)". Lives elsewhere: pure reshapes and permutations
(`view`).

Rows, for one mesh dim:
  slice / select / index_select   S(i) -> S(i') for i != dim (select drops dim); P -> P; a slice
                                  keeping the whole dim (start 0, step 1) may split it too;
                                  index_select's index is B (every device needs all of it)
  cat / stack                     every input S(i) -> S(i') for i != dim; all inputs P -> P
                                  (a B input joined with P ones would be counted once per device)
  split / split_with_sizes /      S(i) -> every output S(i') for i != dim; P -> all outputs P
  unbind
  pad                             unpadded dims split; P -> P only for constant padding with 0
  broadcast_tensors               split an output dim: inputs follow by broadcasting, every output
                                  S; input k P (others B) -> output k P (others B): each output
                                  is its own input expanded
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
    norm_dim,
    one_partial,
    out_shapes,
    uniform,
)
from autosbp.rules.pointwise import broadcast_split_signatures
from autosbp.sbp import B, P, S


def _dim(node: Node, rank: int) -> int:
    return norm_dim(bound_args(node).get("dim", 0), rank)


def along_dim_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    """Inputs and outputs keep their rank; every dim except `dim` may be split."""
    rank = len(in_shapes(node)[0])
    dim = _dim(node, rank)
    splits = [uniform(node, S(i)) for i in range(rank) if i != dim]
    return [all_broadcast(node), *splits, uniform(node, P)]


def slice_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    """A slice that keeps the whole dim (x[:, ...] in export: start 0, end >= size, step 1) is
    the identity there, so that dim may be split too."""
    sigs = along_dim_signatures(node, mesh_dim_size)
    args = bound_args(node)
    rank = len(in_shapes(node)[0])
    whole = in_shapes(node)[0] == out_shapes(node)[0] and args["step"] == 1
    if whole and args["start"] in (None, 0):
        sigs.insert(1, uniform(node, S(_dim(node, rank))))
    return sigs


def dropping_dim_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    """select / unbind: `dim` disappears from the outputs."""
    rank = len(in_shapes(node)[0])
    dim = _dim(node, rank)
    n_out = len(node["outputs"])
    splits = [Signature((S(i),), (S(i - (i > dim)),) * n_out) for i in range(rank) if i != dim]
    return [all_broadcast(node), *splits, uniform(node, P)]


def stack_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    rank = len(out_shapes(node)[0])
    dim = _dim(node, rank)
    splits = [
        Signature((S(i - (i > dim)),) * len(node["inputs"]), (S(i),))
        for i in range(rank)
        if i != dim
    ]
    return [all_broadcast(node), *splits, uniform(node, P)]


def index_select_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    rank = len(in_shapes(node)[0])
    dim = _dim(node, rank)
    sigs = [
        make_signature(node, {"self": S(i), "index": B}, (S(i),)) for i in range(rank) if i != dim
    ]
    return [all_broadcast(node), *sigs, make_signature(node, {"self": P, "index": B}, (P,))]


def pad_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    args = bound_args(node)
    rank = len(in_shapes(node)[0])
    pads = list(args["pad"])
    padded = {rank - 1 - k // 2 for k in range(len(pads)) if pads[k] != 0}
    sigs = [all_broadcast(node), *(uniform(node, S(i)) for i in range(rank) if i not in padded)]
    if args.get("mode", "constant") == "constant" and not args.get("value"):
        sigs.append(uniform(node, P))  # zeros added on every device sum to zeros
    return sigs


def broadcast_tensors_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    n = len(node["inputs"])
    partial = [Signature(one_partial(n, k), one_partial(n, k)) for k in range(n)]
    return [all_broadcast(node), *broadcast_split_signatures(node), *partial, uniform(node, P)]


def rules() -> dict[str, OpRule]:
    """This family's rows of the registry."""
    along = OpRule(along_dim_signatures)
    dropping = OpRule(dropping_dim_signatures)
    pad = OpRule(pad_signatures)
    return {
        "aten.slice.Tensor": OpRule(slice_signatures),
        "aten.cat.default": along,
        "aten.split.Tensor": along,
        "aten.split_with_sizes.default": along,
        "aten.select.int": dropping,
        "aten.unbind.int": dropping,
        "aten.stack.default": OpRule(stack_signatures),
        "aten.index_select.default": OpRule(index_select_signatures),
        "aten.pad.default": pad,
        "aten.constant_pad_nd.default": pad,
        "aten.broadcast_tensors.default": OpRule(broadcast_tensors_signatures),
    }
