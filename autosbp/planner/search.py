"""Search: for each mesh shape, build the strategy ILP of the graph, solve it, keep the fastest.

Lives here: mesh shapes worth trying, the Problem of one (graph, mesh), hand-plan restrictions
(`dp`, `fsdp`, `megatron:tp=..,dp=..`) as limits on which candidates a node may take, and the
assembly of the winning choice into a `Plan`. Lives elsewhere: prices (`costs`, `memory`), the
solver (`ilp`), the plan format (`plan`).

Scope of this version: one pipeline stage (all devices), micro-batches = 1, no recomputation.
Stages, micro-batches and recomputation come next (see docs/architecture.md, "Planner").
The objective is the step time with no overlap: every op's forward and backward, every boxing,
every gradient sync and optimizer update, one after another on each device.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from autosbp.errors import NoFitError, PlanError
from autosbp.graph import OpGraph, Role
from autosbp.ilp import MemoryConstraint, Problem, Solution, solve
from autosbp.planner.costs import BoxingPricer, NodeStrategies, Prices, edge_matrix, node_strategies
from autosbp.planner.memory import candidate_bytes
from autosbp.planner.reduce import tie_blocks
from autosbp.rules import NdSignature
from autosbp.sbp import Broadcast, Mesh, NdSbp, Split

Allow = Callable[[dict, NdSignature], bool]  # may this node (attrs) take this candidate?


@dataclass(frozen=True)
class MeshProblem:
    """The ILP of one (graph, mesh) with the candidates behind its indices."""

    mesh: Mesh
    strategies: dict[str, NodeStrategies]  # every node (tied nodes share their representative's)
    problem: Problem  # keyed by representative nodes
    representative: dict[str, str]

    def choice_of(self, solution: Solution, name: str) -> NdSignature:
        return self.strategies[name].candidates[solution.choice[self.representative[name]]]


LinkOf = Callable[[tuple[int, ...], int], str]  # (mesh shape, mesh dim) -> link class name


def mesh_shapes(devices: int, link_of: LinkOf) -> list[Mesh]:
    """The 1D mesh and every 2D factorization of `devices` (row-major over node-major device
    ids, so the inner mesh dim stays inside a node when it fits); each mesh dim gets the link
    class its groups cross."""
    shapes = [(devices,)] + [
        (devices // inner, inner) for inner in range(2, devices) if devices % inner == 0
    ]
    return [
        Mesh(
            shape,
            tuple(f"d{i}" for i in range(len(shape))),
            link_classes=tuple(link_of(shape, d) for d in range(len(shape))),
        )
        for shape in shapes
    ]


def build_problem(
    graph: OpGraph,
    mesh: Mesh,
    prices: Prices,
    *,
    optimizer: str,
    memory_limit_bytes: float | None,
    allow: Allow | None = None,
    micro_batches: int = 1,
) -> MeshProblem:
    """The ILP of `graph` (one micro-batch) on `mesh`, with repeated blocks tied
    (`reduce.tie_blocks`): variables exist for representatives only, whose costs and memory add
    up those of their tied nodes. Ops and boxings run once per micro-batch; a parameter's
    gradient sync and update once per step; one micro-batch's activations live at a time."""
    pricer = BoxingPricer(prices, mesh)
    rep = tie_blocks(graph)
    copies = Counter(rep.values())
    strategies: dict[str, NodeStrategies] = {}
    node_costs: dict[str, np.ndarray] = {}
    node_bytes: dict[str, np.ndarray] = {}
    for name, attrs in graph.nodes():
        if rep[name] != name:  # a tied node is its representative's twin (same op, args, tensors)
            strategies[name] = strategies[rep[name]]
            continue
        found = _restricted(node_strategies(graph, name, pricer), attrs, allow)
        strategies[name] = found
        memory = [
            candidate_bytes(attrs, sig, mesh.shape, optimizer=optimizer, in_flight=1)
            for sig in found.candidates
        ]
        runs = 1 if attrs["role"] is Role.PARAMETER else micro_batches
        node_costs[name] = found.compute_s * copies[name] * runs
        node_bytes[name] = np.array(memory) * copies[name]
    edges: dict[tuple[str, str], np.ndarray] = {}
    matrices: dict[tuple, np.ndarray] = {}
    for u, v, data in graph.graph.edges(data=True):
        uses = data["uses"]
        metas = tuple(graph.graph.nodes[u]["outputs"][out_idx] for out_idx, _ in uses)
        key = (rep[u], rep[v])
        cache_key = (key, tuple(uses), metas)
        if cache_key not in matrices:  # the same edge in every tied block: priced once
            matrices[cache_key] = micro_batches * edge_matrix(
                strategies[u], strategies[v], uses, metas, pricer
            )
        matrix = matrices[cache_key]
        if key[0] == key[1]:  # same position in two tied blocks: both take the same candidate
            node_costs[key[0]] = node_costs[key[0]] + np.diag(matrix)
        else:
            edges[key] = edges[key] + matrix if key in edges else matrix
    memory_constraints: tuple[MemoryConstraint, ...] = ()
    if memory_limit_bytes is not None:
        memory_constraints = (
            MemoryConstraint(node_bytes, memory_limit_bytes, name="device memory"),
        )
    problem = Problem(node_costs, edges, memory_constraints)
    return MeshProblem(mesh, strategies, problem, rep)


def _restricted(found: NodeStrategies, attrs: dict, allow: Allow | None) -> NodeStrategies:
    """The candidates a hand plan allows. A parameter the plan would split but whose dims the
    mesh does not divide (a (1,)-shaped bias) stays replicated rather than making the plan
    impossible."""
    if allow is None:
        return found
    keep = [i for i, sig in enumerate(found.candidates) if allow(attrs, sig)]
    if not keep and attrs["role"] is Role.PARAMETER:
        keep = [
            i
            for i, sig in enumerate(found.candidates)
            if all(isinstance(s, Broadcast) for s in sig.outputs[0])
        ]
    return NodeStrategies(
        found.name, tuple(found.candidates[i] for i in keep), found.compute_s[keep]
    )


def solve_mesh(mesh_problem: MeshProblem, time_limit_s: float) -> Solution | None:
    """The best choice on this mesh, or None if nothing fits (no candidate or memory)."""
    if any(len(s.candidates) == 0 for s in mesh_problem.strategies.values()):
        return None
    try:
        return solve(mesh_problem.problem, time_limit_s=time_limit_s)
    except NoFitError:
        return None


# ---- hand plans as restrictions ---------------------------------------------------------------


def hand_plan_allow(strategy: str) -> tuple[Allow | None, Callable[[Mesh], bool]]:
    """(candidate filter, mesh filter) of a named strategy; `auto` restricts nothing."""
    if strategy == "auto":
        return None, lambda mesh: True
    if strategy == "dp":
        return _allow(
            param=lambda nd, shape: all(isinstance(s, Broadcast) for s in nd)
        ), lambda m: m.ndim == 1
    if strategy == "fsdp":
        return _allow(param=lambda nd, shape: isinstance(nd[0], Split)), lambda m: m.ndim == 1
    if strategy.startswith("megatron:"):
        tp, dp = _megatron_degrees(strategy)
        if tp == 1:  # no tensor parallelism: plain data parallelism
            return hand_plan_allow("dp")[0], lambda m: m.shape == (dp,)
        # Megatron: every weight matrix (and embedding table) split on the tp mesh dim, the ILP
        # picking which dim (column or row parallel); vectors (biases, norms) free; data split
        # on the dp mesh dim, where weights are replicated.
        if dp == 1:  # tensor parallelism alone: every device sees the whole batch
            allow = _allow(param=_tensor_parallel(0), data=lambda nd: nd == (Broadcast(),))
            return allow, lambda m: m.shape == (tp,)
        allow = _allow(
            param=lambda nd, shape: isinstance(nd[0], Broadcast) and _tensor_parallel(1)(nd, shape),
            data=lambda nd: nd == (Split(0), Broadcast()),
        )
        return allow, lambda m: m.shape == (dp, tp)
    raise PlanError(f"unknown strategy {strategy!r}; use auto, dp, fsdp or megatron:tp=T,dp=D.")


def _megatron_degrees(strategy: str) -> tuple[int, int]:
    """(tp, dp) of `megatron:tp=T,dp=D`; pipeline degrees are refused until stages exist."""
    try:
        fields = {
            k: int(v)
            for k, v in (item.split("=") for item in strategy.removeprefix("megatron:").split(","))
        }
    except ValueError:
        raise PlanError(f"cannot read {strategy!r}; write it like megatron:tp=2,dp=2.") from None
    if "pp" in fields and fields["pp"] != 1:
        raise PlanError(
            f"{strategy!r} asks for pipeline stages (pp), which this planner does not search yet; "
            "use megatron:tp=T,dp=D."
        )
    unknown = sorted(set(fields) - {"tp", "dp", "pp"})
    if unknown:
        raise PlanError(
            f"{strategy!r} has unknown degree(s) {unknown}; write it like megatron:tp=2,dp=2."
        )
    tp, dp = fields.get("tp", 1), fields.get("dp", 1)
    if tp < 1 or dp < 1:
        raise PlanError(
            f"{strategy!r}: degrees must be positive; write it like megatron:tp=2,dp=2."
        )
    return tp, dp


def _tensor_parallel(mesh_dim: int) -> Callable[[NdSbp, tuple[int, ...]], bool]:
    """Matrices split on `mesh_dim`; vectors anything."""
    return lambda nd, shape: len(shape) < 2 or isinstance(nd[mesh_dim], Split)


def _allow(param: Callable | None = None, data: Callable | None = None) -> Allow:
    """`param(nd_sbp, shape) -> bool` filters parameter layouts, `data(nd_sbp)` input layouts
    (default: the batch split on every mesh dim)."""

    def allow(attrs: dict, sig: NdSignature) -> bool:
        if attrs["role"] is Role.PARAMETER and param is not None:
            return bool(param(sig.outputs[0], attrs["outputs"][0].shape))
        if attrs["role"] is Role.INPUT:
            nd = sig.outputs[0]
            if data is not None:
                return bool(data(nd))
            return all(isinstance(s, Split) and s.dim == 0 for s in nd)
        return True

    return allow


def best_over_meshes(
    graph: OpGraph,
    meshes: Sequence[Mesh],
    prices: Prices,
    *,
    optimizer: str,
    memory_limit_bytes: float | None,
    allow: Allow | None,
    time_limit_s: float,
    micro_batches: int = 1,
) -> tuple[MeshProblem, Solution]:
    best: tuple[MeshProblem, Solution] | None = None
    tried = []
    for mesh in meshes:
        mp = build_problem(
            graph,
            mesh,
            prices,
            optimizer=optimizer,
            memory_limit_bytes=memory_limit_bytes,
            allow=allow,
            micro_batches=micro_batches,
        )
        tried.append(mp)
        sol = solve_mesh(mp, time_limit_s)
        if sol is not None and (best is None or sol.objective < best[1].objective - 1e-15):
            best = (mp, sol)
    if best is None:
        raise NoFitError(_no_fit_message(graph, tried, memory_limit_bytes, micro_batches))
    return best


def _no_fit_message(
    graph: OpGraph, tried: Sequence[MeshProblem], limit: float | None, micro_batches: int
) -> str:
    """Why nothing fits: the least memory any plan could need, and what takes it."""
    floors = []
    for mp in tried:
        if not mp.problem.memory:
            continue
        per_node = {
            v: float(np.min(b))
            for v, b in mp.problem.memory[0].bytes_per_candidate.items()
            if len(b)
        }
        floors.append((sum(per_node.values()), mp, per_node))
    if limit is None or not floors:
        return "no plan exists for this model on these devices (no signature fits some op)."
    need, mesh_problem, per_node = min(floors, key=lambda f: f[0])
    mesh = mesh_problem.mesh
    top = sorted(per_node.items(), key=lambda kv: -kv[1])[:5]
    tied = Counter(mesh_problem.representative.values())
    consumers = ", ".join(
        f"{_label(graph, v)}{f' (and {tied[v] - 1} tied copies)' if tied[v] > 1 else ''} {_size(b)}"
        for v, b in top
    )
    return (
        f"no plan fits in {_size(limit)} per device: even the most sharded plan (mesh "
        f"{'x'.join(map(str, mesh.shape))}, {micro_batches} micro-batch(es)) needs at least "
        f"{_size(need)} per device. The "
        f"biggest consumers there: {consumers}. Raise --memory-gib, use more devices, a smaller "
        "batch, or an optimizer with fewer states (sgd)."
    )


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def _label(graph: OpGraph, node: str) -> str:
    attrs = graph.graph.nodes[node]
    return attrs.get("name") or attrs.get("module_path") or node
