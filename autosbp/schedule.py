"""The actor graph of a pipelined training step and its firing rules, defined once.

Lives here: actors (forward and backward of each stage), registers with quotas (the credits),
the rule that says which actor may fire, and `simulate`, a discrete-event run of those rules with
given durations. The planner simulates to price pipelines; the runtime executes the per-stage
firing order that the same rules produce (`stage_orders`), so both agree on what a plan does.
Lives elsewhere: what an actor computes (runtime), how long it takes (cost model / planner).

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
- A cross-stage transfer takes `transfer_s` after its producer ends (send/recv on a link that
  overlaps with compute).
- Gradient sync is fused: gradients that need the same collective are synced together in flat
  buckets of at most GRAD_BUCKET_BYTES (as DDP does), so a parameter pays its share (its bytes
  over the bucket's) of its bucket's collective. A bucket is launched as soon as the last
  micro-batch's backward has finished its gradients, so the sync overlaps that backward
  (`hidden_sync_s`).
- Parameter communication overlaps the blocks' compute (FSDP's prefetch): a stage of identical
  blocks converts the parameters of the next PREFETCH_BLOCKS block(s) while it computes one, in
  forward (their gathers) and in backward (the re-gathers of the blocks before it and the
  reduce-scatters of the gradients of the blocks after it). Per micro-batch, each of its blocks
  but one hides that much (`hidden_gather_s`); activations' boxing runs in line.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

GRAD_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb (25 MB), torch docs
# Blocks whose parameters are converted ahead of the one computing: FSDP2's default (one
# block, `fully_shard`'s implicit prefetching), which the plan states for the runtime.
PREFETCH_BLOCKS = 1


def hidden_gather_s(comm_s: float, compute_s: float, slots: int, overlap: float) -> float:
    """The parameter communication of a stage's blocks that their compute hides, per
    micro-batch and direction: overlap x slots x min(comm_s, compute_s), where `comm_s` and
    `compute_s` are one block's (identical blocks), `slots` the blocks that have a block's
    compute to hide behind (all but one: the first block's forward gathers, and in backward the
    first re-gather and the last reduce-scatter, have none), and `overlap` the profile's
    fraction of communication that running beside compute hides.

    With prefetch, block j + 1's conversions run on the communication stream while block j
    computes, so a block takes the larger of its compute and its communication (with perfect
    overlap): the exposed communication of b blocks is b comm - (b - 1) min(comm, compute),
    whatever the depth (identical blocks: a deeper prefetch cannot beat the slower of the two
    streams). Linear in each argument where they do not cross, so the ILP prices it exactly
    as the larger of two linear parts (`objective`).
    """
    return overlap * max(slots, 0) * min(comm_s, compute_s)


def hidden_sync_s(sync_s: float, backward_s: float, buckets: int, overlap: float) -> float:
    """The part of a stage's gradient sync (`sync_s`, in `buckets` buckets) that its last
    micro-batch's backward (`backward_s`) hides: overlap x (1 - 1/buckets) x min(sync_s,
    backward_s), where `overlap` (the profile's, in [0, 1]) is the fraction of communication
    time that running beside compute hides on this hardware.

    With k equal buckets ready at even intervals of backward, the first starts after 1/k of it
    and the last only when it ends, so with perfect overlap the exposed sync is max(sync / k,
    sync - (1 - 1/k) x backward) = sync - hidden. One bucket hides nothing. Linear in each
    argument where sync and backward do not cross, so the planner's ILP prices it exactly as a
    max of two linear parts.
    """
    return overlap * (1.0 - 1.0 / max(buckets, 1)) * min(sync_s, backward_s)


def sync_buckets(param_bytes: int) -> int:
    """How many buckets the gradients of `param_bytes` of parameters fill, at least one."""
    return max(1, math.ceil(param_bytes / GRAD_BUCKET_BYTES))


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True, slots=True)
class Firing:
    """One actor run: stage, phase, micro-batch, and its simulated start and end (seconds)."""

    stage: int
    phase: Phase
    micro_batch: int
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True)
class Timeline:
    firings: tuple[Firing, ...]
    num_stages: int
    micro_batches: int

    @property
    def makespan_s(self) -> float:
        return max((f.end_s for f in self.firings), default=0.0)

    def busy_s(self, stage: int) -> float:
        return sum(f.end_s - f.start_s for f in self.firings if f.stage == stage)

    def bubble_s(self, stage: int) -> float:
        """Idle time of `stage` inside the step."""
        return self.makespan_s - self.busy_s(stage)

    def max_in_flight(self, stage: int) -> int:
        """Largest number of micro-batches whose saved activations were alive at once on `stage`."""
        events = []
        for f in self.firings:
            if f.stage == stage:
                events.append((f.start_s, 1 if f.phase is Phase.FORWARD else 0))
                if f.phase is Phase.BACKWARD:
                    events.append((f.end_s, -1))
        alive = peak = 0
        for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
            alive += delta
            peak = max(peak, alive)
        return peak


def one_f_one_b_quotas(num_stages: int) -> tuple[int, ...]:
    """Saved-activation quota per stage that yields 1F1B: stages after it + 1."""
    return tuple(num_stages - s for s in range(num_stages))


def simulate(
    num_stages: int,
    micro_batches: int,
    forward_s: Callable[[int], float],
    backward_s: Callable[[int], float],
    transfer_s: Callable[[int], float] = lambda _: 0.0,
    quotas: Sequence[int] | None = None,
) -> Timeline:
    """Run the firing rules with `forward_s(stage)`, `backward_s(stage)` and `transfer_s(stage)`
    (the time to move an activation or gradient between stage and stage + 1)."""
    quotas = tuple(quotas) if quotas is not None else one_f_one_b_quotas(num_stages)
    assert len(quotas) == num_stages and min(quotas) >= 1, quotas
    # Arrival times of each stage's inputs per micro-batch; None until produced.
    act_ready: list[list[float | None]] = [[None] * micro_batches for _ in range(num_stages)]
    grad_ready: list[list[float | None]] = [[None] * micro_batches for _ in range(num_stages)]
    act_ready[0] = [0.0] * micro_batches
    next_fwd = [0] * num_stages
    next_bwd = [0] * num_stages
    free_at = [0.0] * num_stages
    firings: list[Firing] = []
    while len(firings) < 2 * num_stages * micro_batches:
        candidates = []
        for s in range(num_stages):
            for phase, start in _ready(
                s, next_fwd, next_bwd, act_ready, grad_ready, quotas, micro_batches
            ):
                # Backward first on ties (see the module header), then the earliest-ready stage.
                candidates.append((max(start, free_at[s]), phase is Phase.FORWARD, s, phase))
        assert candidates, "the actor graph deadlocked (a quota below 1?)"
        start, _, s, phase = min(candidates)
        duration = forward_s(s) if phase is Phase.FORWARD else backward_s(s)
        end = start + duration
        free_at[s] = end
        if phase is Phase.FORWARD:
            mb = next_fwd[s]
            next_fwd[s] += 1
            if s + 1 < num_stages:
                act_ready[s + 1][mb] = end + transfer_s(s)
            else:
                grad_ready[s][mb] = end
        else:
            mb = next_bwd[s]
            next_bwd[s] += 1
            if s > 0:
                grad_ready[s - 1][mb] = end + transfer_s(s - 1)
        firings.append(Firing(s, phase, mb, start, end))
    return Timeline(tuple(firings), num_stages, micro_batches)


def _ready(
    s: int,
    next_fwd: list[int],
    next_bwd: list[int],
    act_ready: list[list[float | None]],
    grad_ready: list[list[float | None]],
    quotas: Sequence[int],
    micro_batches: int,
) -> list[tuple[Phase, float]]:
    """The actors of stage `s` whose inputs are produced and output registers free, with the
    time their last input arrives (registers are checked as of the last decision)."""
    out: list[tuple[Phase, float]] = []
    fwd, bwd = next_fwd[s], next_bwd[s]
    if fwd < micro_batches and fwd - bwd < quotas[s]:
        arrived = act_ready[s][fwd]
        if arrived is not None:
            out.append((Phase.FORWARD, arrived))
    if bwd < fwd:
        arrived = grad_ready[s][bwd]
        if arrived is not None:
            out.append((Phase.BACKWARD, arrived))
    return out


def stage_orders(
    num_stages: int, micro_batches: int, quotas: Sequence[int] | None = None
) -> list[list[tuple[Phase, int]]]:
    """The firing order of each stage under unit durations: what each runtime rank executes.

    Executing these orders with non-blocking sends and blocking receives cannot deadlock: they
    come from one valid run of the same rules, and each receive follows its send in that run.
    """
    timeline = simulate(num_stages, micro_batches, lambda _: 1.0, lambda _: 2.0, quotas=quotas)
    orders: list[list[tuple[Phase, int]]] = [[] for _ in range(num_stages)]
    for f in sorted(timeline.firings, key=lambda f: f.start_s):
        orders[f.stage].append((f.phase, f.micro_batch))
    return orders
