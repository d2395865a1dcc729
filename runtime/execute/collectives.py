"""Execute boxing steps on torch.distributed, differentiably: the runtime side of `autosbp.boxing`.

Lives here: `execute_boxing` (this rank's local tensor through a chain of steps) and the one
autograd function that runs a step forward and its dual step backward. Lives elsewhere: planning
and the steps' meaning (`autosbp.boxing`, `autosbp.boxing.steps`), the local ops and message
slices shared with the simulator (`autosbp.boxing.simulate`), process groups (`runtime.execute.groups`).

Invariants:
- Every rank of the world calls `execute_boxing` with the same steps, in the same order as every
  other boxing (collectives match by order). Ranks outside a step's meshes skip it.
- Forward runs `step`; backward runs `dual_step(step)` (the adjoint): all-gather <-> reduce-scatter,
  all-reduce <-> all-reduce, all-to-all S(i)->S(j) <-> S(j)->S(i), slice <-> zero-pad, keep-or-zero
  <-> itself, send/recv <-> the same messages reversed. So the gradient of a B tensor comes back P
  and of a P tensor B: a loss replicated on every rank must be seeded as P (e.g. 1 on one rank).
- Results equal `autosbp.boxing.simulate_boxing` on the same pieces (tested on gloo).
- A collective splits along tensor dim k by moving k to the front, so S(1) gathers concatenate
  along dim 1, not dim 0.
Reference: torch.distributed collectives (`all_gather_single`, `reduce_scatter_single`,
`all_to_all_single`, `batch_isend_irecv`); OneFlow's dual SBP for gradients (`nd_sbp.cpp`).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autosbp.boxing.simulate import apply_local_step, transfer_slices
from autosbp.boxing.steps import BoxingStep, StepKind, dual_step
from autosbp.errors import ExecutionError
from autosbp.sbp import Mesh, Split, format_nd_sbp, local_shape
from runtime.execute.groups import ProcessGroups

__all__ = [
    "Started",
    "StartedChain",
    "all_gather_along",
    "all_gather_single",
    "execute_boxing",
    "execute_boxing_summed_in",
    "group_ranks",
    "reduce_scatter_along",
    "run_step",
    "start_step",
    "world_device",
]

# torch 2.13 renamed the tensor forms (the old names warn); older torch has only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def execute_boxing(
    local: torch.Tensor | None, steps: Sequence[BoxingStep], groups: ProcessGroups
) -> torch.Tensor:
    """This rank's local tensor after `steps` (from `plan_boxing`), differentiable.

    `local` is this rank's piece in the layout of `steps[0].src` on `steps[0].mesh`; None on ranks
    that hold none (destination stage, bystanders). Ranks of no destination mesh get an empty
    placeholder: a source stage calls `.backward(torch.empty(0))` on it to take part in the
    backward send. For that, ranks that hold no input build a placeholder that requires grad.
    """
    if not steps:
        return local if local is not None else torch.empty(0)
    rank = dist.get_rank()
    first = steps[0]
    if rank in first.mesh.device_ids:
        _check_local(local, first, rank)
    x = local if local is not None else _placeholder(first)
    for step in steps:
        if rank in step.mesh.device_ids or rank in step.dst_mesh.device_ids:
            x = _BoxingHop.apply(x, step, groups)
    return x


def _check_local(local: torch.Tensor | None, step: BoxingStep, rank: int) -> None:
    want = local_shape(step.shape, step.src, step.mesh.shape)
    if local is None or tuple(local.shape) != want:
        got = "None" if local is None else tuple(local.shape)
        raise ExecutionError(
            f"boxing {format_nd_sbp(step.src)} -> ... of a {step.shape} tensor on {step.mesh}: rank "
            f"{rank} passed a local tensor of shape {got}, but its piece is {want}. Pass this "
            "rank's piece (autosbp.layout.shard_tensor cuts one)."
        )


def world_device() -> torch.device:
    """Where this rank's tensors live: its current GPU where the world carries CUDA tensors by
    NCCL (alone, or "cpu:gloo,cuda:nccl" as `launching.torchrun` joins it), else the CPU. A
    buffer the runtime makes for a collective or a receive is made here, so a rank that
    receives meets the sender's tensor on the same backend."""
    if "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _placeholder(step: BoxingStep) -> torch.Tensor:
    return torch.empty(
        0, dtype=step.dtype, device=world_device(), requires_grad=torch.is_grad_enabled()
    )


def execute_boxing_summed_in(
    local: torch.Tensor, steps: Sequence[BoxingStep], groups: ProcessGroups, dtype: torch.dtype
) -> torch.Tensor:
    """`execute_boxing` of a weight whose gradient is summed in `dtype`: forward as usual,
    backward the dual steps in reverse on the gradient cast to `dtype`, the result cast back
    (a mixed recipe's fp32 reduction of a gathered bf16 weight's gradient, as FSDP2's
    `reduce_dtype`: the sum is exact to fp32, rounded once to the weight's dtype)."""
    return _SummedIn.apply(local, tuple(steps), groups, dtype)


class _SummedIn(torch.autograd.Function):
    """A whole chain forward; its dual chain backward, in another dtype."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        steps: tuple[BoxingStep, ...],
        groups: ProcessGroups,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        ctx.steps, ctx.groups, ctx.dtype = steps, groups, dtype
        for step in steps:
            x = run_step(x, step, groups)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        summed = grad.to(ctx.dtype).contiguous()
        for step in reversed(ctx.steps):
            summed = run_step(summed, dual_step(step), ctx.groups)
        return summed.to(grad.dtype), None, None, None


class _BoxingHop(torch.autograd.Function):
    """One step forward; its dual step backward (the adjoint of the step's linear map)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, step: BoxingStep, groups: ProcessGroups) -> torch.Tensor:
        ctx.step, ctx.groups = step, groups
        return run_step(x, step, groups)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return run_step(grad.contiguous(), dual_step(ctx.step), ctx.groups), None, None


def run_step(
    x: torch.Tensor, step: BoxingStep, groups: ProcessGroups, *, donate: bool = False
) -> torch.Tensor:
    """One step on this rank (which takes part in it), without autograd. With `donate`, the
    caller gives up `x`: an all-reduce then runs in place instead of on a copy."""
    if step.kind is StepKind.SEND_RECV:
        return _send_recv(x, step, dist.get_rank())
    return start_step(x, step, groups, donate=donate, async_op=False).result(None)


@dataclass(slots=True)
class Started:
    """A step on its way: `work` (None for a local step, or a finished collective) and what
    makes the step's result of the collective's output once it is done."""

    work: dist.Work | None
    finish: Callable[[], torch.Tensor]

    def result(self, timeout: datetime.timedelta | None) -> torch.Tensor:
        """The step's result, after waiting at most `timeout` for its collective (None: the
        step was started synchronously)."""
        if self.work is not None and timeout is not None:
            self.work.wait(timeout)
        return self.finish()


def start_step(
    x: torch.Tensor,
    step: BoxingStep,
    groups: ProcessGroups,
    *,
    donate: bool = False,
    async_op: bool = True,
) -> Started:
    """Start one collective or local step on this rank, without autograd (not SEND_RECV: stage
    to stage traffic is the engine's). With `async_op` the collective runs on its group's
    threads while the caller goes on; `Started.result` waits for it."""
    assert step.kind is not StepKind.SEND_RECV, "start_step: send/recv steps run synchronously"
    rank = dist.get_rank()
    mesh, mesh_dim = step.mesh, step.mesh_dim
    assert mesh_dim is not None
    coords = mesh.coords(mesh.device_ids.index(rank))
    if step.kind is StepKind.LOCAL:
        out = apply_local_step(step, x, coords[mesh_dim])
        return Started(None, lambda: out)
    group = groups.get(group_ranks(mesh, mesh_dim, coords))
    a, b, p = step.src_sbp, step.dst_sbp, step.group_size
    if step.kind is StepKind.ALL_REDUCE:
        out = x if donate and x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)
        return Started(dist.all_reduce(out, group=group, async_op=async_op), lambda: out)
    if step.kind is StepKind.ALL_GATHER:
        assert isinstance(a, Split)
        return all_gather_along(x, a.dim, p, group, async_op)
    if step.kind is StepKind.REDUCE_SCATTER:
        assert isinstance(b, Split)
        if donate and dist.get_backend(group) == "gloo":
            return _reduce_scatter_in_place(x, b.dim, p, coords[mesh_dim], group, async_op)
        return reduce_scatter_along(x, b.dim, p, group, async_op)
    assert step.kind is StepKind.ALL_TO_ALL and isinstance(a, Split) and isinstance(b, Split)
    return _all_to_all(x, a.dim, b.dim, p, group, async_op)


def group_ranks(mesh: Mesh, mesh_dim: int, coords: tuple[int, ...]) -> tuple[int, ...]:
    """The global ranks along `mesh_dim` through the device at `coords`, in coordinate order."""
    members = []
    for k in range(mesh.shape[mesh_dim]):
        at = (*coords[:mesh_dim], k, *coords[mesh_dim + 1 :])
        members.append(mesh.device_ids[mesh.index(at)])
    return tuple(members)


def all_gather_along(
    x: torch.Tensor, dim: int, p: int, group: dist.ProcessGroup, async_op: bool
) -> Started:
    """The pieces `x` of the `p` ranks of `group` concatenated along `dim`, in group order."""
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((p * front.shape[0], *front.shape[1:]))
    work = all_gather_single(out, front, group=group, async_op=async_op)
    return Started(work, lambda: _moved_back(out, dim))


def reduce_scatter_along(
    x: torch.Tensor, dim: int, p: int, group: dist.ProcessGroup, async_op: bool
) -> Started:
    """The sum of the `p` ranks' `x`, this rank's chunk of it along `dim` (group order)."""
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // p, *front.shape[1:]))
    work = _reduce_scatter_single(out, front, group=group, async_op=async_op)
    return Started(work, lambda: _moved_back(out, dim))


def _reduce_scatter_in_place(
    x: torch.Tensor, dim: int, p: int, index: int, group: dist.ProcessGroup, async_op: bool
) -> Started:
    """`reduce_scatter_along` for a caller that gives up `x`, on gloo: gloo builds a
    reduce-scatter on an all-reduce of a copy of its input (pytorch/pytorch#118911), held
    until its worker thread lets the work go; all-reducing `x` itself (or the contiguous copy
    made here) and keeping this rank's chunk (`index` in the group) moves the same bytes
    without that second copy of the whole tensor."""
    front = x.movedim(dim, 0).contiguous()
    work = dist.all_reduce(front, group=group, async_op=async_op)
    n = front.shape[0] // p

    def finish() -> torch.Tensor:
        return _moved_back(front.narrow(0, index * n, n).clone(), dim)

    return Started(work, finish)


def _moved_back(out: torch.Tensor, dim: int) -> torch.Tensor:
    """A collective's output (its dim 0 the mesh's) with that dim moved to `dim`, contiguous:
    on dim 0 the output itself, not a view of it (a gathered weight then owns its storage, and
    no copy is made to give it one)."""
    return out if dim == 0 else out.movedim(0, dim).contiguous()


def _all_to_all(
    x: torch.Tensor, src_dim: int, dst_dim: int, p: int, group: dist.ProcessGroup, async_op: bool
) -> Started:
    """S(src_dim) -> S(dst_dim): chunk c along dst_dim goes to member c; what comes back from
    member m is chunk m along src_dim of the result."""
    send = torch.stack(x.chunk(p, dim=dst_dim)).contiguous()
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=async_op)
    return Started(work, lambda: torch.cat(recv.unbind(0), dim=src_dim))


class StartedChain:
    """A chain of steps started on this rank (FSDP's gathers and reduce-scatters,
    `runtime.parallel.prefetch`): its leading local steps done, its first collective running
    asynchronously; `result` waits for it and runs the rest synchronously (no autograd)."""

    def __init__(
        self,
        x: torch.Tensor,
        steps: Sequence[BoxingStep],
        groups: ProcessGroups,
        *,
        donate: bool = False,
    ) -> None:
        """`donate`: the caller gives up `x` (`start_step`'s)."""
        with torch.no_grad():
            k = 0
            while k < len(steps) and steps[k].kind is StepKind.LOCAL:
                x = run_step(x, steps[k], groups)
                k += 1
            started = start_step(x, steps[k], groups, donate=donate) if k < len(steps) else None
            self._started = started
        # Once a collective runs, it holds what it reads: keeping `x` too would hold a
        # gradient's full copy until the deferred reduce-scatter finishes.
        self._value = x if self._started is None else None
        self._rest, self._groups = tuple(steps[k + 1 :]), groups

    def wait(self, timeout: datetime.timedelta) -> None:
        """Wait for the running collective (if any); `result` then finds it done."""
        if self._started is not None and self._started.work is not None:
            self._started.work.wait(timeout)

    def result(self, timeout: datetime.timedelta) -> torch.Tensor:
        """The chain's output (once: the collective's work is let go with it, and with the
        work what the backend keeps for it, e.g. gloo's copy of a reduce-scatter's input)."""
        with torch.no_grad():
            x = self._started.result(timeout) if self._started is not None else self._value
            assert x is not None, "a chain's result is taken once"
            self._started = self._value = None
            for step in self._rest:
                x = run_step(x, step, self._groups)
        return x


def _send_recv(x: torch.Tensor, step: BoxingStep, rank: int) -> torch.Tensor:
    """This rank's part of a stage-to-stage step: send its messages, receive and add its own."""
    src_index = step.mesh.device_ids.index(rank) if rank in step.mesh.device_ids else None
    dst_index = step.dst_mesh.device_ids.index(rank) if rank in step.dst_mesh.device_ids else None
    ops, received = [], []
    for transfer in step.transfers:
        src_slices, dst_slices = transfer_slices(step, transfer)
        if transfer.src == src_index:
            peer = step.dst_mesh.device_ids[transfer.dst]
            ops.append(dist.P2POp(dist.isend, x[src_slices].contiguous(), peer))
        if transfer.dst == dst_index:
            buffer = x.new_empty([stop - start for start, stop in transfer.box])
            ops.append(dist.P2POp(dist.irecv, buffer, step.mesh.device_ids[transfer.src]))
            received.append((dst_slices, buffer))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    if dst_index is None:
        return x.new_empty(0)
    out = x.new_zeros(local_shape(step.shape, step.dst, step.dst_mesh.shape))
    for dst_slices, buffer in received:
        out[dst_slices] += buffer
    return out
