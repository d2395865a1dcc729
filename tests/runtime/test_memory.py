"""The planner's predicted peak memory per rank against the runtime's measured peak (issue 16).

Measured: `runtime.verify.peak_memory.measure_peak_bytes` (torch.profiler's allocation events of c10's CPU
allocator, with what the engine holds between steps: see its header), in a step after Adam's
states exist. Predicted: the plan's `peak_memory_bytes` of the rank's stage. Each rank of the
fsdp and auto plans of the zoo GPT and MLP (and ZeRO-1's and ZeRO-2's of the GPT) on 2 and 4 gloo processes must lie within
TOLERANCE of the prediction.

Why not exact: the planner prices what a step holds at once (model states, what autograd keeps
for backward, with the micro-batches in flight), not the transients of one op (a matmul's output
before the op that consumes it, a gradient before it is accumulated, a boxing's buffers), which
come and go around the peak; and the async collectives' buffers overlap more or less as their
threads run, so a rank's peak moves by a few hundred bytes between runs of these tiny models.
Lives elsewhere: the workers (tests/support/memory_workers.py), the planning (tests/runtime/test_runtime.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.runtime.test_runtime import MODELS, _plan_json
from tests.support.memory_workers import measure_cases
from tests.support.worlds import cases_by_world

TOLERANCE = 0.10  # issue 16's bound on |measured / predicted - 1|
WORKER_TIMEOUT_S = 120.0
# The sizes are tests/runtime/test_runtime.py's wide models (peaks of hundreds of kB: at the tiny
# models' 6 kB, a few hundred bytes of transients moved the ratio by 10%); every rank of every
# case is held to the bound. The
# workers step with the fused Adam that `autosbp train` runs and the planner prices (torch's
# per-tensor loop would add two temporaries the size of the parameter it updates).
# The distributed optimizer (`runtime.parallel.sharded_update`): Adam's states split over data
# parallelism (ZeRO-1), and the gradients too (ZeRO-2: reduce-scattered as backward makes them),
# weights replicated; gpt-wide on 2 processes. Measured 1.000 per rank (ZeRO-1 and ZeRO-2: the
# peak is at the weight gather, the states and one bucket's buffer, `runtime.parallel.
# weight_gather`, as the planner prices it), the same in 3 runs; 0.950 and 0.953 before the
# gather was bucketed and the shard's gradient counted as the view it is. Before gloo's conversions ran as in-place
# all-reduces, its reduce_scatter_tensor / all_gather_into_tensor allocated three buffers the
# size of the parameter per call and ZeRO-1 measured 0.976-1.186, run to run.
CASES: list[tuple[int, str, str]] = [
    *(
        (n, model, strategy)
        for n in (2, 4)
        for model in ("mlp-wide", "gpt-wide")
        for strategy in ("fsdp", "auto")
    ),
    (2, "gpt-wide", "megatron:tp=1,pp=1,dp=2,zero=1"),
    (2, "gpt-wide", "megatron:tp=1,pp=1,dp=2,zero=2"),
    # the mixed recipe (runtime.parallel.precision): bf16 compute copies beside fp32 masters,
    # gradients accumulated in fp32 (18 bytes per Adam element, not 16)
    (2, "gpt-wide", "dp/bf16"),
    (2, "gpt-wide", "fsdp/bf16"),
    # ZeRO under the mixed recipe: the fp32 masters are the shards (`Weights.release`), the
    # bf16 copies gathered from them. Measured 1.045 (zero=1: the peak moved from the weight
    # gather, 1.000 while it gathered fp32 masters, to backward, where a bf16 matmul's 87,168-
    # byte transient lands; an op's transients are not priced) and 0.999 (zero=2).
    (2, "gpt-wide", "megatron:tp=1,pp=1,dp=2,zero=1/bf16"),
    (2, "gpt-wide", "megatron:tp=1,pp=1,dp=2,zero=2/bf16"),
    (4, "mlp-wide", "fsdp/bf16"),
    (4, "gpt-wide", "auto/bf16"),
]


def _case_id(world_size: int, model: str, strategy: str) -> str:
    return f"{world_size}-{model}-{strategy}"


def _cases(world_size: int) -> list[dict[str, Any]]:
    return [
        {
            "id": _case_id(*c),
            "model": MODELS[c[1]][0],
            "model_kwargs": MODELS[c[1]][1],
            "plan": _plan_json(c[1], world_size, c[2]),
            "regather": None,
            "depth": 0,
        }
        for c in CASES
        if c[0] == world_size
    ]


@pytest.fixture(scope="module")
def worlds() -> Callable[[int], dict[str, list[dict[str, float]]]]:
    """world size -> {case id: the case's figures on each rank}; each world is run once."""
    return cases_by_world(measure_cases, _cases, WORKER_TIMEOUT_S)


# fsdp of mlp-wide on 4 ranks measured 1.09-1.22 (an xfail) from collective buffers the
# runtime held needlessly (`runtime.parallel.prefetch`): a unit's gathers started before the
# previous unit's were waited for, so that unit's gloo staging copy lived beside the next's
# (now FSDP2's order: wait, then prefetch); and each deferred reduce-scatter cloned the whole
# gradient (gloo's reduce-scatter is an all-reduce of a copy), a clone its worker thread let
# go of only some time after the wait, so one unit's sat beside the next's (1.085-1.285 by
# the race); the gradient is now all-reduced in place (`collectives._reduce_scatter_in_place`).
# Measured since: 1.064-1.066 on every rank over 12 rank-runs; 1.164 on one rank in ~20 runs
# under load (a clean CI run failed on it): a gather's output freed on gloo's worker thread,
# a free the profiler had not counted (`runtime.verify.peak_memory`'s header). Since every
# thread is counted: 1.064 on every rank in 43 runs beside 3 busy processes.
#
# Priced since the non-finite check joined the update (`autosbp.planner.timing.finite_check`), the
# auto plan of gpt-wide on 2 ranks under the tests' made-up prices (1 GB/s memory) is another
# one: attention and MLP tensor-parallel, where it was replicated attention. Its peak is
# over-predicted: 0.888 on both ranks in a steady step (681,044 of 767,362 bytes), 0.97-0.98 on
# a rank where a 73,728-byte transient lands beside the peak. An open finding (what the
# planner prices of this plan that a step never holds at once), not noise. Held to its band
# (a ratio below it, or above 1 + TOLERANCE, fails), where a non-strict xfail passed either way.
OVER_PREDICTED = {(2, "gpt-wide", "auto"): 0.85}
# fsdp of mlp-wide on 4 ranks in bf16 measured 1.139 on every rank (309,810 of 272,008 bytes):
# under the mixed recipe a gathered weight's bf16 gradient is cast to fp32 for its
# reduce-scatter (`runtime.parallel.prefetch.GatherSchedule.reduce`, as FSDP2's reduce_dtype),
# held until the next unit's; at the peak, in the first block's backward, the second block's
# fp32 gradient (65,536 bytes for its 128 x 128 weight) is held where its bf16 copy (32,768) was
# freed, and its fp32 gradient shard is not made yet. Priced since ("stage s reduce",
# `problem.stage_terms`): 1.001 on every rank (309,810 of 309,432), and fsdp of mlp-wide on 4
# ranks in fp32, whose gathered gradients are held the same way, from 1.064 to 1.025. No other
# case's prediction moved.


@pytest.mark.dist
@pytest.mark.parametrize(
    ("world_size", "model", "strategy"),
    CASES,
    ids=[_case_id(*c) for c in CASES],
)
def test_measured_peak_is_the_predicted_peak(
    worlds: Callable[[int], Any], world_size: int, model: str, strategy: str
) -> None:
    per_rank = worlds(world_size)[_case_id(world_size, model, strategy)]
    ratios = [r["measured_bytes"] / r["predicted_bytes"] for r in per_rank]
    lowest = OVER_PREDICTED.get((world_size, model, strategy), 1 - TOLERANCE)
    assert all(lowest <= ratio <= 1 + TOLERANCE for ratio in ratios), (
        f"measured / predicted peak per rank: {[f'{x:.3f}' for x in ratios]} "
        f"(measured {[int(r['measured_bytes']) for r in per_rank]} bytes, "
        f"predicted {int(per_rank[0]['predicted_bytes'])})"
    )
