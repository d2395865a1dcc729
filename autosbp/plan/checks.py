"""Whole-plan checks: every way a plan can contradict itself or its model, found before anything
runs.

Lives here: `plan_problems(plan, graph=None)` (every problem found, each a sentence) and
`check_plan` (one PlanError listing them). Used by `autosbp train` (in the parent, against the
model's captured graph, before any process starts), `show` and `explain` (the plan alone), and
the Engine (every rank, against its own graph). Lives elsewhere: what JSON and its schema say
(`plan.values`: types, required fields, SBP text, finite numbers, sizes within int64).

The plan alone:
- mesh: one dim name and one known link class per mesh dim;
- devices: stages of the plan's mesh shape that split devices 0..N-1 between them, each once
  (interleaved, v chunks each: virtual stage c x P + d on stage d's devices);
- schedule: one the actor rules give (`zero_bubble.check_schedule`);
- stages: each holds a node, every node's stage exists;
- SBPs: one entry per mesh dim; each parameter's layout (and its optimizer state's, which the
  runtime keeps in the parameter's layout) splits only dims its shape has, evenly;
- numbers: a positive predicted step time, non-negative parts; micro-batches dividing the batch.
With the model's graph (of one micro-batch, as the plan was made):
- the plan covers every node once, with the node's op, and names no other;
- every signature is one the node's rule offers on the mesh, with the collectives its kernel
  runs inside the op (`exchanges`) as the plan states them (what the runtime would refuse);
- data flows forward: a node's value goes to its own stage or a later one (stages run in
  order: a value sent back to an earlier stage would wait forever);
- every parameter's entry matches its node: layout, stage, shape;
- the global batch is what the runtime trains: micro-batches x the graph's batch;
- a recomputed node is a compute node inside a repeated block that writes no input; under
  `full:K`, exactly the nodes full recomputes of each stage's first K blocks are;
- an input re-gathered in backward is an activation reaching a node that is not recomputed
  through a conversion that exchanges data, under a backward that runs once (1f1b);
- an op run in chunks beside its output's reduction (`overlap_chunks` k) is a matmul-like
  compute op, k >= 2, whose one output one reader on its stage reads once through one
  all-reduce or reduce-scatter (`tp_overlap.reduce_step`), cut along a dim (`tp_overlap.
  chunk_plan`) that reduction does not split, recomputed exactly when its reader is (what the
  runtime runs and the planner prices: `planner.timing.tp_overlap`).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from autosbp.errors import PlanError, SbpError
from autosbp.plan.values import Plan
from autosbp.sbp import Broadcast, Split, check_nd_sbp, format_nd_sbp, local_shape, parse_nd_sbp
from autosbp.zero_bubble import check_schedule
from costmodel.profile import LinkClass
from terminal.text import printable

if TYPE_CHECKING:  # torch loads only when a plan is checked against its model
    from autosbp.capturing.graph import OpGraph

__all__ = ["check_plan", "plan_problems"]

_SHOWN = 8  # problems listed in one message (the count says how many more)
_NAMES = 4  # names listed in one problem


def check_plan(plan: Plan, graph: OpGraph | None = None, *, source: str = "the plan") -> None:
    """Raise one PlanError listing every problem `plan_problems` finds."""
    problems = plan_problems(plan, graph)
    if not problems:
        return
    listed = "; ".join(f"({i}) {p}" for i, p in enumerate(problems[:_SHOWN], 1))
    more = f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
    raise PlanError(
        f"{source} is inconsistent ({len(problems)} problem(s)): {printable(listed)}{more}. It "
        "was edited or damaged, or made by another autosbp: make it again with `autosbp plan`."
    )


def plan_problems(plan: Plan, graph: OpGraph | None = None) -> list[str]:
    """Every problem of `plan` (alone, and against `graph` when given), as sentences."""
    problems = [*_mesh(plan), *_devices(plan), *_stages(plan), *_ties(plan)]
    problems += [*_layouts(plan), *_numbers(plan)]
    if graph is not None:
        problems += [*_coverage(plan, graph), *_data_flow(plan, graph), *_params(plan, graph)]
        problems += [*_blocks(plan, graph), *_batch(plan, graph), *_recomputation(plan, graph)]
        problems += [*_regathers(plan, graph), *_overlaps(plan, graph), *_partial(plan, graph)]
    return problems


def _names(names: Iterable[object]) -> str:
    shown = [str(n) for n in names]
    more = f" and {len(shown) - _NAMES} more" if len(shown) > _NAMES else ""
    return ", ".join(shown[:_NAMES]) + more


# ---- the plan alone --------------------------------------------------------------------------


def _mesh(plan: Plan) -> list[str]:
    ndim, out = len(plan.mesh_shape), []
    if len(plan.mesh_dims) != ndim or len(plan.link_classes) != ndim:
        out.append(
            f"the mesh has shape {list(plan.mesh_shape)} but dims {list(plan.mesh_dims)} and link "
            f"classes {list(plan.link_classes)}: one of each per mesh dim"
        )
    known = {lc.value for lc in LinkClass}
    unknown = sorted(set(plan.link_classes) - known)
    if unknown:
        out.append(f"unknown link classes {unknown} (known: {sorted(known)})")
    return out


def _devices(plan: Plan) -> list[str]:
    size, count, out = math.prod(plan.mesh_shape), plan.device_count, _schedule(plan)
    if out:
        return out
    pipeline = plan.stages[: plan.pipeline_stages]
    if size * len(pipeline) != count:
        out.append(
            f"{len(pipeline)} stage(s) of mesh {list(plan.mesh_shape)} hold "
            f"{size * len(pipeline)} devices, but the plan is for {count}"
        )
    for s, stage in enumerate(plan.stages[len(pipeline) :], start=len(pipeline)):
        if stage.devices != (want := pipeline[s % len(pipeline)].devices):
            where = f"chunk {s // len(pipeline)} of stage {s % len(pipeline)} runs on {list(want)}"
            out.append(f"virtual stage {s} lists devices {list(stage.devices)}, but {where}")
    for s, stage in enumerate(plan.stages):
        if stage.mesh_shape != plan.mesh_shape:
            out.append(
                f"stage {s} has mesh {list(stage.mesh_shape)}, the plan {list(plan.mesh_shape)}"
            )
        if len(stage.devices) != size:
            out.append(f"stage {s} lists {len(stage.devices)} devices for a mesh of {size}")
        outside = [d for d in stage.devices if not 0 <= d < count]
        if outside:
            out.append(f"stage {s} lists devices {outside}, outside 0..{count - 1}")
    seen = Counter(d for stage in pipeline for d in stage.devices)
    twice = sorted(d for d, n in seen.items() if n > 1)
    if twice:
        out.append(f"devices {twice} are listed more than once (a device runs one stage, once)")
    if count <= size * len(pipeline):  # else reported above; the list could be huge
        missing = [d for d in range(count) if d not in seen]
        if missing:
            out.append(f"devices {_names(missing)} are in no stage")
    return out


def _schedule(plan: Plan) -> list[str]:
    """A schedule the actor rules give, and v chunks on each of the plan's stages."""
    if (v := plan.virtual_stages) < 1 or len(plan.stages) % v:
        return [f"{len(plan.stages)} stages do not hold {v} model chunks per pipeline stage"]
    reason = check_schedule(plan.schedule, plan.pipeline_stages, v, plan.micro_batches)
    return [reason] if reason else []


def _stages(plan: Plan) -> list[str]:
    by_stage: dict[int, list[str]] = defaultdict(list)
    for name, node in plan.nodes.items():
        by_stage[node.stage].append(name)
    count, out = len(plan.stages), []
    for stage in sorted(s for s in by_stage if s >= count):
        out.append(
            f"nodes {_names(by_stage[stage])} are on stage {stage}, but the plan has {count} "
            "stage(s)"
        )
    empty = [s for s in range(count) if s not in by_stage]
    if empty:
        out.append(f"stages {empty} hold no node (a stage must run part of the model)")
    params = [name for name, p in plan.params.items() if p.stage >= count]
    if params:
        out.append(f"parameters {_names(params)} are on stages the plan does not have")
    listed = Counter(b for stage in plan.stages for b in stage.blocks)
    twice = sorted(b for b, n in listed.items() if n > 1)
    if twice:
        out.append(f"repeated blocks {_names(twice)} are listed by more than one stage (or twice)")
    return out


def _ties(plan: Plan) -> list[str]:
    """A node tied to another shares its choice: the other must be a node of the plan."""
    dangling = [f"{name} -> {n.tied_to}" for name, n in plan.nodes.items() if n.tied_to]
    dangling = [d for d in dangling if d.split(" -> ", 1)[1] not in plan.nodes]
    if not dangling:
        return []
    return [f"nodes are tied to nodes the plan does not have: {_names(dangling)}"]


def _layouts(plan: Plan) -> list[str]:
    out = []
    ndim = len(plan.mesh_shape)
    for name, node in plan.nodes.items():
        for text in (*node.inputs, *node.outputs):
            problem = _layout_problem(text, ndim)
            if problem:
                out.append(f"node {name}: {problem}")
                break
    for name, p in plan.params.items():
        problem = _layout_problem(p.sbp, ndim, p.shape, plan.mesh_shape)
        if problem:
            out.append(f"parameter {name!r}: {problem}")
        if p.optimizer_state_sbp != p.sbp and not problem:
            problem = _state_problem(p.sbp, p.optimizer_state_sbp, p.shape, plan.mesh_shape)
            if problem:
                out.append(f"parameter {name!r}: {problem.rstrip('.')}")
        if p.gradient_sbp not in (p.sbp, p.optimizer_state_sbp):
            out.append(
                f"parameter {name!r}: gradient layout {p.gradient_sbp} is neither the "
                f"parameter's {p.sbp} nor its optimizer states' {p.optimizer_state_sbp} (the "
                "two layouts the runtime accumulates gradients in); write one of them"
            )
    return out


def _state_problem(
    sbp: str, state: str, shape: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> str:
    """Why optimizer states in `state` cannot belong to a parameter in `sbp`, or "": they may
    differ from it only by a split where the parameter is B (the distributed optimizer)."""
    try:
        check_nd_sbp(parse_nd_sbp(state), shape, mesh_shape, "optimizer states")
    except SbpError as exc:
        return str(exc)
    for d, (a, b) in enumerate(zip(parse_nd_sbp(sbp), parse_nd_sbp(state), strict=True)):
        if a != b and not (isinstance(a, Broadcast) and isinstance(b, Split)):
            return (
                f"optimizer states {state} differ from the parameter's {sbp} on mesh dim {d} by more than a "
                "split of a replicated dim (the only difference the runtime shards states by)"
            )
    return ""


def _layout_problem(
    text: str,
    ndim: int,
    shape: tuple[int, ...] | None = None,
    mesh_shape: tuple[int, ...] = (),
) -> str:
    """Why an SBP text does not fit a mesh of `ndim` dims (and a tensor of `shape`), or ""."""
    try:
        layout = parse_nd_sbp(text)
        if len(layout) != ndim:
            return f"SBP {text} has {len(layout)} entries for a mesh of {ndim} dim(s)"
        if shape is not None:
            local_shape(shape, layout, mesh_shape)
    except SbpError as exc:
        return f"SBP {text} does not fit shape {list(shape or ())}: {exc}"
    return ""


def _numbers(plan: Plan) -> list[str]:
    out = []
    if plan.predicted.step_time_s <= 0:
        out.append(f"the predicted step time is {plan.predicted.step_time_s} s (not positive)")
    negative = [k for k, v in plan.predicted.breakdown.items() if v < 0]
    if negative:
        out.append(f"the predicted breakdown has negative parts {negative}")
    if plan.global_batch % plan.micro_batches:
        out.append(
            f"{plan.micro_batches} micro-batches do not divide the global batch of "
            f"{plan.global_batch} samples"
        )
    alternatives = [
        name for name, alts in plan.alternatives.items()
        if any(a.step_time_s is not None and a.step_time_s < 0 for a in alts)
    ]  # fmt: skip
    if alternatives:
        out.append(f"alternatives of {_names(alternatives)} have negative step times")
    return out


# ---- against the model's graph ---------------------------------------------------------------


def _coverage(plan: Plan, graph: OpGraph) -> list[str]:
    from autosbp.rules import exchanges, find_signature

    out = []
    missing = [name for name in graph.order if name not in plan.nodes]
    if missing:
        out.append(f"the plan has no entry for nodes {_names(missing)} of the model")
    extra = [name for name in plan.nodes if name not in graph.graph]
    if extra:
        out.append(f"the plan names nodes {_names(extra)}, which the model does not have")
    ndim, mesh = len(plan.mesh_shape), plan.mesh_shape
    refused, talks = [], []
    for name, attrs in graph.nodes():
        node = plan.nodes.get(name)
        if node is None or any(_layout_problem(t, ndim) for t in (*node.inputs, *node.outputs)):
            continue  # reported above
        if node.op != attrs.op:
            out.append(f"node {name} is {attrs.op} in the model but {node.op} in the plan")
            continue
        layouts = (tuple(map(parse_nd_sbp, node.inputs)), tuple(map(parse_nd_sbp, node.outputs)))
        found = find_signature(attrs, layouts, node.exchanges, mesh)
        if found is None:
            refused.append(f"{name} ({', '.join(node.inputs)} -> {', '.join(node.outputs)})")
        elif tuple(e.describe() for e in exchanges(attrs, found, mesh)) != node.exchanges:
            talks.append(f"{name} (stated: {', '.join(node.exchanges) or 'none'})")
    if refused:
        out.append(
            f"nodes {_names(refused)} have signatures their rules do not offer on mesh "
            f"{list(plan.mesh_shape)}"
        )
    if talks:  # what the runtime refuses on every rank (`runtime.execute.signatures`)
        out.append(f"nodes {_names(talks)} state other collectives inside the op than they run")
    return out


def _data_flow(plan: Plan, graph: OpGraph) -> list[str]:
    from autosbp.capturing.graph import Role

    back = []
    for src, dst in graph.graph.edges:
        if graph.node(src).role is Role.INPUT:
            continue  # each stage reads the user's inputs itself
        if (
            src in plan.nodes
            and dst in plan.nodes
            and plan.nodes[src].stage > plan.nodes[dst].stage
        ):
            back.append(
                f"{src} (stage {plan.nodes[src].stage}) -> {dst} (stage {plan.nodes[dst].stage})"
            )
    if not back:
        return []
    return [
        f"data flows back to an earlier stage: {_names(back)} (a pipeline sends values forward "
        "only; a value sent back would wait forever)"
    ]


def _params(plan: Plan, graph: OpGraph) -> list[str]:
    from autosbp.capturing.graph import Role

    out, seen = [], set()
    for node, attrs in graph.nodes(Role.PARAMETER):
        name, entry, at = attrs.name, plan.params.get(attrs.name), plan.nodes.get(node)
        seen.add(name)
        if entry is None:
            out.append(f"parameter {name!r} is missing from the parameter table")
            continue
        shape = tuple(attrs.outputs[0].shape)
        if entry.shape != shape:
            out.append(
                f"parameter {name!r} has shape {list(entry.shape)} in the plan, {list(shape)} in the model"
            )
        if at is None or not at.outputs or _layout_problem(at.outputs[0], len(plan.mesh_shape)):
            continue
        if format_nd_sbp(parse_nd_sbp(at.outputs[0])) != format_nd_sbp(parse_nd_sbp(entry.sbp)):
            out.append(
                f"parameter {name!r} has SBP {entry.sbp} in the parameter table but "
                f"{at.outputs[0]} in its node {node}"
            )
        if entry.stage != at.stage:
            out.append(
                f"parameter {name!r} is on stage {entry.stage} in the parameter table but its "
                f"node {node} is on stage {at.stage}"
            )
    extra = [name for name in plan.params if name not in seen]
    if extra:
        out.append(f"the parameter table names {_names(extra)}, which the model does not have")
    return out


def _blocks(plan: Plan, graph: OpGraph) -> list[str]:
    """A stage runs repeated blocks of the model: each block it lists must be one."""
    known = sorted({a.block for _, a in graph.nodes() if a.block is not None})
    out = []
    for s, stage in enumerate(plan.stages):
        unknown = sorted(set(stage.blocks) - set(known))
        if unknown:
            has = f"blocks {known[0]}..{known[-1]}" if known else "no repeated blocks"
            out.append(
                f"stage {s} lists repeated blocks {_names(unknown)}, but the model has {has}"
            )
    return out


def _batch(plan: Plan, graph: OpGraph) -> list[str]:
    """The graph is of one micro-batch: its inputs' dim 0 times the micro-batches is the batch
    the runtime trains (models without a batched input are not checked)."""
    from autosbp.capturing.graph import Role

    sizes = [a.outputs[0].shape[0] for _, a in graph.nodes(Role.INPUT) if a.outputs[0].shape]
    if not sizes:
        return []
    batch = sizes[0] * plan.micro_batches
    if plan.global_batch == batch:
        return []
    return [
        f"the plan is for a global batch of {plan.global_batch} samples, but the model's example "
        f"inputs hold {batch} ({plan.micro_batches} micro-batches of {sizes[0]})"
    ]


def _recomputation(plan: Plan, graph: OpGraph) -> list[str]:
    """A recomputed node runs again in backward from its run's saved inputs: it must be a
    compute node inside a repeated block that writes into none of its inputs."""
    from autosbp.capturing.graph import Role
    from autosbp.rules import mutated_inputs

    wrong = [
        name
        for name, attrs in graph.nodes()
        if name in plan.nodes
        and plan.nodes[name].recomputed
        and (attrs.role is not Role.COMPUTE or attrs.block is None or mutated_inputs(attrs))
    ]
    if not wrong:
        return []
    return [
        f"nodes {_names(wrong)} are marked recomputed, but only compute nodes inside a repeated "
        "block that write into none of their inputs can be"
    ]


def _partial(plan: Plan, graph: OpGraph) -> list[str]:
    """Under `full:K` (the first K blocks of each stage recomputed whole, the rest kept: what the
    planner priced, `planner.space.recomputation.block_modes`), a recomputed node lies in one of
    its stage's first K blocks, and a block with a recomputed node has each of its nodes that
    full recomputes (a compute node writing no input) recomputed."""
    from autosbp.capturing.graph import Role
    from autosbp.rules import mutated_inputs

    if not plan.recompute.startswith("full:"):
        return []
    count = int(plan.recompute.removeprefix("full:"))  # the schema's pattern: K >= 1
    blocks: dict[int, set[int]] = defaultdict(set)
    runnable: dict[int, list[str]] = defaultdict(list)  # per block, what full would recompute
    for name, attrs in graph.nodes(Role.COMPUTE):
        if attrs.block is not None and name in plan.nodes:
            blocks[plan.nodes[name].stage].add(attrs.block)
            if not mutated_inputs(attrs):
                runnable[attrs.block].append(name)
    first = {b for found in blocks.values() for b in sorted(found)[:count]}
    wrong = [
        name
        for b, names in runnable.items()
        for name in names
        if plan.nodes[name].recomputed != (b in first)
    ]
    if not wrong:
        return []
    return [
        f"the plan recomputes {plan.recompute} (the first {count} blocks of each stage whole, "
        f"the rest kept), but nodes {_names(wrong)} are marked otherwise"
    ]


def _regathers(plan: Plan, graph: OpGraph) -> list[str]:
    """An input a node re-gathers in backward (`NodePlan.regathered`) is an activation an op
    made, reaching a node that is not recomputed through a conversion that exchanges data,
    under a schedule whose backward runs once (not zb1's split)."""
    from autosbp.boxing import plan_boxing
    from autosbp.boxing.params import has_collective
    from autosbp.capturing.graph import Role
    from autosbp.plan.recompute import recomputed_nodes
    from autosbp.sbp import Mesh

    stated = {n: node for n, node in plan.nodes.items() if node.regathered and n in graph.graph}
    if not stated:
        return []
    if plan.schedule != "1f1b":
        return [
            f"nodes {_names(stated)} re-gather inputs in backward under the {plan.schedule} "
            "schedule, whose backward split in two would gather them twice"
        ]
    again, mesh, wrong = recomputed_nodes(plan, graph), Mesh(plan.mesh_shape), []
    for name, node in stated.items():
        producers = graph.producers(name)
        for index in node.regathered:
            found = producers[index] if index < len(producers) else None
            if found is None or name in again or graph.node(found[0]).role is not Role.COMPUTE:
                wrong.append(f"{name} input {index}")
                continue
            have = parse_nd_sbp(plan.nodes[found[0]].outputs[found[1]])
            want = parse_nd_sbp(node.inputs[index])
            shape = graph.node(found[0]).outputs[found[1]].shape
            if have == want or not has_collective(plan_boxing(have, want, shape, mesh)):
                wrong.append(f"{name} input {index}")
    if not wrong:
        return []
    return [
        f"{_names(wrong)} are re-gathered in backward, but only an activation an op made, read "
        "through a conversion that exchanges data by a node that is not recomputed, can be"
    ]


def _overlaps(plan: Plan, graph: OpGraph) -> list[str]:
    """An op run in chunks beside its output's reduction (`NodePlan.overlap_chunks`): what the
    runtime's overlapped instruction can run (`runtime.parallel.tp_overlap`), and the planner
    states (`planner.timing.tp_overlap.overlap_cut`); one problem per node, its cause and fix."""
    stated = {n: node for n, node in plan.nodes.items() if node.overlap_chunks}
    stated = {n: node for n, node in stated.items() if n in graph.graph}
    if not stated:
        return []
    from autosbp.plan.recompute import recomputed_nodes

    again = recomputed_nodes(plan, graph)
    out = []
    for name, node in stated.items():
        why = _overlap_problem(plan, graph, name, again)
        if why:
            out.append(
                f"node {name} ({node.op}) runs in {node.overlap_chunks} chunks beside its "
                f"output's reduction, but {why}; drop its overlap_chunks (it then runs whole)"
            )
    return out


def _overlap_problem(plan: Plan, graph: OpGraph, name: str, again: frozenset[str]) -> str:
    """Why node `name`'s `overlap_chunks` cannot run as stated ("" where it can)."""
    from autosbp.boxing import plan_boxing
    from autosbp.capturing.graph import Role
    from autosbp.rules import NdSignature
    from autosbp.rules.matmul import EINSUM
    from autosbp.sbp import Mesh
    from autosbp.tp_overlap import chunk_plan, fits, reduce_step

    attrs, node, chunks = graph.node(name), plan.nodes[name], plan.nodes[name].overlap_chunks
    if attrs.role is not Role.COMPUTE or attrs.op not in EINSUM or len(attrs.outputs) != 1:
        return "only a matmul-like op (linear, matmul, bmm, einsum) of one output is cut so"
    if chunks < 2:
        return "it must run in at least 2 chunks to overlap anything"
    uses = [(v, i) for v in graph.readers(name) for _, i in graph.uses(name, v)]
    if len(uses) != 1:
        return f"its output is read {len(uses)} times, not once (each read converts apart)"
    reader, index = uses[0]
    if plan.nodes[reader].stage != node.stage:
        return f"its reader {reader} runs on stage {plan.nodes[reader].stage}, not {node.stage}"
    if (name in again) != (reader in again):
        return (
            f"it is {'' if name in again else 'not '}recomputed and its reader {reader} is "
            f"{'' if reader in again else 'not '}(backward would run its reduction again where "
            "the plan's price does not, or not where it does)"
        )
    have, want = parse_nd_sbp(node.outputs[0]), parse_nd_sbp(plan.nodes[reader].inputs[index])
    shape = attrs.outputs[0].shape
    step = reduce_step(plan_boxing(have, want, shape, Mesh(plan.mesh_shape)))
    if step is None:
        return (
            f"its output ({node.outputs[0]}) reaches {reader} ({plan.nodes[reader].inputs[index]}) "
            "through no single all-reduce or reduce-scatter of partial sums"
        )
    inputs = tuple(map(parse_nd_sbp, node.inputs))
    cut = chunk_plan(attrs, NdSignature(inputs, (have,)), plan.mesh_shape, chunks)
    if cut is None:
        local = list(local_shape(shape, have, plan.mesh_shape))
        return f"no dim of its local output {local} has {chunks} or more entries to cut"
    if not fits(cut, step):
        return f"the reduce-scatter to {reader} splits dim {cut.dim}, the dim the chunks cut"
    return ""
