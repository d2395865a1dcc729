"""The steps of a boxing chain: what each one is, what it costs in bytes, and its backward.

Lives here: `StepKind`, `BoxingStep`, `Transfer`, `TRANSITIONS` (the one table of 1D conversions),
`make_hop` (the step that changes one mesh dim), `cross_step` / `cross_transfers` (the send/recv
between two disjoint meshes), `dual_step` / `dual_nd_sbp` (backward), `local_box`.
Lives elsewhere: choosing the chain (`boxing.plan_boxing`), what a step does to tensors in pure
torch (`boxing.simulate`, the simulator) and with torch.distributed (`runtime.execute.collectives`).

Invariants:
- A step changes one mesh dim (`mesh_dim`), or moves a tensor between two disjoint meshes
  (`SEND_RECV`, `mesh_dim` None). `total_bytes` is the bytes sent summed over all devices (the
  OneFlow paper's convention); a hop on one mesh dim of an nD mesh runs in prod(other dims)
  groups, each on the piece its group holds.
- `make_hop` refuses a hop on mesh dim d that splits or gathers tensor dim k when a later mesh dim
  (of size > 1) also splits k: mesh dims cut left to right (DTensor's order), so the devices of such
  a group do not hold one contiguous piece.
- The backward of a step src->dst is the step dual(dst)->dual(src) (dual swaps B and P, keeps S):
  the adjoint of its linear map on local tensors. The table is closed under duality.
Reference: OneFlow paper (Yuan et al. 2021) section 3.2; oneflow `sbp_infer_util.cpp` (costs),
`nd_sbp.cpp` (`GetDualNdSbp`); nccl-tests PERFORMANCE.md (message sizes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch

from autosbp.sbp import B, Broadcast, Mesh, NdSbp, P, Partial, Sbp, Split, format_nd_sbp

__all__ = [
    "CODE_B",
    "CODE_P",
    "TRANSITIONS",
    "Box",
    "BoxingStep",
    "StepKind",
    "Transfer",
    "code_sbp",
    "cross_step",
    "cross_transfers",
    "dual_nd_sbp",
    "dual_step",
    "hop_bytes",
    "hop_kind",
    "later_split_dims",
    "local_box",
    "make_hop",
    "sbp_code",
]

Box = tuple[tuple[int, int], ...]  # per tensor dim, the half-open index range [start, stop)


class StepKind(str, Enum):
    LOCAL = "local"
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"


# The one table of 1D conversions on a group of p > 1 devices: (src, dst) -> (kind, reason).
# "S" and "S'" are splits of two different tensor dims. Identities (S(i)->S(i), B->B, P->P) need
# no step; on a mesh dim of size 1 every conversion is a relabel (LOCAL, 0 bytes).
# The table is closed under duality: the row dual(dst)->dual(src) is the backward of each row.
TRANSITIONS: dict[tuple[str, str], tuple[StepKind, str]] = {
    ("S", "S'"): (
        StepKind.ALL_TO_ALL,
        "rank c sends chunk c' (new dim) of its piece to rank c', concatenates along the old dim",
    ),
    ("S", "B"): (StepKind.ALL_GATHER, "the p pieces concatenated along the split dim are T"),
    ("S", "P"): (
        StepKind.LOCAL,
        "each piece written at its offset into zeros: the p padded pieces sum to T",
    ),
    ("B", "S"): (StepKind.LOCAL, "every rank already holds its chunk: slice it"),
    ("B", "P"): (StepKind.LOCAL, "coordinate 0 keeps the copy, the others hold zeros: sum is T"),
    ("P", "S"): (StepKind.REDUCE_SCATTER, "rank c needs only chunk c of the sum"),
    ("P", "B"): (StepKind.ALL_REDUCE, "every rank needs the whole sum"),
}

# Bytes sent by one group of p ranks whose collective covers a piece of g bytes: the ring
# algorithms' volumes (nccl-tests conventions), which reproduce the OneFlow table.
_GROUP_VOLUME: dict[StepKind, Callable[[int, int], int]] = {
    StepKind.LOCAL: lambda g, p: 0,
    StepKind.ALL_GATHER: lambda g, p: (p - 1) * g,
    StepKind.REDUCE_SCATTER: lambda g, p: (p - 1) * g,
    StepKind.ALL_REDUCE: lambda g, p: 2 * (p - 1) * g,
    StepKind.ALL_TO_ALL: lambda g, p: (p - 1) * g // p,
}


@dataclass(frozen=True, slots=True)
class Transfer:
    """One message of a SEND_RECV step: the region `box` of the global tensor (an addend of it when
    the source is P), from device `src` (a position in the source mesh) to `dst` (a position in the
    destination mesh), which adds it into its local tensor."""

    src: int
    dst: int
    box: Box

    @property
    def numel(self) -> int:
        return math.prod(stop - start for start, stop in self.box)


@dataclass(frozen=True, slots=True)
class BoxingStep:
    """One hop of a boxing chain: what the cost model prices and the runtime executes.

    `mesh` is where the step starts and `dst_mesh` where it ends (the same mesh unless the kind is
    SEND_RECV). A collective runs in `num_groups` groups of `group_size` ranks along `mesh_dim`;
    `message_bytes` is the nccl-tests "size" of one group's collective (all-reduce, all-gather output,
    reduce-scatter input: the group's piece; all-to-all: one rank's buffer); for SEND_RECV it is the
    most bytes one device sends or receives. `total_bytes`: bytes sent, summed over all devices.
    """

    kind: StepKind
    src: NdSbp
    dst: NdSbp
    mesh_dim: int | None
    shape: tuple[int, ...]
    mesh: Mesh
    dst_mesh: Mesh
    dtype: torch.dtype
    group_size: int
    num_groups: int
    message_bytes: int
    total_bytes: int
    transfers: tuple[Transfer, ...] = field(default=(), repr=False)

    @property
    def src_sbp(self) -> Sbp:
        """The 1D SBP this step converts from (on `mesh_dim`)."""
        assert self.mesh_dim is not None, "a SEND_RECV step changes every mesh dim"
        return self.src[self.mesh_dim]

    @property
    def dst_sbp(self) -> Sbp:
        assert self.mesh_dim is not None, "a SEND_RECV step changes every mesh dim"
        return self.dst[self.mesh_dim]

    @property
    def tensor_dims(self) -> tuple[int, ...]:
        """The tensor dims this step splits or gathers (sorted)."""
        if self.mesh_dim is None:
            sbps: tuple[Sbp, ...] = (*self.src, *self.dst)
        else:
            sbps = (self.src[self.mesh_dim], self.dst[self.mesh_dim])
        return tuple(sorted({s.dim for s in sbps if isinstance(s, Split)}))

    @property
    def link_class(self) -> str | None:
        """The profile link class the collective crosses; None for SEND_RECV (stage to stage)."""
        return None if self.mesh_dim is None else self.mesh.link_classes[self.mesh_dim]

    @property
    def bytes_per_device(self) -> int:
        """Bytes each participating device sends (the mean for SEND_RECV)."""
        return self.total_bytes // (self.group_size * self.num_groups)

    def __repr__(self) -> str:
        where = "stage" if self.mesh_dim is None else f"mesh_dim={self.mesh_dim}"
        return (
            f"BoxingStep({self.kind.value} {format_nd_sbp(self.src)}->{format_nd_sbp(self.dst)} "
            f"{where} p={self.group_size}x{self.num_groups} {self.total_bytes} B)"
        )


def dual_nd_sbp(nd_sbp: Sequence[Sbp]) -> NdSbp:
    """The SBP of a tensor's gradient: B <-> P, S stays (OneFlow `GetDualNdSbp`)."""
    return tuple(
        P if isinstance(s, Broadcast) else B if isinstance(s, Partial) else s for s in nd_sbp
    )


def dual_step(step: BoxingStep) -> BoxingStep:
    """The backward of `step`: dual(dst) -> dual(src), the adjoint of its map on local tensors."""
    if step.kind is StepKind.SEND_RECV:
        mirrored = tuple(Transfer(t.dst, t.src, t.box) for t in step.transfers)
        return cross_step(
            dual_nd_sbp(step.dst),
            dual_nd_sbp(step.src),
            step.shape,
            step.dst_mesh,
            step.mesh,
            step.dtype,
            mirrored,
        )
    assert step.mesh_dim is not None
    dual = make_hop(
        dual_nd_sbp(step.dst),
        dual_nd_sbp(step.src),
        step.mesh_dim,
        step.shape,
        step.mesh,
        step.dtype,
    )
    assert dual is not None, f"the transition table is not closed under duality at {step}"
    return dual


def local_box(
    shape: Sequence[int], nd_sbp: Sequence[Sbp], mesh: Mesh, coords: Sequence[int]
) -> Box:
    """The region of the global tensor that the device at `coords` holds (layout's cut order)."""
    box = [(0, n) for n in shape]
    for sbp, size, coord in zip(nd_sbp, mesh.shape, coords, strict=True):
        if isinstance(sbp, Split):
            start, stop = box[sbp.dim]
            chunk = (stop - start) // size
            box[sbp.dim] = (start + coord * chunk, start + (coord + 1) * chunk)
    return tuple(box)


# ---------------------------------------------------------------------------------------------
# Hops on one mesh


# Integer codes of 1D SBPs, for the planner's search (fast to hash): S(k) -> k, B -> -1, P -> -2.
CODE_B, CODE_P = -1, -2


def sbp_code(sbp: Sbp) -> int:
    assert not isinstance(sbp, Partial) or sbp.op == "sum", f"{sbp!r} is not boxed"
    return sbp.dim if isinstance(sbp, Split) else CODE_B if isinstance(sbp, Broadcast) else CODE_P


def code_sbp(code: int) -> Sbp:
    return Split(code) if code >= 0 else B if code == CODE_B else P


_LETTERS = {CODE_B: "B", CODE_P: "P"}


def _transition_key(a: int, b: int) -> tuple[str, str]:
    if a >= 0 and b >= 0 and a != b:
        return ("S", "S'")
    return (_LETTERS.get(a, "S"), _LETTERS.get(b, "S"))


def hop_kind(a: int, b: int, group_size: int, later_split_dims: set[int]) -> StepKind | None:
    """The kind of the step a -> b (SBP codes) on a mesh dim of `group_size`, or None where no one
    step does it; `later_split_dims`: tensor dims that later mesh dims (of size > 1) split."""
    row = TRANSITIONS.get(_transition_key(a, b))
    if row is None:
        return None
    if group_size == 1:
        return StepKind.LOCAL
    if a in later_split_dims or b in later_split_dims:  # codes of B and P are negative
        return None
    return row[0]


def hop_bytes(kind: StepKind, group_bytes: int, group_size: int, num_groups: int) -> int:
    """Bytes sent by all groups of a hop, each covering a piece of `group_bytes`."""
    return num_groups * _GROUP_VOLUME[kind](group_bytes, group_size)


def later_split_dims(codes: Sequence[int], mesh_shape: Sequence[int], mesh_dim: int) -> set[int]:
    """Tensor dims split by the mesh dims after `mesh_dim` (of size > 1); `codes`: SBP codes."""
    return {
        c
        for c, n in zip(codes[mesh_dim + 1 :], mesh_shape[mesh_dim + 1 :], strict=True)
        if c >= 0 and n > 1
    }


def make_hop(
    src: NdSbp, dst: NdSbp, mesh_dim: int, shape: tuple[int, ...], mesh: Mesh, dtype: torch.dtype
) -> BoxingStep | None:
    """The step that changes `mesh_dim` from src to dst, or None where no one step does it."""
    codes = tuple(sbp_code(s) for s in src)
    nbytes = math.prod(shape) * dtype.itemsize
    sized = hop_size(codes, sbp_code(dst[mesh_dim]), mesh_dim, mesh.shape, nbytes)
    if sized is None:
        return None
    kind, message_bytes, num_groups, total_bytes = sized
    return BoxingStep(
        kind=kind,
        src=src,
        dst=dst,
        mesh_dim=mesh_dim,
        shape=shape,
        mesh=mesh,
        dst_mesh=mesh,
        dtype=dtype,
        group_size=mesh.shape[mesh_dim],
        num_groups=num_groups,
        message_bytes=message_bytes,
        total_bytes=total_bytes,
    )


def hop_size(
    codes: tuple[int, ...], code: int, mesh_dim: int, mesh_shape: tuple[int, ...], nbytes: int
) -> tuple[StepKind, int, int, int] | None:
    """(kind, message bytes, number of groups, total bytes) of the step that changes `mesh_dim`
    of the SBP codes `codes` to `code`, for a tensor of `nbytes`; None where no one step does it."""
    p = mesh_shape[mesh_dim]
    kind = hop_kind(codes[mesh_dim], code, p, later_split_dims(codes, mesh_shape, mesh_dim))
    if kind is None:
        return None
    group_bytes = nbytes // hop_pieces(codes, mesh_dim, mesh_shape)
    num_groups = math.prod(mesh_shape) // p
    message = group_bytes // p if kind is StepKind.ALL_TO_ALL else group_bytes
    total = hop_bytes(kind, group_bytes, p, num_groups)
    return kind, 0 if kind is StepKind.LOCAL else message, num_groups, total


def hop_pieces(codes: tuple[int, ...], mesh_dim: int, mesh_shape: tuple[int, ...]) -> int:
    """The pieces the mesh dims other than `mesh_dim` cut a tensor of SBP codes `codes` into:
    a hop on `mesh_dim` moves groups of 1 / pieces of the tensor."""
    return math.prod(
        n
        for e, (c, n) in enumerate(zip(codes, mesh_shape, strict=True))
        if e != mesh_dim and c >= 0
    )


def cross_transfers(
    src: NdSbp, dst: NdSbp, shape: tuple[int, ...], mesh: Mesh, dst_mesh: Mesh
) -> tuple[Transfer, ...]:
    """Messages that give every destination device its region: one per source addend overlapping
    it, from one of the replicas holding it (spread by destination position). Destination devices
    off coordinate 0 of a P mesh dim receive nothing (they hold zeros)."""
    holders: dict[tuple[Box, tuple[int, ...]], list[int]] = {}
    partial_dims = [e for e, s in enumerate(src) if isinstance(s, Partial)]
    for index in range(mesh.size):
        coords = mesh.coords(index)
        addend = tuple(coords[e] for e in partial_dims)
        holders.setdefault((local_box(shape, src, mesh, coords), addend), []).append(index)
    transfers = []
    for target in range(dst_mesh.size):
        coords = dst_mesh.coords(target)
        if any(c and isinstance(s, Partial) for s, c in zip(dst, coords, strict=True)):
            continue
        region = local_box(shape, dst, dst_mesh, coords)
        for (box, _), devices in holders.items():
            overlap = _intersect(box, region)
            if all(start < stop for start, stop in overlap):
                transfers.append(Transfer(devices[target % len(devices)], target, overlap))
    return tuple(transfers)


def _intersect(box: Box, region: Box) -> Box:
    return tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(box, region, strict=True))


def cross_step(
    src: NdSbp,
    dst: NdSbp,
    shape: tuple[int, ...],
    mesh: Mesh,
    dst_mesh: Mesh,
    dtype: torch.dtype,
    transfers: tuple[Transfer, ...],
) -> BoxingStep:
    sent: dict[int, int] = {}
    received: dict[int, int] = {}
    for t in transfers:
        sent[t.src] = sent.get(t.src, 0) + t.numel
        received[t.dst] = received.get(t.dst, 0) + t.numel
    busiest = max([0, *sent.values(), *received.values()])
    return BoxingStep(
        kind=StepKind.SEND_RECV,
        src=src,
        dst=dst,
        mesh_dim=None,
        shape=shape,
        mesh=mesh,
        dst_mesh=dst_mesh,
        dtype=dtype,
        group_size=mesh.size + dst_mesh.size,
        num_groups=1,
        message_bytes=busiest * dtype.itemsize,
        total_bytes=sum(t.numel for t in transfers) * dtype.itemsize,
        transfers=transfers,
    )
