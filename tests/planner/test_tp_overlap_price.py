"""The price of tensor-parallel reductions overlapped with their matmul (issue 47 item 2): the
exposed time against an event simulation of the chunks, what the planner offers and chooses,
and that a profile without an overlap efficiency prices every plan as before.

Oracles: an event simulation (chunks of compute ready at even intervals, their collectives
one at a time); the same search with the overlapped twins taken away (`overlap_cut` None);
the runtime's own cut (`autosbp.tp_overlap.chunk_plan`, what `runtime.parallel.tp_overlap`
runs) against the plan's statement.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from autosbp.capturing.export import capture
from autosbp.errors import PlanError
from autosbp.overlap import hidden_sync_s
from autosbp.plan import Plan
from autosbp.planner.api import ClusterPrices, plan_graph
from autosbp.planner.problem.priced import price_graph
from autosbp.planner.space.strategy import strategy_space
from autosbp.planner.timing.tp_overlap import overlap_cut, overlapped_s
from autosbp.rules import NdSignature
from autosbp.sbp import Mesh, parse_nd_sbp
from autosbp.tp_overlap import TP_OVERLAP_CHUNKS, chunk_plan
from autosbp.zoo import build_model, load_model
from costmodel import Cluster, load_profile

# Sizes at which tensor parallelism's reductions are worth hiding on dgx-a100 (a Llama-sized
# hidden, 2K tokens); captured on meta, planned only.
WIDE = {"layers": 1, "hidden": 4096, "heads": 32, "seq": 2048, "batch": 8, "vocab": 1024}
TP8 = "megatron:tp=8,pp=1,dp=1,mb=1"


def _simulated_exposed_s(comm_s: float, compute_s: float, chunks: int) -> float:
    """Chunk i computed by (i + 1) compute / k, its collective (comm / k) started then, after
    the previous one: how long the last ends after the compute does."""
    end_s = 0.0
    for i in range(1, chunks + 1):
        end_s = max(end_s, i * compute_s / chunks) + comm_s / chunks
    return end_s - compute_s


def _simulated_backward_exposed_s(comm_s: float, compute_s: float, chunks: int) -> float:
    """The dual's chunks all started at once, run one at a time (the i-th done at i comm / k);
    chunk i's backward (compute / k) after its own collective and the chunk before: how long
    the last ends after the compute would alone."""
    end_s = 0.0
    for i in range(1, chunks + 1):
        end_s = max(end_s, i * comm_s / chunks) + compute_s / chunks
    return end_s - compute_s


@pytest.mark.parametrize("seed", range(3))
def test_exposed_reduction_equals_an_event_simulation_of_the_chunks(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        comm_s, compute_s, k = rng.uniform(0, 2), rng.uniform(0, 2), rng.randint(2, 8)
        exposed = comm_s - hidden_sync_s(comm_s, compute_s, k, overlap=1.0)
        assert exposed == pytest.approx(_simulated_exposed_s(comm_s, compute_s, k))
        assert exposed == pytest.approx(_simulated_backward_exposed_s(comm_s, compute_s, k))


def test_a_twins_edge_prices_its_reduction_and_the_dual_beside_the_chunks() -> None:
    """On the twin's edge, forward the reduction and backward its dual (the all-gather of the
    reduce-scatter's gradient, or the all-reduce's) each cost `overlapped_s` beside the twin's
    forward and backward compute, where the same candidate run whole pays both in line."""
    graph = capture(*build_model("gpt", device="meta", **WIDE))
    mesh = Mesh((8,), link_classes=("intra_node",))
    prices = ClusterPrices(Cluster(load_profile("dgx-a100"), nodes=1))
    priced = price_graph(graph, mesh, prices, strategy_space(TP8).allow)
    found = priced.strategies["linear_3"]  # the MLP's second linear, row-parallel
    (reader,) = graph.readers("linear_3")
    consumer = priced.strategies[reader]
    both, forward = priced.edge_prices("linear_3", reader)
    twins = [i for i, cut in enumerate(found.overlap_cuts or ()) if cut is not None]
    assert twins, "at these sizes the search is offered the row-parallel linear overlapped"
    meta = graph.node("linear_3").outputs[0]
    checked = 0
    for i in twins:
        sig, cut = found.candidates[i], found.overlap_cuts[i]
        whole = found.candidates.index(sig)  # the same candidate, run whole
        fwd = float(found.forward_s[i])
        bwd = float(found.compute_s[i]) - fwd
        dsts = [c.inputs[0] for c in consumer.candidates]
        ahead = overlapped_s(sig.outputs[0], dsts, meta, cut, fwd, mesh, prices)
        behind = overlapped_s(sig.outputs[0], dsts, meta, cut, bwd, mesh, prices, backward=True)
        for j in np.flatnonzero(np.isfinite(forward[i])):
            assert forward[i, j] == pytest.approx(ahead[j])
            assert both[i, j] == pytest.approx(ahead[j] + behind[j])
            assert behind[j] < both[whole, j] - forward[whole, j]  # hidden in part
            checked += 1
    assert checked


def _plan(
    monkeypatch: pytest.MonkeyPatch, *, twins: bool, overlap: float | None, named: str = ""
) -> Plan:
    if overlap is not None:
        monkeypatch.setattr(ClusterPrices, "overlap_efficiency", property(lambda _: overlap))
    if not twins:
        monkeypatch.setattr("autosbp.planner.timing.candidates.overlap_cut", lambda *_: None)
    model, inputs = build_model("gpt", device="meta", **WIDE)
    found = plan_graph(
        capture(model, inputs), profile="dgx-a100", devices=8, memory_limit=None,
        global_batch=None, optimizer="adam", dtype="fp32", strategy=TP8 + named, time_limit_s=60,
    )  # fmt: skip
    monkeypatch.undo()
    return found


def test_the_planner_overlaps_where_it_pays_and_states_what_the_runtime_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    overlapped = _plan(monkeypatch, twins=True, overlap=None)  # dgx-a100's 0.8
    whole = _plan(monkeypatch, twins=False, overlap=None)
    chosen = {n: node for n, node in overlapped.nodes.items() if node.overlap_chunks}
    assert chosen, "at these sizes hiding the row-parallel reductions pays"
    assert overlapped.predicted.step_time_s < whole.predicted.step_time_s
    graph = capture(*build_model("gpt", device="meta", **WIDE))
    for name, node in chosen.items():
        assert node.op == "aten.linear.default" and node.outputs == ("P",), name
        assert node.overlap_chunks == TP_OVERLAP_CHUNKS
        sig = NdSignature(tuple(map(parse_nd_sbp, node.inputs)), (parse_nd_sbp("P"),))
        cut = chunk_plan(graph.node(name), sig, (8,), node.overlap_chunks)  # the runtime's
        assert cut is not None and cut.dim == 0, name  # the batch: the reduce-scatter splits 1


def test_without_an_overlap_efficiency_nothing_is_overlapped_and_prices_stay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    none = _plan(monkeypatch, twins=True, overlap=0.0)
    before = _plan(monkeypatch, twins=False, overlap=0.0)
    assert not any(node.overlap_chunks for node in none.nodes.values())
    assert none.predicted.step_time_s == before.predicted.step_time_s
    assert none.nodes == before.nodes


def test_twins_only_where_the_op_and_its_reader_run_on_one_stage_recomputed_alike() -> None:
    """The MLP's blocks are linear -> gelu (the linear recomputed with its gelu under full);
    its head linear, outside the blocks, is read by the loss's broadcast, also outside: on the
    last stage under the splits here, but not under every split a graph with blocks may have
    (`timing.tp_overlap._beside`), so it has no twin (the check refuses one too)."""
    module, inputs = load_model("mlp", {"layers": 2, "hidden": 32, "features": 16, "batch": 8})
    graph = capture(module, inputs)
    prices = ClusterPrices(Cluster(load_profile("dgx-a100"), nodes=1))
    partial = NdSignature(tuple(map(parse_nd_sbp, ("S(1)", "S(1)", "P"))), (parse_nd_sbp("P"),))
    assert overlap_cut(graph, "linear_1", partial, (2,), prices) is not None  # in block 0
    assert overlap_cut(graph, "linear_3", partial, (2,), prices) is None  # the head


@pytest.mark.parametrize(
    ("named", "overlap", "chunks"),
    [(",overlap=1", 0.0, TP_OVERLAP_CHUNKS), (",overlap=2", None, 2), (",overlap=0", None, 0)],
    ids=["forced-without-efficiency", "two-chunks", "never"],
)
def test_a_hand_plan_names_the_overlap(
    monkeypatch: pytest.MonkeyPatch, named: str, overlap: float | None, chunks: int
) -> None:
    """`megatron:...,overlap=K` forces every twin that applies (each row-parallel linear the ILP
    keeps row-parallel), in K chunks, even where the profile hides nothing; overlap=0 offers none (on dgx-a100, where the
    search takes them: the test above)."""
    found = _plan(monkeypatch, twins=True, overlap=overlap, named=named)
    rows = [n for n, node in found.nodes.items() if node.outputs == ("P",)]
    rows = [n for n in rows if found.nodes[n].op == "aten.linear.default"]
    assert "linear_3" in rows, "the MLP's second linear is row-parallel"
    assert {found.nodes[n].overlap_chunks for n in rows} == {chunks}
    assert not any(node.overlap_chunks for n, node in found.nodes.items() if n not in rows)


@pytest.mark.parametrize(
    ("strategy", "match"),
    [
        ("megatron:tp=1,pp=1,dp=2,overlap=1", "with tp=1 there are none"),
        ("megatron:tp=2,pp=1,dp=1,overlap=-1", "overlap must be given once, a whole number"),
        ("megatron:tp=2,pp=1,dp=1,overlap=x", "a whole number"),
        ("megatron:tp=2,pp=1,dp=1,overlap=1,overlap=2", "given once"),
    ],
    ids=["no-tp", "negative", "not-a-number", "twice"],
)
def test_a_bad_overlap_is_refused(strategy: str, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        strategy_space(strategy)


@pytest.mark.parametrize(("named", "chunks"), [("", None), (",overlap=0", 0), (",overlap=1", 4)])
def test_the_space_states_the_overlap(named: str, chunks: int | None) -> None:
    assert strategy_space(TP8 + named).tp_overlap == chunks


def test_twins_that_cannot_pay_are_not_offered_and_dropping_them_changes_no_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tiny MLP's chunks cost more launches than its reductions could hide: no twin is
    offered (`twin_may_pay`); offered anyway, the search takes none, and prices the same."""
    module, inputs = load_model("mlp", {"layers": 2, "hidden": 32, "features": 16, "batch": 8})
    graph = capture(module, inputs)

    def planned() -> Plan:
        return plan_graph(
            graph, profile="dgx-a100", devices=2, memory_limit=None, global_batch=None,
            optimizer="adam", dtype="fp32", strategy="megatron:tp=2,pp=1,dp=1,mb=1",
            time_limit_s=60,
        )  # fmt: skip

    pruned = planned()
    cuts = price_graph(graph, Mesh((2,)), ClusterPrices(Cluster(load_profile("dgx-a100"), 1)))
    assert cuts.strategies["linear_1"].overlap_cuts is None
    monkeypatch.setattr("autosbp.planner.timing.candidates.twin_may_pay", lambda *_: True)
    offered = price_graph(graph, Mesh((2,)), ClusterPrices(Cluster(load_profile("dgx-a100"), 1)))
    assert any(offered.strategies["linear_1"].overlap_cuts or ())
    unpruned = planned()
    assert not any(node.overlap_chunks for node in unpruned.nodes.values())
    assert unpruned.predicted.step_time_s == pruned.predicted.step_time_s
