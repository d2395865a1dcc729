"""What boxing steps do to local tensors, in pure torch: the simulator and the shared local ops.

Lives here: `apply_local_step` (the LOCAL steps: slice, zero-pad, keep-or-zero), `transfer_slices`
(where a SEND_RECV message sits in the sender's and the receiver's local tensors), and
`simulate_boxing` (every rank's local tensor through a chain of steps, in one process).
Lives elsewhere: planning (`chains`), the same steps on torch.distributed (`runtime.execute.collectives`, which
calls `apply_local_step` and `transfer_slices` so that the two agree by construction).

Invariants: the simulator works group by group on the local tensors only (never re-cuts the
global tensor), so a hop that a group cannot do alone shows up as a wrong result; it is the
oracle the runtime's collectives are tested against. Pieces are ordered like `layout`:
`pieces[i]` belongs to the device at `mesh.coords(i)`.
Reference: layout conventions in `autosbp.layout`; collective semantics as in torch.distributed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from autosbp.boxing.steps import BoxingStep, StepKind, Transfer, local_box
from autosbp.sbp import Broadcast, Partial, Split, local_shape

__all__ = ["apply_local_step", "simulate_boxing", "transfer_slices"]

Slices = tuple[slice, ...]


def apply_local_step(step: BoxingStep, x: torch.Tensor, coord: int) -> torch.Tensor:
    """A LOCAL step on the device at coordinate `coord` of `step.mesh_dim`; returns a new tensor."""
    assert step.kind is StepKind.LOCAL, step
    a, b, p = step.src_sbp, step.dst_sbp, step.group_size
    if p == 1:
        return x.clone()
    if isinstance(a, Broadcast) and isinstance(b, Split):
        return x.chunk(p, dim=b.dim)[coord].clone()
    if isinstance(a, Split) and isinstance(b, Partial):
        sizes = list(x.shape)
        sizes[a.dim] *= p
        out = x.new_zeros(sizes)
        out.narrow(a.dim, coord * x.shape[a.dim], x.shape[a.dim]).copy_(x)
        return out
    assert isinstance(a, Broadcast) and isinstance(b, Partial), step
    return x.clone() if coord == 0 else torch.zeros_like(x)


def transfer_slices(step: BoxingStep, transfer: Transfer) -> tuple[Slices, Slices]:
    """Where `transfer`'s region lies in the sender's local tensor and in the receiver's."""
    src_box = local_box(step.shape, step.src, step.mesh, step.mesh.coords(transfer.src))
    dst_box = local_box(step.shape, step.dst, step.dst_mesh, step.dst_mesh.coords(transfer.dst))

    def within(outer: tuple[tuple[int, int], ...]) -> Slices:
        return tuple(
            slice(start - lo, stop - lo)
            for (start, stop), (lo, _) in zip(transfer.box, outer, strict=True)
        )

    return within(src_box), within(dst_box)


def simulate_boxing(
    pieces: Sequence[torch.Tensor], steps: Sequence[BoxingStep]
) -> list[torch.Tensor]:
    """Every device's local tensor after `steps`, from every device's local tensor before."""
    current = list(pieces)
    for step in steps:
        assert len(current) == step.mesh.size, f"{len(current)} pieces for {step.mesh}"
        if step.kind is StepKind.SEND_RECV:
            current = _simulate_send_recv(current, step)
        else:
            current = _simulate_hop(current, step)
    return current


def _simulate_hop(pieces: list[torch.Tensor], step: BoxingStep) -> list[torch.Tensor]:
    mesh, mesh_dim = step.mesh, step.mesh_dim
    assert mesh_dim is not None
    position = {device: index for index, device in enumerate(mesh.device_ids)}
    out = list(pieces)
    for group in mesh.groups(mesh_dim):
        members = [position[device] for device in group]
        results = _group_op(step, [pieces[m] for m in members])
        for member, result in zip(members, results, strict=True):
            out[member] = result
    return out


def _group_op(step: BoxingStep, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One group's collective on its members' tensors (in coordinate order)."""
    a, b, p = step.src_sbp, step.dst_sbp, len(xs)
    if step.kind is StepKind.LOCAL:
        return [apply_local_step(step, x, coord) for coord, x in enumerate(xs)]
    if step.kind is StepKind.ALL_GATHER:
        assert isinstance(a, Split)
        whole = torch.cat(xs, dim=a.dim)
        return [whole.clone() for _ in xs]
    if step.kind is StepKind.ALL_REDUCE:
        total = torch.stack(xs).sum(0)
        return [total.clone() for _ in xs]
    if step.kind is StepKind.REDUCE_SCATTER:
        assert isinstance(b, Split)
        return [c.clone() for c in torch.stack(xs).sum(0).chunk(p, dim=b.dim)]
    assert step.kind is StepKind.ALL_TO_ALL and isinstance(a, Split) and isinstance(b, Split)
    return [torch.cat([x.chunk(p, dim=b.dim)[c] for x in xs], dim=a.dim) for c in range(p)]


def _simulate_send_recv(pieces: list[torch.Tensor], step: BoxingStep) -> list[torch.Tensor]:
    shape = local_shape(step.shape, step.dst, step.dst_mesh.shape)
    out = [pieces[0].new_zeros(shape) for _ in range(step.dst_mesh.size)]
    for transfer in step.transfers:
        src_slices, dst_slices = transfer_slices(step, transfer)
        out[transfer.dst][dst_slices] += pieces[transfer.src][src_slices]
    return out
