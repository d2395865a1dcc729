"""What every search of one plan request shares: the work that depends only on its graphs.

A request searches several spaces (`search.schedules.search_spaces`: one per schedule `auto`
tries) and, with `compare`, once more per hand plan (`space.strategy.hand_strategies`); each
search has its own `search.evaluator.Evaluator`, whose caches depend on its space. What
depends only on a graph, or on a graph and a stage count, or on the prices and a mesh, is the
same in every one of them, and is computed here once for them all.

Lives here: `GraphMemo` (per graph: its ties and its structure, `GraphFacts`; per structure
and stage count: the cut into stages and its counts; what backward keeps, `memory.kept.
KeptMemo`; per prices and stage mesh: the boxing pricer, `timing.boxing_prices.BoxingPricer`).
Lives elsewhere: what depends on the space or the request's devices (candidates, floors,
bounds: `search.evaluator`, `problem.priced.MeshPrices`), the work itself (`space.ties`,
`space.stages`, `space.configs.structure`, `memory.kept`).

Invariants: every entry is a function of its key alone, so a search reads from it exactly what
it would have computed itself (the plans are the same, bit for bit). Graphs are keyed by
identity and held here, so an id stays its own; structures (`space.configs.structure`, equal
for graphs that cut and tie alike: rebatched micro-batch graphs) by value, interned as small
ints; pricers by the prices' value where they hash (costmodel's cluster does: its profile and
node count), else never shared. A memo lives as long as its request (`planner.api._plan`
makes one; a caller that plans one model many times may pass one, as bench/plan_speed.py's
hand-plan grid does): nothing here is global. Worker processes (`search.processes`) are
forked, so they inherit it; what they add stays theirs.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from autosbp.capturing.graph import OpGraph
from autosbp.errors import PlanError
from autosbp.planner.memory.kept import KeptMemo
from autosbp.planner.space.configs import structure
from autosbp.planner.space.stages import StageSplit, split_stages
from autosbp.planner.space.ties import TiedGraph, TiedStages, tie_graph, tie_stages
from autosbp.planner.timing.boxing_prices import BoxingPricer, Prices
from autosbp.sbp import Mesh


@dataclass(frozen=True)
class GraphFacts:
    """A graph's ties (`space.ties.tie_graph`) and its structure's id: graphs with equal
    structures (`space.configs.structure`) share one id."""

    graph: OpGraph
    tied: TiedGraph
    structure: int


@dataclass
class GraphMemo:
    """The graph-only work of one plan request, shared by its searches (the module docstring)."""

    graphs: dict[int, GraphFacts] = field(default_factory=dict)  # by id(graph)
    structures: dict[Hashable, int] = field(default_factory=dict)  # structure -> its id
    # (structure id, stage count) -> the cut and its counts, or why the graph cannot be cut
    cuts: dict[tuple[int, int], tuple[StageSplit, TiedStages] | str] = field(default_factory=dict)
    kept: KeptMemo = field(default_factory=KeptMemo)  # what backward keeps, per graph and mode
    pricers: dict[Hashable, dict[Mesh, BoxingPricer]] = field(default_factory=dict)  # per prices

    def facts(self, graph: OpGraph) -> GraphFacts:
        """`graph`'s ties and structure (computed once per graph)."""
        found = self.graphs.get(id(graph))
        if found is None:
            tied = tie_graph(graph)
            shape = self.structures.setdefault(structure(tied), len(self.structures))
            found = self.graphs[id(graph)] = GraphFacts(graph, tied, shape)
        return found

    def cut(self, graph: OpGraph, num_stages: int) -> tuple[StageSplit, TiedStages]:
        """`graph` cut into `num_stages` stages (`space.stages.split_stages`) and counted per
        representative and stage (`space.ties.tie_stages`): once per structure and stage count.
        PlanError where the graph cannot be cut so (each time it is asked)."""
        facts = self.facts(graph)
        key = (facts.structure, num_stages)
        if key not in self.cuts:
            try:
                split = split_stages(graph, num_stages)
            except PlanError as exc:
                self.cuts[key] = str(exc)
            else:
                self.cuts[key] = (split, tie_stages(facts.tied, split))
        found = self.cuts[key]
        if isinstance(found, str):
            raise PlanError(found)
        return found

    def pricers_of(self, prices: Prices) -> dict[Mesh, BoxingPricer]:
        """The boxing pricers of `prices`, per stage mesh: shared with every search of equal
        prices; a fresh dict (shared with no one) where `prices` does not hash."""
        try:
            return self.pricers.setdefault(prices, {})  # type: ignore[arg-type]
        except TypeError:  # unhashable prices: nothing says two of them price alike
            return {}
