"""Ring attention's price and how a plan names it (`rules.ring`; its numerics, on simulated
devices and on 2 and 4 gloo processes, forward and backward, are in tests/rules/test_context.py).

Oracles: the cost model's p2p prices summed by hand, each ring step hidden only beside one step's
compute (as the kernel runs it: start the step, compute, wait); the plan's statement of its
exchanges read back into the kernel it was made with.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from autosbp.capturing.rebatch import micro_batch_graphs
from autosbp.errors import PlanError
from autosbp.planner.api import ClusterPrices
from autosbp.planner.problem.build import price_graph
from autosbp.planner.space.strategy import strategy_space
from autosbp.planner.timing.candidates import (
    BACKWARD_FACTOR,
    NodeStrategies,
    _forward_s,
    without_dominated_kernels,
)
from autosbp.rules import exchanges, find_signature, nd_signatures
from autosbp.rules.context import seq_mesh_dims
from autosbp.sbp import Mesh
from autosbp.zoo import build_model
from costmodel import Cluster, load_profile
from tests.support.op_comm_workers import attention_node

SDPA_OP = "aten.scaled_dot_product_attention.default"


def _attention(graph):  # type: ignore[no-untyped-def]
    name = next(n for n, a in graph.nodes() if a.op == SDPA_OP)
    return name, graph.node(name)


@pytest.mark.parametrize("devices", [2, 4], ids=str)
def test_each_ring_step_hides_only_beside_one_steps_compute(devices: int) -> None:
    # cpu-gloo: a math kernel (no causal skip), where the ring is not beaten on every count
    prices = ClusterPrices(Cluster(load_profile("cpu-gloo"), nodes=2))
    mesh = Mesh((devices,), ("cp",), link_classes=("intra_node",))
    model, inputs = build_model(
        "gpt", device="meta", layers=1, hidden=64, heads=4, seq=64, vocab=128, batch=2
    )
    graph = micro_batch_graphs(model, inputs, (1,), name="gpt")[1]
    name, attrs = _attention(graph)
    found = price_graph(graph, mesh, prices).strategies[name]
    rings = [i for i, s in enumerate(found.candidates) if s.kernel == "ring"]
    assert len(rings) == 1  # the one sequence-split layout on a 1D mesh
    assert prices.overlap_efficiency > 0
    (i,) = rings
    sig = found.candidates[i]
    declared = exchanges(attrs, sig, mesh.shape)
    steps = [e for e in declared if e.overlaps]
    assert len(steps) == devices - 1 and not any(e.backward for e in steps)

    def p2p(e) -> float:  # type: ignore[no-untyped-def]
        return prices.p2p_time_s(e.message_bytes, "intra_node")

    compute = _forward_s(attrs, sig, mesh.shape, prices)
    waited_f = sum(p2p(e) for e in declared if not e.overlaps and not e.backward)
    waited_b = sum(p2p(e) for e in declared if e.backward)
    a = prices.overlap_efficiency
    hidden = sum(a * min(p2p(e), compute / devices) for e in steps)  # one step's compute each
    forward = compute + waited_f + sum(p2p(e) for e in steps) - hidden
    assert math.isclose(found.forward_s[i], forward)
    assert math.isclose(found.compute_s[i], forward + BACKWARD_FACTOR * compute + waited_b)
    # what autograd keeps: the keys and values received from the n - 1 others
    _, k, v = (m.nbytes for m in attrs.inputs)
    assert math.isclose(found.held_bytes[i], (k + v) * (devices - 1) / devices)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_a_plan_names_the_kernel_by_the_exchanges_it_states(causal: bool) -> None:
    node = attention_node({"seed": 0, "shape": (1, 4, 2, 16, 8), "causal": causal})
    mesh_shape = (4,)
    cp = [s for s in nd_signatures(node, mesh_shape) if seq_mesh_dims(node, s, mesh_shape)]
    assert sorted(s.kernel for s in cp) == ["", "ring"]  # two kernels of one layout
    for sig in cp:
        stated = tuple(e.describe() for e in exchanges(node, sig, mesh_shape))
        assert find_signature(node, (sig.inputs, sig.outputs), stated, mesh_shape) == sig
    gather, ring = sorted(cp, key=lambda s: s.kernel)
    ring_stated = [e.describe() for e in exchanges(node, ring, mesh_shape)]
    assert ring_stated.count("send_recv on mesh dim 0 (overlapped)") == 3
    # a statement no kernel makes: the rule's own kernel comes back (the caller refuses it)
    assert find_signature(node, (ring.inputs, ring.outputs), ("nonsense",), mesh_shape) == gather


def test_no_ring_with_a_mask_or_on_two_sequence_dims() -> None:
    node = attention_node({"seed": 0, "shape": (1, 2, 2, 16, 8), "causal": True})
    both = [s for s in nd_signatures(node, (2, 2)) if len(seq_mesh_dims(node, s, (2, 2))) == 2]
    assert both and not any(s.kernel for s in both)


def test_a_kernel_beaten_on_every_count_by_another_of_its_layout_is_dropped() -> None:
    node = attention_node({"seed": 0, "shape": (1, 4, 2, 16, 8), "causal": True})
    sigs = tuple(nd_signatures(node, (2,)))
    gather = next(i for i, s in enumerate(sigs) if seq_mesh_dims(node, s, (2,)) and not s.kernel)
    ring = next(i for i, s in enumerate(sigs) if s.kernel)
    n = len(sigs)

    def strategies(ring_cost: tuple[float, float, float]) -> NodeStrategies:
        forward, total, held = np.ones(n), np.full(n, 3.0), np.ones(n)
        forward[ring], total[ring], held[ring] = ring_cost
        return NodeStrategies("sdpa", sigs, total, forward_s=forward, held_bytes=held)

    # (forward, total, held) of the ring against the all-gather's (1, 3, 1): which stay
    table = [
        ((1.0, 3.0, 1.0), False, True),  # a tie: the rule's own kernel stays
        ((2.0, 3.0, 1.0), False, True),
        ((0.5, 3.5, 1.0), True, True),  # each better on one count: both stay
        ((1.0, 2.0, 1.0), True, False),
        ((1.0, 3.0, 0.5), True, False),
    ]
    for cost, ring_stays, gather_stays in table:
        found = without_dominated_kernels(strategies(cost)).candidates
        assert (sigs[ring] in found, sigs[gather] in found) == (ring_stays, gather_stays), cost


def test_the_ring_is_asked_for_by_a_hand_plan_and_never_chosen_by_auto() -> None:
    model, inputs = build_model(
        "gpt", device="meta", layers=1, hidden=64, heads=4, seq=32, vocab=128, batch=2
    )
    graph = micro_batch_graphs(model, inputs, (1,), name="gpt")[1]
    name, attrs = _attention(graph)
    ring = next(s for s in nd_signatures(attrs, (2,)) if s.kernel)
    auto = strategy_space("auto").allow
    assert auto is not None and not auto(graph, name, ring)
    asked = strategy_space("megatron:cp=2,ring=1").allow
    assert asked is not None and asked(graph, name, ring)
    with pytest.raises(PlanError, match="needs cp=C"):
        strategy_space("megatron:tp=2,ring=1")
