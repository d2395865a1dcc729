"""Eager RMSNorms captured as torch's one rms_norm op (`autosbp.capturing.fused_norms`).

Oracles: the eager module itself (loss and every gradient, the captured graph interpreted on the
same weights: bit-equal in float32, where every fused form computes the same products, within
one bfloat16 rounding in bfloat16); torch's own `rms_norm` and its autograd for the kernel; and
for what is not a norm, the graph unchanged (no rms_norm node). The forms are Hugging Face's own
classes (Llama's, copied by some 130 models; OLMo 2's, T5's, Llama 4's, Moshi's, Gemma's), each
in a small model with a projection after the norm so every gradient is non-trivial, and
hand-written near misses that must stay eager. Lives elsewhere: the rule's proof on shards
(tests/rules/test_rules.py, rms_norm cases), what the probe says the op keeps
(tests/planner/test_saved.py), training under `--check` (tests/runtime/test_fused_norm_check.py).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from torch import nn

from autosbp.capturing.export import capture, run_graph
from autosbp.capturing.fused_norms import rms_norm
from autosbp.zoo import build_model

HIDDEN = 8
EPS = 1e-5


class WithNorm(nn.Module):
    """x -> norm -> linear -> mean square: the loss of one norm, gradients to its weight and
    to its input through the projection."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.proj = nn.Linear(HIDDEN, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x)).square().mean()


def _hf(module: str, name: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        kind = getattr(__import__(module, fromlist=[name]), name)
        return kind(HIDDEN, eps=EPS)

    return make


class Unweighted(nn.Module):
    """An RMSNorm without a weight: torch's rms_norm(x, weight=None)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


class Eager(nn.Module):
    """A Llama-style norm with one thing changed, which makes it no rms_norm (or not torch's)."""

    def __init__(self, change: str) -> None:
        super().__init__()
        self.change = change
        self.weight = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.change
        h = x if c == "no-upcast" else x.to(torch.float32)
        square = h.pow(3).abs() if c == "cube" else h.pow(2)
        dim = 0 if c == "mean-over-rows" else -1
        variance = square.mean(dim, keepdim=c != "no-keepdim")
        if c == "no-keepdim":
            variance = variance.unsqueeze(-1)
        rstd = torch.rsqrt(variance + EPS) if c != "no-eps" else torch.rsqrt(variance)
        normed = h * rstd
        if c == "rstd-read-twice":
            normed = normed + rstd
        if c == "scale-float32":
            return (normed * self.weight.float() * 2).to(x.dtype)
        return self.weight.to(x.dtype) * normed.to(x.dtype)


MODELING = "transformers.models"
# (id, the norm, dtype, fused: the weight's role or None, kept-eager reason or None)
FUSED: list[tuple[str, Callable[[], nn.Module], torch.dtype, bool]] = [
    ("llama", _hf(f"{MODELING}.llama.modeling_llama", "LlamaRMSNorm"), torch.float32, True),
    ("llama", _hf(f"{MODELING}.llama.modeling_llama", "LlamaRMSNorm"), torch.bfloat16, True),
    ("olmo2", _hf(f"{MODELING}.olmo2.modeling_olmo2", "Olmo2RMSNorm"), torch.bfloat16, True),
    ("t5", _hf(f"{MODELING}.t5.modeling_t5", "T5LayerNorm"), torch.float32, True),
    ("t5", _hf(f"{MODELING}.t5.modeling_t5", "T5LayerNorm"), torch.bfloat16, True),
    ("llama4", _hf(f"{MODELING}.llama4.modeling_llama4", "Llama4TextRMSNorm"), torch.bfloat16, True),
    ("moshi", _hf(f"{MODELING}.moshi.modeling_moshi", "MoshiRMSNorm"), torch.bfloat16, True),
    ("gemma", _hf(f"{MODELING}.gemma.modeling_gemma", "GemmaRMSNorm"), torch.float32, True),
    ("unweighted", Unweighted, torch.bfloat16, False),
]  # fmt: skip
# Forms whose eager rounding differs from the fused op's by one rounding of the half dtype
# (the weight multiplied after the cast): the module header of `fused_norms`.
ROUNDED_TWICE = {"llama", "t5", "llama4"}
# (id, the norm, dtype, the reason said, or None where it is no RMSNorm at all)
EAGER: list[tuple[str, Callable[[], nn.Module], torch.dtype, str | None]] = [
    ("gemma", _hf(f"{MODELING}.gemma.modeling_gemma", "GemmaRMSNorm"), torch.bfloat16,
     "scaled by a float32 tensor where its input is bfloat16"),
    ("no-upcast", lambda: Eager("no-upcast"), torch.bfloat16,
     "statistics are computed in bfloat16, torch's rms_norm computes them in float32"),
    ("rstd-read-twice", lambda: Eager("rstd-read-twice"), torch.float32,
     "rstd is read by more than the product"),
    ("scale-float32", lambda: Eager("scale-float32"), torch.bfloat16,
     "normalized value is used in float32"),
    ("cube", lambda: Eager("cube"), torch.float32, None),
    ("mean-over-rows", lambda: Eager("mean-over-rows"), torch.float32, None),
    ("no-keepdim", lambda: Eager("no-keepdim"), torch.float32, None),
    ("no-eps", lambda: Eager("no-eps"), torch.float32, None),
]  # fmt: skip


def _model(make: Callable[[], nn.Module], dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = WithNorm(make())
    for p in model.parameters():  # weights away from their init (ones, or Gemma's zeros)
        nn.init.normal_(p, mean=0.5, std=0.5)
    return model.to(dtype), torch.randn(3, 5, HIDDEN, dtype=dtype)


def _ops(graph) -> Counter[str]:  # type: ignore[no-untyped-def]
    return Counter(a.op.removeprefix("aten.") for _, a in graph.nodes())


def _loss_and_grads(
    run: Callable[[], torch.Tensor], params: list[torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss = run()
    return loss.detach(), list(torch.autograd.grad(loss, params))


def _graph_and_eager(model: nn.Module, x: torch.Tensor):  # type: ignore[no-untyped-def]
    graph = capture(model, [x], name="with_norm")
    params = list(model.parameters())
    state = dict(model.named_parameters())
    fused = _loss_and_grads(lambda: run_graph(graph, state, [x]), params)
    eager = _loss_and_grads(lambda: model(x), params)
    return graph, fused, eager


@pytest.mark.parametrize(
    ("make", "dtype", "weighted", "form"),
    [pytest.param(m, d, w, i, id=f"{i}-{str(d)[6:]}") for i, m, d, w in FUSED],
)
def test_an_eager_rms_norm_runs_as_torchs_op(
    make: Callable[[], nn.Module], dtype: torch.dtype, weighted: bool, form: str
) -> None:
    model, x = _model(make, dtype)
    graph, (loss, grads), (want_loss, want_grads) = _graph_and_eager(model, x)
    ops = _ops(graph)
    assert (
        ops["rms_norm.default"] == 1 and not ops["rsqrt.default"] and not ops["pow.Tensor_Scalar"]
    )
    (norm,) = [a for _, a in graph.nodes() if a.op == "aten.rms_norm.default"]
    assert norm.module_path == "norm" and norm.args[1:] == ([HIDDEN], *norm.args[2:3], EPS)
    assert (len(norm.inputs) == 2) == weighted  # x, and the weight where there is one
    (line,) = graph.meta["fused_norms"]
    assert " at norm: run as torch's fused rms_norm" in line, line
    assert ("rounding" in line) == (dtype == torch.bfloat16 and form in ROUNDED_TWICE), line
    if dtype == torch.float32:  # the same products in the same order: the same bits
        torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
        for got, want in zip(grads, want_grads, strict=True):  # backward sums in another order
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # within a few bfloat16 roundings (u = 2^-8) of eager
        torch.testing.assert_close(loss, want_loss, rtol=2e-2, atol=0)
        for got, want in zip(grads, want_grads, strict=True):
            scale = want.float().abs().max()
            assert (got.float() - want.float()).abs().max() <= 4e-2 * scale


@pytest.mark.parametrize(
    ("make", "dtype", "reason"),
    [pytest.param(m, d, r, id=f"{i}-{str(d)[6:]}") for i, m, d, r in EAGER],
)
def test_what_is_not_exactly_torchs_op_stays_eager(
    make: Callable[[], nn.Module], dtype: torch.dtype, reason: str | None
) -> None:
    model, x = _model(make, dtype)
    graph, (loss, grads), (want_loss, want_grads) = _graph_and_eager(model, x)
    assert not _ops(graph)["rms_norm.default"]
    lines = graph.meta["fused_norms"]
    if reason is None:
        assert lines == []
    else:
        (line,) = lines
        assert "kept eager" in line and reason in line, line
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)  # eager's own ops
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_layer_norm_module_is_captured_as_torchs_op() -> None:
    # nn.LayerNorm (the zoo gpt's) is aten.layer_norm already: nothing to fuse, nothing said
    model, inputs = build_model("gpt", layers=2, hidden=16, heads=2, seq=8, vocab=32, batch=2)
    graph = capture(model, inputs, name="gpt")
    ops = _ops(graph)
    assert ops["layer_norm.default"] == 5 and not ops["rsqrt.default"]
    assert graph.meta["fused_norms"] == []


def test_a_hugging_face_llama_fuses_every_norm_and_says_which() -> None:
    from tests.support.real_models import llama

    model, inputs = llama(layers=2)
    graph = capture(model, inputs, name="llama")
    ops = _ops(graph)
    assert ops["rms_norm.default"] == 5 and not ops["rsqrt.default"]  # 2 per layer and the last
    (line,) = graph.meta["fused_norms"]
    assert line.startswith("modeling_llama.py:") and " LlamaRMSNorm at " in line, line
    paths = "model.model.layers.*.input_layernorm, model.model.layers.*.post_attention_layernorm"
    assert f"{paths}, model.model.norm: run as torch's fused rms_norm" in line, line


KERNEL_CASES = [  # (input shape, normalized shape, weighted, dtype, eps)
    ((3, 5, 8), (8,), True, torch.float64, 1e-6),
    ((3, 5, 8), (8,), False, torch.float32, 1e-5),
    ((3, 5, 8), (5, 8), True, torch.float64, None),
    ((8,), (8,), True, torch.float64, 1e-6),
    ((4, 8), (8,), True, torch.bfloat16, 1e-6),
]


@pytest.mark.parametrize(("shape", "normalized", "weighted", "dtype", "eps"), KERNEL_CASES)
def test_the_kernel_is_torchs_rms_norm_and_its_gradient(
    shape: tuple[int, ...],
    normalized: tuple[int, ...],
    weighted: bool,
    dtype: torch.dtype,
    eps: float | None,
) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    w = torch.randn(normalized, dtype=dtype, requires_grad=True) if weighted else None
    leaves = [x] if w is None else [x, w]
    seed = torch.randn(shape, dtype=dtype)
    got = rms_norm(x, list(normalized), w, eps)
    want = torch.ops.aten.rms_norm.default(x, list(normalized), w, eps)  # torch's, on the CPU
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the composite's own arithmetic
    # what backward keeps: the input, the weight and one rstd per row (the fused kernel's)
    assert got.grad_fn is not None and type(got.grad_fn).__name__ == "_RmsNormBackward"
    kept = [t for t in got.grad_fn.saved_tensors if t is not None]
    assert [t.data_ptr() for t in kept[:-1]] == [t.data_ptr() for t in leaves]
    rows = x.numel() // math.prod(normalized)
    assert kept[-1].numel() == rows and kept[-1].dtype == _COMPUTE[dtype]
    got_grads = torch.autograd.grad(got, leaves, seed)
    want_grads = torch.autograd.grad(want, leaves, seed)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for g, h in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, h, rtol=tol, atol=tol)


_COMPUTE = {
    torch.float64: torch.float64,
    torch.float32: torch.float32,
    torch.bfloat16: torch.float32,
}


def test_autosbp_capture_says_which_norms_it_fused(capsys: pytest.CaptureFixture[str]) -> None:
    from autosbp import cli
    from tests.support import real_models

    assert cli.main(["capture", f"{real_models.__file__}:llama"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "norm: modeling_llama.py:" in out and " LlamaRMSNorm at model.model.layers.*" in out
    assert "run as torch's fused rms_norm" in out
