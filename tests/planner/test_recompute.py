"""Recomputation as defined: what each mode recomputes, and what it keeps.

Selective (Korthikanti et al. 2022, section 5) recomputes the attention core alone (from the
product of queries and keys to the product with the values); with a fused attention kernel
there is nothing to drop and it prices as none; mlp recomputes each MLP's activation (nothing
beside a one-op GELU); full recomputes every op of a block. So, for every choice of
signatures, a stage's memory under full <= under selective, mlp <= under none: the oracle here
is that order, checked at the solved choice of every mode that recomputes something
(`distinct_modes`), for every zoo model and every hand plan (each priced under all four). The
runtime checkpoints exactly the runs the planner prices
(`runtime.execute.program._recompute_runs`).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from autosbp.capturing.graph import OpGraph, Role
from autosbp.capturing.rebatch import micro_batch_graphs
from autosbp.planner.api import ClusterPrices
from autosbp.planner.problem.build import MeshProblem, build_problem
from autosbp.planner.problem.priced import price_graph
from autosbp.planner.problem.solve import solve_mesh
from autosbp.planner.space.configs import mesh_shapes
from autosbp.planner.space.recomputation import RECOMPUTE_MODES, distinct_modes, recompute_runs
from autosbp.planner.space.stages import split_stages
from autosbp.planner.space.strategy import hand_strategies, strategy_space
from autosbp.zoo import ZOO_MODELS, build_model
from autosbp.zoo.models import CausalSelfAttention, Gpt
from costmodel import Cluster, load_profile

DEVICES, PER_NODE = 8, 8
CLUSTER = Cluster(load_profile("dgx-a100"), nodes=1)
PRICES = ClusterPrices(CLUSTER)


class EagerAttention(CausalSelfAttention):
    """nanoGPT's attention without the fused kernel: scores, causal mask, softmax, dropout."""

    def __init__(self, hidden: int, heads: int, seq: int) -> None:
        super().__init__(hidden, heads)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
        att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf"))
        att = F.dropout(F.softmax(att, dim=-1), 0.1, self.training)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, c))


def eager_gpt(layers: int = 2, hidden: int = 64, heads: int = 4, seq: int = 16, batch: int = 16):
    model = Gpt(layers, hidden, heads, 128, seq, tied=False)
    for block in model.blocks:
        block.attn = EagerAttention(hidden, heads, seq)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (batch, seq), generator=g)
    return model, (ids, torch.randint(0, 128, (batch, seq), generator=g))


def _graph(name: str) -> OpGraph:
    """Two micro-batches of 8 samples: every hand plan of 8 devices splits them."""
    model, inputs = eager_gpt() if name == "gpt-eager" else build_model(name, batch=16)
    return micro_batch_graphs(model, inputs, (2,), name=name)[2]


def _link(shape: tuple[int, ...], mesh_dim: int) -> str:
    return CLUSTER.link_class_for_mesh_dim(shape, mesh_dim).value


def _problems(graph: OpGraph, strategy: str) -> list[dict[str, MeshProblem]]:
    """Per stage mesh the strategy allows, its problem under each mode (2 micro-batches)."""
    blocks = len({a.block for _, a in graph.nodes() if a.block is not None})
    space = strategy_space(strategy, "auto", blocks)
    stages = space.stage_counts[-1]
    if blocks < stages or DEVICES % stages:
        return []
    split = split_stages(graph, stages)
    meshes = mesh_shapes(DEVICES // stages, lambda s, d: _link((stages, *s), d + 1), PER_NODE)
    out = []
    for mesh in filter(space.mesh_ok, meshes):
        priced = price_graph(graph, mesh, PRICES, space.allow)
        out.append(
            {
                mode: build_problem(
                    graph,
                    mesh,
                    PRICES,
                    optimizer="adam",
                    memory_limit_bytes=None,
                    allow=space.allow,
                    micro_batches=2,
                    split=split,
                    recompute=mode,
                    stage_link=_link((stages, mesh.size), 0),
                    priced=priced,
                )
                for mode in RECOMPUTE_MODES
            }
        )
    return out


CASES = [
    (model, strategy)
    for model in (*ZOO_MODELS, "gpt-eager")
    for strategy in hand_strategies(DEVICES, PER_NODE, 2)
]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "strategy"), CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_full_keeps_at_most_selective_keeps_at_most_none(model: str, strategy: str) -> None:
    graph = _graph(model)
    checked = 0
    for by_mode in _problems(graph, strategy):
        for solved_under in distinct_modes(graph):  # the others' problems are none's
            mp = by_mode[solved_under]
            solution = solve_mesh(mp, 60.0)
            assert solution is not None, f"{model} {strategy}: no plan without a memory limit"
            checked += 1
            used = {
                mode: [c.used_bytes(solution.choice) for c in by_mode[mode].stage_costs.memory]
                for mode in RECOMPUTE_MODES
            }
            for s in range(len(used["none"])):
                full, none = used["full"][s], used["none"][s]
                where = (
                    f"{model} {strategy} {mp.mesh.shape} stage {s} (chosen under {solved_under})"
                )
                for between in ("selective", "mlp"):
                    assert full <= used[between][s] * (1 + 1e-12), (
                        f"{where}: full {full} > {between} {used[between][s]}"
                    )
                    assert used[between][s] <= none * (1 + 1e-12), (
                        f"{where}: {between} {used[between][s]} > none {none}"
                    )
    blocks = len({a.block for _, a in graph.nodes() if a.block is not None})
    assert checked or blocks < strategy_space(strategy, "auto", blocks).stage_counts[-1]


def test_selective_recomputes_the_attention_core_alone() -> None:
    graph = _graph("gpt-eager")
    runs = recompute_runs(graph, "selective")
    ops = [graph.node(n).op.split(".")[1] for n in graph.order if n in runs]
    per_block = len(ops) // 2
    assert len(set(runs.values())) == 2, "one run per block"
    core = ops[:per_block]
    assert core[0] == core[-1] == "matmul", core  # queries x keys ... x values
    assert "softmax" in core and "dropout" in core, core
    assert "linear" not in ops and "layer_norm" not in ops, ops


def test_selective_keeps_less_than_none_without_a_fused_kernel() -> None:
    """The scores (batch x heads x seq^2) are what selective drops: at the same choice,
    selective keeps strictly less than none, and strictly more than full."""
    by_mode = _problems(_graph("gpt-eager"), "megatron:tp=1,pp=2,dp=4")[0]
    solution = solve_mesh(by_mode["none"], 60.0)
    assert solution is not None
    first = {m: by_mode[m].stage_costs.memory[0].used_bytes(solution.choice) for m in by_mode}
    assert first["full"] < first["selective"] < first["none"], first


def test_a_fused_kernel_leaves_selective_nothing_to_drop() -> None:
    graph = _graph("gpt")
    assert not recompute_runs(graph, "selective")
    assert recompute_runs(graph, "full")
    blocks = {graph.node(n).block for n in recompute_runs(graph, "full")}
    assert blocks == {0, 1}


def test_every_block_op_is_recomputed_under_full() -> None:
    graph = _graph("gpt-eager")
    runs = recompute_runs(graph, "full")
    in_blocks = {n for n, a in graph.nodes(Role.COMPUTE) if a.block is not None}
    assert set(runs) == in_blocks
    assert len(set(runs.values())) == 2, "one run per block"


def test_the_runtime_checkpoints_the_runs_the_planner_prices() -> None:
    # The plan states the recomputed nodes (the planner's runs' members); the runtime cuts the
    # same runs from them.
    from runtime.execute.builder import ProgramBuilder
    from runtime.execute.recompute_runs import recompute_runs as runtime_runs

    graph = _graph("gpt-eager")
    runs = recompute_runs(graph, "selective")
    builder = ProgramBuilder.__new__(ProgramBuilder)
    builder.graph = graph
    builder.owners = [n for n, _ in graph.nodes(Role.COMPUTE)]
    builder.steps = list(builder.owners)
    spans = runtime_runs(builder, frozenset(runs))
    checkpointed = [{builder.owners[k] for k in range(a, b)} for a, b in spans]
    expected = [{n for n in runs if runs[n] == r} for r in sorted(set(runs.values()))]
    assert checkpointed == expected


@pytest.mark.parametrize("model", ["gpt-eager", "moe", "resnet"])
def test_a_count_keeps_what_another_count_of_its_structure_says(model: str) -> None:
    # The search reads what backward keeps once per structure
    # (`search.evaluator.Evaluator.kept_of`): read off another micro-batch count's graph, it equals
    # reading this graph afresh.
    from autosbp.planner.memory.kept import kept_for_backward
    from autosbp.planner.space.ties import tie_graph

    built = eager_gpt() if model == "gpt-eager" else build_model(model, batch=16)
    graphs = micro_batch_graphs(*built, (1, 2, 4), name=model)
    for mode in RECOMPUTE_MODES:
        first = kept_for_backward(graphs[1], tie_graph(graphs[1]).representative, mode)
        for count in (2, 4):
            rep = tie_graph(graphs[count]).representative
            fresh = kept_for_backward(graphs[count], rep, mode)
            assert kept_for_backward(graphs[count], rep, mode, like=first) == fresh
