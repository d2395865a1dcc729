"""Helpers for boxing tests: random layouts, checked assembly, random cases, and gloo workers.

Lives here: `shard_random` (every device's piece, with random integer addends on P mesh dims),
`assemble_checked` (assemble after checking that B copies agree), `draw_case` (one random boxing
case from any integer source: hypothesis or a seeded `random.Random`), `BoxingCase`, and
`run_boxing_cases` (the module-level worker for `launching.workers.run_workers`).
Lives elsewhere: the assertions (tests/test_boxing_*.py); cut/assemble conventions
(`autosbp.layout`).

Invariants: every worker builds the process groups of all cases first, in case order, then runs
the cases in order (collectives match by order); values are small integers held in float32, so
sums are exact and comparisons use `torch.equal`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from autosbp.boxing import dual_nd_sbp, plan_boxing
from autosbp.layout import assemble_tensor, shard_tensor
from autosbp.sbp import B, Broadcast, Mesh, NdSbp, P, Partial, S, Sbp, split_factors
from launching.errors import ExecutionError
from runtime.execute.collectives import execute_boxing
from runtime.execute.groups import ProcessGroups, build_groups

Pick = Callable[[int, int], int]  # pick(lo, hi): an integer in [lo, hi]


def shard_random(tensor: torch.Tensor, nd_sbp: NdSbp, mesh: Mesh, seed: int) -> list[torch.Tensor]:
    """Every device's piece of `tensor`; on each P mesh dim the addends are random integers
    (the same on B copies) that sum to the piece, not the value-and-zeros of `shard_tensor`."""
    pieces = [shard_tensor(tensor, nd_sbp, mesh, mesh.coords(i)) for i in range(mesh.size)]
    gen = torch.Generator().manual_seed(seed)
    for mesh_dim, sbp in enumerate(nd_sbp):
        if not isinstance(sbp, Partial) or mesh.shape[mesh_dim] == 1:
            continue
        noise: dict[tuple[int, ...], torch.Tensor] = {}
        for i in range(mesh.size):
            coords = mesh.coords(i)
            if coords[mesh_dim] and _noise_key(nd_sbp, coords) not in noise:
                noise[_noise_key(nd_sbp, coords)] = torch.randint(
                    -3, 4, pieces[i].shape, generator=gen
                ).float()
        for i in range(mesh.size):
            coords = list(mesh.coords(i))
            if coords[mesh_dim]:
                pieces[i] = pieces[i] + noise[_noise_key(nd_sbp, coords)]
                continue
            for k in range(1, mesh.shape[mesh_dim]):
                coords[mesh_dim] = k
                pieces[i] = pieces[i] - noise[_noise_key(nd_sbp, coords)]
    return pieces


def _noise_key(nd_sbp: NdSbp, coords: Sequence[int]) -> tuple[int, ...]:
    """Coordinates with B mesh dims zeroed: B copies get the same noise."""
    return tuple(0 if isinstance(s, Broadcast) else c for s, c in zip(nd_sbp, coords, strict=True))


def assemble_checked(pieces: Sequence[torch.Tensor], nd_sbp: NdSbp, mesh: Mesh) -> torch.Tensor:
    """`assemble_tensor`, after checking that the copies along every B mesh dim are equal."""
    for i in range(mesh.size):
        coords = mesh.coords(i)
        for mesh_dim, sbp in enumerate(nd_sbp):
            if isinstance(sbp, Broadcast) and coords[mesh_dim]:
                first = mesh.index((*coords[:mesh_dim], 0, *coords[mesh_dim + 1 :]))
                assert torch.equal(pieces[i], pieces[first]), (
                    f"B copies differ on mesh dim {mesh_dim}: device {coords} vs its coordinate 0"
                )
    return assemble_tensor(pieces, nd_sbp, mesh)


# ---------------------------------------------------------------------------------------------
# Random cases


def byte_picker(choices: bytes) -> Pick:
    """A `Pick` that reads `choices` in order (then picks `lo`): hypothesis shrinks bytes towards
    zero, so failing cases shrink towards the first option of every choice. One `st.binary` draw
    costs far less than a `data.draw` per choice (1,000 examples in about a second)."""
    stream = iter(choices)

    def pick(lo: int, hi: int) -> int:
        return lo + next(stream, 0) % (hi - lo + 1)

    return pick


def draw_mesh(pick: Pick, max_devices: int, first_device: int = 0) -> Mesh:
    """A mesh of 1 to 3 dims of sizes 1 to 3, at most `max_devices` devices."""
    shape = []
    left = max_devices
    for _ in range(pick(1, 3)):
        size = pick(1, min(3, left))
        shape.append(size)
        left //= size
    ids = tuple(range(first_device, first_device + math.prod(shape)))
    return Mesh(tuple(shape), device_ids=ids)


def draw_nd_sbp(pick: Pick, ndim: int, mesh: Mesh) -> NdSbp:
    options: list[Sbp] = [B, P, *(S(k) for k in range(ndim))]
    return tuple(options[pick(0, len(options) - 1)] for _ in mesh.shape)


def draw_case(pick: Pick, max_devices: int) -> tuple[NdSbp, NdSbp, tuple[int, ...], Mesh, Mesh]:
    """(src, dst, shape, mesh, dst_mesh): one third of the cases cross to a disjoint mesh. The
    shape is the smallest that both SBPs divide, times 1 or 2 per dim."""
    cross = max_devices > 1 and pick(0, 2) == 0
    mesh = draw_mesh(pick, max_devices - 1 if cross else max_devices)
    dst_mesh = draw_mesh(pick, max_devices - mesh.size, mesh.size) if cross else mesh
    ndim = pick(0, 3)
    src, dst = draw_nd_sbp(pick, ndim, mesh), draw_nd_sbp(pick, ndim, dst_mesh)
    need = [1] * ndim
    for nd_sbp, m in ((src, mesh), (dst, dst_mesh)):
        for dim, parts in split_factors(nd_sbp, m.shape).items():
            need[dim] = math.lcm(need[dim], parts)
    shape = tuple(n * pick(1, 2) for n in need)
    return src, dst, shape, mesh, dst_mesh


def random_values(shape: Sequence[int], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, tuple(shape), generator=gen).float()


# ---------------------------------------------------------------------------------------------
# gloo worker


@dataclass(frozen=True)
class BoxingCase:
    """One conversion to run on every rank: `tensor` forward, `grad` as the upstream gradient."""

    case_id: str
    src: NdSbp
    dst: NdSbp
    mesh: Mesh
    dst_mesh: Mesh
    tensor: torch.Tensor
    grad: torch.Tensor
    seed: int


# (local output, local input grad), as numpy arrays: torch tensors would cross the result queue
# as shared-memory handles that die with the worker.
CaseResult = tuple[np.ndarray | None, np.ndarray | None]


def run_boxing_cases(
    rank: int, world_size: int, cases: Sequence[BoxingCase]
) -> tuple[list[CaseResult], str]:
    """Worker: plan and execute every case on this rank, forward and backward; then pass a local
    tensor of the wrong shape and return the error message."""
    meshes: list[Mesh] = []
    for case in cases:
        meshes += [m for m in (case.mesh, case.dst_mesh) if m not in meshes]
    groups = build_groups(meshes)
    results = [_run_case(rank, case, groups) for case in cases]
    steps = plan_boxing(S(0), B, (8, 4), Mesh((world_size,)))
    try:
        execute_boxing(torch.zeros(8, 4), steps, groups)
    except ExecutionError as error:
        return results, str(error)
    return results, "no error"


def _run_case(rank: int, case: BoxingCase, groups: ProcessGroups) -> CaseResult:
    steps = plan_boxing(case.src, case.dst, case.tensor.shape, case.mesh, case.dst_mesh)
    x = None
    if rank in case.mesh.device_ids:
        pieces = shard_random(case.tensor, case.src, case.mesh, case.seed)
        x = pieces[case.mesh.device_ids.index(rank)].requires_grad_()
    y = execute_boxing(x, steps, groups)
    in_dst = rank in case.dst_mesh.device_ids
    if in_dst:
        grads = shard_random(case.grad, dual_nd_sbp(case.dst), case.dst_mesh, case.seed + 1)
        y.backward(grads[case.dst_mesh.device_ids.index(rank)])
    elif x is not None:
        y.backward(torch.empty(0))
    out = y.detach().numpy().copy() if in_dst else None
    grad = x.grad.numpy().copy() if x is not None and x.grad is not None else None
    return out, grad
