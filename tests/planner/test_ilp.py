"""The strategy ILP equals brute-force enumeration on random small problems: with memory on
node candidates and on edge pairs, with max terms, and with max terms nested in others. The
least memory share (`least_memory_share`) fits exactly where the LP does, below brute force's."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest

from autosbp.errors import PlanError
from autosbp.planner.ilp.formulation import Costs, MaxTerm, MemoryConstraint, Problem
from autosbp.planner.ilp.solvers import MEMORY_SLACK, CutOff, Relaxed, fix_by_reduced_costs, relax
from autosbp.planner.ilp.solving import (
    brute_force,
    least_memory_share,
    lower_bound,
    solve,
    solve_below,
)


def random_problem(
    seed: int, n_nodes: int, n_cands: int, *, memory: bool, forbid: float
) -> Problem:
    """A chain with random skip edges; costs, memory and forbidden pairs drawn from `seed`."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, n_cands + 1, size=n_nodes)
    nodes = {v: rng.uniform(0, 10, size=sizes[v]) for v in range(n_nodes)}
    edges = {}
    for v in range(1, n_nodes):
        for u in {v - 1, int(rng.integers(0, v))}:
            m = rng.uniform(0, 10, size=(sizes[u], sizes[v]))
            m[rng.random(m.shape) < forbid] = math.inf
            edges[(u, v)] = m
    mem = ()
    if memory:  # on candidates and on pairs (a boxed copy kept for backward)
        per = {v: rng.uniform(0, 100, size=sizes[v]) for v in range(n_nodes)}
        pairs = {e: rng.uniform(0, 50, size=m.shape) for e, m in edges.items()}
        lo = sum(p.min() for p in (*per.values(), *pairs.values()))
        hi = sum(p.max() for p in (*per.values(), *pairs.values()))
        limit = lo + 0.3 * (hi - lo) + 0.123
        mem = (MemoryConstraint(per, limit, constant_bytes=7.0, bytes_per_pair=pairs),)
    return Problem(nodes, edges, mem)


CASES = [
    pytest.param(
        seed, n, k, memory, forbid, id=f"s{seed}-n{n}-k{k}-{'mem' if memory else 'nomem'}-f{forbid}"
    )
    for seed in range(6)
    for n, k in ((5, 3), (7, 2), (4, 4))
    for memory in (False, True)
    for forbid in (0.0, 0.3)
]


@pytest.mark.parametrize(("seed", "n", "k", "memory", "forbid"), CASES)
def test_solve_equals_brute_force(seed: int, n: int, k: int, memory: bool, forbid: float) -> None:
    problem = random_problem(seed, n, k, memory=memory, forbid=forbid)
    try:
        expected = brute_force(problem)
    except PlanError:
        with pytest.raises(PlanError):
            solve(problem)
        return
    got = solve(problem)
    assert got.status == "optimal"
    assert problem.feasible(got.choice)
    assert got.objective == pytest.approx(expected.objective, rel=1e-7, abs=1e-7)


def _enumerated(problem: Problem) -> tuple[float, dict]:
    """The best assignment found one at a time, in `itertools.product`'s order, by the scalar
    `Problem.feasible` and `objective` (`brute_force`'s definition, without its arrays)."""
    keys = list(problem.node_costs)
    best: tuple[float, dict] = (math.inf, {})
    for combo in itertools.product(*(range(len(problem.node_costs[k])) for k in keys)):
        choice = dict(zip(keys, combo, strict=True))
        if problem.feasible(choice) and problem.objective(choice) < best[0]:
            best = (problem.objective(choice), choice)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_brute_force_is_the_enumeration_of_every_assignment(seed: int) -> None:
    # chunks of 7 assignments: the best may lie in any chunk, ties across chunks keep the first
    problem = with_stages(
        random_problem(seed, 6, 3, memory=True, forbid=0.2), seed, 3, 2, nested=seed % 2 == 1
    )
    objective, choice = _enumerated(problem)
    if not choice:
        with pytest.raises(PlanError):
            brute_force(problem, chunk=7)
        return
    got = brute_force(problem, chunk=7)
    assert (got.objective, got.choice) == (objective, choice)
    assert brute_force(problem).choice == choice


def with_stages(
    problem: Problem, seed: int, stages: int, micro_batches: int, nested: bool = False
) -> Problem:
    """`problem` priced as a pipeline: nodes dealt to `stages` in order, each part the costs of
    its stage; objective = sum of parts + (micro_batches - 1) x the slowest part + the slowest
    of random per-stage update costs (as the planner builds it). `nested`: each stage's part
    also holds the larger of two random costs of its stage (a stage's communication or its
    compute, whichever is longer), as terms of their own inside the slowest-part term."""
    rng = np.random.default_rng(seed + 1000)
    n = len(problem.node_costs)
    stage_of = {v: v * stages // n for v in problem.node_costs}
    parts = [
        Costs(
            {v: c for v, c in problem.node_costs.items() if stage_of[v] == s},
            {e: m for e, m in problem.edge_costs.items() if stage_of[e[1]] == s},
        )
        for s in range(stages)
    ]
    updates = [
        Costs({v: rng.uniform(0, 30, size=len(c)) for v, c in part.node_costs.items()})
        for part in parts
    ]
    if not nested:
        terms = (MaxTerm(micro_batches - 1, parts), MaxTerm(1.0, updates))
        return Problem(problem.node_costs, problem.edge_costs, problem.memory, terms)
    longer = [  # per stage, a term: the larger of two random costs of its nodes and edges
        MaxTerm(0.0, [_random_like(part, rng) for _ in range(2)]) for part in parts
    ]
    inner = [{s: float(rng.uniform(0.5, 3))} for s in range(stages)]
    slowest = MaxTerm(micro_batches - 1, parts, inner)
    terms = (*longer, slowest, MaxTerm(1.0, updates))
    return Problem(problem.node_costs, problem.edge_costs, problem.memory, terms)


def _random_like(part: Costs, rng: np.random.Generator) -> Costs:
    """Random non-negative costs on the nodes and edges of `part`."""
    nodes = {v: rng.uniform(0, 10, size=len(c)) for v, c in part.node_costs.items()}
    return Costs(nodes, {e: rng.uniform(0, 10, size=m.shape) for e, m in part.edge_costs.items()})


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(("stages", "micro_batches"), [(2, 4), (3, 2)])
def test_max_terms_equal_brute_force(
    seed: int, stages: int, micro_batches: int, nested: bool
) -> None:
    problem = with_stages(
        random_problem(seed, 6, 3, memory=seed % 2 == 0, forbid=0.2), seed, stages, micro_batches,
        nested,
    )  # fmt: skip
    try:
        expected = brute_force(problem)
    except PlanError:
        with pytest.raises(PlanError):
            solve(problem)
        return
    got = solve(problem)
    assert got.status == "optimal"
    assert got.objective == pytest.approx(expected.objective, rel=1e-7, abs=1e-7)


def test_edge_memory_and_inner_terms_change_the_optimum_in_the_tables() -> None:
    # Guard for the tables above: the edge bytes bind (the optimum without them breaks the
    # limit) and the inner terms matter (the optimum without them is another assignment).
    binds = changes = 0
    for seed in range(8):
        problem = with_stages(random_problem(seed, 6, 3, memory=True, forbid=0.2), seed, 2, 4, True)
        no_pairs = replace(problem, memory=[replace(problem.memory[0], bytes_per_pair={})])
        flat = replace(problem, max_terms=[replace(t, inner=()) for t in problem.max_terms])
        try:
            best = brute_force(problem)
        except PlanError:
            continue
        binds += not problem.feasible(brute_force(no_pairs).choice)
        changes += brute_force(flat).choice != best.choice
    assert binds > 0 and changes > 0, (binds, changes)


def staged_random_problem(seed: int, stages: int) -> Problem:
    """A random problem with memory and forbidden pairs, cut into `stages` stages when > 1
    (with nested max terms on odd seeds)."""
    problem = random_problem(seed, 6, 3, memory=True, forbid=0.2)
    if stages == 1:
        return problem
    return with_stages(problem, seed, stages, micro_batches=4, nested=seed % 2 == 1)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("above", [0.9, 0.99, 1.01, 1.5])
def test_solve_below_cuts_off_only_what_cannot_win(seed: int, stages: int, above: float) -> None:
    # None only when no assignment beats the cutoff; otherwise the optimum itself.
    problem = staged_random_problem(seed, stages)
    try:
        expected = brute_force(problem)
    except PlanError:
        return
    cutoff = expected.objective * above
    got = solve_below(problem, cutoff)
    if got is None:
        assert expected.objective >= cutoff * (1 - 1e-9)
    else:
        assert got.objective == pytest.approx(expected.objective, rel=1e-7, abs=1e-7)
    if above > 1:
        assert got is not None  # the optimum beats the cutoff: it must not be cut off


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("stages", [1, 3])
def test_lower_bound_never_exceeds_the_optimum(seed: int, stages: int) -> None:
    problem = staged_random_problem(seed, stages)
    try:
        expected = brute_force(problem)
    except PlanError:
        with pytest.raises(PlanError):
            lower_bound(problem)
        return
    assert lower_bound(problem) <= expected.objective * (1 + 1e-9)


def test_memory_limit_changes_the_choice() -> None:
    # Candidate 0 is fast and big, candidate 1 slow and small: the limit decides.
    problem = Problem({"a": np.array([1.0, 5.0])})
    assert solve(problem).choice == {"a": 0}
    tight = Problem(
        problem.node_costs, memory=(MemoryConstraint({"a": np.array([100.0, 10.0])}, 50.0),)
    )
    assert solve(tight).choice == {"a": 1}


def test_infeasible_raises_plan_error() -> None:
    problem = Problem(
        {"a": np.array([1.0]), "b": np.array([1.0])}, {("a", "b"): np.array([[math.inf]])}
    )
    with pytest.raises(PlanError, match="infeasible"):
        solve(problem)


def fractional_cases() -> list:
    """Random problems with a tight memory limit whose LP relaxation is fractional: `solve`
    rounds them and fixes columns by reduced cost before its MIP."""
    cases = []
    for seed in range(40):
        problem = random_problem(seed, 7, 3, memory=True, forbid=0.2)
        try:
            relaxed = relax(problem, 60.0)
        except PlanError:
            continue
        values = np.concatenate(list(relaxed.values.values())) if relaxed else []
        if any(1e-6 < x < 1 - 1e-6 for x in values):
            cases.append(pytest.param(problem, relaxed, id=f"s{seed}"))
    assert len(cases) >= 5, "the table no longer exercises fractional relaxations"
    return cases


@pytest.mark.parametrize(("problem", "relaxed"), fractional_cases())
def test_fractional_relaxations_solve_to_brute_force(problem: Problem, relaxed) -> None:
    expected = brute_force(problem)
    got = solve(problem)
    assert got.status == "optimal"
    assert problem.feasible(got.choice)
    assert got.objective == pytest.approx(expected.objective, rel=1e-7, abs=1e-7)


@pytest.mark.parametrize(("problem", "relaxed"), fractional_cases())
@pytest.mark.parametrize("above", [1.0, 1.05, 1.3])
def test_fixing_keeps_every_solution_better_than_the_bound(
    problem: Problem, relaxed, above: float
) -> None:
    upper = brute_force(problem).objective * above
    fixed = fix_by_reduced_costs(problem, relaxed, upper)
    for choice in assignments(problem):
        if problem.feasible(choice) and problem.objective(choice) < upper:
            assert fixed.feasible(choice), f"fixing dropped {choice}, better than {upper}"


def test_fixing_at_the_optimum_drops_solutions() -> None:
    # Not a theorem per problem (the LP gap may exceed every reduced cost), but on this table
    # the fixing must do something, or solve_below's rounding and fixing are dead weight.
    dropped = 0
    for case in fractional_cases():
        problem, relaxed = case.values
        fixed = fix_by_reduced_costs(problem, relaxed, brute_force(problem).objective)
        dropped += sum(problem.feasible(c) and not fixed.feasible(c) for c in assignments(problem))
    assert dropped > 0


def assignments(problem: Problem) -> Iterator[dict]:
    keys = list(problem.node_costs)
    sizes = [len(problem.node_costs[k]) for k in keys]
    for combo in itertools.product(*(range(s) for s in sizes)):
        yield dict(zip(keys, combo, strict=True))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("below", [0.5, 0.9, 0.99, 1.01])
def test_the_lp_stops_at_a_cutoff_only_when_its_bound_passes_it(
    seed: int, stages: int, below: float
) -> None:
    problem = staged_random_problem(seed, stages)
    try:
        full = relax(problem, 60.0)
    except PlanError:
        return
    assert isinstance(full, Relaxed)
    cutoff = full.bound_s * below
    got = relax(problem, 60.0, cutoff)
    if isinstance(got, CutOff):
        assert full.bound_s >= cutoff * (1 - 1e-9) and got.bound_s == cutoff
    else:
        assert isinstance(got, Relaxed) and got.bound_s == pytest.approx(full.bound_s, rel=1e-9)
    assert lower_bound(problem, cutoff=cutoff) <= brute_force(problem).objective * (1 + 1e-9)


def test_the_lp_stops_at_a_cutoff_on_some_problems() -> None:
    # Guard for the test above: HiGHS's objective bound reaches us (scipy passes it on).
    stopped = 0
    for seed in range(6):
        problem = staged_random_problem(seed, 1)
        try:
            full = relax(problem, 60.0)
        except PlanError:
            continue  # nothing fits
        if isinstance(full, Relaxed):
            stopped += isinstance(relax(problem, 60.0, full.bound_s * 0.5), CutOff)
    assert stopped > 0


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("stages", [1, 3])
def test_highs_binding_and_linprog_agree(
    seed: int, stages: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # relax calls HiGHS through scipy's binding, or through linprog where it is missing: both
    # give the same optimum, the same reduced costs and the same cutoff.
    from autosbp.planner.ilp import solvers as ilp_solvers

    problem = staged_random_problem(seed, stages)

    def both(cutoff: float) -> list[Relaxed | CutOff | str | None]:
        found: list[Relaxed | CutOff | str | None] = []
        for binding in (ilp_solvers._HIGHS, None):
            monkeypatch.setattr(ilp_solvers, "_HIGHS", binding)
            try:
                found.append(relax(problem, 60.0, cutoff))
            except PlanError:
                found.append("infeasible")
        return found

    fast, slow = both(math.inf)
    assert type(fast) is type(slow)
    if isinstance(fast, Relaxed) and isinstance(slow, Relaxed):
        assert fast.bound_s == pytest.approx(slow.bound_s, rel=1e-9, abs=1e-12)
        # A degenerate LP has many optimal duals, so the reduced costs may differ; each set
        # must keep the optimum when fixing at a value it reaches.
        best = brute_force(problem)
        for relaxed in (fast, slow):
            fixed = fix_by_reduced_costs(problem, relaxed, best.objective)
            assert math.isfinite(fixed.objective(best.choice))
        fast_cut, slow_cut = both(fast.bound_s * 0.5)
        assert type(fast_cut) is type(slow_cut)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("stages", [1, 3])
def test_columns_are_the_rows_in_csc_form(seed: int, stages: int) -> None:
    # HiGHS gets `columns()`, built in one sort; scipy's CSR -> CSC conversion of `rows()` is
    # the oracle: the same arrays entry for entry (order included), so the same LP.
    from autosbp.planner.ilp.solvers import LinearProgram

    lp = LinearProgram(staged_random_problem(seed, stages))
    indptr, indices, data = lp.columns()
    expected = lp.rows().tocsc()
    assert np.array_equal(indptr, expected.indptr)
    assert np.array_equal(indices, expected.indices)
    assert np.array_equal(data, expected.data)


def memory_per_stage(seed: int, share: float) -> Problem:
    """A random problem whose bytes are split into two stages' constraints (its first and
    second half of nodes, an edge with its consumer), each limit at `share` of the way from
    its fewest bytes to its most."""
    problem = random_problem(seed, 6, 3, memory=True, forbid=0.2)
    (mem,) = problem.memory
    limits = []
    for s in range(2):
        per = {v: b for v, b in mem.bytes_per_candidate.items() if v * 2 // 6 == s}
        pairs = {e: b for e, b in mem.bytes_per_pair.items() if e[1] * 2 // 6 == s}
        lo = sum(b.min() for b in (*per.values(), *pairs.values()))
        hi = sum(b.max() for b in (*per.values(), *pairs.values()))
        limit = 7.0 + lo + share * (hi - lo)
        limits.append(MemoryConstraint(per, limit, 7.0, f"stage {s}", pairs))
    return replace(problem, memory=tuple(limits))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("share", [0.02, 0.1, 0.3])
def test_the_least_memory_share_fits_exactly_where_the_lp_does(seed: int, share: float) -> None:
    # Oracles: the LP relaxation's own feasibility, and brute force over every choice (the
    # share of a relaxation is at most the least share of the fullest stage of any choice).
    problem = memory_per_stage(seed, share)
    least = least_memory_share(problem)
    assert least is not None
    try:
        relax(problem, 60.0)
        fits = True
    except PlanError:  # NoFitError: infeasible LP
        fits = False
    assert (least <= 1 - MEMORY_SLACK) == fits, least
    allowed = [c for c in assignments(problem) if math.isfinite(problem.objective(c))]
    if not allowed:  # forbidden pairs leave no choice at all
        assert least == math.inf
        return
    fullest = min(max(m.used_bytes(c) / m.limit_bytes for m in problem.memory) for c in allowed)
    assert least <= fullest * (1 + 1e-9)


def test_a_cutoff_hides_an_lp_that_does_not_fit() -> None:
    # Why `least_memory_share` exists: with a cutoff, HiGHS's dual simplex passes the
    # objective bound before it proves that no fractional choice fits (a CutOff, read as
    # 'nothing below the cutoff'), where the share says it does not fit.
    hidden = 0
    for seed in range(6):
        problem = memory_per_stage(seed, 0.02)
        share = least_memory_share(problem)
        assert share is not None
        try:
            cut = relax(problem, 60.0, 1e-6)
        except PlanError:  # HiGHS proved it infeasible first
            continue
        hidden += share > 1 and isinstance(cut, CutOff)
    assert hidden > 0


@pytest.mark.parametrize("seed", range(6))
def test_the_least_memory_share_of_a_tree_is_brute_forces(seed: int) -> None:
    # On a chain with one constraint the LP relaxation is integral: the share is the least
    # over every choice, its constant bytes included.
    problem = random_problem(seed, 6, 3, memory=True, forbid=0.2)
    edges = {(u, v): m for (u, v), m in problem.edge_costs.items() if u == v - 1}
    (mem,) = problem.memory
    pairs = {e: b for e, b in mem.bytes_per_pair.items() if e in edges}
    problem = Problem(problem.node_costs, edges, (replace(mem, bytes_per_pair=pairs),))
    allowed = [c for c in assignments(problem) if math.isfinite(problem.objective(c))]
    fewest = min((problem.memory[0].used_bytes(c) for c in allowed), default=math.inf)
    assert least_memory_share(problem) == pytest.approx(fewest / mem.limit_bytes, rel=1e-7)
