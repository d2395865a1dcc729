"""Op families and forward flop counts of captured ATen ops, by formula.

Lives here: `op_family` (a coarse family per ATen op, for summaries and flop formulas) and
`count_flops` (forward flops of one node from its input/output shapes). Lives elsewhere: the graph
(`graph`), capture (`export`), the SBP rules of each family (`rules`), time from flops
(`costmodel`).

Conventions (one multiply-add = 2 flops, fp32 or not):
  matmul     linear/mm/matmul/bmm: 2 * out_numel * k; addmm/baddbmm: same, k from the 2nd input;
             grouped matmuls of MoE experts (rows [S, k] each times its expert's [k, n]): the same.
             Bias adds are not counted (they are O(out_numel) next to O(out_numel * k)).
  attention  SDPA: 4 * b * h * s_q * s_kv * d (QK^T and PV), NOT halved for `is_causal`: the
             same convention as torch.utils.flop_counter, and what a dense kernel executes.
             What a kernel computes of it (a flash kernel skips causal's masked blocks, the
             sequence-split kernel reads only the keys its rows see) is priced apart, per
             signature and profile: `rules.work_fraction`.
  conv       2 * out_numel * (c_in / groups) * prod(kernel) = 2 * out_numel * prod(w.shape[1:]).
  norm, softmax, loss: a few flops per input element (`_PER_ELEMENT` below, derived by counting
             the passes: e.g. layer norm = mean, variance, subtract, scale, shift).
  reduction  one flop per input element.
  views, data movement (cat, embedding gather, copies), factories: 0 (their cost is bytes).
  elementwise and every op not listed: one flop per output element.
Transcendentals (`count_transcendentals`, priced apart by profiles that measure their rate: a
CPU evaluates exp far slower than a multiply-add): one per element of softmax / log-softmax
inputs, of SDPA's score matrix (b * h * s_q * s_kv), of cross-entropy-style losses' inputs, and
of the outputs of exp, log, tanh, sigmoid, erf, GELU, SiLU and their kin; 0 elsewhere.
Invariants: pure functions of (op name, TensorMeta); never raise on an unknown op.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autosbp.capturing.graph import TensorMeta

# Op family of the op packet name ("aten.linear" for "aten.linear.default").
_FAMILY_OPS: dict[str, tuple[str, ...]] = {
    "matmul": (
        *("linear", "mm", "matmul", "bmm", "addmm", "baddbmm", "addbmm"),
        *("_grouped_mm", "grouped_mm_fallback"),  # MoE experts: each row times its expert's
    ),
    "attention": ("scaled_dot_product_attention",),
    "conv": ("conv1d", "conv2d", "conv3d", "convolution"),
    "norm": (
        "layer_norm",
        "native_layer_norm",
        "batch_norm",
        "group_norm",
        "rms_norm",
        "native_batch_norm",
        "_native_batch_norm_legit_functional",
        "instance_norm",
    ),
    "softmax": ("softmax", "log_softmax", "_softmax", "_log_softmax"),
    "loss": (
        "cross_entropy_loss",
        "nll_loss",
        "nll_loss_nd",
        "mse_loss",
        "l1_loss",
        "binary_cross_entropy_with_logits",
        "binary_cross_entropy",
        "smooth_l1_loss",
        "ctc_loss",  # autosbp::ctc_loss: a T x (2S + 1) lattice, about log_probs' T x C
    ),
    "embedding": ("embedding", "index_select", "gather", "index"),
    "reduction": (
        "sum",
        "mean",
        "amax",
        "amin",
        "max",
        "min",
        "prod",
        "var",
        "std",
        "norm",
        "argmax",
        "logsumexp",
    ),
    "view": (
        "view",
        "_unsafe_view",
        "reshape",
        "transpose",
        "permute",
        "t",
        "expand",
        "unsqueeze",
        "squeeze",
        "split",
        "split_with_sizes",
        "chunk",
        "slice",
        "select",
        "flatten",
        "unflatten",
        "narrow",
        "alias",
        "detach",
        "detach_",
        "unbind",
        "contiguous",
        "as_strided",
        "view_as",
        "expand_as",
        "movedim",
    ),
    "copy": (
        "cat",
        "stack",
        "clone",
        "copy",
        "copy_",
        "to",
        "_to_copy",
        "lift_fresh_copy",
        "pad",
        "constant_pad_nd",
        "repeat",
        "index_put",
        "scatter",
        "tril",
        "triu",
    ),
    "factory": (
        "arange",
        "zeros",
        "ones",
        "full",
        "empty",
        "zeros_like",
        "ones_like",
        "full_like",
        "empty_like",
        "scalar_tensor",
    ),
    "pool": ("max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "max_pool2d_with_indices"),
    "dropout": ("dropout", "native_dropout", "bernoulli"),
}
_FAMILY: dict[str, str] = {op: fam for fam, ops in _FAMILY_OPS.items() for op in ops}

# Flops per input element, counted as passes over the tensor (derived, not measured).
_PER_ELEMENT: dict[str, float] = {
    "norm": 5.0,  # mean, variance, subtract, scale, shift
    "softmax": 5.0,  # max, subtract, exp, sum, divide
    "loss": 6.0,  # log-softmax (5) + gather/mean (1); MSE/BCE-style losses are bounded by it
    "reduction": 1.0,
    "pool": 1.0,
    "dropout": 2.0,  # draw, multiply
}
_ZERO_FLOP_FAMILIES = frozenset({"view", "copy", "factory", "embedding"})


def op_packet(op: str) -> str:
    """ "aten.linear.default" -> "linear" (the name without namespace and overload)."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 else op


def op_family(op: str) -> str:
    """The family of an ATen op name ("aten.add_.Tensor" as "add"); "elementwise" if not listed."""
    packet = op_packet(op)
    return _FAMILY.get(packet) or _FAMILY.get(packet.rstrip("_")) or "elementwise"


def count_flops(op: str, inputs: Sequence[TensorMeta], outputs: Sequence[TensorMeta]) -> float:
    """Forward flops of one call of `op` (conventions in the module header)."""
    family = op_family(op)
    if family in _ZERO_FLOP_FAMILIES or not outputs:
        return 0.0
    out_numel = outputs[0].numel
    if family == "matmul":
        return 2.0 * out_numel * _contracted_size(op_packet(op), inputs)
    if family == "attention":
        return _sdpa_flops(inputs)
    if family == "conv":
        return 2.0 * out_numel * math.prod(inputs[1].shape[1:])
    if family in _PER_ELEMENT:
        return _PER_ELEMENT[family] * (inputs[0].numel if inputs else out_numel)
    return float(sum(t.numel for t in outputs))


# Elementwise ops that evaluate one exp, log, erf or tanh (or the like) per output element.
_TRANSCENDENTAL_OPS = frozenset(
    {
        "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "tanh", "sigmoid", "erf",
        "erfc", "erfinv", "gelu", "silu", "mish", "softplus", "elu", "selu", "celu", "logit",
        "sin", "cos", "tan", "atan",
    }
)  # fmt: skip
_TRANSCENDENTAL_LOSSES = frozenset(
    {"cross_entropy_loss", "binary_cross_entropy_with_logits", "binary_cross_entropy"}
)


def count_transcendentals(
    op: str, inputs: Sequence[TensorMeta], outputs: Sequence[TensorMeta]
) -> float:
    """Transcendental evaluations (exp, log, erf, tanh, ...) of one forward call of `op`."""
    if not outputs:
        return 0.0
    packet, family = op_packet(op), op_family(op)
    if family == "softmax" or packet in _TRANSCENDENTAL_LOSSES:
        return float(inputs[0].numel if inputs else outputs[0].numel)
    if family == "attention":
        q, k = inputs[0].shape, inputs[1].shape
        return float(math.prod(q[:-1]) * k[-2])  # one exp per score
    if packet.rstrip("_") in _TRANSCENDENTAL_OPS:
        return float(outputs[0].numel)
    return 0.0


def _contracted_size(packet: str, inputs: Sequence[TensorMeta]) -> int:
    """k of an (m, k) x (k, n) product; the first matrix is input 1 for addmm/baddbmm/addbmm."""
    first = inputs[1] if packet in ("addmm", "baddbmm", "addbmm") else inputs[0]
    return first.shape[-1] if first.shape else 1


def _sdpa_flops(inputs: Sequence[TensorMeta]) -> float:
    q, k, v = inputs[0].shape, inputs[1].shape, inputs[2].shape
    batch_heads = math.prod(q[:-2])
    return 2.0 * batch_heads * q[-2] * k[-2] * (q[-1] + v[-1])
