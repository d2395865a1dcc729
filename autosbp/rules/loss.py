"""Losses: cross_entropy_loss, and elementwise losses that reduce (mse, l1, smooth_l1, bce).

Lives here: the rows of losses and their local kernels for a batch split under reduction='mean'.
Lives elsewhere: log_softmax (`reduction`), the loss as the graph's output (`boundary`).

Rows, for one mesh dim (reduction: 0 none, 1 mean, 2 sum):
  cross_entropy (N, C, *d)   split N or a d dim of the logits and the same dim of the target
                             (class indices (N, *d) or probabilities like the logits); class
                             weights B. none -> S; sum -> P; mean -> P with the local kernel
                             sum(local losses) / global count. The class dim is never split: the
                             log-sum-exp needs the whole row.
  elementwise losses         split any dim of the broadcast shape; inputs follow by broadcasting.
                             none -> S; sum -> P; mean -> P rescaled by local / global count.
  Mean with class weights (cross_entropy) has no split row: its denominator is the sum of the
  weights of the targets, which depends on the data.
Ignored targets: the batch-split mean divides by the global count of targets, which is the count
of non-ignored targets only when no target equals ignore_index; the local kernel asserts that
(torch._assert_async, no host sync on GPU) rather than silently returning a wrong loss.
"""

from __future__ import annotations

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
    bound_args,
    default_local_op,
    in_shapes,
    local_op_with,
    make_signature,
    reduced_fraction,
)
from autosbp.rules.pointwise import aligned_sbp
from autosbp.sbp import B, P, S, Sbp, local_shape

NONE, MEAN, SUM = 0, 1, 2


def _reduced_out(reduction: int, split: Sbp) -> Sbp:
    return split if reduction == NONE else P


def cross_entropy_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    args = bound_args(node)
    logits_shape = in_shapes(node)[0]
    if len(logits_shape) < 2 or (args["reduction"] == MEAN and args["weight"] is not None):
        return [all_broadcast(node)]
    index_target = not node["inputs"][1].dtype.is_floating_point
    sigs = [all_broadcast(node)]
    for dim in (d for d in range(len(logits_shape)) if d != 1):
        out_dim = dim - 1 if dim > 1 else dim  # the loss per element has no class dim
        target_dim = out_dim if index_target else dim  # an index target has none either
        by_name: dict[str, Sbp] = {"self": S(dim), "target": S(target_dim), "weight": B}
        out = _reduced_out(args["reduction"], S(out_dim))
        sigs.append(make_signature(node, by_name, (out,)))
    return sigs


def cross_entropy_local(node: Node, sig: NdSignature, mesh_shape: Shape, coords: Shape) -> LocalOp:
    args = bound_args(node)
    target = in_shapes(node)[1]
    fraction = reduced_fraction(
        target, local_shape(target, sig.inputs[1], mesh_shape), range(len(target))
    )
    if args["reduction"] != MEAN or fraction == 1:
        return default_local_op(node)
    index_target = not node["inputs"][1].dtype.is_floating_point
    kernel = BatchShardCrossEntropy(fraction, args["ignore_index"] if index_target else None)
    return local_op_with(node, kernel, {})


@dataclass(frozen=True, slots=True)
class BatchShardCrossEntropy:
    """cross_entropy_loss(mean) of a shard, scaled so that the shards sum to the global mean."""

    fraction: float
    ignore_index: int | None

    def __call__(
        self, logits: torch.Tensor, target: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        if self.ignore_index is not None:
            torch._assert_async(
                (target != self.ignore_index).all(),
                f"cross_entropy_loss: a target equals ignore_index={self.ignore_index}, but this "
                "plan splits the batch under reduction='mean', whose local kernel divides by the "
                "global target count; use targets without ignored entries, reduction='sum', or "
                "a plan that keeps the loss input B.",
            )
        loss = torch.ops.aten.cross_entropy_loss.default(logits, target, *args, **kwargs)
        return loss * self.fraction


def elementwise_loss_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    shapes = in_shapes(node)
    full = tuple(torch.broadcast_shapes(*shapes))
    reduction = bound_args(node)["reduction"]
    sigs = [all_broadcast(node)]
    for dim in range(len(full)):
        ins = tuple(aligned_sbp(shape, full, dim) for shape in shapes)
        sigs.append(Signature(ins, (_reduced_out(reduction, S(dim)),)))
    return sigs


def elementwise_loss_local(
    node: Node, sig: NdSignature, mesh_shape: Shape, coords: Shape
) -> LocalOp:
    if bound_args(node)["reduction"] != MEAN:
        return default_local_op(node)
    shapes = in_shapes(node)
    full = tuple(torch.broadcast_shapes(*shapes))
    local_full = tuple(
        torch.broadcast_shapes(
            *(local_shape(s, nd, mesh_shape) for s, nd in zip(shapes, sig.inputs, strict=True))
        )
    )
    fraction = reduced_fraction(full, local_full, range(len(full)))
    return default_local_op(node, scale=None if fraction == 1 else fraction)


ELEMENTWISE_LOSSES = (
    "aten.mse_loss.default",
    "aten.l1_loss.default",
    "aten.smooth_l1_loss.default",
    "aten.huber_loss.default",
    "aten.binary_cross_entropy.default",
    "aten.binary_cross_entropy_with_logits.default",
)


def rules() -> dict[str, OpRule]:
    """This family's rows of the registry."""
    table = {
        "aten.cross_entropy_loss.default": OpRule(cross_entropy_signatures, cross_entropy_local)
    }
    table.update(
        dict.fromkeys(
            ELEMENTWISE_LOSSES, OpRule(elementwise_loss_signatures, elementwise_loss_local)
        )
    )
    return table
