"""Reductions over dims (sum, mean, amax, amin) and softmax / log_softmax.

Lives here: `REDUCTIONS` (op -> how its reduced dims split and whether P passes through) and
`SOFTMAX` (ops normalizing along one dim). Lives elsewhere: losses that reduce (`loss`), norms
(`norm`), pooling (`conv`).

Rows, for one mesh dim:
  kept dim i split          S(i) -> S(i'), i' = i shifted down by the reduced dims before it
                            when keepdim is false
  reduced dim split (sum)   S(i) -> P: the full sum is the sum of the partial sums
  reduced dim split (mean)  S(i) -> P, local kernel rescaled by local_count / global_count:
                            mean = sum_r local_mean_r * n_r / n
  reduced dim split (amax)  S(i) -> P(max): the max of partial maxima (amin: P(min))
  P -> P                    sum and mean are linear; P(max) -> P(max) for amax (idempotent)
  softmax / log_softmax     S(i) -> S(i) for every i except the softmax dim (it needs the whole
                            row); no P (nonlinear)
  cumsum                    S(i) -> S(i) except along the summed dim (each prefix needs all that
                            comes before it); P -> P (linear)
References: OneFlow reduce_ops.cpp, softmax_op.cpp; torch/distributed/tensor/_ops/_math_ops.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
    norm_dim,
    reduced_fraction,
    uniform,
)
from autosbp.sbp import P, Partial, S, Sbp, local_shape


@dataclass(frozen=True, slots=True)
class Reduction:
    """`partial`: what a split reduced dim gives (None: no such row); `rescale`: a mean."""

    partial: Partial | None
    rescale: bool = False


REDUCTIONS: dict[str, Reduction] = {
    "aten.sum.default": Reduction(P),
    "aten.sum.dim_IntList": Reduction(P),
    "aten.mean.default": Reduction(P, rescale=True),
    "aten.mean.dim": Reduction(P, rescale=True),
    "aten.amax.default": Reduction(Partial("max")),
    "aten.amin.default": Reduction(Partial("min")),
}

SOFTMAX = (
    "aten._softmax.default",
    "aten.softmax.int",
    "aten._log_softmax.default",
    "aten.log_softmax.int",
)


def reduced_dims(node: Node) -> list[int]:
    """The reduced dims of the input, normalized; no dim argument or an empty list means all."""
    rank = len(in_shapes(node)[0])
    dims = bound_args(node).get("dim")
    if dims is None or (isinstance(dims, Sequence) and len(dims) == 0):
        return list(range(rank))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted({norm_dim(d, rank) for d in dims})


def _keepdim(node: Node) -> bool:
    return bool(bound_args(node).get("keepdim", False))


def reduction_signatures(node: Node, reduction: Reduction) -> list[Signature]:
    rank = len(in_shapes(node)[0])
    reduced = reduced_dims(node)
    keep = _keepdim(node)
    sigs = [all_broadcast(node)]
    for dim in range(rank):
        if dim not in reduced:
            out_dim = dim if keep else dim - sum(1 for r in reduced if r < dim)
            sigs.append(Signature((S(dim),), (S(out_dim),)))
        elif reduction.partial is not None:
            sigs.append(Signature((S(dim),), (reduction.partial,)))
    if reduction.partial is not None:
        sigs.append(uniform(node, reduction.partial))
    return sigs


def _mean_local(node: Node, sig: NdSignature, mesh_shape: Shape, coords: Shape) -> LocalOp:
    shape = in_shapes(node)[0]
    fraction = reduced_fraction(
        shape, local_shape(shape, sig.inputs[0], mesh_shape), reduced_dims(node)
    )
    return default_local_op(node, scale=None if fraction == 1 else fraction)


def softmax_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    rank = len(in_shapes(node)[0])
    dim = norm_dim(bound_args(node)["dim"], rank)
    splits: list[Sbp] = [S(i) for i in range(rank) if i != dim]
    return [all_broadcast(node), *(uniform(node, s) for s in splits)]


def cumsum_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    return [*softmax_signatures(node, mesh_dim_size), uniform(node, P)]


def rules() -> dict[str, OpRule]:
    """This family's rows of the registry."""

    def make(reduction: Reduction) -> OpRule:
        def signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
            return reduction_signatures(node, reduction)

        if reduction.rescale:
            return OpRule(signatures, _mean_local)
        return OpRule(signatures)

    table = {op: make(reduction) for op, reduction in REDUCTIONS.items()}
    table.update(dict.fromkeys(SOFTMAX, OpRule(softmax_signatures)))
    table["aten.cumsum.default"] = OpRule(cumsum_signatures)
    return table
