"""Communication inside an op: what a signature exchanges, and the context its kernel runs with.

Lives here: `Exchange` (one collective an op runs inside itself under a signature: its kind, the
mesh dim, its bytes, whether it runs in forward or backward, whether the runtime overlaps it
with the op's compute, and the bytes it holds until backward), `OpComm` (the seam through which
a kernel communicates: autograd-aware collectives on one mesh dim of this device's groups),
`OpContext` (what a communicating kernel is built with: mesh shape, coords, the `OpComm`) and
(the rule hooks that use them: `core.OpRule.exchanges`, `core.OpRule.build_comm`). Lives elsewhere: the rules that
declare exchanges (`attention`: context parallelism), the one place they are priced
(`autosbp.planner.timing.op_exchanges`), the runtime's `OpComm` on torch.distributed groups with timeouts
and timeline spans (`runtime.execute.op_comm`), communication between ops (boxing, on edges).

In the spirit of DTensor's op strategies: a signature is the op's placements; most signatures
communicate nothing and their kernel is built from (node, signature, mesh shape, coords) alone.
A signature whose rule lists exchanges for it is built with an `OpContext` instead, and the
planner adds the exchanges' time to the node's compute through one hook.

Invariants: `exchanges(node, sig, mesh_shape)` is a pure function of what it reads, empty for
every signature whose kernel does not communicate; every collective a kernel calls through its
`OpComm` is declared by an `Exchange` with the same kind and mesh dim (and its backward's, with
`backward=True`); every rank of a mesh-dim group calls the same collectives in the same order
(the kernel's code path depends only on shapes and coords along other mesh dims).
References: torch/distributed/tensor/_op_schema.py (OpStrategy, PlacementStrategy); Llama 3
paper section 3.3.2 (context parallelism by all-gathered keys and values).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeAlias

import torch

Shape: TypeAlias = tuple[int, ...]

# The collective kinds an exchange may declare: the cost model's (costmodel.profile.CollectiveKind
# values), named here as strings so the rules need no cost model.
EXCHANGE_KINDS = frozenset(
    {"all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv"}
)


@dataclass(frozen=True, slots=True)
class Exchange:
    """One collective an op runs inside itself, per micro-batch, on one device.

    `message_bytes` follows the cost model's convention (nccl-tests' size: an all-gather's
    output, a reduce-scatter's input, a send/recv's message); `backward` says it runs in the
    op's backward (the adjoint of a forward one, e.g. the reduce-scatter of an all-gather's
    gradient); `overlaps` that the runtime runs it beside the op's own compute (priced hidden
    up to the profile's overlap efficiency), False where the kernel waits for it before
    computing, and `beside` the share of that compute it can run beside (1: all of it; a ring
    step's exchange: the one step's compute it overlaps); `held_bytes` what it allocates that
    stays alive until the op's backward (a gathered tensor autograd saves), counted in the
    node's memory.
    """

    kind: str
    mesh_dim: int
    message_bytes: float
    backward: bool = False
    overlaps: bool = False
    held_bytes: float = 0.0
    beside: float = 1.0

    def __post_init__(self) -> None:
        assert self.kind in EXCHANGE_KINDS, f"exchange kind {self.kind!r}"

    def describe(self) -> str:
        """How a plan states it: "all_gather on mesh dim 0", "... (backward)", "...
        (overlapped)"."""
        text = f"{self.kind} on mesh dim {self.mesh_dim}"
        return (
            text
            + (" (backward)" if self.backward else "")
            + (" (overlapped)" if self.overlaps else "")
        )


class OpComm(Protocol):
    """Collectives a kernel may call, each on the group of this device along one mesh dim;
    differentiable (each one's backward is its declared adjoint) and bounded by a timeout."""

    def all_gather(self, x: torch.Tensor, dim: int, mesh_dim: int) -> torch.Tensor:
        """The pieces of `x` of every device of the group, concatenated along `dim` in group
        order; backward: the gradient reduce-scattered back along `dim`."""
        ...

    def swap(self, x: torch.Tensor, mesh_dim: int, peer: int) -> torch.Tensor:
        """`x` sent to the group's member `peer` and what `peer` sent back (itself where `peer`
        is this device); backward: the same swap of the gradient."""
        ...

    def shift(self, x: torch.Tensor, mesh_dim: int) -> tuple[torch.Tensor, Callable[[], None]]:
        """One ring step, started: `x` sent to the next member of the group (in group order,
        the last to the first), and the tensor the previous member sends, to read only once the
        returned wait has been called (compute may run in between); backward: the gradient
        shifted back the other way (waited)."""
        ...


@dataclass(frozen=True, slots=True)
class OpContext:
    """What a communicating kernel is built with: the mesh, this device's coords on it, and the
    collectives on its groups (None where nothing can communicate: a single-process call)."""

    mesh_shape: Shape
    coords: Shape
    comm: OpComm | None
