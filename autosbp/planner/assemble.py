"""Turn a solved mesh problem into a `Plan`: signatures as text, predictions, solver report.

Lives here: the translation from ILP indices back to signatures and the prediction breakdown.
Lives elsewhere: the search (`search`), the plan format (`plan`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from autosbp.boxing import plan_boxing
from autosbp.boxing.params import has_collective
from autosbp.capturing.graph import OpGraph, Role
from autosbp.overlap import GRAD_BUCKET_BYTES, PREFETCH_BLOCKS
from autosbp.plan import (
    Alternative,
    NodePlan,
    ParamPlan,
    Plan,
    Predicted,
    Replicated,
    SolverReport,
    StagePlan,
)
from autosbp.plan.values import DTYPE_NAMES
from autosbp.planner.ilp.formulation import Costs, Solution
from autosbp.planner.memory.device_bytes import is_view_conversion
from autosbp.planner.problem.build import MeshProblem
from autosbp.planner.search.entry import Found
from autosbp.planner.space.recomputation import recomputed_nodes
from autosbp.rules import exchanges
from autosbp.sbp import Broadcast, NdSbp, format_nd_sbp, parse_nd_sbp


@dataclass(frozen=True)
class PlanContext:
    """What the request said, recorded in the plan."""

    profile: str
    memory_limit_bytes: int
    strategy: str
    global_batch: int
    dtype: torch.dtype
    optimizer: str
    reduce_dtype: str = "fp32"  # the gradient sync's (`Plan.precision`)
    clips_gradients: bool = False


def assemble_plan(found: Found, ctx: PlanContext) -> Plan:
    graph, solved, solution, pred = found.graph, found.problem, found.solution, found.prediction
    mesh, split = solved.mesh, solved.split
    nodes: dict[str, NodePlan] = {}
    params: dict[str, ParamPlan] = {}
    regathered = regathered_inputs(solved, solution)
    recomputing = recomputed_nodes(graph, solved.recompute, split.blocks)
    for name in graph.order:
        attrs = graph.node(name)
        sig = solved.choice_of(solution, name)
        rep = solved.representative[name]
        stage = split.stage_of[name]
        nodes[name] = NodePlan(
            attrs.op,
            tuple(format_nd_sbp(nd) for nd in sig.inputs),
            tuple(format_nd_sbp(nd) for nd in sig.outputs),
            stage,
            tied_to="" if rep == name else rep,
            recomputed=name in recomputing,
            exchanges=tuple(e.describe() for e in exchanges(attrs, sig, mesh.shape)),
            path=attrs.name or attrs.module_path,
            regathered=regathered.get(name, ()),
            overlap_chunks=solved.strategies[rep].chunks_of(solution.choice[rep])
            if attrs.role is Role.COMPUTE
            else 0,
        )
        if attrs.role is Role.PARAMETER:
            sbp = format_nd_sbp(sig.outputs[0])
            again = _reshards(solved, solution, name, sig.outputs[0])
            shape = tuple(attrs.outputs[0].shape)
            chose, i = solved.strategies[rep], solution.choice[rep]
            state, grad = chose.state_of(i), chose.gradient_of(i)
            states = format_nd_sbp(state) if state is not None else sbp
            grads = format_nd_sbp(grad) if grad is not None else sbp
            params[attrs.name] = ParamPlan(sbp, stage, states, shape, again, grads)
    pipeline, m = solved.pipeline_stages, solved.micro_batches
    stages = _stage_plans(found)
    return Plan(
        model_name=graph.model_name,
        fingerprint=graph.fingerprint(),
        profile=ctx.profile,
        device_count=mesh.size * pipeline,
        memory_limit_bytes=ctx.memory_limit_bytes,
        strategy=ctx.strategy,
        mesh_shape=mesh.shape,
        mesh_dims=mesh.dim_names,
        link_classes=mesh.link_classes,
        stages=stages,
        micro_batches=m,
        grad_bucket_bytes=GRAD_BUCKET_BYTES,  # what `sync_bucket_bytes` priced the sync with
        recompute=solved.recompute,
        global_batch=ctx.global_batch,
        dtype=DTYPE_NAMES[ctx.dtype],
        optimizer=ctx.optimizer,
        reduce_dtype=ctx.reduce_dtype,
        clips_gradients=ctx.clips_gradients,
        nodes=nodes,
        params=params,
        predicted=Predicted(
            step_time_s=pred.step_time_s,
            peak_memory_bytes=int(max(pred.peak_bytes)),
            throughput_samples_per_s=ctx.global_batch / max(pred.step_time_s, 1e-12),
            breakdown=breakdown(found),
        ),
        solver=solver_report(found),
        alternatives=alternatives(solved, solution),
        replicated=replicated_of(graph, nodes, mesh.shape),
        virtual_stages=solved.virtual_stages,
        schedule=solved.schedule,
    )


def _stage_plans(found: Found) -> tuple[StagePlan, ...]:
    """Each (virtual) stage's devices, blocks and predicted times, as the plan states them."""
    solved, pred = found.problem, found.prediction
    mesh, split, m = solved.mesh, solved.split, solved.micro_batches
    per_stage, pipeline = mesh.size, solved.pipeline_stages
    return tuple(
        StagePlan(  # virtual stage s (interleaved) runs on stage s % P's devices
            devices=tuple(range((s % pipeline) * per_stage, (s % pipeline + 1) * per_stage)),
            mesh_shape=mesh.shape,
            blocks=split.blocks[s],
            step_time_s=m * (pred.forward_s[s] + pred.backward_s[s])
            + pred.update_s[s]
            - pred.sync_hidden_s[s],
            peak_memory_bytes=int(pred.peak_bytes[s]),
            forward_s=pred.forward_s[s],
            backward_s=pred.backward_s[s],
            send_s=pred.send_s[s],
            update_s=pred.update_s[s],
            sync_hidden_s=pred.sync_hidden_s[s],
            prefetch_blocks=PREFETCH_BLOCKS if solved.stage_costs.hides(s) else 0,
            gather_hidden_s=pred.gather_hidden_s[s],
            grad_sync_s=pred.sync_s[s],
            weight_s=pred.weight_s[s] if pred.weight_s else None,
        )
        for s in range(split.num_stages)
    )


def replicated_of(
    graph: OpGraph, nodes: Mapping[str, NodePlan], mesh_shape: tuple[int, ...]
) -> Replicated:
    """The share of compute FLOPs whose node every device runs whole (B in and out on each
    mesh dim of more than one device), and the share of those with no rule (`warn_unknown_ops`
    names them at capture): what the plan cannot split, and why."""
    total = replicated = no_rule = 0.0
    unknown = set(graph.unknown_ops)
    ops: set[str] = set()
    for name, attrs in graph.nodes(Role.COMPUTE):
        total += attrs.flops
        texts = (*nodes[name].inputs, *nodes[name].outputs)
        if all(_whole(parse_nd_sbp(t), mesh_shape) for t in texts):
            replicated += attrs.flops
            if attrs.op in unknown:
                no_rule += attrs.flops
                ops.add(attrs.op)
    if not total or max(mesh_shape, default=1) == 1:  # one device: nothing to split
        return Replicated(0.0, 0.0)
    return Replicated(replicated / total, no_rule / total, tuple(sorted(ops)))


def _whole(layout: NdSbp, mesh_shape: tuple[int, ...]) -> bool:
    return all(isinstance(s, Broadcast) or n == 1 for s, n in zip(layout, mesh_shape, strict=True))


def _reshards(solved: MeshProblem, solution: Solution, name: str, layout: NdSbp) -> bool:
    """Does parameter `name` (stored in `layout`) free its converted copies after forward? Where
    its candidate re-gathers and some consumer's conversion makes a copy: where none does, the
    two twins are priced alike (nothing to free) and the plan says keep."""
    rep = solved.representative[name]
    if not solved.strategies[rep].regathers(solution.choice[rep]):
        return False
    graph = solved.graph
    assert graph is not None, "a solved problem keeps its graph"
    for v in graph.graph.successors(name):
        inputs = solved.choice_of(solution, v).inputs
        for _, in_idx in graph.uses(name, v):
            if not is_view_conversion(layout, inputs[in_idx]):
                return True
    return False


def regathered_inputs(solved: MeshProblem, solution: Solution) -> dict[str, tuple[int, ...]]:
    """Per op whose chosen candidate is a re-gathering twin (`timing.regather`), the input its
    backward converts again: a twin takes only pairs where that input is kept and reaches it
    through a conversion that exchanges data, by an op that is not recomputed."""
    graph = solved.graph
    assert graph is not None, "a solved problem keeps its graph"
    rep, choice = solved.representative, solution.choice
    again = recomputed_nodes(graph, solved.recompute, solved.split.blocks)
    found: dict[str, tuple[int, ...]] = {}
    for v, _ in graph.nodes(Role.COMPUTE):
        index = solved.strategies[rep[v]].regathered_input(choice[rep[v]])
        if index is None or v in again:  # a recomputed copy converts again in its run
            continue
        u, out = graph.producers(v)[index] or ("", 0)
        have = solved.choice_of(solution, u).outputs[out]
        want, shape = solved.choice_of(solution, v).inputs[index], graph.node(u).outputs[out].shape
        assert has_collective(plan_boxing(have, want, shape, solved.mesh)), (v, index)
        found[v] = (index,)
    return found


def solver_report(found: Found) -> SolverReport:
    """The search's proven status and gap over its whole space, and its effort."""
    effort = found.effort
    assert effort is not None, "plans are assembled from what `search` returns"
    return SolverReport(
        effort.status, effort.gap, effort.seconds, effort.configurations, effort.bounded,
        effort.solved,
    )  # fmt: skip


def breakdown(found: Found) -> dict[str, float]:
    """Where the step goes on its busiest stage: compute (with recomputation) and boxing for all
    micro-batches (the parameters' conversions in full, what the blocks' compute hides of them
    apart), the per-step gradient sync + optimizer (what backward does not hide of it; the
    hidden part apart), and the rest of the step (pipeline bubble and transfers). Interleaved,
    a stage's figures are the sums over its chunks."""
    solved, choice, pred = found.problem, found.solution.choice, found.prediction
    costs, p = solved.stage_costs, solved.pipeline_stages
    chunks = [range(d, solved.split.num_stages, p) for d in range(p)]
    busiest = max(chunks, key=lambda cs: sum(costs.busy[k].value(choice) for k in cs))
    m = solved.micro_batches

    def total(value: Callable[[int], float]) -> float:
        return sum(value(k) for k in busiest)

    compute = m * total(lambda k: Costs(costs.busy[k].node_costs).value(choice))
    comm = m * total(lambda k: Costs({}, costs.busy[k].edge_costs).value(choice))
    hidden = m * total(lambda k: pred.gather_hidden_s[k])
    update = total(lambda k: pred.update_s[k] - pred.sync_hidden_s[k])
    return {
        "compute_s": compute,
        "comm_s": comm,
        "param_comm_hidden_s": hidden,
        "optimizer_and_grad_sync_s": update,
        "grad_sync_hidden_s": total(lambda k: pred.sync_hidden_s[k]),
        "bubble_and_transfer_s": max(0.0, pred.step_time_s - compute - comm + hidden - update),
    }


def alternatives(
    solved: MeshProblem, solution: Solution, keep: int = 8
) -> dict[str, tuple[Alternative, ...]]:
    """Per representative node, its `keep` cheapest signatures (the chosen one included), each
    priced as the ILP objective if the node (and its tied copies) switched to it alone. A
    parameter's layout that appears twice (kept, re-gathered: `costs.NodeStrategies.regather`)
    is named with `reshard_after_forward` for its re-gathered twin, and with `states Q` for
    its twin whose optimizer states lie in Q (ZeRO-1)."""
    problem, choice = solved.problem, solution.choice
    out: dict[str, tuple[Alternative, ...]] = {}
    linear = Costs(problem.node_costs, problem.edge_costs)
    for v in problem.node_costs:
        chosen = choice[v]
        objective = _switched(linear, v, choice)
        values: list[np.ndarray] = []  # each max term's value per candidate (inner ones first)
        for term in problem.max_terms:
            parts = [
                _switched(part, v, choice) + sum(c * values[t] for t, c in term.inner_of(p).items())
                for p, part in enumerate(term.parts)
            ]
            values.append(np.max(parts, axis=0))
            objective = objective + term.weight * values[-1]
        mem = np.zeros(len(objective))
        if problem.memory:  # the tightest stage's bytes
            mem = np.max(
                [_switched(Costs(c.bytes_per_candidate, c.bytes_per_pair), v, choice)
                 for c in problem.memory],
                axis=0,
            )  # fmt: skip
        order = sorted(
            range(len(objective)),
            key=lambda i: (not np.isfinite(objective[i]), objective[i]),
        )[:keep]
        if chosen not in order:
            order[-1] = chosen
        found = solved.strategies[v]
        out[v] = tuple(
            Alternative(
                repr(found.candidates[i])
                + (_regather_label(solved, v) if found.regathers(i) else "")
                + (f" states {format_nd_sbp(q)}" if (q := found.state_of(i)) else "")
                + (" gradient too" if found.gradient_of(i) is not None else ""),
                float(objective[i]) if np.isfinite(objective[i]) else None,
                int(mem[i] - mem[chosen]),
            )
            for i in order
        )
    return out


def _regather_label(solved: MeshProblem, v: str) -> str:
    """How `alternatives` names a re-gathering twin: FSDP's word for a parameter's, sequence
    parallelism's for an op's."""
    graph = solved.graph
    parameter = graph is not None and graph.node(v).role is Role.PARAMETER
    return " reshard_after_forward" if parameter else " re-gathered in backward"


def _switched(costs: Costs, v: str, choice: dict[str, int]) -> np.ndarray:
    """The value of `costs` for each candidate of `v`, every other node keeping its choice."""
    base = costs.value(choice)
    marginal = np.array(costs.node_costs[v], dtype=float)
    for (a, b), matrix in costs.edge_costs.items():
        if a == v:
            marginal = marginal + matrix[:, choice[b]]
        elif b == v:
            marginal = marginal + matrix[choice[a], :]
    return base - marginal[choice[v]] + marginal
