"""Ops that work along one dim of their input: roll, diff, argmax / argmin.

Lives here: their signatures. Lives elsewhere: reductions that keep a value (`reduction`: sum,
amax), scans (`reduction`: cumsum), views (`view`).

Rows, for one mesh dim (d: the op's dims):
  roll(self, shifts, dims)     S(i) -> S(i) for every i not rolled (each row of a kept dim
                               rolls alone); P -> P (a permutation is linear). Rolled on the
                               flattened tensor (no dims): B and P only.
  diff(self, n, dim, prepend,  S(i) -> S(i) for i != dim, prepend/append split alike (they
       append)                 match self off dim); P -> P with every tensor P (linear)
  argmax / argmin(self, dim,   S(i) -> S(i') for i != dim (i' shifted when keepdim is false);
       keepdim)                no P (a max of a sum is not a sum of maxima); dim None: B only
References: torch/distributed/tensor/_ops/_tensor_ops.py (roll), _math_ops.py (argmax).
"""

from __future__ import annotations

from collections.abc import Sequence

from autosbp.rules.core import (
    Node,
    OpRule,
    Signature,
    all_broadcast,
    bound_args,
    in_shapes,
    norm_dim,
    uniform,
)
from autosbp.sbp import P, S


def _dims(value: int | Sequence[int] | None, rank: int) -> set[int]:
    if value is None:
        return set()
    values = [value] if isinstance(value, int) else list(value)
    return {norm_dim(d, rank) for d in values}


def roll_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    rank = len(in_shapes(node)[0])
    rolled = _dims(bound_args(node).get("dims"), rank)
    sigs = [all_broadcast(node)]
    if rolled:  # no dims: the flattened tensor rolls as one, every element may move anywhere
        sigs += [uniform(node, S(i)) for i in range(rank) if i not in rolled]
    return [*sigs, uniform(node, P)]


def diff_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    rank = len(in_shapes(node)[0])
    dim = norm_dim(bound_args(node).get("dim", -1), rank)
    splits = [uniform(node, S(i)) for i in range(rank) if i != dim]
    return [all_broadcast(node), *splits, uniform(node, P)]


def arg_extreme_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    rank = len(in_shapes(node)[0])
    args = bound_args(node)
    if args.get("dim") is None:
        return [all_broadcast(node)]  # an index into the flattened tensor: no split is local
    dim, keep = norm_dim(args["dim"], rank), bool(args.get("keepdim", False))
    sigs = [all_broadcast(node)]
    for i in range(rank):
        if i != dim:
            sigs.append(Signature((S(i),), (S(i if keep or i < dim else i - 1),)))
    return sigs


def rules() -> dict[str, OpRule]:
    """This family's rows of the registry."""
    extreme = OpRule(arg_extreme_signatures)
    return {
        "aten.roll.default": OpRule(roll_signatures),
        "aten.diff.default": OpRule(diff_signatures),
        "aten.argmax.default": extreme,
        "aten.argmin.default": extreme,
    }
