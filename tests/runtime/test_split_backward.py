"""`runtime.parallel.split_backward` against a plain backward (the oracle): B's input
gradients and, after W, every weight's gradient equal autograd's, B alone accumulating
nothing, and each weight's gradient accumulated once (one post-accumulate hook call).

Graphs, each a case of the split's rules: a chain of linears with biases and a norm (one group
per weight), a weight read twice (its reads' intermediates in one group, clamped), a weight
reached from a root without passing the inputs' path (W the whole backward), a weight the
roots never reach, and no input to differentiate (the first stage); each with every weight
trained, or one frozen (no gradient, no node to group).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch

from runtime.parallel.split_backward import input_gradients

Weights = list[torch.Tensor]
Model = Callable[[torch.Tensor, Weights], list[torch.Tensor]]


def _chain(x: torch.Tensor, w: Weights) -> list[torch.Tensor]:
    h = torch.relu(x @ w[0] + w[1])
    h = torch.nn.functional.layer_norm(h, (8,), w[2], w[3])
    return [h @ w[4]]


def _read_twice(x: torch.Tensor, w: Weights) -> list[torch.Tensor]:
    h = torch.tanh(x @ w[0]) @ w[0].t()  # a tied weight: two reads on the inputs' path
    return [h @ w[4], (h * w[1]).sum()]


def _outside_the_path(x: torch.Tensor, w: Weights) -> list[torch.Tensor]:
    return [x @ w[0], (w[1] * w[2]).sum()]  # a loss term no input feeds


def _unreached(x: torch.Tensor, w: Weights) -> list[torch.Tensor]:
    return [x @ w[0] @ w[4]]  # w[1..3] never read


CASES = {"chain": _chain, "read twice": _read_twice, "outside the path": _outside_the_path,
         "unreached": _unreached}  # fmt: skip


def _weights() -> Weights:
    g = torch.Generator().manual_seed(0)
    shapes = [(8, 8), (8,), (8,), (8,), (8, 4)]
    return [torch.randn(s, generator=g).requires_grad_(True) for s in shapes]


def _run(
    model: Model, split: bool, differentiable: bool, frozen: int | None = None
) -> tuple[object, Weights, Counter]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 8, generator=g).requires_grad_(differentiable)
    weights = _weights()
    if frozen is not None:
        weights[frozen].requires_grad_(False)
    calls: Counter = Counter()
    for i, w in enumerate(weights):
        if w.requires_grad:
            w.register_post_accumulate_grad_hook(lambda _, i=i: calls.update([i]))
    outputs = model(x, weights)
    seeds = [torch.randn(r.shape, generator=g) for r in outputs if r.requires_grad]
    roots = [r for r in outputs if r.requires_grad]  # as the pipeline's `_roots` keeps them
    if not split:
        torch.autograd.backward(roots, seeds)
        return (x.grad if differentiable else None), weights, calls
    found, later = input_gradients(roots, seeds, [x], weights)
    assert all(w.grad is None for w in weights) and x.grad is None, "B accumulated"
    later.run()
    return found[0], weights, calls


@pytest.mark.parametrize("frozen", [None, 0, 1], ids=["trained", "frozen matrix", "frozen bias"])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("differentiable", [True, False], ids=["input", "first stage"])
def test_split_backward_is_the_plain_backward(
    name: str, differentiable: bool, frozen: int | None
) -> None:
    want_x, want_w, want_calls = _run(CASES[name], False, differentiable, frozen)
    got_x, got_w, got_calls = _run(CASES[name], True, differentiable, frozen)
    if differentiable:
        assert isinstance(got_x, torch.Tensor) and isinstance(want_x, torch.Tensor)
        torch.testing.assert_close(got_x, want_x)
    else:
        assert got_x is None
    for got, want in zip(got_w, want_w, strict=True):
        assert (got.grad is None) == (want.grad is None)
        if want.grad is not None:
            torch.testing.assert_close(got.grad, want.grad)
    assert got_calls == want_calls  # each gradient accumulated once, as one backward does
