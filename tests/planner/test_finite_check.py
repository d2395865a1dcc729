"""The runtime's non-finite check is priced in the update (`autosbp.planner.timing.finite_check`).

The check (`runtime.verify.finite.first_non_finite`) reads every local gradient once (one
fused max-norm op) and all-reduces one integer over the world, each step. Oracles: the
profile's own prices, asked here directly: per parameter candidate, its update less the sync
and optimizer `timing.param_candidates.parameter_prices` gives is a streaming read of its local
gradient; per stage, the predicted update less its parameters' updates is the op's floor
and one 8-byte all-reduce over the world.
"""

from __future__ import annotations

import math

import pytest
import torch

from autosbp.capturing.export import capture
from autosbp.capturing.graph import Role
from autosbp.planner.problem.build import build_problem
from autosbp.planner.problem.solve import solve_mesh
from autosbp.planner.space.stages import split_stages
from autosbp.planner.timing.boxing_prices import BoxingPricer
from autosbp.planner.timing.candidates import sync_bucket_bytes
from autosbp.planner.timing.param_candidates import parameter_prices
from autosbp.planner.timing.predict import predict
from autosbp.sbp import Mesh, local_shape
from autosbp.zoo import build_model
from tests.planner.test_planner import a100_prices

MESHES = [((2,), ("intra_node",)), ((2, 2), ("inter_node", "intra_node"))]


def _problem(shape: tuple[int, ...], links: tuple[str, ...], stages: int = 1):
    model, inputs = build_model("mlp", layers=2, hidden=16, features=8, outputs=4, batch=8)
    graph = capture(model, inputs)  # 2 blocks: 2 stages can split it
    mesh = Mesh(shape, link_classes=links)
    prices = a100_prices()
    mp = build_problem(
        graph, mesh, prices, optimizer="adam", memory_limit_bytes=None,
        split=split_stages(graph, stages), stage_link="inter_node",
    )  # fmt: skip
    return graph, mesh, prices, mp


@pytest.mark.parametrize(("shape", "links"), MESHES, ids=["mesh2", "mesh2x2"])
def test_each_parameter_candidate_pays_the_read_of_its_gradient(shape, links) -> None:
    graph, mesh, prices, mp = _problem(shape, links)
    pricer, bucket = BoxingPricer(prices, mesh), sync_bucket_bytes(graph)
    params = [n for n in mp.strategies if graph.node(n).role is Role.PARAMETER]
    assert params
    for name in params:
        found, meta = mp.strategies[name], graph.node(name).outputs[0]
        states = [found.state_of(i) for i in range(len(found.candidates))]
        grads = [found.gradient_of(i) for i in range(len(found.candidates))]
        priced = parameter_prices(
            meta, found.candidates, states, grads, pricer.bucketed_time_s, prices, mesh.shape,
            bucket,
        )  # fmt: skip
        sync, update = priced.sync_s, priced.update_s
        for i, sig in enumerate(found.candidates):
            local = math.prod(local_shape(meta.shape, sig.outputs[0], mesh.shape))
            # the profile's streaming read of those bytes (its memory rate, no per-op floor)
            n = 1 << 30
            read_s = local * prices.op_time_s(n, n * meta.dtype.itemsize, meta.dtype) / n
            assert read_s > 0
            check_s = found.compute_s[i] - sync[i] - update[i]
            assert check_s == pytest.approx(read_s, rel=1e-9), (name, i)


@pytest.mark.parametrize("stages", [1, 2], ids=["1stage", "2stages"])
@pytest.mark.parametrize(("shape", "links"), MESHES, ids=["mesh2", "mesh2x2"])
def test_the_predicted_update_holds_one_all_reduce_of_the_check(shape, links, stages) -> None:
    graph, mesh, prices, mp = _problem(shape, links, stages)
    got = solve_mesh(mp, time_limit_s=30)
    assert got is not None
    prediction = predict(mp, got)
    # the fused norm's one floor, the all-reduce over the stage's mesh, then over the stages
    check_s = prices.op_time_s(0, 0, torch.float32)
    check_s += prices.collective_time_s("all_reduce", 8, mesh.size, links[0])
    if stages > 1:
        check_s += prices.collective_time_s("all_reduce", 8, stages, "inter_node")
    assert check_s > 0
    for s in range(stages):  # every parameter of the stage, tied copies too, as chosen
        params = [
            n for n in graph.order
            if graph.node(n).role is Role.PARAMETER and mp.split.stage_of[n] == s
        ]  # fmt: skip
        choice = {n: got.choice[mp.representative[n]] for n in params}
        updates_s = sum(mp.strategies[n].compute_s[choice[n]] for n in params)
        assert prediction.update_s[s] - updates_s == pytest.approx(check_s, rel=1e-9)
        # the split the plan records: the sync, and the optimizer's part holding the check
        assert 0 <= prediction.sync_s[s] <= prediction.update_s[s] - check_s
