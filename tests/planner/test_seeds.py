"""Seeds first (`search.best_first.BestFirst.seed_first`): the seed of least LP bound is solved as
soon as no seed left can bound below it (each seed's bound is at least its node bound, and the seeds
come in node-bound order), so its plan cuts the seeds left.

The rule is tested on an evaluator of stated bounds (`StatedBounds`): the order of the seeding's
LPs and solves is the specification. That the search stays sound with it (the optimum of
exhaustive enumeration, on real graphs and prices) is test_search.py's."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from autosbp.planner.ilp.formulation import Solution
from autosbp.planner.search.best_first import BestFirst
from autosbp.planner.space.configs import Config
from autosbp.sbp import Mesh


@dataclass
class StatedBounds:
    """The evaluator's part that seeding reads, each configuration's bounds and value stated:
    node bound (the forest bound too), LP bound (never integral here) and the step its solve
    predicts."""

    stated: dict[Config, tuple[float, float, float]]
    calls: list[tuple[str, int]] = field(default_factory=list)  # (what, stage count)
    request: Any = field(default_factory=lambda: SimpleNamespace(devices_per_node=2, batch=8))
    refusals: Any = None
    bounded: int = 0
    solved: int = 0

    def node_bound(self, config: Config) -> float:
        return self.stated[config][0]

    def forest_bound(self, config: Config) -> float:
        return self.stated[config][0]  # no higher than the node bound

    def shared_bound(self, config: Config, time_left_s: float, cutoff: float) -> float:
        return -math.inf  # one recomputation mode: no shared bound

    def shared_plan(self, config: Config) -> None:
        return None

    def lp_bound(self, config: Config, time_left_s: float, cutoff: float) -> tuple:
        self.calls.append(("lp", config.num_stages))
        return self.stated[config][1], config, None

    def solve(self, config: Config, time_left_s: float, cutoff: float) -> Solution | None:
        self.calls.append(("solve", config.num_stages))
        value = self.stated[config][2]
        return Solution({}, value, "optimal", 0.0, 0.0) if value < cutoff else None

    def found(self, config: Config, solution: Solution) -> Any:
        return SimpleNamespace(prediction=SimpleNamespace(step_time_s=solution.objective))


def _config(stages: int) -> Config:
    return Config(stages, Mesh((2, 2)), 4, "none")


# Per stage count: node bound, LP bound, solved value. In node-bound order the LPs come 4.0,
# 3.5, 6.0: the least is stage count 2's, and stage count 8's node bound 5.0 is above it.
STATED = {
    1: (1.0, 4.0, 4.2),
    2: (2.0, 3.5, 3.6),
    4: (3.0, 6.0, 6.1),
    8: (5.0, 7.0, 7.1),
}


def _seeded(stated: dict[int, tuple[float, float, float]]) -> StatedBounds:
    ev = StatedBounds({_config(s): bounds for s, bounds in stated.items()})
    state = BestFirst(ev, math.inf, 60.0)  # type: ignore[arg-type]
    state.heap = [(0.0, 0, i, _config(s), None) for i, s in enumerate(stated)]
    state.seed_first()
    return ev


def test_the_least_lp_seed_is_solved_once_no_seed_left_bounds_below_it() -> None:
    # stage count 8 is never bounded: its node bound 5.0 is above the plan 3.6 of the early
    # solve (the second seed solve, of stage count 1, does not dive: LP 4.0 > 0.9 x 3.6)
    assert _seeded(STATED).calls == [("lp", 1), ("lp", 2), ("lp", 4), ("solve", 2)]


@pytest.mark.parametrize(
    ("last_node", "calls"),
    [
        (3.4, [("lp", 1), ("lp", 2), ("lp", 4), ("lp", 8), ("solve", 2)]),
        (3.5, [("lp", 1), ("lp", 2), ("lp", 4), ("solve", 2), ("lp", 8)]),
    ],
    ids=["a-seed-left-might-bound-below", "none-left-can"],
)
def test_the_early_solve_waits_for_every_seed_that_might_bound_below(
    last_node: float, calls: list[tuple[str, int]]
) -> None:
    """With the last seed's node bound below the least LP so far (3.5) every seed is bounded
    first, as before the rule; at it, the least LP's seed is solved first (and the last seed,
    below that plan's cutoff, is bounded after)."""
    assert _seeded({**STATED, 8: (last_node, 7.0, 7.1)}).calls == calls
