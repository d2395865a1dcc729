"""Interleaved 1F1B from the actor rules, against oracles: Megatron-LM's own order formulas,
the bubble's closed form, a brute-force event loop of the rules; and the fast simulation
against the event loop it replaced (vp=1 is today's 1F1B, firing for firing)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from autosbp.schedule import (
    Firing,
    Phase,
    Timeline,
    check_interleaving,
    one_f_one_b_quotas,
    pipeline_bubble_s,
    simulate,
    stage_orders,
)

Dur = Callable[[int], float]


def reference_1f1b(p: int, m: int, fwd: Dur, bwd: Dur, tr: Dur) -> list[Firing]:
    """The event loop `simulate` ran before (brute force: every stage's ready actors each
    decision, the earliest first; ties backward, then the lower stage)."""
    quotas = one_f_one_b_quotas(p)
    act: list[list[float | None]] = [[0.0] * m] + [[None] * m for _ in range(p - 1)]
    grad: list[list[float | None]] = [[None] * m for _ in range(p)]
    nf, nb, free, out = [0] * p, [0] * p, [0.0] * p, []
    while len(out) < 2 * p * m:
        cands = []
        for s in range(p):
            if nf[s] < m and nf[s] - nb[s] < quotas[s] and act[s][nf[s]] is not None:
                cands.append((max(act[s][nf[s]], free[s]), True, s))  # type: ignore[type-var]
            if nb[s] < nf[s] and grad[s][nb[s]] is not None:
                cands.append((max(grad[s][nb[s]], free[s]), False, s))  # type: ignore[type-var]
        start, forward, s = min(cands)
        if forward:
            mb, nf[s] = nf[s], nf[s] + 1
            end = start + fwd(s)
            if s + 1 < p:
                act[s + 1][mb] = end + tr(s)
            else:
                grad[s][mb] = end
        else:
            mb, nb[s] = nb[s], nb[s] + 1
            end = start + bwd(s)
            if s > 0:
                grad[s - 1][mb] = end + tr(s - 1)
        free[s] = end
        out.append(Firing(s, Phase.FORWARD if forward else Phase.BACKWARD, mb, start, end))
    return out


def megatron_order(p: int, v: int, m: int, rank: int) -> list[tuple[Phase, int, int]]:
    """Megatron-LM's interleaved order on `rank` (schedules.py:
    forward_backward_pipelining_with_interleaving: get_model_chunk_id, the micro-batch of
    virtual micro-batch k, num_warmup_microbatches)."""
    total = m * v

    def step(k: int, forward: bool) -> tuple[Phase, int, int]:
        in_group = k % (p * v)
        chunk = in_group // p
        mb = (k // (p * v)) * p + in_group % p
        if forward:
            return Phase.FORWARD, chunk, mb
        return Phase.BACKWARD, v - 1 - chunk, mb

    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = [step(k, True) for k in range(warmup)]
    for k in range(total - warmup):
        order += [step(k + warmup, True), step(k, False)]
    return order + [step(k, False) for k in range(total - warmup, total)]


def event_loop_interleaved(p: int, v: int, m: int, fwd: Dur, bwd: Dur, tr: Dur) -> Timeline:
    """The actor rules of interleaving as a brute-force event loop: each decision, every
    stage's next actor in turn (warm-up forwards while its register has room, then a forward
    and a backward in turn) is checked for its input; the earliest ready fires."""
    orders = [megatron_order(p, v, m, d) for d in range(p)]
    ready: dict[tuple[Phase, int, int], float] = {(Phase.FORWARD, 0, mb): 0.0 for mb in range(m)}
    pos, free, out = [0] * p, [0.0] * p, []
    while len(out) < 2 * p * v * m:
        cands = []
        for d in range(p):
            if pos[d] < len(orders[d]):
                phase, c, mb = orders[d][pos[d]]
                at = ready.get((phase, c * p + d, mb))
                if at is not None:
                    cands.append((max(at, free[d]), d))
        start, d = min(cands)
        phase, c, mb = orders[d][pos[d]]
        vs = c * p + d
        if phase is Phase.FORWARD:
            end = start + fwd(vs)
            nxt = (Phase.FORWARD, vs + 1, mb) if vs + 1 < p * v else (Phase.BACKWARD, vs, mb)
            ready[nxt] = end + (tr(vs) if vs + 1 < p * v else 0.0)
        else:
            end = start + bwd(vs)
            if vs > 0:
                ready[(Phase.BACKWARD, vs - 1, mb)] = end + tr(vs - 1)
        free[d], pos[d] = end, pos[d] + 1
        out.append(Firing(d, phase, mb, start, end, c))
    return Timeline(tuple(out), p, m, v)


def _durations(rng: random.Random, n: int, choices: tuple[float, ...]) -> Dur:
    return [rng.choice(choices) for _ in range(n)].__getitem__


@pytest.mark.parametrize("seed", range(40), ids=lambda s: f"seed{s}")
def test_vp1_is_the_old_event_loop_firing_for_firing(seed: int) -> None:
    rng = random.Random(seed)
    p, m = rng.choice((1, 2, 3, 4, 6)), rng.choice((1, 2, 3, 5, 8, 12))
    fwd = _durations(rng, p, (0.5, 1.0, 2.0, 3.0, 7.0))
    bwd = _durations(rng, p, (0.5, 1.0, 2.0, 4.0))
    tr = _durations(rng, p, (0.0, 0.25, 1.0))
    assert simulate(p, m, fwd, bwd, tr).firings == tuple(reference_1f1b(p, m, fwd, bwd, tr))


@pytest.mark.parametrize(("p", "m"), [(1, 3), (2, 4), (4, 8), (3, 7)], ids=str)
def test_vp1_stage_orders_are_the_old_unit_run(p: int, m: int) -> None:
    firings = reference_1f1b(p, m, lambda _: 1.0, lambda _: 2.0, lambda _: 0.0)
    want = [
        [(f.phase, 0, f.micro_batch) for f in sorted(firings, key=lambda f: f.start_s)
         if f.stage == s]
        for s in range(p)
    ]  # fmt: skip
    assert stage_orders(p, m) == want == stage_orders(p, m, virtual_stages=1)


GRID = [(p, v, k) for p in (2, 3, 4, 8) for v in (2, 3, 4) for k in (1, 2, 3)]


@pytest.mark.parametrize(("p", "v", "groups"), GRID, ids=str)
def test_interleaved_order_is_megatrons(p: int, v: int, groups: int) -> None:
    m = groups * p
    orders = stage_orders(p, m, virtual_stages=v)
    assert orders == [megatron_order(p, v, m, d) for d in range(p)]
    for d, order in enumerate(orders):  # warm-up: (P - d - 1) x 2 + (v - 1) x P, then 1F1B
        first_backward = next(i for i, f in enumerate(order) if f[0] is Phase.BACKWARD)
        assert first_backward == min((p - d - 1) * 2 + (v - 1) * p + 1, v * m)


@pytest.mark.parametrize(("p", "v", "groups"), GRID, ids=str)
@pytest.mark.parametrize(("tf", "tb"), [(1.0, 2.0), (1.0, 1.0), (2.0, 3.0)], ids=str)
def test_interleaved_bubble_is_the_closed_form(
    p: int, v: int, groups: int, tf: float, tb: float
) -> None:
    """Uniform stages, no transfer: each stage is busy m (tf + tb) and idle (P - 1)(tf + tb)
    / v (Narayanan et al. 2021 section 2.2), in the rules' event loop and in `simulate`."""
    m = groups * p
    fc, bc = tf / v, tb / v  # one chunk: 1/v of the stage's blocks
    timeline = simulate(p, m, lambda _: fc, lambda _: bc, virtual_stages=v)
    loop = event_loop_interleaved(p, v, m, lambda _: fc, lambda _: bc, lambda _: 0.0)
    for stage in range(p):
        assert timeline.bubble_s(stage) == pytest.approx(pipeline_bubble_s(p, v, tf, tb))
        assert loop.bubble_s(stage) == pytest.approx(pipeline_bubble_s(p, v, tf, tb))
    assert timeline.makespan_s == pytest.approx(m * (tf + tb) + pipeline_bubble_s(p, v, tf, tb))
    assert pipeline_bubble_s(p, 1, tf, tb) == pytest.approx(
        simulate(p, m, lambda _: tf, lambda _: tb).bubble_s(0)
    )


@pytest.mark.parametrize("seed", range(30), ids=lambda s: f"seed{s}")
def test_interleaved_simulation_is_the_rules_event_loop(seed: int) -> None:
    """Any durations and transfers: the recurrence gives the event loop's times."""
    rng = random.Random(seed)
    p, v = rng.choice((2, 3, 4)), rng.choice((2, 3))
    m = p * rng.choice((1, 2, 3))
    fwd = _durations(rng, p * v, (0.5, 1.0, 2.0, 3.0))
    bwd = _durations(rng, p * v, (0.5, 1.0, 2.0, 4.0))
    tr = _durations(rng, p * v, (0.0, 0.25, 1.0))
    got = simulate(p, m, fwd, bwd, tr, virtual_stages=v)
    want = event_loop_interleaved(p, v, m, fwd, bwd, tr)
    key = lambda f: (f.stage, f.start_s)  # noqa: E731
    assert sorted(got.firings, key=key) == sorted(want.firings, key=key)


def test_interleaving_keeps_more_chunks_in_flight_each_smaller() -> None:
    """Stage d holds at most its quota of chunk activations; stage 0's first chunk at most
    the P micro-batches of a group more than its last."""
    p, v, m = 4, 2, 8
    timeline = simulate(p, m, lambda _: 1.0, lambda _: 2.0, virtual_stages=v)
    for d, quota in enumerate(one_f_one_b_quotas(p, v)):
        assert timeline.max_in_flight(d) == min(quota, v * m)
        per_chunk = [timeline.max_in_flight(d, c) for c in range(v)]
        assert sum(per_chunk) >= timeline.max_in_flight(d)


@pytest.mark.parametrize(
    ("p", "v", "m", "words"),
    [(2, 2, 3, "not a multiple of 2"), (1, 2, 4, "2 stages or more"), (2, 0, 2, "at least 1")],
    ids=str,
)
def test_interleaving_refuses_what_megatron_cannot_run(p: int, v: int, m: int, words: str) -> None:
    reason = check_interleaving(p, v, m)
    assert reason is not None and words in reason
    with pytest.raises(ValueError, match=words):
        simulate(p, m, lambda _: 1.0, lambda _: 1.0, virtual_stages=v)
