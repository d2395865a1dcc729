"""Repeated layers exported once: the graph built from exports at depths 3, 4 and 5 equals the
export of the whole model, node for node; where the layers are not alike, capture exports whole.

Oracle: `export._capture_whole` (one torch.export of the whole model) on the same model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from torch import nn

from autosbp.capturing import export, repeats
from autosbp.capturing.graph import OpGraph
from autosbp.capturing.rebatch import micro_batch_graphs
from autosbp.zoo import build_model

LAYERS = repeats.MIN_LAYERS


def assert_same_graph(got: OpGraph, want: OpGraph) -> None:
    """Every node field, the order, the edges, the meta (but timings) and the fingerprint."""
    assert got.order == want.order
    for name in want.order:
        g, w = got.node(name), want.node(name)
        for key in (f.name for f in dataclasses.fields(w)):
            assert repr(getattr(g, key)) == repr(getattr(w, key)), (name, key)
    assert list(got.edges()) == list(want.edges())
    assert got.unknown_ops == want.unknown_ops and got.model_name == want.model_name
    assert set(got.meta) == {*want.meta, "capture_s", "repeated_from"}
    for key in ("tied", "block_container", "buffer_mutations", "absorbed", "fused_norms"):
        assert got.meta[key] == want.meta[key], key
    constants = got.meta["constants"], want.meta["constants"]
    assert list(constants[0]) == list(constants[1])
    for key, value in constants[1].items():
        assert constants[0][key].shape == value.shape and constants[0][key].dtype == value.dtype
    assert got.fingerprint() == want.fingerprint()


def _zoo_gpt() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model, inputs = build_model(
        "gpt", device="meta", batch=4, layers=LAYERS, hidden=16, heads=2, vocab=32, seq=8
    )
    return model, tuple(inputs)


def _hf_llama() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.support.real_models import LossOf

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8,
        attention_dropout=0.0, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.train()
    ids = torch.zeros((4, 8), dtype=torch.long, device="meta")
    return LossOf(model, ("input_ids", "labels")), (ids, ids.clone())


@pytest.mark.slow
@pytest.mark.parametrize("build", [_zoo_gpt, _hf_llama], ids=["zoo-gpt", "hf-llama"])
def test_replicated_graph_is_the_whole_export(
    build: Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]],
) -> None:
    model, inputs = build()
    got = export.capture(model, inputs)
    assert got.meta["repeated_from"] == (3, 4, 5)
    assert len({a.block for _, a in got.nodes()} - {None}) == LAYERS
    # Llama's eager norms fused in every export alike (`fused_norms`: lines whatever the depth)
    fused = sum(a.op == "aten.rms_norm.default" for _, a in got.nodes())
    assert fused == (2 * LAYERS + 1 if build is _hf_llama else 0)
    assert_same_graph(got, export._capture_whole(model, inputs, type(model).__name__))


class _Layer(nn.Module):
    def __init__(self, index: int, scale: float) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.index, self.scale = index, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x) * self.scale
        return torch.tanh(y * (2.0 if self.index % 2 else 3.0))  # branches on its own index


class _Stack(nn.Module):
    def __init__(self, scales: list[float]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(i, s) for i, s in enumerate(scales))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


@pytest.mark.parametrize(
    "scales",
    [[1.0] * LAYERS, [1.0] * (LAYERS - 1) + [2.0]],
    ids=["forward-branches-on-index", "one-layer-attribute-differs"],
)
def test_layers_not_alike_are_exported_whole(scales: list[float]) -> None:
    """Layers that alternate by index (same ops, other constants: seen by the spread picks,
    refused by the family) or differ in an attribute (refused before any export) are exported
    whole."""
    model, inputs = _Stack(scales), (torch.randn(2, 4),)
    got = export.capture(model, inputs)
    assert "repeated_from" not in got.meta
    want = export._capture_whole(model, inputs, "_Stack")
    assert got.fingerprint() == want.fingerprint()


class _PlainLayer(_Layer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x) * self.scale)


def test_alike_layers_compute_the_whole_model() -> None:
    """Alike layers that branch on nothing replicate, and the graph computes the whole
    model's loss (run on real weights, against the model itself)."""
    model, inputs = _Stack([1.0] * LAYERS), (torch.randn(2, 4),)
    model.layers = nn.ModuleList(_PlainLayer(i, 1.0) for i in range(LAYERS))
    got = export.capture(model, inputs)
    assert got.meta["repeated_from"] == (3, 4, 5)
    state = dict(model.named_parameters())
    loss = export.run_graph(got, state, inputs)
    torch.testing.assert_close(loss, model(*inputs), rtol=0, atol=0)


def test_an_input_passed_twice_rebatches() -> None:
    """(ids, ids) as input_ids and labels: each input its own placeholder, so the whole batch
    (one tensor twice) and a micro-batch (two slices) give one structure, which rebatches."""
    model, (ids, _) = build_model(
        "gpt", device="meta", batch=8, layers=2, hidden=16, heads=2, vocab=32, seq=8
    )
    graphs = micro_batch_graphs(model, (ids, ids), (1, 2, 4, 8))
    assert "rebatched_from" in graphs[4].meta
    assert graphs[1].fingerprint() == export.capture(model, (ids, ids.clone())).fingerprint()


class _UnruledLayer(_PlainLayer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * torch.prod(x).tanh()  # prod: no SBP rule


def test_an_unknown_op_is_warned_of_once() -> None:
    """The shallow exports' warnings are said once, as the whole export says them."""
    from autosbp.rules import UnknownOpWarning

    model, inputs = _Stack([1.0] * LAYERS), (torch.randn(2, 4),)
    model.layers = nn.ModuleList(_UnruledLayer(i, 1.0) for i in range(LAYERS))
    with pytest.warns(UnknownOpWarning) as said:
        got = export.capture(model, inputs)
    assert got.meta["repeated_from"] == (3, 4, 5)
    assert len([w for w in said if issubclass(w.category, UnknownOpWarning)]) == 1
