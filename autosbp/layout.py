"""Cut a global tensor into per-device pieces by an nD SBP, and put the pieces back together.

Lives here: `shard_tensor` (the piece device r holds) and `assemble_tensor` (the global tensor
from all pieces), used by tests (simulated ranks), by the runtime to materialize parameters, and
by checkpoints. Lives elsewhere: moving pieces between devices (`boxing`).

Conventions (the same as torch DTensor): mesh dims apply in order, outer first, so on a 2x2 mesh
S(0)S(0) gives device (i, j) chunk 2*i + j of dim 0. A P mesh dim is laid out with the whole value
on coordinate 0 and zeros elsewhere (any addends that sum to the value are valid P; this one is
exact in floating point). P(max)/P(min) put the value on every coordinate (idempotent ops).
Assembly sums over P mesh dims (or takes max/min), concatenates over S dims and checks nothing
for B (callers that need it compare B copies themselves).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from autosbp.errors import SbpError
from autosbp.sbp import Broadcast, Mesh, NdSbp, Partial, Sbp, Split, as_nd_sbp, check_nd_sbp


def shard_tensor(
    tensor: torch.Tensor,
    nd_sbp: NdSbp | Sequence[Sbp] | str,
    mesh: Mesh | Sequence[int],
    coords: Sequence[int],
) -> torch.Tensor:
    """The piece of `tensor` that the device at mesh `coords` holds under `nd_sbp` (an nD SBP
    or its text, e.g. "S(0)B")."""
    mesh = Mesh.of(mesh)
    nd_sbp = as_nd_sbp(nd_sbp)
    check_nd_sbp(nd_sbp, tensor.shape, mesh.shape)
    coords = tuple(coords)
    if len(coords) != mesh.ndim or not all(
        0 <= c < n for c, n in zip(coords, mesh.shape, strict=True)
    ):
        raise SbpError(
            f"coords {coords} are not a device of mesh {mesh.shape}; give one coordinate per "
            f"mesh dim, each in 0..size-1 (e.g. {(0,) * mesh.ndim})."
        )
    piece = tensor
    for sbp, size, coord in zip(nd_sbp, mesh.shape, coords, strict=True):
        if isinstance(sbp, Split):
            piece = piece.chunk(size, dim=sbp.dim)[coord]
        elif isinstance(sbp, Partial) and sbp.op == "sum" and coord != 0:
            piece = torch.zeros_like(piece)
    return piece.contiguous()


def assemble_tensor(
    pieces: Sequence[torch.Tensor], nd_sbp: NdSbp, mesh: Mesh | Sequence[int]
) -> torch.Tensor:
    """Inverse of `shard_tensor`: `pieces[i]` is the piece of the device at `mesh.coords(i)`."""
    mesh = Mesh.of(mesh)
    assert len(pieces) == mesh.size, f"{len(pieces)} pieces for a mesh of {mesh.size} devices"
    # Fold the last mesh dim first: each group along it becomes one piece of the mesh without it.
    current = list(pieces)
    shape = list(mesh.shape)
    for mesh_dim in reversed(range(mesh.ndim)):
        size = shape[mesh_dim]
        sbp = nd_sbp[mesh_dim]
        folded = []
        for start in range(0, len(current), size):
            group = current[start : start + size]
            folded.append(_combine(group, sbp))
        current = folded
        shape.pop()
    assert len(current) == 1
    return current[0]


def _combine(group: list[torch.Tensor], sbp: Split | Broadcast | Partial) -> torch.Tensor:
    if isinstance(sbp, Split):
        return torch.cat(group, dim=sbp.dim)
    if isinstance(sbp, Broadcast):
        return group[0]
    stacked = torch.stack(group)
    if sbp.op == "max":
        return stacked.amax(0)
    if sbp.op == "min":
        return stacked.amin(0)
    return stacked.sum(0)
