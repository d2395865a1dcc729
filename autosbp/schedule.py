"""The actor graph of a pipelined training step and its firing rules, defined once.

Lives here: actors (forward and backward of each stage, or of each model chunk a stage holds),
registers with quotas (the credits), the rule that says which actor may fire, `simulate`, a
run of those rules with given durations, and `run_schedule`. The runtime executes the
per-stage firing order that the rules produce under unit durations (`stage_orders`), fixed
whatever the stages' real durations; the planner prices that same fixed order with the real
durations (`run_schedule`: `run_orders` of `stage_orders`), so both agree on what a plan does
(the rules' own run with uneven stages picks other orders, never faster: 0-24% slower over
300 random shapes and durations). Lives elsewhere: what an actor computes (runtime), how long it
takes (cost model / planner).

Rules (OneFlow's actor model, Yuan et al. 2021 section 4):
- An actor fires when every input register it reads holds a micro-batch and it has a free output
  register. Forward F[s] reads the activation of F[s-1] (stage 0 reads the data) and writes its
  saved activation, read by B[s]; B[s] reads the gradient of B[s+1] (the last stage reads its own
  forward) and frees the saved activation when done.
- The saved-activation register of stage s has quota `num_stages - s`: at most that many
  micro-batches are in flight on stage s. 1F1B emerges from these quotas; a quota of
  `micro_batches` everywhere gives GPipe's all-forward-then-all-backward.
- One device per stage runs one actor at a time; when both are ready, backward goes first (it
  frees a register, so it never delays the pipeline) and ties break by micro-batch order.
- Interleaved 1F1B (Narayanan et al. 2021 section 2.2; Megatron-LM's
  forward_backward_pipelining_with_interleaving): each stage holds v model chunks, chunk c of
  stage d being virtual stage c x P + d, and the actors are those of the P x v virtual stages.
  The stage's chunks share one register of quota (P - d - 1) x 2 + (v - 1) x P + 1; forwards
  run micro-batches in groups of P through chunk 0, then chunk 1, ...; backwards the same
  groups through the chunks in reverse; once the register is full the stage takes turns (one
  forward, one backward), which keeps the bubble at (P - 1)/v of 1F1B's (`pipeline_bubble_s`).
  The micro-batches must be a multiple of P (`check_interleaving`). v = 1 is 1F1B above.
- A cross-stage transfer takes `transfer_s` after its producer ends (send/recv on a link that
  overlaps with compute).
- What compute hides of gradient sync and of parameter conversions: `autosbp.overlap`.
"""

from __future__ import annotations

import enum
import functools
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"  # the whole backward; zero bubble: the input gradients only
    WEIGHT = "weight"  # zero bubble: the weight gradients, deferred (`zero_bubble`)


Chunk = tuple[int, int]  # (chunk, micro-batch)
Step = tuple[Phase, int, int]  # a stage's firing: (phase, chunk, micro-batch)
Duration = Callable[[int], float]  # seconds, of a virtual stage


SCHEDULES = ("1f1b", "zb1")  # a plan's `schedule` (zb1: `zero_bubble`)


@dataclass(frozen=True, slots=True)
class Firing:
    """One actor run: the device's stage (its place in the pipeline), phase, micro-batch, its
    simulated start and end (seconds), and the model chunk it runs (virtual stage
    chunk x num_stages + stage; 0 without interleaving)."""

    stage: int
    phase: Phase
    micro_batch: int
    start_s: float
    end_s: float
    chunk: int = 0


@dataclass(frozen=True, slots=True)
class Timeline:
    firings: tuple[Firing, ...]
    num_stages: int
    micro_batches: int
    virtual_stages: int = 1

    @property
    def makespan_s(self) -> float:
        return max((f.end_s for f in self.firings), default=0.0)

    def busy_s(self, stage: int) -> float:
        return sum(f.end_s - f.start_s for f in self.firings if f.stage == stage)

    def bubble_s(self, stage: int) -> float:
        """Idle time of `stage` (its device, all its chunks) inside the step."""
        return self.makespan_s - self.busy_s(stage)

    def end_s(self, stage: int) -> float:
        """When `stage`'s last firing ends."""
        return max(f.end_s for f in self.firings if f.stage == stage)

    def max_in_flight(self, stage: int, chunk: int | None = None) -> int:
        """Largest number of micro-batches whose saved activations were alive at once on
        `stage` (of its chunk `chunk`, or of all its chunks together)."""
        events = []
        for f in self.firings:
            if f.stage == stage and chunk in (None, f.chunk):
                events.append((f.start_s, 1 if f.phase is Phase.FORWARD else 0))
                if f.phase is Phase.BACKWARD:
                    events.append((f.end_s, -1))
        alive = peak = 0
        for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
            alive += delta
            peak = max(peak, alive)
        return peak


def one_f_one_b_quotas(num_stages: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """Saved-activation quota per stage (its device's register, shared by its chunks) that
    yields 1F1B: stages after it + 1; interleaved (v > 1 chunks per device), Megatron's
    warm-up (P - s - 1) x 2 + (v - 1) x P forwards plus the one of the steady state
    (Narayanan et al. 2021 section 2.2; Megatron-LM's schedules.py)."""
    p, v = num_stages, virtual_stages
    if v == 1:
        return tuple(p - s for s in range(p))
    return tuple((p - s - 1) * 2 + (v - 1) * p + 1 for s in range(p))


def chunk_order(num_stages: int, virtual_stages: int, micro_batches: int) -> list[Chunk]:
    """The (chunk, micro-batch) sequence every stage runs its forwards in: micro-batches in
    groups of `num_stages`, each group through chunk 0, then chunk 1, ... (Megatron's
    interleaving); its backwards run the same sequence with the chunks reversed. Without
    interleaving, micro-batches in order."""
    p, v = num_stages, virtual_stages
    return [((k // p) % v, (k // (p * v)) * p + k % p) for k in range(v * micro_batches)]


def check_interleaving(num_stages: int, virtual_stages: int, micro_batches: int) -> str | None:
    """Why the actor rules cannot interleave this pipeline, or None when they can."""
    if virtual_stages < 1:
        return f"{virtual_stages} virtual stages per device: there must be at least 1"
    if virtual_stages > 1 and num_stages < 2:
        return (
            f"{virtual_stages} chunks per device need a pipeline of 2 stages or more (1 has "
            "nothing to interleave); use vp=1"
        )
    if virtual_stages > 1 and micro_batches % num_stages:
        return (
            f"interleaving runs micro-batches in groups of the {num_stages} stages, but "
            f"{micro_batches} micro-batches is not a multiple of {num_stages}; use a multiple "
            "(Megatron-LM's rule) or vp=1"
        )
    return None


@dataclass
class _Run:
    """The state of one run without interleaving: per stage its next forward and backward
    (micro-batches), when it is free, and per stage and micro-batch when its input arrives."""

    quotas: tuple[int, ...]
    act_ready: list[list[float | None]]
    grad_ready: list[list[float | None]]
    next_fwd: list[int]
    next_bwd: list[int]
    free_at: list[float]

    def ready(self, s: int) -> tuple[float, bool] | None:
        """(start, is forward) of stage `s`'s actor that fires first, or None while neither
        has its input (registers as of the last decision); backward first on ties."""
        fwd, bwd = self.next_fwd[s], self.next_bwd[s]
        best: tuple[float, bool] | None = None
        if bwd < fwd and (arrived := self.grad_ready[s][bwd]) is not None:
            best = (max(arrived, self.free_at[s]), False)
        room = fwd < len(self.act_ready[s]) and fwd - bwd < self.quotas[s]
        if room and (arrived := self.act_ready[s][fwd]) is not None:
            candidate = (max(arrived, self.free_at[s]), True)
            best = candidate if best is None else min(best, candidate)
        return best


def simulate(
    num_stages: int,
    micro_batches: int,
    forward_s: Duration,
    backward_s: Duration,
    transfer_s: Duration = lambda _: 0.0,
    quotas: Sequence[int] | None = None,
    virtual_stages: int = 1,
) -> Timeline:
    """Run the firing rules with `forward_s(v)`, `backward_s(v)` and `transfer_s(v)` (the time
    to move an activation or gradient between virtual stage v and v + 1; v = chunk x
    num_stages + stage, the stage itself without interleaving).

    Without interleaving, event-driven: each stage's first actor to fire is kept in a heap and
    recomputed only when the stage fires or an input of it arrives, so a run costs
    O(firings x log stages); the firings are those of the rule "the earliest ready actor of any
    stage fires next" (ties: backward, then the lower stage). Interleaved, the stages take
    turns (`interleaved_orders`) and the times follow by `run_orders`."""
    p, v = num_stages, virtual_stages
    reason = check_interleaving(p, v, micro_batches)
    if reason is not None:
        raise ValueError(reason)
    if v > 1:
        assert quotas is None, "interleaving takes Megatron's quotas (one_f_one_b_quotas)"
        orders = interleaved_orders(p, v, micro_batches)
        return run_orders(orders, micro_batches, forward_s, backward_s, transfer_s)
    quotas = tuple(quotas) if quotas is not None else one_f_one_b_quotas(p)
    assert len(quotas) == p and min(quotas) >= 1, quotas
    run = _Run(
        quotas,
        [[None] * micro_batches for _ in range(p)],
        [[None] * micro_batches for _ in range(p)],
        [0] * p, [0] * p, [0.0] * p,
    )  # fmt: skip
    run.act_ready[0] = [0.0] * micro_batches
    versions = [0] * p
    heap: list[tuple[float, bool, int, int]] = []

    def push(s: int) -> None:
        versions[s] += 1
        best = run.ready(s)
        if best is not None:
            heapq.heappush(heap, (best[0], best[1], s, versions[s]))

    for s in range(p):
        push(s)
    firings = []
    while heap:
        start, forward, s, version = heapq.heappop(heap)
        if version != versions[s]:
            continue
        firings.append(_fire(run, s, start, forward, forward_s, backward_s, transfer_s))
        for t in {s, min(s + 1, p - 1) if forward else max(s - 1, 0)}:
            push(t)
    assert len(firings) == 2 * p * micro_batches, "the actor graph deadlocked (a quota < 1?)"
    return Timeline(tuple(firings), p, micro_batches)


def interleaved_orders(
    num_stages: int, virtual_stages: int, micro_batches: int
) -> list[list[Step]]:
    """Each stage's firings when its register (quota W + 1, `one_f_one_b_quotas`) is shared
    by its chunks and it takes turns: W forwards of warm-up (Megatron's), then one forward and
    one backward in turn, then the remaining backwards; forwards in `chunk_order`, backwards
    in the same order with the chunks reversed (Narayanan et al. 2021 section 2.2). Taking
    turns, not running whichever actor is ready first, is what keeps the bubble at
    (P - 1) / v chunk-times: a stage that ran ready backwards first would hold back the
    forwards the next chunk's stages wait for."""
    p, v = num_stages, virtual_stages
    sequence = chunk_order(p, v, micro_batches)
    forwards = [(Phase.FORWARD, c, mb) for c, mb in sequence]
    backwards = [(Phase.BACKWARD, v - 1 - c, mb) for c, mb in sequence]
    orders = []
    for quota in one_f_one_b_quotas(p, v):
        warm = min(quota - 1, len(sequence))
        order = forwards[:warm]
        for i in range(len(sequence) - warm):
            order += [forwards[warm + i], backwards[i]]
        orders.append(order + backwards[len(sequence) - warm :])
    return orders


def run_orders(
    orders: Sequence[Sequence[Step]],
    micro_batches: int,
    forward_s: Duration,
    backward_s: Duration,
    transfer_s: Duration = lambda _: 0.0,
    weight_s: Duration | None = None,
) -> Timeline:
    """The times of each stage firing `orders` (fixed per stage) as soon as its input arrives
    and the one before it ended: a recurrence over the firings, O(firings). Asserts that the
    orders complete (blocking receives in these orders cannot deadlock). With `weight_s`
    (zero bubble's split backward) BACKWARD is the input gradients only, and a WEIGHT firing
    runs once its stage's BACKWARD of that micro-batch ended."""
    p = len(orders)
    v = 1 + max(c for order in orders for _, c, _ in order)
    arrival = {(Phase.FORWARD, 0, mb): 0.0 for mb in range(micro_batches)}
    position, free_at, firings = [0] * p, [0.0] * p, []
    waiting = list(range(p))
    while waiting:
        s = waiting.pop()
        while position[s] < len(orders[s]):
            phase, chunk, mb = orders[s][position[s]]
            vs = chunk * p + s
            arrived = arrival.get((phase, vs, mb))
            if arrived is None:
                break
            start = max(arrived, free_at[s])
            if phase is Phase.FORWARD:
                end = start + forward_s(vs)
                to, at = (vs + 1, end + transfer_s(vs)) if vs + 1 < p * v else (vs, end)
                arrival[(Phase.FORWARD if to > vs else Phase.BACKWARD, to, mb)] = at
            elif phase is Phase.WEIGHT:
                assert weight_s is not None, "a WEIGHT firing without weight_s"
                end, to = start + weight_s(vs), vs
            else:
                end = start + backward_s(vs)
                arrival[(Phase.WEIGHT, vs, mb)] = end
                to = vs - 1
                if to >= 0:
                    arrival[(Phase.BACKWARD, to, mb)] = end + transfer_s(to)
            free_at[s] = end
            position[s] += 1
            firings.append(Firing(s, phase, mb, start, end, chunk))
            waiting.append(to % p)
    assert all(position[s] == len(orders[s]) for s in range(p)), "the orders deadlock"
    return Timeline(tuple(firings), p, micro_batches, v)


def _fire(
    run: _Run, s: int, start: float, forward: bool,
    forward_s: Duration, backward_s: Duration, transfer_s: Duration,
) -> Firing:  # fmt: skip
    """Stage `s` runs its next forward (or backward) from `start`: its output's register is
    filled for the actor that reads it."""
    last = len(run.act_ready) - 1
    if forward:
        mb = run.next_fwd[s]
        run.next_fwd[s] += 1
        end = start + forward_s(s)
        if s < last:
            run.act_ready[s + 1][mb] = end + transfer_s(s)
        else:
            run.grad_ready[s][mb] = end
    else:
        mb = run.next_bwd[s]
        run.next_bwd[s] += 1
        end = start + backward_s(s)
        if s > 0:
            run.grad_ready[s - 1][mb] = end + transfer_s(s - 1)
    run.free_at[s] = end
    return Firing(s, Phase.FORWARD if forward else Phase.BACKWARD, mb, start, end)


def stage_orders(
    num_stages: int,
    micro_batches: int,
    quotas: Sequence[int] | None = None,
    virtual_stages: int = 1,
) -> list[list[Step]]:
    """The firing order of each stage, (phase, chunk, micro-batch) each: what each runtime
    rank executes (without interleaving, the rules' run under unit durations).

    Executing these orders with non-blocking sends and blocking receives cannot deadlock: they
    come from one valid run of the same rules, and each receive follows its send in that run.
    """
    if virtual_stages > 1:
        return interleaved_orders(num_stages, virtual_stages, micro_batches)
    timeline = simulate(num_stages, micro_batches, lambda _: 1.0, lambda _: 2.0, quotas=quotas)
    orders: list[list[Step]] = [[] for _ in range(num_stages)]
    for f in sorted(timeline.firings, key=lambda f: f.start_s):
        orders[f.stage].append((f.phase, f.chunk, f.micro_batch))
    return orders


def run_schedule(
    num_stages: int,
    micro_batches: int,
    forward_s: Duration,
    backward_s: Duration,
    transfer_s: Duration = lambda _: 0.0,
    virtual_stages: int = 1,
) -> Timeline:
    """The step as the runtime runs it: every stage fires its `stage_orders` order, each firing
    as soon as its input arrives and the one before it ended (`run_orders`), with the given
    durations (those of `simulate`)."""
    orders = _cached_orders(num_stages, micro_batches, virtual_stages)
    return run_orders(orders, micro_batches, forward_s, backward_s, transfer_s)


@functools.lru_cache(maxsize=32)
def _cached_orders(
    num_stages: int, micro_batches: int, virtual_stages: int
) -> tuple[tuple[Step, ...], ...]:
    """`stage_orders` of a shape, once per search (the configurations repeat them)."""
    check = check_interleaving(num_stages, virtual_stages, micro_batches)
    if check is not None:
        raise ValueError(check)
    orders = stage_orders(num_stages, micro_batches, virtual_stages=virtual_stages)
    return tuple(tuple(order) for order in orders)


def pipeline_bubble_s(
    num_stages: int, virtual_stages: int, forward_s: float, backward_s: float
) -> float:
    """Each stage's idle time in a step of uniform stages without transfer time (closed form):
    (P - 1)(f + b) / v, `forward_s` and `backward_s` one micro-batch's on a whole stage (its v
    chunks together). 1F1B's (v = 1) is (P - 1)(f + b) (Narayanan et al. 2021 section 2.2);
    transfers and uneven stages add to it (`simulate`)."""
    return (num_stages - 1) * (forward_s + backward_s) / virtual_stages
