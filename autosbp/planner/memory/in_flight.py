"""Micro-batches in flight: how many micro-batches' activations a stage holds at once.

Lives here: `in_flight` (1F1B: stage s of P holds P - s, the schedule's quotas) and
`interleaved_in_flight` (per chunk of an interleaved stage, at its device's peak, read off the
actor simulation). Lives elsewhere: zero bubble's counts (`autosbp.zero_bubble`), the bytes a
micro-batch keeps (`memory.kept`, `memory.device_bytes`), their per-stage sum
(`problem.stage_terms`).
"""

from __future__ import annotations

from autosbp.schedule import Phase, simulate


def in_flight(stage: int, num_stages: int) -> int:
    """Micro-batches whose activations stage `stage` holds at once under 1F1B (schedule quotas)."""
    return num_stages - stage


def interleaved_in_flight(
    num_stages: int, virtual_stages: int, micro_batches: int
) -> tuple[int, ...]:
    """Per virtual stage (chunk c of stage d: c x P + d), the micro-batches whose activations
    chunk c holds at the moment stage d holds the most chunk activations under interleaved
    1F1B (`schedule.simulate`, unit durations): the chunks' in-flight counts that add up to
    the stage's peak (exact where the chunks' activations are alike, as equal blocks are)."""
    p, v = num_stages, virtual_stages
    timeline = simulate(p, micro_batches, lambda _: 1.0, lambda _: 2.0, virtual_stages=v)
    out = [0] * (p * v)
    for d in range(p):
        events = sorted(
            (f.end_s if f.phase is Phase.BACKWARD else f.start_s,
             -1 if f.phase is Phase.BACKWARD else 1, f.chunk)
            for f in timeline.firings if f.stage == d
        )  # fmt: skip
        alive, best = [0] * v, [0] * v
        for _, delta, chunk in events:  # a backward's end frees before a forward starts
            alive[chunk] += delta
            if sum(alive) > sum(best):
                best = list(alive)
        for c in range(v):
            out[c * p + d] = best[c]
    return tuple(out)
