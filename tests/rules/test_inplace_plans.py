"""The planner emits only plans the runtime runs: in-place writes and empty tensors (issue #17).

An in-place write that capture keeps (into a view: T5's `shifted[..., 1:] = ids[..., :-1]`)
must reach the tensor the model reads afterwards, so no edge of its alias chain may be boxed
(`autosbp.rules.pinned_inputs`). Proven both ways: every pair of layouts the planner prices as
finite on such an edge is the identity (so every plan it can emit runs), and the runtime refuses
a plan edited to box one. Empty tensors (HF's empty KV-cache constant) price without a division
by their 0 bytes, whatever order the pricer meets them in, and every hand plan of a model with
one is priced. Oracles: the runtime's own refusal; enumeration of the edge matrices.
Lives elsewhere: capture's side of in-place ops (tests/capturing/test_capture_canonical.py), training
such models under their plans (tests/models/test_real_models.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from autosbp.capturing.export import capture
from autosbp.capturing.graph import OpGraph, TensorMeta
from autosbp.errors import PlanError
from autosbp.planner.api import auto_parallelize
from autosbp.planner.timing.candidates import (
    BoxingPricer,
    edge_matrix,
    node_strategies,
    sync_bucket_bytes,
)
from autosbp.rules import NdSignature, nd_signatures, pinned_inputs
from autosbp.sbp import B, Mesh, S
from runtime.execute.groups import ProcessGroups
from runtime.execute.instructions import Boxer
from runtime.execute.program import build_program
from tests.runtime.test_runtime import AlphaBetaPrices
from tests.support.canonical_models import build


def _pinned_edges(graph: OpGraph) -> list[tuple[str, str]]:
    edges = []
    for v in graph.order:
        pinned = pinned_inputs(graph, v)
        for u in graph.graph.predecessors(v):
            if any(i in pinned for _, i in graph.uses(u, v)):
                edges.append((u, v))
    return edges


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=str)
def test_the_planner_prices_boxing_into_an_in_place_write_as_forbidden(mesh_shape: tuple) -> None:
    graph = capture(*build("shift-right", "meta"))
    pricer = BoxingPricer(AlphaBetaPrices(), Mesh.of(mesh_shape))
    bucket = sync_bucket_bytes(graph)
    edges = _pinned_edges(graph)
    assert len(edges) >= 3  # new_zeros -> slice -> copy_, and the other writes
    forbidden = 0
    for u, v in edges:
        su, sv = (node_strategies(graph, n, pricer, bucket) for n in (u, v))
        uses = graph.uses(u, v)
        metas = [graph.node(u).outputs[o] for o, _ in uses]
        matrix = edge_matrix(su, sv, uses, metas, pricer)
        for i, j in zip(*np.nonzero(np.isfinite(matrix)), strict=True):
            for o, k in uses:
                if k in sv.pinned:
                    assert su.candidates[i].outputs[o] == sv.candidates[j].inputs[k], (u, v)
        forbidden += int(np.isinf(matrix).sum())
    assert forbidden > 0, "the constraint must bind somewhere on these meshes"


def test_the_runtime_refuses_a_plan_that_boxes_into_an_in_place_write() -> None:
    graph = capture(*build("shift-right", "cpu"))
    mesh = Mesh.of((1,))
    sigs = {name: nd_signatures(attrs, (1,))[0] for name, attrs in graph.nodes()}
    u, v = _pinned_edges(graph)[0]
    index = next(i for _, i in graph.uses(u, v) if i in pinned_inputs(graph, v))
    boxed = next(s for s in nd_signatures(graph.node(v), (1,)) if s.inputs[index] == (S(0),))
    assert sigs[u].outputs[0] == (B,)
    sigs[v] = NdSignature(boxed.inputs, boxed.outputs)
    model, _ = build("shift-right", "cpu")
    state = {**graph.meta["constants"], **dict(model.state_dict(keep_vars=True))}
    with pytest.raises(PlanError, match="in-place write"):
        build_program(graph, sigs, state, (0,), Boxer(mesh, ProcessGroups()))


@pytest.mark.parametrize("first", ["empty", "full"])
def test_boxing_prices_an_empty_tensor_in_either_order(first: str) -> None:
    """(0,) and (16,) share a divisibility pattern on 4 devices (0 divides like any size): the
    chain planned for one must not divide the other's bytes by 0."""
    pricer = BoxingPricer(AlphaBetaPrices(), Mesh.of((4,)))
    empty, full = TensorMeta((0,), torch.float32), TensorMeta((16,), torch.float32)
    order = [empty, full] if first == "empty" else [full, empty]
    prices = {meta.shape: pricer.time_s((S(0),), (B,), meta) for meta in order}
    assert prices[(0,)] == AlphaBetaPrices().collective_time_s("all_gather", 0, 4, "intra_node")
    assert prices[(16,)] > prices[(0,)]
    assert all(math.isfinite(p) for p in prices.values())


@pytest.mark.parametrize("strategy", ["auto", "fsdp"])
def test_a_model_with_an_empty_constant_plans_beside_every_hand_plan(strategy: str) -> None:
    model, inputs = build("empty-cache", "meta")
    plan = auto_parallelize(
        model, inputs, profile="cpu-gloo", devices=4, strategy=strategy, compare=True,
        time_limit_s=10.0,
    )  # fmt: skip
    assert plan.hand_plans, "the usual hand plans are priced beside it"
    assert math.isfinite(plan.predicted.step_time_s)
