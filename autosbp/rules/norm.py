"""Normalizations: layer_norm / native_layer_norm / rms_norm, group_norm, batch_norm in its forms.

Lives here: the rules of ops that normalize with statistics computed over some dims. Lives
elsewhere: the pieces of a hand-written RMSNorm (pow, mean, rsqrt, mul: `pointwise`,
`reduction`), which compose from their own rules where capture did not fuse them into one
rms_norm (`capturing.fused_norms`, whose kernel rms_norm runs as).

Rows, for one mesh dim:
  layer / rms norm   leading dim i (i < rank - len(normalized_shape)) split: x S(i), weight and
                     bias B -> S(i) (and mean / rstd S(i)). The normalized dims never split: the
                     statistics need the whole row. No P (nonlinear).
  batch_norm         channel dim 1 split: x S(1), weight, bias, running stats S(0) -> S(1); the
                     statistics are per channel, so each device computes its channels exactly.
                     Training mode uses the statistics of the batch, so the batch (and spatial)
                     dims are NOT split: a local batch would normalize by local statistics. In
                     eval mode (training=False) the op is elementwise given the running stats:
                     batch and spatial splits are added.
  group_norm         batch dim 0 split: x S(0), weight and bias B -> S(0) (statistics per
                     sample and group). Groups of one channel (num_groups = channels, as
                     Wav2Vec2's feature encoder): x S(1), weight, bias S(0) -> S(1), each device
                     normalizing its channels with num_groups = its channel count. Larger
                     groups are not split by channel (a split of two mesh dims could cut one).
                     Spatial dims never split: the statistics need them whole. No P.
BatchNorm semantics under a plan (training): the statistics of each micro-batch as a whole,
across every data-parallel device (SyncBatchNorm's, within a micro-batch): data parallel gathers
the micro-batch or splits channels, never normalizes a device's share by its own statistics.
So a plan with one micro-batch trains exactly like one device; with m micro-batches, like one
device accumulating gradients over the same m pieces (`capturing.batches`: what `--check`'s
reference runs), running statistics updated once per piece, as eager accumulation does. Torch
DDP's per-replica statistics are not offered: they would make the model's arithmetic depend on
the plan's data-parallel degree, which the planner chooses. A micro-batch of one sample cannot
train BatchNorm; capture says so (`MicroBatchError`) and the search skips that count.
References: OneFlow layer_norm_op.cpp; torch/distributed/tensor/_ops/_math_ops.py.
"""

from __future__ import annotations

from autosbp.capturing.graph import kernel_of
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
    out_shapes,
)
from autosbp.sbp import B, S, Sbp, local_shape

LAYER_NORMS = ("aten.layer_norm.default", "aten.native_layer_norm.default", "aten.rms_norm.default")

BATCH_NORMS = (
    "aten.batch_norm.default",
    "aten.native_batch_norm.default",
    "aten._native_batch_norm_legit_functional.default",
    "aten._native_batch_norm_legit_no_training.default",
)
_STATS = ("weight", "bias", "running_mean", "running_var")


def layer_norm_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    rank = len(in_shapes(node)[0])
    leading = rank - len(bound_args(node)["normalized_shape"])
    sigs = [all_broadcast(node)]
    for dim in range(leading):
        by_name: dict[str, Sbp] = {"input": S(dim), "weight": B, "bias": B}
        # native_layer_norm's mean and rstd keep the leading dims (trailing dims become 1)
        sigs.append(make_signature(node, by_name, (S(dim),) * len(node.outputs)))
    return sigs


def batch_norm_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    args = bound_args(node)
    training = args.get("training", False) is not False  # the legit_no_training form has no flag
    rank = len(in_shapes(node)[0])
    sigs = [all_broadcast(node)]
    if rank > 1:
        by_name: dict[str, Sbp] = {"input": S(1), **dict.fromkeys(_STATS, S(0))}
        sigs.append(make_signature(node, by_name, _batch_norm_outputs(node, S(1), S(0))))
    if not training:
        for dim in (d for d in range(rank) if d != 1):
            by_name = {"input": S(dim), **dict.fromkeys(_STATS, B)}
            sigs.append(make_signature(node, by_name, _batch_norm_outputs(node, S(dim), B)))
    return sigs


def _batch_norm_outputs(node: Node, out: Sbp, per_channel: Sbp) -> tuple[Sbp, ...]:
    """The first output is the normalized tensor; the others are per-channel vectors."""
    shapes = out_shapes(node)
    return (out, *(per_channel if len(s) == 1 else B for s in shapes[1:]))


def group_norm_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    shape = in_shapes(node)[0]
    sigs = [all_broadcast(node)]
    if len(shape) < 2:
        return sigs
    sigs.append(make_signature(node, {"input": S(0), "weight": B, "bias": B}, (S(0),)))
    if bound_args(node)["num_groups"] == shape[1]:  # one channel per group
        sigs.append(make_signature(node, {"input": S(1), "weight": S(0), "bias": S(0)}, (S(1),)))
    return sigs


def group_norm_local(node: Node, sig: NdSignature, mesh_shape: Shape, coords: Shape) -> LocalOp:
    """A channel split keeps one channel per group: num_groups = the device's channel count."""
    shape = in_shapes(node)[0]
    channels = local_shape(shape, sig.inputs[0], mesh_shape)[1]
    if channels == shape[1]:
        return default_local_op(node)
    return default_local_op(node, {"num_groups": channels})


def rms_norm_local(node: Node, sig: NdSignature, mesh_shape: Shape, coords: Shape) -> LocalOp:
    """rms_norm runs as the graph runs it (`graph.kernel_of`: torch's op, keeping the fused
    kernel's input, weight and rstd on every device); a row split changes no argument."""
    assert node.target is not None
    return local_op_with(node, kernel_of(node.target), {})


def rules() -> dict[str, OpRule]:
    """This family's rows of the registry."""
    table = dict.fromkeys(LAYER_NORMS, OpRule(layer_norm_signatures))
    table["aten.rms_norm.default"] = OpRule(layer_norm_signatures, rms_norm_local)
    table["aten.group_norm.default"] = OpRule(group_norm_signatures, group_norm_local)
    table.update(dict.fromkeys(BATCH_NORMS, OpRule(batch_norm_signatures)))
    return table
