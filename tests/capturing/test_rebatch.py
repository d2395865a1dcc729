"""Rebatching: a graph fitted from captures at two batches equals a real capture at a third.

Oracle: `capture` at the target batch (fingerprint, and every node's shapes, args, flops, bytes).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch
from torch import nn

from autosbp.capturing import rebatch
from autosbp.capturing.export import capture, capture_micro_batch
from autosbp.capturing.graph import OpGraph
from autosbp.capturing.rebatch import BatchFamily, micro_batch_graphs
from autosbp.errors import CaptureError, SbpError
from autosbp.zoo import ZOO_MODELS, build_model

_TINY: dict[str, dict[str, Any]] = {
    "gpt": {"layers": 2, "hidden": 16, "heads": 2, "vocab": 32, "seq": 8},
    "mlp": {"layers": 2, "hidden": 16, "features": 8, "outputs": 4},
    "moe": {"layers": 2, "hidden": 16, "heads": 2, "experts": 4, "ffn": 32, "vocab": 32, "seq": 8},
    "resnet": {"channels": 4, "blocks": 1, "image": 4},
    "widedeep": {"tables": 2, "rows": 20, "dim": 4, "hidden": 8},
    # batch-independent ints that equal a batch: seq == heads == head dim == 4 == a fit batch
    "gpt-coincide": {"layers": 1, "hidden": 16, "heads": 4, "vocab": 32, "seq": 4},
}


@functools.cache
def zoo_graph(key: str, batch: int) -> OpGraph:
    model, inputs = build_model(key.split("-")[0], device="meta", batch=batch, **_TINY[key])
    return capture(model, inputs, name=key)


def assert_same_graph(got: OpGraph, want: OpGraph) -> None:
    assert got.fingerprint() == want.fingerprint()
    assert got.order == want.order and list(got.graph) == list(want.graph)
    for name in want.order:
        g, w = got.node(name), want.node(name)
        for key in (f.name for f in dataclasses.fields(w)):
            gv, wv = getattr(g, key), getattr(w, key)
            assert gv == wv, (name, key, gv, wv)
            assert type(gv) is type(wv), (name, key)
    assert list(got.edges()) == list(want.edges())
    assert got.unknown_ops == want.unknown_ops and got.model_name == want.model_name
    assert set(got.meta) == {*want.meta, "rebatched_from"}
    for key in ("tied", "block_container", "buffer_mutations"):
        assert got.meta[key] == want.meta[key], key
    assert set(got.meta["constants"]) == set(want.meta["constants"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("key", "fit", "target"),
    [
        *[(name, (2, 3), 5) for name in ZOO_MODELS],
        ("gpt", (4, 2), 3),  # fitted in descending order, evaluated between the points
        ("gpt-coincide", (4, 2), 8),
        ("gpt-coincide", (4, 6), 3),
    ],
    ids=[*ZOO_MODELS, "gpt-between", "gpt-coincide-8", "gpt-coincide-3"],
)
def test_rebatched_graph_equals_a_real_capture(key: str, fit: tuple[int, int], target: int) -> None:
    family = BatchFamily.fit(zoo_graph(key, fit[0]), fit[0], zoo_graph(key, fit[1]), fit[1])
    assert family.rebatchable, family.reason
    got = family.graph_at(target)
    assert_same_graph(got, zoo_graph(key, target))
    assert got.program is None and got.meta["rebatched_from"] == fit


def test_rebatched_graphs_share_no_mutable_args() -> None:
    family = BatchFamily.fit(zoo_graph("gpt", 2), 2, zoo_graph("gpt", 3), 3)
    one, two = family.graph_at(5), family.graph_at(5)
    view = next(n for n in one.order if one.node(n).op == "aten.view.default")
    assert one.node(view).args[1] is not two.node(view).args[1]
    assert one.node(view).args[1] is not family.base.node(view).args[1]


# ------------------------------------------------------------------------- not rebatchable
class BranchOnBatch(nn.Module):
    """An extra op only from batch 4 on: the structure depends on the batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= 4:
            x = torch.relu(x)
        return x.sum()


class HalfBatch(nn.Module):
    """A size of batch // 2: not a*batch + c with whole a, c at batches 2 and 5 (1 and 2)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum() + torch.ones(x.shape[0] // 2).sum()


class ScaleByBatch(nn.Module):
    """A float argument that depends on the batch (1 / batch)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * (1.0 / x.shape[0])).sum()


class BatchMinusThree(nn.Module):
    """A size of batch - 3: affine, but not positive below batch 4."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum() + torch.ones(x.shape[0] - 3).sum()


def capture_at(model: nn.Module, batch: int) -> OpGraph:
    return capture(model, [torch.randn(batch, 3)])


@pytest.mark.parametrize(
    ("model", "fit", "reason"),
    [
        (BranchOnBatch(), (2, 4), "different nodes"),
        (HalfBatch(), (2, 5), "is 1 at batch 2 and 2 at batch 5: not a positive a*batch + c"),
        (ScaleByBatch(), (2, 4), "only ints may depend on the batch"),
    ],
    ids=["branch", "non-affine-int", "float-arg"],
)
def test_not_rebatchable_says_why(model: nn.Module, fit: tuple[int, int], reason: str) -> None:
    family = BatchFamily.fit(capture_at(model, fit[0]), fit[0], capture_at(model, fit[1]), fit[1])
    assert not family.rebatchable
    assert family.reason is not None and reason in family.reason
    with pytest.raises(CaptureError, match="not rebatchable"):
        family.graph_at(6)


def test_non_positive_size_names_the_node() -> None:
    model = BatchMinusThree()
    family = BatchFamily.fit(capture_at(model, 4), 4, capture_at(model, 6), 6)
    assert_same_graph(family.graph_at(9), capture_at(model, 9))
    with pytest.raises(CaptureError, match=r"node `ones` .* = 1\*batch \+ -3 = 0"):
        family.graph_at(3)


@pytest.mark.parametrize(("b1", "b2"), [(1, 3), (3, 3)], ids=["batch-1", "equal"])
def test_fit_needs_two_batches_of_at_least_two(b1: int, b2: int) -> None:
    with pytest.raises(CaptureError, match="two different batches >= 2"):
        BatchFamily.fit(zoo_graph("mlp", 3), b1, zoo_graph("mlp", 3), b2)


def test_batch_one_is_not_rebatched() -> None:
    family = BatchFamily.fit(zoo_graph("mlp", 2), 2, zoo_graph("mlp", 3), 3)
    with pytest.raises(CaptureError, match="only batches >= 2"):
        family.graph_at(1)


# --------------------------------------------------------------------- micro_batch_graphs
@pytest.fixture
def exports(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The micro-batch counts `micro_batch_graphs` captured for real, in order."""
    counted: list[int] = []

    def counting(model: nn.Module, inputs: Any, count: int, *, name: str | None = None) -> OpGraph:
        counted.append(count)
        return capture_micro_batch(model, inputs, count, name=name)

    monkeypatch.setattr(rebatch, "capture_micro_batch", counting)
    return counted


@pytest.mark.parametrize(
    ("counts", "captured"),
    [
        ([1, 2, 4, 8, 16], [1, 2, 16]),  # sizes 16, 8 fitted; 4, 2 rebatched; 1 captured
        ([2, 4, 8], [2, 4]),
        ([4], [4]),
        ([4, 1, 4], [4, 1]),
    ],
    ids=["powers-of-two", "three-sizes", "one-size", "repeated"],
)
def test_micro_batch_graphs_exports_at_most_twice(
    exports: list[int], counts: list[int], captured: list[int]
) -> None:
    model, inputs = build_model("gpt", device="meta", batch=16, **_TINY["gpt"])
    graphs = micro_batch_graphs(model, inputs, counts, name="gpt")
    assert sorted(exports) == sorted(captured)
    assert list(graphs) == list(dict.fromkeys(counts))
    for count, graph in graphs.items():
        assert graph.fingerprint() == zoo_graph("gpt", 16 // count).fingerprint(), count


def test_micro_batch_graphs_falls_back_per_count(exports: list[int]) -> None:
    graphs = micro_batch_graphs(ScaleByBatch(), [torch.randn(8, 3)], [1, 2, 4])
    assert sorted(exports) == [1, 2, 4]
    for count, graph in graphs.items():
        assert_same_fingerprint_and_args(graph, capture_at(ScaleByBatch(), 8 // count))


def assert_same_fingerprint_and_args(got: OpGraph, want: OpGraph) -> None:
    assert got.fingerprint() == want.fingerprint()
    assert [a.args for _, a in got.nodes()] == [a.args for _, a in want.nodes()]


def test_a_branch_outside_the_fit_points_is_not_seen() -> None:
    """The documented limit: both fit points take the branch, so batch 2 is predicted with it.
    The fingerprint differs from a real capture, which is what the runtime checks plans by."""
    model = BranchOnBatch()
    family = BatchFamily.fit(capture_at(model, 4), 4, capture_at(model, 8), 8)
    assert family.rebatchable
    assert family.graph_at(2).fingerprint() != capture_at(model, 2).fingerprint()


def test_micro_batch_graphs_rejects_a_count_that_does_not_cut_the_batch() -> None:
    model, inputs = build_model("mlp", device="meta", batch=6, **_TINY["mlp"])
    with pytest.raises(SbpError, match="cannot be cut into 4"):
        micro_batch_graphs(model, inputs, [1, 2, 4])
