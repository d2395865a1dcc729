"""Ops that make tensors from sizes or from another tensor's metadata, and bookkeeping ops.

Lives here: arange, eye, zeros / ones / full / empty, the *_like and new_* families, type_as,
scalar_tensor, and
_assert_tensor_metadata (a check with no output). Lives elsewhere: identities such as alias,
detach and lift_fresh_copy (`pointwise`, linear).

Rows, for one mesh dim:
  arange, zeros, ones, full    no tensor input: output B, or S(d) generated locally (each device
                               makes only its block: local sizes; arange's block starts at its
                               offset). Never P.
  eye (n[, m])                 no tensor input: output B, or S(0) / S(1) generated locally (a
                               block of rows or columns of the identity: ones where the global
                               row equals the global column; SigLIP's loss labels its pairs so)
  *_like (self)                output has self's shape and values that do not depend on self:
                               S(i) -> S(i), B -> B, P -> B (a P input still has the full shape)
  new_* (self, size)           self only gives dtype and device: any self SBP -> B, and
                               B -> S(d) generated locally
  _assert_tensor_metadata      any SBP in, nothing out; it runs as a no-op (its size argument,
                               if any, is global)
  type_as (self, other)         a cast of self to other's dtype; other gives its dtype only:
                               self's SBP passes (P only between floats), other any SBP
  empty, new_empty, empty_like as zeros, new_zeros, zeros_like: their values are undefined, so
                               the proof compares shapes and dtypes only (tests/rules)
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
    bound_args,
    default_local_op,
    in_shapes,
    local_out_shape,
    shard_range,
)
from autosbp.sbp import B, P, S, Sbp


def generated_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    """Output B or S(d): the op reads no tensor values (an input, if any, gives dtype/device)."""
    n_in = len(node.inputs)
    out_rank = len(node.outputs[0].shape)
    sigs = [
        Signature((B,) * n_in, (B,)),
        *(Signature((B,) * n_in, (S(d),)) for d in range(out_rank)),
    ]
    if n_in:  # new_*(self, size): whatever self's SBP, a B output is made locally
        in_rank = len(in_shapes(node)[0])
        choices: list[Sbp] = [*(S(i) for i in range(in_rank)), P]
        sigs += [Signature((sbp,), (B,)) for sbp in choices]
    return sigs


def _sized_local(node: Node, sig: NdSignature, mesh_shape: Shape, coords: Shape) -> LocalOp:
    return default_local_op(node, {"size": local_out_shape(node, sig, mesh_shape)})


def _arange_local(node: Node, sig: NdSignature, mesh_shape: Shape, coords: Shape) -> LocalOp:
    length = node.outputs[0].shape[0]
    block = shard_range(length, 0, sig.outputs[0], mesh_shape, coords)
    if len(block) == length:
        return default_local_op(node)
    args = bound_args(node)
    kernel = ArangeBlock(
        args.get("start", 0), args.get("step", 1), block.start, block.stop, node.outputs[0].dtype
    )
    return LocalOp(kernel, (), {"device": args.get("device")}, 1)  # a runtime may move it


@dataclass(frozen=True, slots=True)
class ArangeBlock:
    """Elements [lo, hi) of arange(start, ..., step): start + i * step, computed as torch does."""

    start: Any
    step: Any
    lo: int
    hi: int
    dtype: torch.dtype

    def __call__(self, device: torch.device | str | None = None) -> torch.Tensor:
        exact = torch.int64 if not self.dtype.is_floating_point else torch.float64
        index = torch.arange(self.lo, self.hi, dtype=exact, device=device)
        return (index * self.step + self.start).to(self.dtype)


def _eye_local(node: Node, sig: NdSignature, mesh_shape: Shape, coords: Shape) -> LocalOp:
    rows, columns = node.outputs[0].shape
    row_block = shard_range(rows, 0, sig.outputs[0], mesh_shape, coords)
    column_block = shard_range(columns, 1, sig.outputs[0], mesh_shape, coords)
    if len(row_block) == rows and len(column_block) == columns:
        return default_local_op(node)
    kernel = EyeBlock(row_block.start, row_block.stop, column_block.start, column_block.stop,
                      node.outputs[0].dtype)  # fmt: skip
    return LocalOp(kernel, (), {"device": bound_args(node).get("device")}, 1)


@dataclass(frozen=True, slots=True)
class EyeBlock:
    """Rows [row_lo, row_hi) and columns [column_lo, column_hi) of an identity matrix: one
    where the global row index equals the global column index."""

    row_lo: int
    row_hi: int
    column_lo: int
    column_hi: int
    dtype: torch.dtype

    def __call__(self, device: torch.device | str | None = None) -> torch.Tensor:
        rows = torch.arange(self.row_lo, self.row_hi, device=device)
        columns = torch.arange(self.column_lo, self.column_hi, device=device)
        return (rows[:, None] == columns[None, :]).to(self.dtype)


def like_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    rank = len(in_shapes(node)[0])
    return [
        Signature((B,), (B,)),
        *(Signature((S(i),), (S(i),)) for i in range(rank)),
        Signature((P,), (B,)),
    ]


def type_as_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    self_rank, other_rank = (len(shape) for shape in in_shapes(node))
    floats = node.inputs[0].dtype.is_floating_point and node.outputs[0].dtype.is_floating_point
    others: list[Sbp] = [B, *(S(j) for j in range(other_rank))]
    if node.inputs[1].dtype.is_floating_point:
        others.append(P)
    passes: list[Sbp] = [B, *(S(i) for i in range(self_rank)), *([P] if floats else [])]
    return [Signature((sbp, other), (sbp,)) for sbp in passes for other in others]


def assert_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    rank = len(in_shapes(node)[0])
    return [
        Signature((B,), ()),
        *(Signature((S(i),), ()) for i in range(rank)),
        Signature((P,), ()),
    ]


def _no_op_local(node: Node, sig: NdSignature, mesh_shape: Shape, coords: Shape) -> LocalOp:
    return LocalOp(_nothing, (), {}, 0)


def _nothing() -> None:
    return None


def rules() -> dict[str, OpRule]:
    """This family's rows of the registry."""
    generated = OpRule(generated_signatures, _sized_local)
    arange = OpRule(generated_signatures, _arange_local)
    return {
        "aten.arange.default": arange,
        "aten.arange.start": arange,
        "aten.arange.start_step": arange,
        **dict.fromkeys(
            ("aten.eye.default", "aten.eye.m"), OpRule(generated_signatures, _eye_local)
        ),
        **dict.fromkeys(
            ("aten.zeros.default", "aten.ones.default", "aten.full.default"), generated
        ),
        **dict.fromkeys(
            ("aten.new_zeros.default", "aten.new_ones.default", "aten.new_full.default"), generated
        ),
        **dict.fromkeys(("aten.empty.memory_format", "aten.new_empty.default"), generated),
        "aten.empty_like.default": OpRule(like_signatures),
        "aten.type_as.default": OpRule(type_as_signatures),
        "aten.scalar_tensor.default": OpRule(generated_signatures),
        **dict.fromkeys(
            ("aten.zeros_like.default", "aten.ones_like.default", "aten.full_like.default"),
            OpRule(like_signatures),
        ),
        "aten._assert_tensor_metadata.default": OpRule(assert_signatures, _no_op_local),
    }
