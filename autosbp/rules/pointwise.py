"""Elementwise ops with broadcasting: unary activations, binary arithmetic, compares, where, casts.

Lives here: one rule for every op whose output element depends only on the same-position input
elements (after broadcasting), with a table saying in which way, if any, the op is linear (its
P rows). Lives elsewhere: reductions (`reduction`), losses that reduce (`loss`), identity-like
views (`view`).

Rows: output dim i split -> each input split on its aligned dim, or B where it broadcasts (size
1 or missing). Partial rows, one per `Linearity`, each with its algebraic reason:
  LINEAR     f(sum x_r) = sum f(x_r) for f linear (neg, clone, casts between floats, dropout p=0);
             copy_(self, src) and fill_(self, value tensor) are src and value broadcast to
             self's shape: linear in all inputs at once (self's values are unread)
  ADD        (sum x_r) + (sum y_r) = sum (x_r + y_r): all tensor operands P, and no scalar addend
  MUL        (sum x_r) * y = sum (x_r * y): one operand P, the others B (any operand)
  DIV        (sum x_r) / y = sum (x_r / y): the numerator P, the rest B (never the denominator)
  WHERE      where(c, sum x_r, sum y_r) = sum where(c, x_r, y_r): condition B, values P
  FILL_ZERO  masked_fill(sum x_r, m, 0) = sum masked_fill(x_r, m, 0): only for a fill value of 0
Nonlinear ops (relu, gelu, exp, compares, ...) have no P row: f(a + b) != f(a) + f(b).
Device moves (`to.device`, `to.dtype_layout` with a device) are casts: a captured graph runs on
one device (its RUN_DEVICE), so only the dtype changes. In-place ops that capture did not make
functional (`capturing.builder`) write their first input: its SBP is the output's in every row.
References: OneFlow math_binary_broadcast_ops.cpp; torch/distributed/tensor/_ops/_pointwise_ops.py.
"""

from __future__ import annotations

import enum

from autosbp.rules.core import (
    Node,
    OpRule,
    Shape,
    Signature,
    all_broadcast,
    bound_args,
    in_shapes,
    make_signature,
    one_partial,
    out_shapes,
    slot_of,
    tensor_slots,
)
from autosbp.sbp import B, P, S, Sbp, is_split


class Linearity(enum.Enum):
    NONE = "none"
    LINEAR = "linear"
    ADD = "add"
    MUL = "mul"
    DIV = "div"
    WHERE = "where"
    FILL_ZERO = "fill_zero"
    CAST = "cast"  # linear when both dtypes are floating point (an int cast rounds each addend)
    DROPOUT = "dropout"  # linear when p == 0 or not training (otherwise random, S/B only)


def aligned_sbp(shape: Shape, out_shape: Shape, out_dim: int) -> Sbp:
    """The SBP an input of `shape` needs when the broadcast output is split on `out_dim`."""
    dim = out_dim - (len(out_shape) - len(shape))
    if dim < 0 or shape[dim] != out_shape[out_dim]:
        return B  # the input broadcasts along that dim: every device needs all of it
    return S(dim)


def broadcast_split_signatures(node: Node) -> list[Signature]:
    """Split any output dim; inputs follow by broadcasting. At least one input must be split."""
    out_shape = out_shapes(node)[0]
    n_out = len(node.outputs)
    sigs = []
    for dim in range(len(out_shape)):
        ins = tuple(aligned_sbp(shape, out_shape, dim) for shape in in_shapes(node))
        if any(is_split(s) for s in ins):
            sigs.append(Signature(ins, (S(dim),) * n_out))
    return sigs


def _partial_rows(node: Node, linearity: Linearity) -> list[Signature]:
    n_in, n_out = len(node.inputs), len(node.outputs)
    outs = (P,) * n_out
    slots = tensor_slots(node)
    if linearity is Linearity.LINEAR or (linearity is Linearity.MUL and n_in == 1):
        return [Signature((P,) * n_in, outs)]
    if linearity is Linearity.ADD and n_in == 2:
        return [Signature((P, P), outs)]
    if linearity is Linearity.MUL:
        return [Signature(one_partial(n_in, i), outs) for i in range(n_in)]
    numerator = slot_of(node, "self")
    if linearity is Linearity.DIV and numerator is not None:
        return [Signature(one_partial(n_in, numerator), outs)]
    if linearity is Linearity.WHERE and {"self", "other"} <= set(slots):
        return [make_signature(node, {"condition": B, "self": P, "other": P}, outs)]
    if linearity is Linearity.FILL_ZERO and bound_args(node).get("value") == 0:
        return [make_signature(node, {"self": P, "mask": B}, outs)]
    if linearity is Linearity.CAST:
        floats = node.inputs[0].dtype.is_floating_point and node.outputs[0].dtype.is_floating_point
        return [Signature((P,), outs)] if floats else []
    if linearity is Linearity.DROPOUT:
        args = bound_args(node)
        quiet = args.get("p") == 0 or args.get("train") is False
        return [Signature((P,) * n_in, outs)] if quiet else []
    return []


def pointwise_rule(linearity: Linearity) -> OpRule:
    def signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
        return [
            all_broadcast(node),
            *broadcast_split_signatures(node),
            *_partial_rows(node, linearity),
        ]

    return OpRule(signatures)


def aten_names(text: str) -> list[str]:
    """`"relu.default gelu.default"` -> `["aten.relu.default", "aten.gelu.default"]`."""
    return [f"aten.{name}" for name in text.split()]


_L = Linearity
# op -> linearity. Unary ops are the one-input case of the same rule.
POINTWISE: dict[str, Linearity] = {
    # nonlinear activations, math and compares: S rows only
    **dict.fromkeys(
        aten_names(
            """
            relu.default relu_.default gelu.default silu.default silu_.default tanh.default
            sigmoid.default exp.default log.default rsqrt.default sqrt.default cos.default
            sin.default abs.default erf.default reciprocal.default square.default log1p.default
            softplus.default leaky_relu.default hardtanh.default elu.default sign.default
            pow.Tensor_Scalar pow.Tensor_Tensor clamp.default clamp_min.default clamp_max.default
            maximum.default minimum.default logical_not.default logical_and.default
            logical_or.default bitwise_not.default bitwise_and.Tensor bitwise_or.Tensor
            eq.Tensor eq.Scalar ne.Tensor ne.Scalar lt.Tensor lt.Scalar le.Tensor le.Scalar
            gt.Tensor gt.Scalar ge.Tensor ge.Scalar isnan.default rsub.Scalar masked_fill.Tensor
            min.other max.other where.ScalarOther where.ScalarSelf where.Scalar __and__.Tensor
            __or__.Tensor hardswish.default hardswish_.default hardsigmoid.default
            hardsigmoid_.default hardtanh_.default clamp_.default floor_divide.default
            masked_fill_.Tensor fill.Scalar fill_.Scalar remainder.Scalar div.Tensor_mode
            """
        ),
        _L.NONE,
    ),
    # linear in their single input; clone/contiguous/alias/detach/lift_fresh_copy are identities
    **dict.fromkeys(
        aten_names(
            """
            neg.default clone.default contiguous.default alias.default detach.default
            detach_.default lift_fresh_copy.default positive.default copy.default copy_.default
            fill.Tensor fill_.Tensor
            """
        ),
        _L.LINEAR,
    ),
    "aten.to.dtype": _L.CAST,
    "aten.to.dtype_layout": _L.CAST,
    "aten.to.device": _L.CAST,
    "aten._to_copy.default": _L.CAST,
    "aten.dropout.default": _L.DROPOUT,
    "aten.dropout_.default": _L.DROPOUT,
    "aten.native_dropout.default": _L.DROPOUT,
    "aten.add.Tensor": _L.ADD,
    "aten.add_.Tensor": _L.ADD,
    "aten.sub.Tensor": _L.ADD,
    "aten.mul.Tensor": _L.MUL,
    "aten.mul_.Tensor": _L.MUL,
    "aten.div.Tensor": _L.DIV,
    "aten.where.self": _L.WHERE,
    "aten.masked_fill.Scalar": _L.FILL_ZERO,
    "aten.masked_fill_.Scalar": _L.FILL_ZERO,
}


def rules() -> dict[str, OpRule]:
    """This family's rows of the registry (one shared rule object per linearity)."""
    made: dict[Linearity, OpRule] = {}
    return {op: made.setdefault(lin, pointwise_rule(lin)) for op, lin in POINTWISE.items()}
