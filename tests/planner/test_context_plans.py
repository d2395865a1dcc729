"""Context parallelism in the search (issue #30): where grouped-query attention's KV-head count
caps the head split, auto chooses the sequence split inside attention when it is cheaper, its
peak fits, and it is the optimum of the space with and without it; the plan states the
exchanges it priced, and DTensor export refuses it with the reason.

Oracle: the space cut in two (every attention's sequence split on some mesh dim, or on none):
the optimum of the whole space is the better of the two halves' optima, each searched alone
(the search's own optimality over a space is tested against enumeration in test_search.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autosbp.capturing.rebatch import micro_batch_graphs
from autosbp.errors import PlanError
from autosbp.plan.dtensor import check_dtensor_expressible
from autosbp.planner.api import MEMORY_RESERVE_FRACTION, ClusterPrices, auto_parallelize
from autosbp.planner.problem.solve import MIP_GAP
from autosbp.planner.search.entry import search
from autosbp.planner.space.strategy import strategy_space
from autosbp.rules.context import seq_mesh_dims
from costmodel import Cluster, load_profile

SDPA = "aten.scaled_dot_product_attention.default"


class GqaBlock(nn.Module):
    """Causal attention with `kv_heads` key/value heads shared by `heads` query heads."""

    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, hidden // heads
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.kv = nn.Linear(hidden, 2 * kv_heads * self.dim, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q = self.q(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, self.dim).unbind(2)
        y = F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return x + self.out(y.transpose(1, 2).reshape(b, t, c))


class GqaModel(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(GqaBlock(hidden, heads, kv_heads) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.float().pow(2).mean()


def _long_sequence(seq: int = 16384, kv_heads: int = 2):
    with torch.device("meta"):
        model = GqaModel(2, 1024, 16, kv_heads).to(torch.bfloat16)
        x = torch.zeros(1, seq, 1024, dtype=torch.bfloat16)
    return model, (x,)


def _search(graphs, devices: int, allow):
    hw = load_profile("dgx-h100")
    cluster = Cluster(hw, nodes=1)
    limit = int(cluster.memory_bytes * (1 - MEMORY_RESERVE_FRACTION))

    def link_of(shape: tuple[int, ...], mesh_dim: int) -> str:
        return cluster.link_class_for_mesh_dim(shape, mesh_dim).value

    space = replace(strategy_space("auto", "none", 1), micro_batches=(1,), allow=allow)
    return search(
        graphs.__getitem__, 1, devices, ClusterPrices(cluster), link_of, space,
        optimizer="adam", memory_limit_bytes=limit, time_limit_s=120,
    ), limit  # fmt: skip


def test_auto_splits_the_sequence_where_kv_heads_cap_the_heads_and_it_is_the_optimum() -> None:
    # Batch 1 (no data to split), 2 KV heads (at most a 2-way head split), 8 devices at
    # sequence 16384: attention's work can spread further only by the sequence.
    model, inputs = _long_sequence()
    graphs = micro_batch_graphs(model, inputs, (1,), name="gqa")
    found, limit = _search(graphs, 8, None)
    names = [n for n, a in graphs[1].nodes() if a.op == SDPA]
    chosen = [found.problem.choice_of(found.solution, n) for n in names]
    assert names and all(
        _is_split(graphs[1].node(n), s) for n, s in zip(names, chosen, strict=True)
    )
    assert max(found.prediction.peak_bytes) <= limit  # its predicted peak fits, every stage
    halves = [_search(graphs, 8, _attention(split))[0].prediction.step_time_s for split in (1, 0)]
    best = found.prediction.step_time_s
    assert min(halves) * (1 - MIP_GAP) <= best <= min(halves) * (1 + MIP_GAP)
    assert halves[0] < halves[1], "the split sequence is the cheaper half here"


def _attention(split: bool):
    """Allow only signatures whose attention splits its sequence (or only those that do not)."""

    def allow(graph, name, sig) -> bool:
        attrs = graph.node(name)
        return attrs.op != SDPA or _is_split(attrs, sig) == split

    return allow


def _is_split(attrs, sig) -> bool:
    """Is `sig` the sequence-split row on some mesh dim (any mesh: every dim counted as > 1)?"""
    return bool(seq_mesh_dims(attrs, sig, (2,) * len(sig.inputs[0])))


def test_a_plan_states_its_exchanges_and_dtensor_refuses_it() -> None:
    from autosbp.zoo import build_model

    model, inputs = build_model("gpt", layers=1, hidden=32, heads=4, seq=16, batch=2)
    plan = auto_parallelize(model, inputs, devices=2, strategy="megatron:cp=2", time_limit_s=60)
    stated = [n.exchanges for n in plan.nodes.values() if n.op == SDPA]
    assert stated and all("all_gather on mesh dim 0" in e for e in stated)
    with pytest.raises(PlanError, match="communicate inside"):
        check_dtensor_expressible(plan)


@pytest.mark.parametrize(
    ("strategy", "mesh"),
    [
        ("megatron:cp=4", (4,)),
        ("megatron:tp=2,cp=2", (2, 2)),
        ("megatron:tp=2,cp=2,dp=2,pp=2", (2, 2, 2)),
    ],
    ids=str,
)
def test_cp_hand_plans_are_a_dp_cp_tp_mesh(strategy: str, mesh: tuple[int, ...]) -> None:
    from autosbp.sbp import Mesh

    space = strategy_space(strategy, "none")
    assert space.mesh_ok(Mesh(mesh)) and not space.mesh_ok(Mesh((*mesh[:-1], mesh[-1] * 2)))
    assert space.meshes == ((mesh,) if len(mesh) > 2 else ())


def test_cp_with_ep_is_refused() -> None:
    with pytest.raises(PlanError, match="cp and ep"):
        strategy_space("megatron:cp=2,ep=2,dp=2", "none")
