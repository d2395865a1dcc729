"""The price of gradient sync hidden behind the last backward: the formula against an event
simulation of the buckets, and the planner's ILP (a max term) against brute force and against
the prediction it must equal on one stage."""

from __future__ import annotations

import random

import pytest
import torch

from autosbp import overlap as overlap_rules
from autosbp.capturing.export import capture
from autosbp.overlap import hidden_sync_s
from autosbp.planner.problem.build import build_problem
from autosbp.planner.timing.predict import predict
from autosbp.sbp import Mesh
from tests.planner.test_planner import (
    UNLIMITED,
    TinyNet,
    a100_prices,
    limit_between,
    solved_like_brute_force,
)


def _simulated_exposed_s(sync_s: float, backward_s: float, buckets: int) -> float:
    """Buckets of equal sync time, ready at even intervals of backward, synced one at a time:
    how long the last one ends after backward does."""
    end_s = 0.0
    for j in range(1, buckets + 1):
        end_s = max(end_s, j * backward_s / buckets) + sync_s / buckets
    return end_s - backward_s


@pytest.mark.parametrize("seed", range(5))
def test_hidden_sync_equals_an_event_simulation_of_the_buckets(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        sync_s, backward_s, buckets = rng.uniform(0, 2), rng.uniform(0, 2), rng.randint(1, 40)
        exposed = sync_s - hidden_sync_s(sync_s, backward_s, buckets, overlap=1.0)
        assert exposed == pytest.approx(_simulated_exposed_s(sync_s, backward_s, buckets))


def test_one_bucket_or_no_overlap_hides_nothing_and_overlap_scales_the_rest() -> None:
    assert hidden_sync_s(1.0, 5.0, 1, overlap=1.0) == 0.0
    assert hidden_sync_s(1.0, 5.0, 4, overlap=0.0) == 0.0
    assert hidden_sync_s(1.0, 5.0, 4, overlap=0.5) == pytest.approx(0.5 * 0.75)


@pytest.mark.slow
@pytest.mark.parametrize("memory_fraction", [None, 0.3])
def test_overlapped_sync_problem_equals_brute_force_and_the_prediction(
    monkeypatch: pytest.MonkeyPatch, memory_fraction: float | None
) -> None:
    # Buckets of 64 bytes: TinyNet's 768 bytes of weights fill 12, so the sync partly hides.
    monkeypatch.setattr(overlap_rules, "GRAD_BUCKET_BYTES", 64)
    graph = capture(TinyNet(), [torch.randn(8, 8), torch.randn(8, 4)])

    def build(limit: float | None):
        return build_problem(
            graph, Mesh((2,)), a100_prices(), optimizer="adam", memory_limit_bytes=limit,
            micro_batches=2,
        )  # fmt: skip

    limit = None if memory_fraction is None else limit_between(build(UNLIMITED).problem.memory, 0.3)
    mp = build(limit)
    assert mp.stage_costs.sync_buckets == (12,)
    assert len(mp.problem.max_terms) == 1
    got = solved_like_brute_force(mp.problem)
    prediction = predict(mp, got)
    assert prediction.step_time_s == pytest.approx(got.objective, rel=1e-9)
    sync_s = mp.stage_costs.sync[0].value(got.choice)
    overlap = mp.stage_costs.overlap
    assert overlap > 0  # the spec profile's: else nothing would hide
    hidden = hidden_sync_s(sync_s, prediction.backward_s[0], 12, overlap)
    assert prediction.sync_hidden_s[0] == pytest.approx(hidden)
    if memory_fraction is None:  # replicated weights: their sync partly hides
        assert 0 < prediction.sync_hidden_s[0] < sync_s


def _two_streams_s(gather_s: float, compute_s: float, blocks: int, depth: int) -> float:
    """Identical blocks on two streams: block j computes once its parameters are gathered and
    block j - 1 is done; block j's gather starts once block j - 1's is done and a buffer is
    free (at most 1 + `depth` blocks' parameters held: block j - 1 - depth's compute done)."""
    gathered, computed = [0.0] * blocks, [0.0] * blocks
    for j in range(blocks):
        freed = computed[j - 1 - depth] if j - 1 - depth >= 0 else 0.0
        gathered[j] = max(gathered[j - 1] if j else 0.0, freed) + gather_s
        computed[j] = max(computed[j - 1] if j else 0.0, gathered[j]) + compute_s
    return computed[-1]


@pytest.mark.parametrize("depth", [1, 2], ids=["prefetch1", "prefetch2"])
@pytest.mark.parametrize("seed", range(3))
def test_hidden_gather_equals_a_two_stream_simulation(seed: int, depth: int) -> None:
    # Perfect overlap: what prefetching hides of b blocks' gathers is what the two streams
    # save against running gather and compute one after another; a deeper prefetch saves
    # nothing more on identical blocks (the slower stream sets the pace).
    rng = random.Random(seed)
    for _ in range(50):
        gather_s, compute_s, blocks = rng.uniform(0, 2), rng.uniform(0, 2), rng.randint(1, 12)
        serial = blocks * (gather_s + compute_s)
        saved = serial - _two_streams_s(gather_s, compute_s, blocks, depth)
        hidden = overlap_rules.hidden_gather_s(gather_s, compute_s, blocks - 1, overlap=1.0)
        assert hidden == pytest.approx(saved, rel=1e-12, abs=1e-12)
        half = overlap_rules.hidden_gather_s(gather_s, compute_s, blocks - 1, overlap=0.5)
        assert half == pytest.approx(0.5 * hidden, rel=1e-12, abs=1e-12)
