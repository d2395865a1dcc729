"""Losses: cross_entropy_loss, elementwise losses that reduce (mse, l1, smooth_l1, bce), CTC.

Lives here: the rows of losses and their local kernels for a batch split under reduction='mean'.
Lives elsewhere: log_softmax (`reduction`), the loss as the graph's output (`boundary`).

Rows, for one mesh dim (reduction: 0 none, 1 mean, 2 sum):
  cross_entropy (N, C, *d)   split N or a d dim of the logits and the same dim of the target
                             (class indices (N, *d) or probabilities like the logits); class
                             weights B. none -> S; sum -> P. The class dim is never split: the
                             log-sum-exp needs the whole row.
                             mean of probabilities -> P with the local kernel sum(local losses)
                             / global count (weights or not, the mean is over elements).
                             mean of class indices -> the target B (every device holds all of
                             it), P with the local kernel: the shard's summed losses over its
                             part of the target / the weight of every target of the batch that
                             is not ignore_index (its count without weights). That denominator
                             is torch's own (nll_loss, and label smoothing's, divide by it), and
                             each device computes it from the whole target, so ignored targets
                             (HF's -100 padding) are exact under any split with no reduction
                             beyond the loss's P -> B: the target is tiny beside the logits.
  elementwise losses         split any dim of the broadcast shape; inputs follow by broadcasting.
                             none -> S; sum -> P; mean -> P rescaled by local / global count.
  autosbp::ctc_loss           per sample (`capturing.ctc`): log_probs (T, N, C) S(1), targets
       (per sample, padded)  (N, S), input and target lengths (N,) S(0) -> S(0): each sample's
                             alignment sums over its own row alone. T and C stay whole (the
                             forward recursion runs along T, normalised over C).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autosbp.capturing.graph import InputRef
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
    shard_range,
)
from autosbp.rules.pointwise import aligned_sbp
from autosbp.sbp import B, P, S, Sbp, local_shape

NONE, MEAN, SUM = 0, 1, 2


def _reduced_out(reduction: int, split: Sbp) -> Sbp:
    return split if reduction == NONE else P


def cross_entropy_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    args = bound_args(node)
    logits_shape = in_shapes(node)[0]
    if len(logits_shape) < 2:
        return [all_broadcast(node)]
    index_target = not node.inputs[1].dtype.is_floating_point
    sigs = [all_broadcast(node)]
    for dim in (d for d in range(len(logits_shape)) if d != 1):
        out_dim = dim - 1 if dim > 1 else dim  # the loss per element has no class dim
        target_dim = out_dim if index_target else dim  # an index target has none either
        whole_target = index_target and args["reduction"] == MEAN  # see the module header
        target: Sbp = B if whole_target else S(target_dim)
        by_name: dict[str, Sbp] = {"self": S(dim), "target": target, "weight": B}
        out = _reduced_out(args["reduction"], S(out_dim))
        sigs.append(make_signature(node, by_name, (out,)))
    return sigs


def cross_entropy_local(node: Node, sig: NdSignature, mesh_shape: Shape, coords: Shape) -> LocalOp:
    args = bound_args(node)
    logits = in_shapes(node)[0]
    local = local_shape(logits, sig.inputs[0], mesh_shape)
    if args["reduction"] != MEAN or local == logits:
        return default_local_op(node)
    if node.inputs[1].dtype.is_floating_point:  # probabilities: a mean over elements
        fraction = reduced_fraction(logits, local, [d for d in range(len(logits)) if d != 1])
        return default_local_op(node, scale=fraction)
    block = tuple(
        slice(r.start, r.stop)
        for r in (
            shard_range(logits[d], d, sig.inputs[0], mesh_shape, coords)
            for d in range(len(logits))
            if d != 1
        )
    )
    return local_op_with(node, ShardOfMeanCrossEntropy(block), {})


@dataclass(frozen=True, slots=True)
class ShardOfMeanCrossEntropy:
    """cross_entropy_loss(mean) of a shard of the logits against the whole target: the shard's
    part of the sum over the batch, so that the shards' losses sum to the global mean."""

    block: tuple[slice, ...]  # the shard's part of the target

    def __call__(
        self,
        logits: torch.Tensor,
        target: torch.Tensor,
        weight: torch.Tensor | None = None,
        reduction: int = MEAN,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
    ) -> torch.Tensor:
        summed = torch.ops.aten.cross_entropy_loss.default(
            logits, target[self.block], weight, SUM, ignore_index, label_smoothing
        )
        denominator = kept_targets(target, weight, ignore_index)
        return summed / denominator.to(summed.dtype)


def kept_targets(
    target: torch.Tensor, weight: torch.Tensor | None = None, ignore_index: int = -100
) -> torch.Tensor:
    """The denominator of cross_entropy_loss(mean) over class indices: the count of targets
    that are not `ignore_index`, or with class weights the sum of their weights (torch's
    nll_loss divides by it)."""
    valid = target != ignore_index
    if weight is None:
        return valid.sum()
    return torch.where(valid, weight[torch.where(valid, target, 0)], 0).sum()


@dataclass(frozen=True, slots=True)
class MeanOverTargets:
    """A cross_entropy_loss(mean) over class indices: which of its inputs are the target and
    the class weights, and the index it ignores. Its mean divides by the kept targets of its
    own batch: a loss over micro-batches normalises like one device only when each
    micro-batch's share is weighted by its count (`runtime`'s loss weights)."""

    target: int  # input position
    weight: int | None  # input position, or None without class weights
    ignore_index: int


def mean_over_targets(node: Node) -> MeanOverTargets | None:
    """`node` as a `MeanOverTargets`, or None (another op, another reduction, probabilities)."""
    if node.op != "aten.cross_entropy_loss.default":
        return None
    args = bound_args(node)
    if args["reduction"] != MEAN or node.inputs[1].dtype.is_floating_point:
        return None
    positions = {ref.index: name for name, ref in _input_refs(args)}
    by_name = {name: index for index, name in positions.items()}
    return MeanOverTargets(by_name["target"], by_name.get("weight"), int(args["ignore_index"]))


def _input_refs(args: dict) -> list[tuple[str, InputRef]]:
    return [(name, value) for name, value in args.items() if isinstance(value, InputRef)]


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


def ctc_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    by_sample = {"log_probs": S(1), "targets": S(0), "input_lengths": S(0), "target_lengths": S(0)}
    return [all_broadcast(node), make_signature(node, by_sample, (S(0),))]


def rules() -> dict[str, OpRule]:
    """This family's rows of the registry."""
    table = {
        "aten.cross_entropy_loss.default": OpRule(cross_entropy_signatures, cross_entropy_local),
        "autosbp.ctc_loss.default": OpRule(ctc_signatures),
    }
    table.update(
        dict.fromkeys(
            ELEMENTWISE_LOSSES, OpRule(elementwise_loss_signatures, elementwise_loss_local)
        )
    )
    return table
