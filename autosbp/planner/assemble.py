"""Turn a solved mesh problem into a `Plan`: signatures as text, predictions, solver report.

Lives here: the translation from ILP indices back to signatures and the prediction breakdown.
Lives elsewhere: the search (`search`), the plan format (`plan`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from autosbp.graph import OpGraph, Role
from autosbp.ilp import Solution
from autosbp.plan import Alternative, NodePlan, ParamPlan, Plan, Predicted, SolverReport, StagePlan
from autosbp.planner.memory import candidate_bytes
from autosbp.planner.search import MeshProblem
from autosbp.sbp import format_nd_sbp

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class PlanContext:
    """What the request said, recorded in the plan."""

    profile: str
    memory_limit_bytes: int
    strategy: str
    global_batch: int
    dtype: torch.dtype
    optimizer: str
    micro_batches: int = 1


def assemble_plan(
    graph: OpGraph, solved: MeshProblem, solution: Solution, ctx: PlanContext
) -> Plan:
    mesh = solved.mesh
    nodes: dict[str, NodePlan] = {}
    params: dict[str, ParamPlan] = {}
    compute_s = param_s = 0.0
    peak = 0.0
    for name, strategies in solved.strategies.items():
        attrs = graph.graph.nodes[name]
        sig = solved.choice_of(solution, name)
        rep = solved.representative[name]
        nodes[name] = NodePlan(
            attrs["op"],
            tuple(format_nd_sbp(nd) for nd in sig.inputs),
            tuple(format_nd_sbp(nd) for nd in sig.outputs),
            tied_to="" if rep == name else rep,
        )
        peak += candidate_bytes(attrs, sig, mesh.shape, optimizer=ctx.optimizer, in_flight=1)
        own = float(strategies.compute_s[strategies.candidates.index(sig)])
        if attrs["role"] is Role.PARAMETER:
            sbp = format_nd_sbp(sig.outputs[0])
            params[attrs["name"]] = ParamPlan(sbp, 0, sbp, tuple(attrs["outputs"][0].shape))
            param_s += own
        else:
            compute_s += own
    comm_s = solution.objective - compute_s - param_s
    blocks = tuple(sorted({a["block"] for _, a in graph.nodes() if a.get("block") is not None}))
    return Plan(
        model_name=graph.model_name,
        fingerprint=graph.fingerprint(),
        profile=ctx.profile,
        device_count=mesh.size,
        memory_limit_bytes=ctx.memory_limit_bytes,
        strategy=ctx.strategy,
        mesh_shape=mesh.shape,
        mesh_dims=mesh.dim_names,
        link_classes=mesh.link_classes,
        stages=(StagePlan(mesh.device_ids, mesh.shape, blocks, solution.objective, int(peak)),),
        micro_batches=ctx.micro_batches,
        recompute="none",
        global_batch=ctx.global_batch,
        dtype=DTYPE_NAMES[ctx.dtype],
        optimizer=ctx.optimizer,
        nodes=nodes,
        params=params,
        predicted=Predicted(
            step_time_s=solution.objective,
            peak_memory_bytes=int(peak),
            throughput_samples_per_s=ctx.global_batch / max(solution.objective, 1e-12),
            breakdown={
                "compute_s": compute_s,
                "comm_s": comm_s,
                "optimizer_and_grad_sync_s": param_s,
            },
        ),
        solver=SolverReport(solution.status, solution.gap, solution.seconds),
        alternatives=alternatives(solved, solution),
    )


def alternatives(
    solved: MeshProblem, solution: Solution, keep: int = 8
) -> dict[str, tuple[Alternative, ...]]:
    """Per representative node, its `keep` cheapest signatures (the chosen one included), each
    priced as the step time if the node (and its tied copies) switched to it alone."""
    problem = solved.problem
    neighbours: dict[str, list[tuple[np.ndarray, str, bool]]] = defaultdict(list)
    for (u, v), matrix in problem.edge_costs.items():
        neighbours[u].append((matrix, v, True))
        neighbours[v].append((matrix, u, False))
    memory = problem.memory[0].bytes_per_candidate if problem.memory else {}
    out: dict[str, tuple[Alternative, ...]] = {}
    for v, costs in problem.node_costs.items():
        chosen = solution.choice[v]
        marginal = np.array(costs, dtype=float)
        for matrix, other, outgoing in neighbours[v]:
            marginal = marginal + (
                matrix[:, solution.choice[other]] if outgoing else matrix[solution.choice[other], :]
            )
        step = solution.objective - marginal[chosen] + marginal
        mem = np.asarray(memory.get(v, np.zeros(len(costs))), dtype=float)
        order = sorted(range(len(costs)), key=lambda i: (not np.isfinite(step[i]), step[i]))[:keep]
        if chosen not in order:
            order[-1] = chosen
        candidates = solved.strategies[v].candidates
        out[v] = tuple(
            Alternative(
                repr(candidates[i]),
                float(step[i]) if np.isfinite(step[i]) else None,
                int(mem[i] - mem[chosen]),
            )
            for i in order
        )
    return out
