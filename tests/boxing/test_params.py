"""`autosbp.boxing.params`: which stored-to-read conversions of a parameter are gathers, the one
test the planner drops interleaved and zb1 winners by and the runtime refuses such plans by.
Oracle: the steps themselves, run on one process (`simulate_boxing`): a conversion is local
exactly when every device's output piece is computed from its own input piece."""

from __future__ import annotations

import pytest
import torch

from autosbp.boxing import plan_boxing, simulate_boxing
from autosbp.boxing.params import has_collective
from autosbp.layout import shard_tensor
from autosbp.sbp import B, Mesh, NdSbp, P, S

SHAPE = (4, 6)
# (stored, read, mesh shape, a gather?)
CASES: list[tuple[NdSbp, NdSbp, tuple[int, ...], bool]] = [
    ((S(0),), (P,), (2,), False),  # row-parallel bias: keep one's own rows, zeros elsewhere
    ((B,), (S(1),), (2,), False),  # a slice of what each device holds
    ((B,), (P,), (2,), False),  # one device keeps it, the others zero
    ((S(0),), (B,), (2,), True),  # FSDP's all-gather
    ((S(0),), (S(1),), (2,), True),  # an all-to-all
    ((S(0), B), (P, S(1)), (2, 2), False),
    ((B, S(0)), (B, B), (2, 2), True),
]


@pytest.mark.parametrize(
    ("stored", "read", "mesh_shape", "gather"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES]
)
def test_a_gather_is_a_conversion_that_reads_another_devices_piece(
    stored: NdSbp, read: NdSbp, mesh_shape: tuple[int, ...], gather: bool
) -> None:
    mesh = Mesh(mesh_shape)
    steps = plan_boxing(stored, read, SHAPE, mesh)
    assert has_collective(steps) == gather
    whole = torch.arange(24.0).reshape(SHAPE)
    pieces = [shard_tensor(whole, stored, mesh, mesh.coords(d)) for d in range(mesh.size)]
    out = simulate_boxing(pieces, steps)
    reads_others = False
    for device in range(mesh.size):  # every other device's piece changed: is this one's output?
        changed = [p if d == device else p + 100.0 for d, p in enumerate(pieces)]
        reads_others |= not torch.equal(simulate_boxing(changed, steps)[device], out[device])
    assert reads_others == gather
