"""Communication inside an op, on this rank's process groups: the runtime's `OpComm`.

Lives here: `GroupComm` (the collectives a communicating kernel calls, `autosbp.rules.comm.OpComm`,
on the groups of this rank's mesh dims: differentiable, every wait bounded by the world's
timeout, each one a span "exchange" of the timeline). Lives elsewhere: which kernels communicate
and what they declare (`autosbp.rules.comm`, e.g. `autosbp.rules.context`), the kernel built with
it (`runtime.execute.builder`), boxing between ops (`runtime.execute.collectives`), the groups
(`runtime.execute.groups`).

Invariants: each collective runs on the group along its mesh dim through this rank's coords,
the group `build_groups` made for the mesh (never a new one); forward and backward are each
other's adjoints (all-gather <-> reduce-scatter, a swap <-> the same swap), so autograd
through a kernel is exact; a wait longer than the timeout raises (gloo and NCCL), never hangs.
The all-gathers and swaps run synchronously: the kernel waits for each before it computes, as
`rules.comm.Exchange.overlaps` False prices them; a ring step (`shift`) is started and waited
by the kernel after the step's compute (gloo and NCCL run it meanwhile), as `overlaps` True
prices it; its backward is waited where autograd reaches it.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from autosbp.sbp import Mesh
from autosbp.timeline import SpanHook
from runtime.execute.collectives import all_gather_along, group_ranks, reduce_scatter_along
from runtime.execute.groups import ProcessGroups, world_timeout

__all__ = ["GroupComm"]


class GroupComm:
    """This rank's collectives inside ops, along the mesh dims of its stage's mesh."""

    def __init__(
        self,
        mesh: Mesh,
        coords: tuple[int, ...],
        groups: ProcessGroups,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        self.mesh, self.coords, self.groups = mesh, coords, groups
        self._timeout = timeout
        self.span_hook: SpanHook | None = None  # the Engine's recorder, where it has one

    @property
    def timeout(self) -> datetime.timedelta:
        if self._timeout is None:
            self._timeout = world_timeout()
        return self._timeout

    def group(self, mesh_dim: int) -> tuple[tuple[int, ...], dist.ProcessGroup]:
        ranks = group_ranks(self.mesh, mesh_dim, self.coords)
        return ranks, self.groups.get(ranks)

    @contextlib.contextmanager
    def span(self) -> Iterator[None]:
        if self.span_hook is None:
            yield
        else:
            with self.span_hook.span("exchange"):
                yield

    def all_gather(self, x: torch.Tensor, dim: int, mesh_dim: int) -> torch.Tensor:
        """`rules.comm.OpComm.all_gather`: backward reduce-scatters the gradient."""
        return _AllGather.apply(x, dim % x.dim(), mesh_dim, self)

    def swap(self, x: torch.Tensor, mesh_dim: int, peer: int) -> torch.Tensor:
        """`rules.comm.OpComm.swap`: backward swaps the gradient back."""
        return _Swap.apply(x, mesh_dim, peer, self)

    def shift(self, x: torch.Tensor, mesh_dim: int) -> tuple[torch.Tensor, Callable[[], None]]:
        """`rules.comm.OpComm.shift`: started (isend to the next member, irecv from the previous),
        waited by the returned call, each wait bounded; backward shifts the gradient back."""
        pending: list[Any] = []
        received = _Shift.apply(x, mesh_dim, self, pending)

        def wait() -> None:
            with self.span():
                for work in pending:
                    work.wait(self.timeout)
            pending.clear()  # the sent buffer, held until here, may go

        return received, wait

    def shift_raw(
        self, x: torch.Tensor, mesh_dim: int, step: int, pending: list[Any] | None = None
    ) -> torch.Tensor:
        """`x` to the member `step` places on in group order, from the one `step` places back;
        started into `pending` where given (with the buffer it sends), else waited."""
        ranks, group = self.group(mesh_dim)
        me = ranks.index(dist.get_rank())
        send, recv = x.contiguous(), torch.empty_like(x, memory_format=torch.contiguous_format)
        ops = [
            dist.P2POp(dist.isend, send, ranks[(me + step) % len(ranks)], group),
            dist.P2POp(dist.irecv, recv, ranks[(me - step) % len(ranks)], group),
        ]
        works = dist.batch_isend_irecv(ops)
        if pending is not None:
            pending.extend([*works, _Held(send)])
            return recv
        with self.span():
            for work in works:
                work.wait(self.timeout)
        return recv

    def gather_raw(self, x: torch.Tensor, dim: int, mesh_dim: int) -> torch.Tensor:
        ranks, group = self.group(mesh_dim)
        with self.span():
            return all_gather_along(x, dim, len(ranks), group, True).result(self.timeout)

    def scatter_raw(self, x: torch.Tensor, dim: int, mesh_dim: int) -> torch.Tensor:
        ranks, group = self.group(mesh_dim)
        with self.span():
            return reduce_scatter_along(x, dim, len(ranks), group, True).result(self.timeout)

    def swap_raw(self, x: torch.Tensor, mesh_dim: int, peer: int) -> torch.Tensor:
        ranks, group = self.group(mesh_dim)
        if ranks[peer] == dist.get_rank():
            return x.clone()  # the middle device of an odd group swaps with itself
        send = x.contiguous()
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, ranks[peer], group),
            dist.P2POp(dist.irecv, recv, ranks[peer], group),
        ]
        with self.span():
            for work in dist.batch_isend_irecv(ops):
                work.wait(self.timeout)
        return recv


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, mesh_dim: int, comm: GroupComm) -> Any:
        ctx.dim, ctx.mesh_dim, ctx.comm = dim, mesh_dim, comm
        return comm.gather_raw(x, dim, mesh_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.comm.scatter_raw(grad, ctx.dim, ctx.mesh_dim), None, None, None


class _Held:
    """A buffer an exchange in flight sends, kept alive until it is waited for."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer

    def wait(self, timeout: datetime.timedelta) -> None:
        del timeout  # nothing to wait for: holding it was the point


class _Shift(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, mesh_dim: int, comm: GroupComm, pending: list[Any]
    ) -> Any:
        ctx.mesh_dim, ctx.comm = mesh_dim, comm
        return comm.shift_raw(x, mesh_dim, 1, pending)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.comm.shift_raw(grad, ctx.mesh_dim, -1), None, None, None


class _Swap(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh_dim: int, peer: int, comm: GroupComm) -> Any:
        ctx.mesh_dim, ctx.peer, ctx.comm = mesh_dim, peer, comm
        return comm.swap_raw(x, mesh_dim, peer)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.comm.swap_raw(grad, ctx.mesh_dim, ctx.peer), None, None, None
