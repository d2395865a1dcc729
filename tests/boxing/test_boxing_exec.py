"""Boxing executed on 4 gloo processes: every SBP pair on 1D and 2x2 meshes, stage-to-stage
transfers, and a random sample of the property-test cases, forward and backward.

Oracles: the layout (the output assembles to the input tensor; the input gradient, assembled per
dual(src), to the upstream gradient assembled per dual(dst)) and the simulator (every rank's
local tensor equals `simulate_boxing`'s, forward and dual backward). The 4 processes start once
for the module (start-up costs seconds); each case is one parametrized assertion on the results.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from autosbp.boxing import dual_nd_sbp, dual_step, plan_boxing
from autosbp.boxing.simulate import simulate_boxing
from autosbp.sbp import B, Mesh, P, S, format_nd_sbp
from launching.errors import ExecutionError
from launching.workers import run_workers
from runtime.execute.groups import ProcessGroups
from tests.support.dist_helpers import (
    BoxingCase,
    CaseResult,
    assemble_checked,
    draw_case,
    random_values,
    run_boxing_cases,
    shard_random,
)

WORLD = 4
SBPS = (S(0), S(1), B, P)


def _case(case_id: str, src, dst, shape, mesh: Mesh, dst_mesh: Mesh, seed: int) -> BoxingCase:
    src, dst = tuple(src), tuple(dst)
    tensor, grad = random_values(shape, seed), random_values(shape, seed + 7)
    return BoxingCase(case_id, src, dst, mesh, dst_mesh, tensor, grad, seed)


def _all_cases() -> list[BoxingCase]:
    cases = []
    meshes = {
        "1d4": Mesh((4,)),
        "1d2": Mesh((2,), device_ids=(1, 3)),  # a group of non-adjacent ranks
        "2x2": Mesh((2, 2)),
    }
    for name, mesh in meshes.items():
        for src, dst in itertools.product(itertools.product(SBPS, repeat=mesh.ndim), repeat=2):
            case_id = f"{name}-{format_nd_sbp(src)}-{format_nd_sbp(dst)}"
            cases.append(_case(case_id, src, dst, (4, 4), mesh, mesh, len(cases)))
    stages = {
        "2to2": (Mesh((2,), device_ids=(0, 1)), Mesh((2,), device_ids=(2, 3))),
        "2to1": (Mesh((2,), device_ids=(0, 1)), Mesh((1,), device_ids=(2,))),
    }
    for name, (mesh, dst_mesh) in stages.items():
        for src, dst in itertools.product(SBPS, repeat=2):
            case_id = f"stage{name}-{src!r}-{dst!r}"
            cases.append(_case(case_id, (src,), (dst,), (4, 2), mesh, dst_mesh, len(cases)))
    rng = random.Random(2024)
    for k in range(40):
        src, dst, shape, mesh, dst_mesh = draw_case(rng.randint, WORLD)
        case_id = f"random{k}-{mesh.shape}{format_nd_sbp(src)}-{dst_mesh.shape}{format_nd_sbp(dst)}"
        cases.append(_case(case_id, src, dst, shape, mesh, dst_mesh, len(cases)))
    return cases


CASES = _all_cases()


@pytest.fixture(scope="module")
def worker_output() -> list[tuple[list[CaseResult], str]]:
    return run_workers(run_boxing_cases, WORLD, (CASES,), timeout_s=120)


@pytest.fixture(scope="module")
def results(worker_output) -> dict[str, list[CaseResult]]:
    per_rank = [cases for cases, _ in worker_output]
    return {case.case_id: [per_rank[r][i] for r in range(WORLD)] for i, case in enumerate(CASES)}


def _tensor(array: np.ndarray | None) -> torch.Tensor:
    assert array is not None, "the rank returned no tensor"
    return torch.from_numpy(array)


def _steps(case: BoxingCase):
    return plan_boxing(case.src, case.dst, case.tensor.shape, case.mesh, case.dst_mesh)


@pytest.mark.dist
@pytest.mark.parametrize("case", CASES, ids=[c.case_id for c in CASES])
def test_forward_gives_the_target_layout(results: dict[str, list[CaseResult]], case: BoxingCase):
    outs = [_tensor(results[case.case_id][rank][0]) for rank in case.dst_mesh.device_ids]
    assert torch.equal(assemble_checked(outs, case.dst, case.dst_mesh), case.tensor)
    pieces = shard_random(case.tensor, case.src, case.mesh, case.seed)
    simulated = simulate_boxing(pieces, _steps(case))
    for rank, out, sim in zip(case.dst_mesh.device_ids, outs, simulated, strict=True):
        assert torch.equal(out, sim), f"rank {rank}: executor and simulator differ"


@pytest.mark.dist
@pytest.mark.parametrize("case", CASES, ids=[c.case_id for c in CASES])
def test_backward_is_the_dual_conversion(results: dict[str, list[CaseResult]], case: BoxingCase):
    grads = [_tensor(results[case.case_id][rank][1]) for rank in case.mesh.device_ids]
    assert torch.equal(assemble_checked(grads, dual_nd_sbp(case.src), case.mesh), case.grad)
    upstream = shard_random(case.grad, dual_nd_sbp(case.dst), case.dst_mesh, case.seed + 1)
    simulated = simulate_boxing(upstream, [dual_step(s) for s in reversed(_steps(case))])
    for rank, grad, sim in zip(case.mesh.device_ids, grads, simulated, strict=True):
        assert torch.equal(grad, sim), f"rank {rank}: executor and simulated dual steps differ"


@pytest.mark.dist
def test_wrong_local_shape_is_a_clear_error(worker_output):
    for rank, (_, message) in enumerate(worker_output):
        assert (
            f"rank {rank} passed a local tensor of shape (8, 4), but its piece is (2, 4)" in message
        )


def test_missing_group_is_a_clear_error():
    with pytest.raises(ExecutionError, match=r"no process group for ranks \[0, 1\].*build_groups"):
        ProcessGroups().get((0, 1))
