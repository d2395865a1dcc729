"""The searches of one plan request share what depends only on the graphs
(`search.graph_memo.GraphMemo`): each graph is tied, cut and read for what backward keeps once
per request, each mesh's boxing pricer is built once, and every plan is what its search finds
alone (the oracle: the same searches, each with a fresh memo); and `auto_parallelize` tries
each micro-batch capture once per request, one that fails included.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from autosbp.capturing.rebatch import micro_batch_graphs
from autosbp.planner import api
from autosbp.planner.api import plan_graphs
from autosbp.planner.memory import kept
from autosbp.planner.problem import priced
from autosbp.planner.search import graph_memo
from autosbp.planner.search.graph_memo import GraphMemo
from autosbp.planner.timing import boxing_prices
from autosbp.zoo import build_model

COMMON: dict[str, Any] = {
    "profile": "dgx-a100", "devices": 8, "memory_limit": None, "global_batch": None,
    "optimizer": "adam", "dtype": "fp32", "time_limit_s": 600, "jobs": 1,
}  # fmt: skip
HAND = ("dp", "megatron:tp=2,pp=2,dp=2", "megatron:tp=4,pp=2,dp=1")


@pytest.fixture(scope="module")
def graphs() -> dict:
    model, inputs = build_model("gpt", layers=4, hidden=64, heads=4, vocab=128, seq=16, batch=16)
    return micro_batch_graphs(model, inputs, (1, 2, 4), name="gpt")


def _counting(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Calls of the graph-only work, by what it was asked of (graph, and stage count or mode)."""
    calls: Counter = Counter()

    def counted(module: Any, name: str, key: Any) -> None:
        real = getattr(module, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[(name, *key(*args))] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    counted(graph_memo, "tie_graph", lambda g: (id(g),))
    counted(graph_memo, "split_stages", lambda g, n: (id(g), n))
    for module in (kept, priced):  # KeptMemo's, and what `Priced.kept` adds on first use
        counted(module, "kept_for_backward", lambda g, rep, mode, **_: (id(g), mode))
    pricers = boxing_prices.BoxingPricer

    class Counted(pricers):  # type: ignore[misc, valid-type]
        def __init__(self, prices: Any, mesh: Any) -> None:
            calls[("BoxingPricer", mesh)] += 1
            super().__init__(prices, mesh)

    monkeypatch.setattr(priced, "BoxingPricer", Counted)
    return calls


@pytest.mark.slow
def test_a_compare_request_does_the_graph_work_once(graphs, monkeypatch) -> None:
    # auto and every usual hand plan (`--compare`): 3+ searches over the same graphs. Before
    # the memo each search tied each graph, cut it, read what backward keeps and built a boxing
    # pricer per mesh again; now each is done once per request.
    calls = _counting(monkeypatch)
    plan = plan_graphs(graphs, **COMMON, strategy="auto", compare=True)
    assert len(plan.hand_plans) >= 2, plan.hand_plans
    assert calls, "the graph work is counted"
    again = {k: n for k, n in calls.items() if n > 1}
    assert not again, again


@pytest.mark.slow
def test_plans_with_a_shared_memo_are_those_of_fresh_searches(graphs) -> None:
    # One memo through auto and three hand plans (as bench/plan_speed.py's grid shares one):
    # each plan, its prediction and effort's configurations are those of its search alone.
    memo = GraphMemo()
    for strategy in ("auto", *HAND):
        shared = plan_graphs(graphs, **COMMON, strategy=strategy, memo=memo)
        alone = plan_graphs(graphs, **COMMON, strategy=strategy)
        assert shared.predicted == alone.predicted, strategy
        assert (shared.stages, shared.nodes) == (alone.stages, alone.nodes), strategy
        assert shared.solver.configurations == alone.solver.configurations, strategy
    assert len(memo.graphs) == len(graphs)


def test_pricers_are_shared_only_between_equal_prices() -> None:
    from costmodel import Cluster, load_profile

    memo = GraphMemo()
    a100 = api.ClusterPrices(Cluster(load_profile("dgx-a100"), nodes=1))
    again = api.ClusterPrices(Cluster(load_profile("dgx-a100"), nodes=1))
    two = api.ClusterPrices(Cluster(load_profile("dgx-a100"), nodes=2))
    assert memo.pricers_of(a100) is memo.pricers_of(again)
    assert memo.pricers_of(two) is not memo.pricers_of(a100)

    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

    loose: Any = Unhashable()  # prices that do not hash: shared with no one, not even itself
    assert memo.pricers_of(loose) is not memo.pricers_of(loose)


class _BatchNormed(torch.nn.Module):
    """Trains on 2 samples or more: a micro-batch of one leaves BatchNorm one value a channel."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x)).pow(2).mean()


def test_a_count_that_does_not_capture_is_tried_once_per_request(monkeypatch) -> None:
    # With compare, every search asks for every micro-batch count. A count whose micro-batch
    # does not capture (MicroBatchError) was captured again by each, each time after every
    # count at once failed again (HF ResNet at 64 devices: 16 captures, 5.0 of its 5.4 s).
    # Now each capture is tried once per request: every count at once, then each alone.
    from autosbp.capturing import rebatch

    calls: list[tuple[int, ...]] = []
    real = rebatch.micro_batch_graphs

    def counted(model: Any, inputs: Any, counts: Any, **kwargs: Any) -> Any:
        calls.append(tuple(counts))
        return real(model, inputs, counts, **kwargs)

    monkeypatch.setattr(rebatch, "micro_batch_graphs", counted)
    plan = api.auto_parallelize(
        _BatchNormed(), (torch.randn(4, 8),), profile="cpu-gloo", devices=2, compare=True,
        time_limit_s=60, jobs=1,
    )  # fmt: skip
    assert plan.micro_batches < 4 and plan.hand_plans
    assert sorted(calls) == [(1,), (1, 2, 4), (2,), (4,)], calls
