"""Shared by the rule tests: the table of op cases, and the DTensor peer-oracle worker.

Lives here: `CASES`, one row per (op, case) covering every registered op: an ATen overload, a
function drawing its global arguments (shapes divisible by 4, so most splits survive the filter
on meshes of 2, 4 and 2x2), the 1D signatures on a mesh dim of 2 that must be listed (`expect`: a
rule cannot silently shrink to all-B) and those that must not (`forbid`: the restrictions of
docs/architecture.md, "Contracts": rules); and `dtensor_worker`, run on 2 gloo processes by tests/rules/test_rules_dtensor.py (it
must be importable at module level because workers are spawned).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import autosbp.capturing.ctc  # noqa: F401  (registers autosbp::ctc_loss)
from autosbp.capturing.graph import OpNode
from autosbp.rules import NdSignature, signatures_1d
from autosbp.rules.core import as_tuple, resolve_refs
from autosbp.rules.oracle import node_from_call, run_global, shard_inputs
from autosbp.sbp import Broadcast, Partial, Sbp, Split

aten = torch.ops.aten
F64 = torch.float64


@dataclass(frozen=True)
class Case:
    id: str
    target: Any
    make_args: Callable[[], tuple[Any, ...]]
    kwargs: dict[str, Any] | None = None
    expect: tuple[str, ...] = ()
    forbid: tuple[str, ...] = ()


def f(*shape: int) -> torch.Tensor:
    return torch.randn(shape, dtype=F64)


def pos(*shape: int) -> torch.Tensor:
    return torch.rand(*shape, dtype=F64) + 0.5


def ints(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape)


def mask(*shape: int) -> torch.Tensor:
    return torch.rand(*shape) > 0.5


def ctc_args() -> tuple[Any, ...]:
    """CTC per sample: log-probabilities (T 12, N 4, C 6), targets padded to 5 (-100 beyond each
    row's length, as Wav2Vec2's labels), uneven input and target lengths, blank 0."""
    log_probs = f(12, 4, 6).log_softmax(-1)
    target_lengths = torch.tensor([5, 3, 4, 1])
    targets = ints(5, 4, 5) + 1
    targets[torch.arange(5) >= target_lengths[:, None]] = -100
    return log_probs, targets, torch.tensor([12, 10, 12, 7]), target_lengths, 0, False


def ignored(target: torch.Tensor) -> torch.Tensor:
    """`target` with its first half and every fourth entry set to -100 (torch's and HF's
    ignore_index): on 2 devices of a batch split, device 0 holds no target that counts."""
    out = target.clone()
    out[: len(out) // 2] = -100
    out.view(-1)[::4] = -100
    return out


def words(text: str) -> list[str]:
    return text.split()


C = Case


class LibraryOp:
    """An op a library registers when imported, imported on first use (transformers takes
    seconds): `str` is its name at once, a call or an attribute read (`_schema`) imports it."""

    def __init__(self, name: str, module: str) -> None:
        self.name, self.module = name, module

    def __str__(self) -> str:
        return self.name

    def op(self) -> Any:
        importlib.import_module(self.module)
        namespace, packet, overload = self.name.split(".")
        return getattr(getattr(getattr(torch.ops, namespace), packet), overload)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.op()(*args, **kwargs)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.op(), attr)


GROUPED_MM_FALLBACK = LibraryOp(
    "transformers.grouped_mm_fallback.default", "transformers.integrations.moe"
)


def expert_ends(counts: list[int]) -> torch.Tensor:
    """`offs` of a grouped matmul: where each expert's rows end (int32, as transformers makes)."""
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def row_permutations(rows: int, cols: int) -> torch.Tensor:
    """Each row a permutation of 0..cols-1: scatter indices without duplicates."""
    return torch.stack([torch.randperm(cols) for _ in range(rows)])


SDPA = aten.scaled_dot_product_attention.default
CE = aten.cross_entropy_loss.default


def qkv(heads_kv: int = 4) -> tuple[torch.Tensor, ...]:
    return f(4, 4, 8, 8), f(4, heads_kv, 8, 8), f(4, heads_kv, 8, 8)


def bn(*tail: Any) -> tuple[Any, ...]:
    return (f(4, 8, 4, 4), f(8), f(8), f(8), pos(8), *tail)


# The table reads best one row per case, so the formatter is off for it.
# fmt: off
_UNARY = {
    **dict.fromkeys(words("relu relu_ gelu silu silu_ tanh sigmoid exp cos sin abs erf square "
                          "softplus leaky_relu hardtanh elu sign neg clone contiguous alias "
                          "detach detach_ lift_fresh_copy positive isnan hardswish hardswish_ "
                          "hardsigmoid hardsigmoid_ hardtanh_"), lambda: f(4, 8)),
    **dict.fromkeys(words("log rsqrt sqrt reciprocal log1p"), lambda: pos(4, 8)),
    "logical_not": lambda: mask(4, 8),
    "bitwise_not": lambda: ints(8, 4, 8),
}

MATMUL = [
    C("linear-bias", aten.linear.default, lambda: (f(4, 8), f(12, 8), f(12)),
      expect=("(S(0), B, B -> S(0))", "(B, S(0), S(0) -> S(1))", "(S(1), S(1), P -> P)", "(P, B, P -> P)")),
    C("linear-3d", aten.linear.default, lambda: (f(4, 8, 8), f(12, 8)),
      expect=("(S(1), B -> S(1))", "(S(2), S(1) -> P)", "(B, S(0) -> S(2))")),
    C("mm", aten.mm.default, lambda: (f(4, 8), f(8, 12)),
      expect=("(S(0), B -> S(0))", "(B, S(1) -> S(1))", "(S(1), S(0) -> P)")),
    C("bmm", aten.bmm.default, lambda: (f(4, 4, 8), f(4, 8, 12)),
      expect=("(S(0), S(0) -> S(0))", "(S(2), S(1) -> P)")),
    C("matmul-nd-2d", aten.matmul.default, lambda: (f(4, 4, 8), f(8, 12))),
    C("matmul-broadcast", aten.matmul.default, lambda: (f(4, 1, 4, 8), f(4, 8, 12)), expect=("(B, S(0) -> S(1))",)),
    C("matmul-vector", aten.matmul.default, lambda: (f(8), f(4, 8, 12))),
    C("addmm", aten.addmm.default, lambda: (f(12), f(4, 8), f(8, 12)),
      expect=("(P, S(1), S(0) -> P)", "(S(0), B, S(1) -> S(1))")),
    C("baddbmm", aten.baddbmm.default, lambda: (f(4, 4, 12), f(4, 4, 8), f(4, 8, 12))),
    C("sdpa-causal", SDPA, qkv, {"is_causal": True},
      expect=("(S(0), S(0), S(0) -> S(0))", "(S(1), S(1), S(1) -> S(1))", "(B, B, P -> P)"),
      forbid=("(S(2), B, B -> S(2))",)),
    C("sdpa-mask", SDPA, lambda: (*qkv(), f(8, 8)), expect=("(S(2), B, B, S(0) -> S(2))",)),
    C("sdpa-gqa", SDPA, lambda: qkv(heads_kv=2), {"enable_gqa": True}, expect=("(S(1), S(1), S(1) -> S(1))",)),
]

POINTWISE = [
    *(C(name, getattr(aten, name).default, lambda m=make: (m(),)) for name, make in _UNARY.items()),
    C("neg-linear", aten.neg.default, lambda: (f(4, 8),), expect=("(P -> P)",)),
    C("gelu-tanh", aten.gelu.default, lambda: (f(4, 8),), {"approximate": "tanh"}, forbid=("(P -> P)",)),
    C("pow-scalar", aten.pow.Tensor_Scalar, lambda: (f(4, 8), 2)),
    C("pow-tensor", aten.pow.Tensor_Tensor, lambda: (pos(4, 8), f(8))),
    C("clamp", aten.clamp.default, lambda: (f(4, 8), -0.5, 0.5)),
    C("clamp_min", aten.clamp_min.default, lambda: (f(4, 8), 0.0)),
    C("clamp_max", aten.clamp_max.default, lambda: (f(4, 8), 0.0)),
    C("maximum", aten.maximum.default, lambda: (f(4, 8), f(8))),
    C("minimum", aten.minimum.default, lambda: (f(4, 8), f(4, 1))),
    C("logical_and", aten.logical_and.default, lambda: (mask(4, 8), mask(8))),
    C("logical_or", aten.logical_or.default, lambda: (mask(4, 8), mask(8))),
    C("bitwise_and", aten.bitwise_and.Tensor, lambda: (ints(8, 4, 8), ints(8, 8))),
    C("bitwise_or", aten.bitwise_or.Tensor, lambda: (ints(8, 4, 8), ints(8, 8))),
    C("rsub", aten.rsub.Scalar, lambda: (f(4, 8), 1.0), forbid=("(P -> P)",)),
    C("add-broadcast", aten.add.Tensor, lambda: (f(4, 8), f(8)),
      expect=("(S(1), S(0) -> S(1))", "(S(0), B -> S(0))", "(P, P -> P)")),
    C("add-alpha", aten.add.Tensor, lambda: (f(4, 8), f(4, 8)), {"alpha": 2}),
    C("add-scalar", aten.add.Tensor, lambda: (f(4, 8), 3.0), forbid=("(P -> P)",)),
    C("add_-inplace", aten.add_.Tensor, lambda: (f(4, 8), f(4, 8))),
    C("sub", aten.sub.Tensor, lambda: (f(4, 8), f(4, 1)), expect=("(P, P -> P)",)),
    C("mul-broadcast", aten.mul.Tensor, lambda: (f(4, 8), f(8)), expect=("(P, B -> P)", "(B, P -> P)"),
      forbid=("(P, P -> P)",)),
    C("mul-scalar", aten.mul.Tensor, lambda: (f(4, 8), 3.0), expect=("(P -> P)",)),
    C("mul_-inplace", aten.mul_.Tensor, lambda: (f(4, 8), f(4, 8))),
    C("div", aten.div.Tensor, lambda: (f(4, 8), pos(8)), expect=("(P, B -> P)",), forbid=("(B, P -> P)",)),
    C("div-scalar", aten.div.Tensor, lambda: (f(4, 8), 4.0), expect=("(P -> P)",)),
    C("where", aten.where.self, lambda: (mask(4, 8), f(4, 8), f(8)), expect=("(B, P, P -> P)",)),
    C("masked_fill-zero", aten.masked_fill.Scalar, lambda: (f(4, 8), mask(8), 0.0), expect=("(P, B -> P)",)),
    C("masked_fill-inf", aten.masked_fill.Scalar, lambda: (f(4, 8), mask(8), -1e9), forbid=("(P, B -> P)",)),
    C("masked_fill-tensor", aten.masked_fill.Tensor, lambda: (f(4, 8), mask(8), torch.tensor(1.0, dtype=F64))),
    C("to-float32", aten.to.dtype, lambda: (f(4, 8), torch.float32), expect=("(P -> P)",)),
    C("to-int", aten.to.dtype, lambda: (f(4, 8), torch.int64), forbid=("(P -> P)",)),
    C("_to_copy", aten._to_copy.default, lambda: (f(4, 8),), {"dtype": torch.float32}),
    C("dropout-p0", aten.dropout.default, lambda: (f(4, 8), 0.0, True), expect=("(P -> P)",)),
    C("native_dropout-eval", aten.native_dropout.default, lambda: (f(4, 8), 0.5, False)),
    C("dropout_-p0", aten.dropout_.default, lambda: (f(4, 8), 0.0, True), expect=("(P -> P)",)),
    C("clamp_", aten.clamp_.default, lambda: (f(4, 8), -0.5, 0.5), forbid=("(P -> P)",)),
    C("min-other", aten.min.other, lambda: (f(4, 8), f(8)), forbid=("(P, P -> P)",)),
    C("max-other", aten.max.other, lambda: (f(4, 1), f(4, 8))),
    C("where-scalar-other", aten.where.ScalarOther, lambda: (mask(4, 8), f(4, 8), 0.5),
      expect=("(S(1), S(1) -> S(1))",), forbid=("(B, P -> P)",)),
    C("where-scalar-self", aten.where.ScalarSelf, lambda: (mask(4, 8), 0.5, f(8))),
    C("where-scalars", aten.where.Scalar, lambda: (mask(4, 8), 1.0, 0.0), expect=("(S(0) -> S(0))",)),
    C("__and__", aten.__and__.Tensor, lambda: (mask(4, 8), mask(8)), expect=("(S(1), S(0) -> S(1))",)),
    C("__or__", aten.__or__.Tensor, lambda: (ints(8, 4, 8), ints(8, 4, 1))),
    C("floor_divide", aten.floor_divide.default, lambda: (ints(16, 4, 8), ints(4, 4, 8) + 1)),
    C("div-floor", aten.div.Tensor_mode, lambda: (f(4, 8) * 9, 2.0), {"rounding_mode": "floor"},
      expect=("(S(1) -> S(1))",), forbid=("(P -> P)",)),
    C("remainder-scalar", aten.remainder.Scalar, lambda: (f(4, 8), 0.75)),
    C("fill-scalar", aten.fill.Scalar, lambda: (f(4, 8), 2.0), forbid=("(P -> P)",)),
    C("fill_-scalar", aten.fill_.Scalar, lambda: (f(4, 8), 2.0)),
    C("fill-tensor", aten.fill.Tensor, lambda: (f(4, 8), f()), expect=("(P, P -> P)", "(S(0), B -> S(0))")),
    C("fill_-tensor", aten.fill_.Tensor, lambda: (f(4, 8), f())),
    C("copy", aten.copy.default, lambda: (f(4, 8), f(8)), expect=("(P, P -> P)", "(S(1), S(0) -> S(1))")),
    C("copy_-cast", aten.copy_.default, lambda: (f(4, 8), ints(8, 4, 8)), forbid=("(P, P -> P)",)),
    C("masked_fill_-zero", aten.masked_fill_.Scalar, lambda: (f(4, 8), mask(8), 0.0), expect=("(P, B -> P)",)),
    C("masked_fill_-tensor", aten.masked_fill_.Tensor, lambda: (f(4, 8), mask(4, 8), f())),
    C("to-dtype_layout", aten.to.dtype_layout, lambda: (f(4, 8),),
      {"dtype": torch.float32, "layout": torch.strided, "device": torch.device("cpu")}, expect=("(P -> P)",)),
    C("to-device", aten.to.device, lambda: (f(4, 8), torch.device("cpu"), torch.float32), expect=("(P -> P)",)),
    C("to-device-int", aten.to.device, lambda: (f(4, 8), torch.device("cpu"), torch.int64), forbid=("(P -> P)",)),
    *(C(f"{cmp}-tensor", getattr(aten, cmp).Tensor, lambda: (f(4, 1), f(8))) for cmp in words("eq ne lt le gt ge")),
    *(C(f"{cmp}-scalar", getattr(aten, cmp).Scalar, lambda: (f(4, 8), 0.0)) for cmp in words("eq ne lt le gt ge")),
]

REDUCTION_AND_NORM = [
    C("sum-all", aten.sum.default, lambda: (f(4, 8),), expect=("(S(0) -> P)", "(P -> P)")),
    C("sum-dim", aten.sum.dim_IntList, lambda: (f(4, 8, 4), [1]), expect=("(S(1) -> P)", "(S(2) -> S(1))")),
    C("sum-keepdim", aten.sum.dim_IntList, lambda: (f(4, 8, 4), [-1], True)),
    C("mean-all", aten.mean.default, lambda: (f(4, 8),)),
    C("mean-dim", aten.mean.dim, lambda: (f(4, 8, 4), [-1], True), expect=("(S(2) -> P)", "(S(1) -> S(1))")),
    C("mean-dims", aten.mean.dim, lambda: (f(4, 8, 4, 4), [2, 3])),
    C("amax", aten.amax.default, lambda: (f(4, 8), [1]), expect=("(S(1) -> P(max))",)),
    C("amin", aten.amin.default, lambda: (f(4, 8),)),
    C("_softmax", aten._softmax.default, lambda: (f(4, 8, 4), -1, False), expect=("(S(0) -> S(0))",),
      forbid=("(S(2) -> S(2))", "(P -> P)")),
    C("softmax-int", aten.softmax.int, lambda: (f(4, 8, 4), 1)),
    C("_log_softmax", aten._log_softmax.default, lambda: (f(4, 8), 1, False)),
    C("log_softmax-int", aten.log_softmax.int, lambda: (f(4, 8), 0)),
    C("cumsum", aten.cumsum.default, lambda: (f(4, 8), 1), expect=("(S(0) -> S(0))", "(P -> P)"),
      forbid=("(S(1) -> S(1))",)),
    C("layer_norm", aten.layer_norm.default, lambda: (f(4, 4, 8), [8], f(8), f(8), 1e-5),
      expect=("(S(0), B, B -> S(0))", "(S(1), B, B -> S(1))"), forbid=("(S(2), B, B -> S(2))",)),
    C("layer_norm-2dims", aten.layer_norm.default, lambda: (f(4, 4, 8), [4, 8])),
    C("group_norm-per-channel", aten.group_norm.default, lambda: (f(4, 8, 6), 8, f(8), f(8), 1e-5),
      expect=("(S(0), B, B -> S(0))", "(S(1), S(0), S(0) -> S(1))"), forbid=("(S(2), B, B -> S(2))",)),
    C("group_norm-groups-of-4", aten.group_norm.default, lambda: (f(4, 8, 6), 2, f(8), f(8), 1e-5),
      expect=("(S(0), B, B -> S(0))",), forbid=("(S(1), S(0), S(0) -> S(1))",)),
    C("native_layer_norm", aten.native_layer_norm.default, lambda: (f(4, 4, 8), [8], f(8), f(8), 1e-5)),
    C("rms_norm", aten.rms_norm.default, lambda: (f(4, 4, 8), [8], f(8), 1e-6),
      expect=("(S(0), B -> S(0))", "(S(1), B -> S(1))"), forbid=("(S(2), B -> S(2))",)),
    C("rms_norm-no-weight", aten.rms_norm.default, lambda: (f(4, 4, 8), [8], None, 1e-6),
      expect=("(S(0) -> S(0))", "(S(1) -> S(1))"), forbid=("(S(2) -> S(2))",)),
    C("rms_norm-2dims", aten.rms_norm.default, lambda: (f(4, 4, 8), [4, 8], f(4, 8), None),
      expect=("(S(0), B -> S(0))",), forbid=("(S(1), B -> S(1))",)),
    C("batch_norm-train", aten.batch_norm.default, lambda: bn(True, 0.1, 1e-5, False),
      expect=("(S(1), S(0), S(0), S(0), S(0) -> S(1))",), forbid=("(S(0), B, B, B, B -> S(0))",)),
    C("batch_norm-eval", aten.batch_norm.default, lambda: bn(False, 0.1, 1e-5, False),
      expect=("(S(0), B, B, B, B -> S(0))",)),
    C("native_batch_norm", aten.native_batch_norm.default, lambda: bn(True, 0.1, 1e-5)),
    C("bn_legit_functional", aten._native_batch_norm_legit_functional.default, lambda: bn(True, 0.1, 1e-5)),
    C("bn_legit_no_training", aten._native_batch_norm_legit_no_training.default, lambda: bn(0.1, 1e-5)),
    C("embedding", aten.embedding.default, lambda: (f(16, 8), ints(16, 4, 8)),
      expect=("(B, S(0) -> S(0))", "(B, S(1) -> S(1))", "(S(0), B -> P)", "(S(1), B -> S(2))")),
    C("embedding-padding", aten.embedding.default, lambda: (f(16, 8), ints(16, 4, 8), 5)),
    C("embedding-freq", aten.embedding.default, lambda: (f(16, 8), ints(16, 8), -1, True),
      forbid=("(B, S(0) -> S(0))", "(S(0), B -> P)")),
]

SHAPE = [
    C("view-split-heads", aten.view.default, lambda: (f(4, 8, 16), [4, 8, 4, 4]),
      expect=("(S(0) -> S(0))", "(S(1) -> S(1))", "(S(2) -> S(2))")),
    C("view-merge", aten.view.default, lambda: (f(4, 8, 16), [-1, 16]), expect=("(S(0) -> S(0))",),
      forbid=("(S(1) -> S(0))",)),
    C("view-regroup", aten.view.default, lambda: (f(4, 6), [2, 12])),
    C("reshape", aten.reshape.default, lambda: (f(4, 4, 8), [4, 32])),
    C("_unsafe_view", aten._unsafe_view.default, lambda: (f(16, 8), [4, 4, 8])),
    C("flatten", aten.flatten.using_ints, lambda: (f(4, 4, 2, 2), 1)),
    C("unflatten", aten.unflatten.int, lambda: (f(4, 16), 1, [4, 4])),
    C("unsqueeze", aten.unsqueeze.default, lambda: (f(4, 8), 1)),
    C("squeeze-dim", aten.squeeze.dim, lambda: (f(4, 1, 8), 1)),
    C("squeeze-noop", aten.squeeze.dim, lambda: (f(4, 8), 0)),
    C("squeeze-dims", aten.squeeze.dims, lambda: (f(4, 1, 8, 1), [1, 3])),
    C("squeeze-all", aten.squeeze.default, lambda: (f(4, 1, 4),)),
    C("transpose", aten.transpose.int, lambda: (f(4, 8, 16), 1, 2), expect=("(S(2) -> S(1))", "(P -> P)")),
    C("permute", aten.permute.default, lambda: (f(4, 8, 16), [2, 0, 1])),
    C("t", aten.t.default, lambda: (f(4, 8),)),
    C("numpy_T", aten.numpy_T.default, lambda: (f(4, 8, 4, 2),), expect=("(S(1) -> S(2))",)),
    C("expand-size1", aten.expand.default, lambda: (f(1, 8), [4, 8]), expect=("(B -> S(0))",)),
    C("expand-new-dims", aten.expand.default, lambda: (f(8), [4, 4, -1])),
    C("slice", aten.slice.Tensor, lambda: (f(4, 8), 1, 2, 6), forbid=("(S(1) -> S(1))",)),
    C("slice-whole", aten.slice.Tensor, lambda: (f(4, 8), 0, 0, 2**63 - 1), expect=("(S(0) -> S(0))",)),
    C("select", aten.select.int, lambda: (f(4, 8, 4), 1, 2), expect=("(S(2) -> S(1))",)),
    C("cat", aten.cat.default, lambda: ([f(4, 8), f(4, 4)], 1), expect=("(S(0), S(0) -> S(0))", "(P, P -> P)")),
    C("cat-cache", aten.cat.default, lambda: ([f(0), f(2, 4, 8)], -2), expect=("(B, S(0) -> S(0))", "(B, S(2) -> S(2))", "(B, P -> P)")),
    C("stack", aten.stack.default, lambda: ([f(4, 8), f(4, 8)], 1)),
    C("split", aten.split.Tensor, lambda: (f(4, 12), 4, 1)),
    C("split_with_sizes", aten.split_with_sizes.default, lambda: (f(8, 4), [4, 4], 0)),
    C("chunk", aten.chunk.default, lambda: (f(4, 12), 3, 1), expect=("(S(0) -> S(0), S(0), S(0))",)),
    C("gather", aten.gather.default, lambda: (f(4, 8), 1, ints(8, 4, 4)),
      expect=("(S(0), S(0) -> S(0))", "(P, B -> P)"), forbid=("(S(1), S(1) -> S(1))",)),
    C("gather-narrow-index", aten.gather.default, lambda: (f(4, 8), 1, ints(8, 2, 4)),
      forbid=("(S(0), S(0) -> S(0))",)),
    C("index-first", aten.index.Tensor, lambda: (f(8, 4, 4), [ints(8, 4, 2)]),
      expect=("(S(1), B -> S(2))", "(B, S(0) -> S(0))", "(P, B -> P)")),
    C("index-none-first", aten.index.Tensor, lambda: (f(4, 8, 4), [None, ints(8, 4)]),
      expect=("(S(0), B -> S(0))", "(S(2), B -> S(2))", "(B, S(0) -> S(1))")),
    C("index-separated", aten.index.Tensor, lambda: (f(4, 8, 4), [ints(4, 4), None, ints(4, 4)]),
      expect=("(S(1), B, B -> S(1))",)),
    C("unbind", aten.unbind.int, lambda: (f(4, 2, 8), 1)),
    C("pad", aten.pad.default, lambda: (f(4, 8), [1, 1]), expect=("(P -> P)",)),
    C("pad-value", aten.pad.default, lambda: (f(4, 8), [1, 1, 0, 0], "constant", 2.0), forbid=("(P -> P)",)),
    C("constant_pad_nd", aten.constant_pad_nd.default, lambda: (f(4, 8, 4), [0, 0, 2, 2])),
    C("index_select", aten.index_select.default, lambda: (f(4, 8), 1, torch.tensor([1, 3]))),
    C("broadcast_tensors", aten.broadcast_tensors.default, lambda: ([f(4, 8), f(8)],)),
]

CONV_AND_LOSS = [
    C("conv2d-bias", aten.conv2d.default, lambda: (f(4, 8, 6, 6), f(8, 8, 3, 3), f(8), [1, 1], [1, 1]),
      expect=("(S(0), B, B -> S(0))", "(B, S(0), S(0) -> S(1))", "(S(1), S(1), P -> P)")),
    C("conv2d-groups", aten.conv2d.default,
      lambda: (f(4, 8, 6, 6), f(8, 4, 3, 3), None, [1, 1], [0, 0], [1, 1], 2), forbid=("(B, S(0) -> S(1))",)),
    C("conv1d", aten.conv1d.default, lambda: (f(4, 8, 8), f(4, 8, 3))),
    C("conv3d", aten.conv3d.default, lambda: (f(4, 4, 4, 4, 4), f(4, 4, 1, 1, 1))),
    C("max_pool1d", aten.max_pool1d.default, lambda: (f(4, 8, 8), [2])),
    C("max_pool2d", aten.max_pool2d.default, lambda: (f(4, 8, 4, 4), [2, 2]), expect=("(S(1) -> S(1))",),
      forbid=("(P -> P)",)),
    C("max_pool2d_with_indices", aten.max_pool2d_with_indices.default, lambda: (f(4, 8, 4, 4), [2, 2])),
    C("max_pool3d", aten.max_pool3d.default, lambda: (f(4, 4, 4, 4, 4), [2, 2, 2])),
    C("avg_pool1d", aten.avg_pool1d.default, lambda: (f(4, 8, 8), [2])),
    C("avg_pool2d", aten.avg_pool2d.default, lambda: (f(4, 8, 4, 4), [2, 2]), expect=("(P -> P)",)),
    C("avg_pool3d", aten.avg_pool3d.default, lambda: (f(4, 4, 4, 4, 4), [2, 2, 2])),
    C("adaptive_avg_pool1d", aten.adaptive_avg_pool1d.default, lambda: (f(4, 8, 8), [2])),
    C("adaptive_avg_pool2d", aten.adaptive_avg_pool2d.default, lambda: (f(4, 8, 4, 4), [1, 1])),
    C("adaptive_avg_pool3d", aten.adaptive_avg_pool3d.default, lambda: (f(4, 4, 4, 4, 4), [1, 1, 1])),
    C("adaptive_max_pool2d", aten.adaptive_max_pool2d.default, lambda: (f(4, 8, 4, 4), [2, 2])),
    C("ce-mean", CE, lambda: (f(8, 12), ints(12, 8)), expect=("(S(0), B -> P)",),
      forbid=("(S(1), B -> P)", "(S(0), S(0) -> P)")),
    C("ce-ignored", CE, lambda: (f(8, 12), ignored(ints(12, 8))), expect=("(S(0), B -> P)",)),
    C("ce-ignored-spatial", CE, lambda: (f(4, 12, 4), ignored(ints(12, 4, 4))),
      expect=("(S(0), B -> P)", "(S(2), B -> P)")),
    C("ce-ignored-weight-smoothing", CE, lambda: (f(8, 12), ignored(ints(12, 8)), pos(12), 1, -100, 0.1),
      expect=("(S(0), B, B -> P)",)),
    C("ce-sum", CE, lambda: (f(8, 12), ints(12, 8), None, 2)),
    C("ce-ignore-index", CE, lambda: (f(8, 12), ints(12, 8), None, 1, -1)),
    C("ce-none-spatial", CE, lambda: (f(4, 12, 4), ints(12, 4, 4), None, 0), expect=("(S(2), S(1) -> S(1))",)),
    C("ce-mean-spatial", CE, lambda: (f(4, 12, 4), ints(12, 4, 4))),
    C("ce-weight-sum", CE, lambda: (f(8, 12), ints(12, 8), pos(12), 2)),
    C("ce-weight-mean", CE, lambda: (f(8, 12), ints(12, 8), pos(12)), expect=("(S(0), B, B -> P)",)),
    C("ce-probs", CE, lambda: (f(8, 12), f(8, 12).softmax(-1)), expect=("(S(0), S(0) -> P)",)),
    C("ce-probs-weight", CE, lambda: (f(8, 12), f(8, 12).softmax(-1), pos(12)),
      expect=("(S(0), S(0), B -> P)",)),
    C("mse-mean", aten.mse_loss.default, lambda: (f(8, 4), f(8, 4)), expect=("(S(1), S(1) -> P)",)),
    C("mse-sum", aten.mse_loss.default, lambda: (f(8, 4), f(8, 4), 2)),
    C("mse-none", aten.mse_loss.default, lambda: (f(8, 4), f(8, 4), 0)),
    C("l1", aten.l1_loss.default, lambda: (f(8, 4), f(8, 4))),
    C("smooth_l1", aten.smooth_l1_loss.default, lambda: (f(8, 4), f(8, 4))),
    C("huber", aten.huber_loss.default, lambda: (f(8, 4), f(8, 4))),
    C("bce", aten.binary_cross_entropy.default, lambda: (f(8, 4).sigmoid(), f(8, 4).sigmoid(), pos(4))),
    C("bce-logits", aten.binary_cross_entropy_with_logits.default,
      lambda: (f(8, 4), f(8, 4).sigmoid(), None, pos(4)), expect=("(S(1), S(1), S(0) -> P)",)),
    C("ctc", torch.ops.autosbp.ctc_loss.default, lambda: ctc_args(),
      expect=("(S(1), S(0), S(0), S(0) -> S(0))",)),
]

FACTORY = [
    C("arange", aten.arange.default, lambda: (8,), {"dtype": torch.int64}, expect=("( -> S(0))",)),
    C("arange-start", aten.arange.start, lambda: (2, 10)),
    C("arange-float-step", aten.arange.start_step, lambda: (1.0, 5.0, 0.5), {"dtype": F64}),
    C("eye", aten.eye.default, lambda: (8,), expect=("( -> S(0))", "( -> S(1))")),
    C("eye-rectangular", aten.eye.m, lambda: (4, 8), {"dtype": F64},
      expect=("( -> S(0))", "( -> S(1))")),
    C("zeros", aten.zeros.default, lambda: ([4, 8],), {"dtype": F64}),
    C("ones", aten.ones.default, lambda: ([4, 8],), expect=("( -> S(1))",)),
    C("full", aten.full.default, lambda: ([4, 8], 2.5), {"dtype": F64}),
    C("scalar_tensor", aten.scalar_tensor.default, lambda: (2.0,)),
    C("new_zeros", aten.new_zeros.default, lambda: (f(4, 8), [8, 4])),
    C("new_ones", aten.new_ones.default, lambda: (f(4, 8), [8])),
    C("new_full", aten.new_full.default, lambda: (f(4, 8), [4, 4], 3.0)),
    C("zeros_like", aten.zeros_like.default, lambda: (f(4, 8),), expect=("(P -> B)",)),
    C("ones_like", aten.ones_like.default, lambda: (f(4, 8),)),
    C("full_like", aten.full_like.default, lambda: (f(4, 8), 2.0)),
    C("_assert_tensor_metadata", aten._assert_tensor_metadata.default, lambda: (f(4, 8),), {"dtype": F64}),
    # values undefined: UNDEFINED_VALUES compares shapes and dtypes only
    C("empty", aten.empty.memory_format, lambda: ([4, 8],), {"dtype": F64}),
    C("new_empty", aten.new_empty.default, lambda: (f(4, 8), [8, 4])),
    C("empty_like", aten.empty_like.default, lambda: (f(4, 8),), expect=("(S(1) -> S(1))",)),
    C("type_as", aten.type_as.default, lambda: (f(4, 8), f(2, 6).float()),
      expect=("(S(1), S(0) -> S(1))", "(P, B -> P)")),
    C("type_as-to-int", aten.type_as.default, lambda: (f(4, 8), ints(5, 6)),
      expect=("(S(0), S(0) -> S(0))",), forbid=("(P, B -> P)",)),
]
# Along one dim (autosbp/rules/along_dim.py)
ALONG = [
    C("roll", aten.roll.default, lambda: (f(4, 8), [3], [1]),
      expect=("(S(0) -> S(0))", "(P -> P)"), forbid=("(S(1) -> S(1))",)),
    C("roll-flat", aten.roll.default, lambda: (f(4, 8), [3]), forbid=("(S(0) -> S(0))",)),
    C("diff", aten.diff.default, lambda: (f(4, 8),), expect=("(S(0) -> S(0))", "(P -> P)"),
      forbid=("(S(1) -> S(1))",)),
    C("diff-prepend", aten.diff.default, lambda: (f(4, 8), 1, 0, f(2, 8)),
      expect=("(S(1), S(1) -> S(1))", "(P, P -> P)")),
    C("argmax", aten.argmax.default, lambda: (f(4, 8, 6), 1), expect=("(S(2) -> S(1))",),
      forbid=("(S(1) -> S(1))",)),
    C("argmin-keepdim", aten.argmin.default, lambda: (f(4, 8, 6), 2, True),
      expect=("(S(1) -> S(1))",)),
    C("argmax-flat", aten.argmax.default, lambda: (f(4, 8),), forbid=("(S(0) -> S(0))",)),
]  # fmt: skip
UNDEFINED_VALUES = {"empty", "new_empty", "empty_like"}
# Routing (autosbp/rules/routing.py). Expert ends 5, 0, 7, 4: uneven groups and an empty one,
# so each device of an expert split (2 or 4) computes another number of rows, one of them none.
ROUTING = [
    C("topk", aten.topk.default, lambda: (f(4, 8, 8), 2),
      expect=("(S(0) -> S(0), S(0))", "(S(1) -> S(1), S(1))"), forbid=("(S(2) -> S(2), S(2))", "(P -> P, P)")),
    C("topk-dim-smallest", aten.topk.default, lambda: (f(4, 8, 4), 3, 1, False), forbid=("(S(1) -> S(1), S(1))",)),
    C("sort", aten.sort.default, lambda: (f(4, 8),), expect=("(S(0) -> S(0), S(0))",),
      forbid=("(S(1) -> S(1), S(1))",)),
    C("sort-stable", aten.sort.stable, lambda: (f(8, 4),), {"stable": True, "dim": 0, "descending": True},
      expect=("(S(1) -> S(1), S(1))",)),
    C("one_hot", aten.one_hot.default, lambda: (ints(4, 4, 8), 4), expect=("(S(0) -> S(0))", "(S(1) -> S(1))")),
    C("histc", aten.histc.default, lambda: (f(4, 8), 4, -1.0, 1.0), expect=("(S(0) -> P)", "(S(1) -> P)")),
    C("histc-data-range", aten.histc.default, lambda: (f(4, 8), 4), forbid=("(S(0) -> P)",)),
    C("scatter_add", aten.scatter_add.default, lambda: (f(4, 8), 1, ints(8, 4, 8), f(4, 8)),
      expect=("(S(0), S(0), S(0) -> S(0))", "(P, B, P -> P)"), forbid=("(S(1), S(1), S(1) -> S(1))",)),
    C("scatter_add-narrow-index", aten.scatter_add.default, lambda: (f(4, 8), 1, ints(8, 2, 8), f(4, 8)),
      forbid=("(S(0), S(0), S(0) -> S(0))",)),
    C("scatter-src", aten.scatter.src, lambda: (f(4, 8), 1, row_permutations(4, 8), f(4, 8)),
      expect=("(S(0), S(0), S(0) -> S(0))",), forbid=("(P, B, P -> P)",)),
    C("scatter-value-zero", aten.scatter.value, lambda: (f(4, 8), 1, ints(8, 4, 8), 0.0), expect=("(P, B -> P)",)),
    C("scatter-value", aten.scatter.value, lambda: (f(4, 8), 1, ints(8, 4, 8), 2.0), forbid=("(P, B -> P)",)),
    C("index_add", aten.index_add.default, lambda: (f(8, 4), 0, ints(8, 12), f(12, 4)),
      expect=("(S(1), B, S(1) -> S(1))", "(P, B, P -> P)"), forbid=("(S(0), B, S(0) -> S(0))",)),
    C("index_put-accumulate", aten.index_put.default, lambda: (f(8, 4), [ints(8, 12)], f(12, 4), True),
      expect=("(S(1), B, S(1) -> S(1))", "(P, B, P -> P)")),
    C("index_put-broadcast-values", aten.index_put.default, lambda: (f(8, 4, 4), [torch.randperm(8)[:4]], f(4)),
      expect=("(S(1), B, B -> S(1))", "(S(2), B, S(0) -> S(2))"), forbid=("(P, B, P -> P)",)),
    C("index_put-none-first", aten.index_put.default, lambda: (f(4, 8), [None, torch.randperm(8)], f(4, 8)),
      forbid=("(S(0), B, S(0) -> S(0))",)),
    C("grouped_mm_fallback", GROUPED_MM_FALLBACK, lambda: (f(16, 8), f(4, 8, 12), expert_ends([5, 0, 7, 4])),
      expect=("(B, S(0), B -> P)", "(B, S(2), B -> S(1))", "(S(1), S(1), B -> P)", "(B, P, B -> P)"),
      forbid=("(S(0), B, B -> S(0))",)),
    C("_grouped_mm", aten._grouped_mm.default,
      lambda: (f(16, 16).float(), f(4, 16, 16).float(), expert_ends([5, 0, 7, 4])),
      expect=("(B, S(0), B -> P)", "(B, S(2), B -> S(1))")),
    C("_grouped_mm-narrow", aten._grouped_mm.default,
      lambda: (f(16, 8).float(), f(4, 8, 12).float(), expert_ends([5, 0, 7, 4])),
      expect=("(B, S(0), B -> P)",), forbid=("(B, S(2), B -> S(1))", "(S(1), S(1), B -> P)")),
]
# fmt: on

CASES: list[Case] = [
    *MATMUL, *POINTWISE, *REDUCTION_AND_NORM, *SHAPE, *CONV_AND_LOSS, *FACTORY, *ROUTING, *ALONG,
]  # fmt: skip
CASES_BY_ID = {case.id: case for case in CASES}
assert len(CASES_BY_ID) == len(CASES), "case ids must be unique"


def build_case(case: Case, seed: int = 0) -> tuple[OpNode, tuple[torch.Tensor, ...]]:
    """The case's node and global tensor inputs, drawn from `seed`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return node_from_call(case.target, case.make_args(), case.kwargs)


# ---------------------------------------------------------------------------------------------
# DTensor peer oracle (one gloo process per rank)


def dtensor_placement(sbp: Sbp) -> Any:
    from torch.distributed.tensor import Partial as DPartial
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(sbp, Split):
        return Shard(sbp.dim)
    if isinstance(sbp, Broadcast):
        return Replicate()
    assert isinstance(sbp, Partial)
    return DPartial(sbp.op)


def dtensor_worker(rank: int, world: int, case_ids: list[str]) -> list[dict[str, Any]]:
    """For every 1D signature of every case: run the op on DTensors placed like our inputs.

    Returns one record per signature: our signature, DTensor's output placements, how many
    collectives DTensor issued inside the op, whether full_tensor() equals the global result,
    or the error DTensor raised (an op or placement it does not support).
    """
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    records = []
    for case_id in case_ids:
        node, inputs = build_case(CASES_BY_ID[case_id])
        expected = run_global(node, inputs)
        for sig in signatures_1d(node, world):
            records.append(_dtensor_record(case_id, node, inputs, expected, sig, mesh, rank))
    return records


def _dtensor_record(
    case_id: str, node: Any, inputs: Any, expected: Any, sig: Any, mesh: Any, rank: int
) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    world = mesh.size()
    nd = NdSignature.from_1d([sig])
    gen = torch.Generator().manual_seed(1)  # the same addends on every rank
    dtensors = [
        DTensor.from_local(
            shard_inputs(t, sbp, (world,), gen)[rank], mesh, [dtensor_placement(sbp[0])]
        )
        for t, sbp in zip(inputs, nd.inputs, strict=True)
    ]
    record: dict[str, Any] = {
        "case": case_id,
        "sig": repr(sig),
        "ours": [repr(s) for s in sig.outputs],
    }
    try:
        with CommDebugMode() as comm:
            outs = as_tuple(
                node.target(
                    *resolve_refs(node.args, dtensors), **resolve_refs(node.kwargs, dtensors)
                )
            )
    except Exception as exc:  # DTensor lacks a strategy: reported, judged by the test
        record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        return record
    record["comms"] = comm.get_total_counts()
    record["theirs"] = [_dtensor_name(o.placements[0]) for o in outs]
    fulls = [o.full_tensor() for o in outs]  # collectives: every rank runs them in this order
    record["equal"] = all(_equal(a, b) for a, b in zip(fulls, expected, strict=True))
    return record


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    tol = 1e-9 if b.dtype == F64 else 1e-5
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=tol, atol=tol)


def _dtensor_name(placement: Any) -> str:
    """`Shard(0)`, `Replicate()`, `Partial(sum)`, `MaskPartial(sum)` (vocab-parallel lookups) ..."""
    reduce_op = getattr(placement, "reduce_op", None)
    if reduce_op is not None:
        return f"{type(placement).__name__}({reduce_op})"
    return f"Shard({placement.dim})" if hasattr(placement, "dim") else "Replicate()"
