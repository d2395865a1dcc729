"""Ops that take or join parts along one dim: slice, select, cat, stack, split, chunk, unbind,
pad, index_select, gather, index (advanced indexing), broadcast_tensors. (No getitem: capture
folds it into edges, see capture.py.)

Lives here: one rule per op, all built on "any dim except the one being cut, joined or padded may
be split, and the op is linear (P -> P)". Lives elsewhere: pure reshapes and permutations
(`view`).

Rows, for one mesh dim:
  slice / select / index_select   S(i) -> S(i') for i != dim (select drops dim); P -> P; a slice
                                  keeping the whole dim (start 0, step 1) may split it too;
                                  index_select's index is B (every device needs all of it)
  cat / stack                     every input S(i) -> S(i') for i != dim; all inputs P -> P
                                  (a B input joined with P ones would be counted once per device);
                                  cat skips a legacy empty input (1-D of size 0, what a key/value
                                  cache starts from): B in every signature, the others' rows
  split / split_with_sizes /      S(i) -> every output S(i') for i != dim; P -> all outputs P
  chunk / unbind
  pad                             unpadded dims split; P -> P only for constant padding with 0
  gather (self, dim, index)       out[..i..] = self[..index[..i..]..] along dim: any other dim d
                                  split in self, index and output alike where index and self
                                  have the same size there (gather allows index to be smaller:
                                  then chunk k of the two would hold different rows); self P,
                                  index B -> P (linear in self)
  index (self, indices)           x[i0, i1, ...] with index tensors (None for a whole dim): a
                                  dim of self no index reads may be split (it moves to its
                                  place in the output, after the broadcast index dims); one
                                  index tensor may be split along its own dims (self B: every
                                  device reads its own indices); self P, indices B -> P
  broadcast_tensors               split an output dim: inputs follow by broadcasting, every output
                                  S; input k P (others B) -> output k P (others B): each output
                                  is its own input expanded
"""

from __future__ import annotations

import torch

from autosbp.rules.core import (
    Node,
    OpRule,
    Signature,
    all_broadcast,
    arg_shape,
    bound_args,
    in_shapes,
    make_signature,
    norm_dim,
    one_partial,
    out_shapes,
    slot_of,
    tensor_slots,
    uniform,
)
from autosbp.rules.pointwise import broadcast_split_signatures
from autosbp.sbp import B, P, S, Sbp


def _dim(node: Node, rank: int) -> int:
    return norm_dim(bound_args(node).get("dim", 0), rank)


def along_dim_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    """Inputs and outputs keep their rank; every dim except `dim` may be split."""
    rank = len(in_shapes(node)[0])
    dim = _dim(node, rank)
    splits = [uniform(node, S(i)) for i in range(rank) if i != dim]
    return [all_broadcast(node), *splits, uniform(node, P)]


def cat_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    """`along_dim_signatures`, but torch.cat skips a legacy empty input (shape (0,), as Hugging
    Face's key/value cache starts from before its first `cat`): it joins nothing, so it is B (the
    same nothing on every device) and the other inputs take the rows of a cat without it. Seen
    whole, such an input would make the rank 1 and leave only B and P: every device would hold
    the whole batch's keys."""
    shapes = in_shapes(node)
    legacy = [shape == (0,) for shape in shapes]
    if not any(legacy) or all(legacy):
        return along_dim_signatures(node, mesh_dim_size)
    rank = len(out_shapes(node)[0])
    dim = _dim(node, rank)

    def beside_empty(sbp: Sbp) -> Signature:
        return Signature(tuple(B if empty else sbp for empty in legacy), (sbp,))

    splits = [beside_empty(S(i)) for i in range(rank) if i != dim]
    return [all_broadcast(node), *splits, beside_empty(P)]


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
    n_out = len(node.outputs)
    splits = [Signature((S(i),), (S(i - (i > dim)),) * n_out) for i in range(rank) if i != dim]
    return [all_broadcast(node), *splits, uniform(node, P)]


def stack_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    rank = len(out_shapes(node)[0])
    dim = _dim(node, rank)
    splits = [
        Signature((S(i - (i > dim)),) * len(node.inputs), (S(i),)) for i in range(rank) if i != dim
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


def gather_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    self_shape, index_shape = arg_shape(node, "self"), arg_shape(node, "index")
    dim = _dim(node, len(self_shape))
    sigs = [all_broadcast(node)]
    for d in range(len(self_shape)):
        if d != dim and index_shape[d] == self_shape[d]:
            sigs.append(make_signature(node, {"self": S(d), "index": S(d)}, (S(d),)))
    return [*sigs, make_signature(node, {"self": P, "index": B}, (P,))]


def index_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    """aten.index.Tensor: see the module header. The output puts the broadcast index dims where
    the (adjacent) indexed dims were, or first when None entries separate them (torch's rule)."""
    self_rank = len(arg_shape(node, "self"))
    indices = list(bound_args(node)["indices"])
    indexed = [k for k, index in enumerate(indices) if index is not None]
    slots = tensor_slots(node)["indices"]
    assert isinstance(slots, tuple)
    index_rank = len(torch.broadcast_shapes(*(in_shapes(node)[slot] for slot in slots)))
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1))
    first = indexed[0] if adjacent else 0
    n_in = len(node.inputs)
    self_slot = slot_of(node, "self")
    assert self_slot is not None

    def with_self(sbp: Sbp) -> tuple[Sbp, ...]:
        return tuple(sbp if i == self_slot else B for i in range(n_in))

    sigs = [all_broadcast(node)]
    for d in (d for d in range(self_rank) if d not in indexed):
        out = d if (adjacent and d < first) else d - len([k for k in indexed if k < d]) + index_rank
        sigs.append(Signature(with_self(S(d)), (S(out),)))
    if len(slots) == 1 and len(in_shapes(node)[slots[0]]) == index_rank:
        for j in range(index_rank):
            ins = tuple(S(j) if i == slots[0] else B for i in range(n_in))
            sigs.append(Signature(ins, (S(first + j),)))
    return [*sigs, Signature(with_self(P), (P,))]


def broadcast_tensors_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    n = len(node.inputs)
    partial = [Signature(one_partial(n, k), one_partial(n, k)) for k in range(n)]
    return [all_broadcast(node), *broadcast_split_signatures(node), *partial, uniform(node, P)]


def rules() -> dict[str, OpRule]:
    """This family's rows of the registry."""
    along = OpRule(along_dim_signatures)
    dropping = OpRule(dropping_dim_signatures)
    pad = OpRule(pad_signatures)
    return {
        "aten.slice.Tensor": OpRule(slice_signatures),
        "aten.cat.default": OpRule(cat_signatures),
        "aten.split.Tensor": along,
        "aten.split_with_sizes.default": along,
        "aten.chunk.default": along,
        "aten.select.int": dropping,
        "aten.unbind.int": dropping,
        "aten.stack.default": OpRule(stack_signatures),
        "aten.index_select.default": OpRule(index_select_signatures),
        "aten.gather.default": OpRule(gather_signatures),
        "aten.index.Tensor": OpRule(index_signatures),
        "aten.pad.default": pad,
        "aten.constant_pad_nd.default": pad,
        "aten.broadcast_tensors.default": OpRule(broadcast_tensors_signatures),
    }
