"""GradSync on 4 gloo processes (a 2x2 mesh): buckets launch inside the last backward, in order,
and the synced gradients equal the sums an oracle computes from every rank's inputs; an Engine
buckets with the cap its plan states (`Plan.grad_bucket_bytes`), not the planner's constant."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist

from autosbp.overlap import GRAD_BUCKET_BYTES
from autosbp.plan import Plan
from autosbp.planner.api import auto_parallelize
from autosbp.sbp import B, Mesh, S, parse_nd_sbp
from autosbp.zoo import build_model
from launching.workers import run_workers
from runtime import Engine
from runtime.execute.groups import world_timeout
from runtime.parallel.grad_sync import GradSync, build_sync_groups, summed_dims, sync_patterns

pytestmark = pytest.mark.dist

MESH = Mesh((2, 2), device_ids=(0, 1, 2, 3))
# graph order; "unused" gets no gradient and comes first, so its bucket is launched last
LAYOUTS = {
    "unused": parse_nd_sbp("BB"),
    "both": parse_nd_sbp("BB"),
    "dim1": parse_nd_sbp("S(0)B"),
    "dim0": parse_nd_sbp("BS(0)"),
    "split": parse_nd_sbp("S(0)S(0)"),
}
SHAPE = (4, 3)  # every parameter's local shape (the full shape follows from its layout)


def _inputs(rank: int, micro_batch: int) -> dict[str, torch.Tensor]:
    """What rank `rank` multiplies each parameter by in `micro_batch`: its local gradient."""
    gen = torch.Generator().manual_seed(100 * rank + micro_batch)
    return {name: torch.randn(SHAPE, generator=gen) for name in LAYOUTS}


def _sync_worker(rank: int, world_size: int) -> dict[str, object]:
    params = {name: torch.zeros(SHAPE, requires_grad=True) for name in LAYOUTS}
    groups = build_sync_groups([MESH], sync_patterns(LAYOUTS.values(), MESH.shape))
    sync = GradSync(params, LAYOUTS, MESH, groups, world_timeout(), bucket_bytes=1)
    for micro_batch in range(2):
        if micro_batch == 1:
            sync.arm()
        x = _inputs(rank, micro_batch)
        loss = sum((params[n] * x[n]).sum() for n in LAYOUTS if n != "unused")
        loss.backward()
    launched = sync.launched_in_backward
    sync.finish()
    coords = MESH.coords(rank)
    wrong = []
    for name, param in params.items():
        if name == "unused":
            if param.grad is not None:
                wrong.append(name)
            continue
        group = MESH.group_of(coords, summed_dims(LAYOUTS[name], MESH.shape)) or (rank,)
        expected = sum(_inputs(r, mb)[name] for r in group for mb in range(2))
        if not torch.allclose(param.grad, expected, rtol=1e-6, atol=1e-6):
            wrong.append(name)
    dist.barrier()
    return {"buckets": len(sync.buckets), "launched": launched, "wrong": wrong}


def test_buckets_launch_during_backward_and_sum_over_their_mesh_dims() -> None:
    results = run_workers(_sync_worker, MESH.size, timeout_s=120)
    for rank, result in enumerate(results):
        assert result["wrong"] == [], f"rank {rank}: wrong gradients {result['wrong']}"
        # "split" needs no sync; "unused" never finishes, so only its bucket waits for finish
        assert result["buckets"] == 4, result
        assert result["launched"] == 3, result


def test_patterns_and_groups() -> None:
    assert summed_dims((B, S(0)), (2, 2)) == (0,)
    assert summed_dims((B, B), (2, 1)) == (0,)  # a dim of one device sums nothing
    assert sync_patterns(LAYOUTS.values(), (2, 2)) == [(0,), (0, 1), (1,)]
    assert MESH.groups_over((0, 1)) == [(0, 1, 2, 3)]
    assert MESH.groups_over((0,)) == MESH.groups(0) == [(0, 2), (1, 3)]
    assert MESH.group_of((1, 1), (1,)) == (2, 3)


def _engine_buckets(rank: int, world_size: int, plans: list[Any]) -> list[tuple[int, int]]:
    """Per plan (JSON): the Engine's gradient buckets and the parameters they hold."""
    out = []
    for data in plans:
        model, inputs = build_model("mlp", seed=0)
        engine = Engine(model, Plan.from_json(data), torch.optim.SGD, example_inputs=inputs)
        buckets = engine.grad_sync.buckets
        out.append((len(buckets), sum(len(b.params) for b in buckets)))
    return out


def test_the_engine_buckets_with_the_cap_its_plan_states() -> None:
    model, inputs = build_model("mlp", seed=0)
    plan = auto_parallelize(model, inputs, devices=2, strategy="dp", time_limit_s=30.0)
    assert plan.grad_bucket_bytes == GRAD_BUCKET_BYTES  # a new plan states what it priced
    tiny = dataclasses.replace(plan, grad_bucket_bytes=1)
    results = run_workers(_engine_buckets, 2, ([plan.to_json(), tiny.to_json()],), timeout_s=120)
    for rank, [(priced, synced), (one_each, synced_again)] in enumerate(results):
        # mlp's gradients fit one 25 MB bucket; a 1-byte cap puts each in its own
        assert (priced, one_each) == (1, synced) and synced == synced_again > 1, (rank, results)
