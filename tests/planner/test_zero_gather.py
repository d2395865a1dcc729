"""The planner prices ZeRO's weight gather inside a bucket exactly where the runtime buckets it.

Oracle: brute force over every device of the mesh, as the runtime decides
(`runtime.parallel.sharded_update._member_slots`): the layouts differ on one mesh dim, each
member's piece in the state layout lies inside its piece in the weight's layout
(`boxing.steps.local_box`), and the slot is a contiguous view of a real tensor of the piece's
shape. `memory.gather_buffers.gathers_in_bucket` decides from the layouts alone; both must agree on
every weight layout and state layout of small shapes and meshes. The staging bytes follow it,
and a piece of `GATHER_IN_PLACE_BYTES` or more, which the runtime gathers in place
(`weight_gather.GatheredParam.in_place`), shares no bucket and stages nothing.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from autosbp.boxing.steps import local_box
from autosbp.capturing.graph import TensorMeta
from autosbp.overlap import GATHER_IN_PLACE_BYTES
from autosbp.planner.memory.gather_buffers import (
    gather_staging_bytes,
    gathers_in_bucket,
    shares_gather_bucket,
)
from autosbp.rules import NdSignature
from autosbp.sbp import Broadcast, Mesh, NdSbp, Sbp, Split, local_shape, split_factors
from runtime.parallel.weight_gather import GatheredParam

SHAPES = [(8,), (8, 4), (4, 8), (1, 8), (2, 8), (4, 4, 4), (1, 1, 8)]
MESHES = [(2,), (4,), (2, 2), (2, 4), (4, 2)]


def _layouts(shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> list[NdSbp]:
    """Every layout of B and S(k) per mesh dim that splits `shape` evenly."""
    options: list[Sbp] = [Broadcast(), *(Split(k) for k in range(len(shape)))]
    out = []
    for layout in itertools.product(options, repeat=len(mesh_shape)):
        parts = split_factors(layout, mesh_shape)
        if all(shape[k] % parts.get(k, 1) == 0 for k in range(len(shape))):
            out.append(tuple(layout))
    return out


def _bucketed_by_devices(
    p: NdSbp, q: NdSbp, shape: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> bool:
    differ = [d for d, (a, b) in enumerate(zip(p, q, strict=True)) if a != b]
    if len(differ) != 1:
        return False
    mesh = Mesh(mesh_shape)
    piece = torch.empty(local_shape(shape, p, mesh_shape))
    for index in range(mesh.size):
        coords = mesh.coords(index)
        outer, inner = local_box(shape, p, mesh, coords), local_box(shape, q, mesh, coords)
        if any(a < o or b > e for (o, e), (a, b) in zip(outer, inner, strict=True)):
            return False
        slot = tuple(slice(a - o, b - o) for (o, _), (a, b) in zip(outer, inner, strict=True))
        if not piece[slot].is_contiguous():
            return False
    return True


def _pairs() -> list[tuple[NdSbp, NdSbp, tuple[int, ...], tuple[int, ...]]]:
    """(weight layout, state layout that splits one of its B mesh dims more, shape, mesh)."""
    out = []
    for shape, mesh_shape in itertools.product(SHAPES, MESHES):
        layouts = _layouts(shape, mesh_shape)
        for p in layouts:
            for q in layouts:
                differ = [d for d, (a, b) in enumerate(zip(p, q, strict=True)) if a != b]
                if differ and all(
                    isinstance(p[d], Broadcast) and isinstance(q[d], Split) for d in differ
                ):
                    out.append((p, q, shape, mesh_shape))
    return out


PAIRS = _pairs()


def test_the_pairs_hold_both_answers() -> None:
    answers = {_bucketed_by_devices(*pair) for pair in PAIRS}
    assert answers == {True, False}, "the oracle's cases must include both outcomes"
    assert len(PAIRS) > 200


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_gathers_in_bucket_is_the_runtimes_decision(mesh_shape: tuple[int, ...]) -> None:
    wrong = [
        (p, q, shape)
        for p, q, shape, m in PAIRS
        if m == mesh_shape
        and gathers_in_bucket(p, q, shape, m) != _bucketed_by_devices(p, q, shape, m)
    ]
    assert not wrong, f"predicate and devices disagree on {wrong[:5]}"


def test_staging_bytes_are_the_bucketed_candidates_pieces() -> None:
    meta = TensorMeta((8, 4), torch.float32)
    mesh_shape = (2, 2)
    p_tp = (Split(1), Broadcast())  # tensor parallel on mesh dim 0, replicated over dim 1
    p_rep = (Broadcast(), Broadcast())
    candidates = [NdSignature((), (p,)) for p in (p_rep, p_tp, p_tp)]
    states = [(Broadcast(), Split(0)), (Split(1), Split(0)), None]
    staged = gather_staging_bytes(meta, candidates, states, mesh_shape)
    assert list(staged) == [8 * 4 * 4, 8 * 2 * 4, 0]


@pytest.mark.parametrize("rows", [GATHER_IN_PLACE_BYTES // 1024 - 2, GATHER_IN_PLACE_BYTES // 1024])
def test_large_pieces_are_gathered_in_place_by_both(rows: int) -> None:
    meta = TensorMeta((rows, 256), torch.float32)  # 1 KiB a row
    p, q = (Broadcast(),), (Split(0),)
    piece = torch.empty(meta.shape)
    half = rows // 2
    slots = ((slice(0, half),), (slice(half, rows),))
    in_place = GatheredParam(piece, piece[slots[0]].clone(), slots).in_place
    assert in_place == (rows * 1024 >= GATHER_IN_PLACE_BYTES)
    assert gathers_in_bucket(p, q, meta.shape, (2,))
    assert shares_gather_bucket(meta, p, q, (2,)) == (not in_place)
    staged = gather_staging_bytes(meta, [NdSignature((), (p,))], [q], (2,))
    assert list(staged) == [0 if in_place else rows * 1024]
