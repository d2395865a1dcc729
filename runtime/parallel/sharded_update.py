"""The distributed optimizer (ZeRO-1 and ZeRO-2): optimizer states (and with ZeRO-2 the
gradients) split over the mesh dims where the weight is replicated, the weight kept whole.

Lives here: `ShardedUpdate` (this rank's parameters whose plan puts their optimizer states in
another layout than the weight's: the shard the optimizer steps, the gradient's conversion to
it after backward and the updated shard's conversion back to the weight's layout after the
step) and `build_sharded_update`. Lives elsewhere: the choice of layouts and its price
(`autosbp.planner.timing.param_candidates`; the plan's `params[name].optimizer_state_sbp`), the
bucketed gradient sync (`runtime.parallel.grad_sync`), the conversions
(`runtime.execute.instructions.Boxer`).

Invariants:
- ZeRO-1: a parameter in layout p with states in q has its gradient synced dual(p) -> p by
  the buckets of `grad_sync` like any other (DDP's all-reduce, overlapping the last
  backward: as torch's ZeroRedundancyOptimizer over DDP runs it). After the sync the synced
  gradient is converted p -> q (a local slice where q only splits what p replicates) into the
  gradient of the shard (the parameter's own gradient stays, a view of its bucket: the
  planner counts it held), the optimizer steps the shard (an fp32 tensor of its own in q:
  the master copy), and the shard is converted q -> p (an all-gather) into the parameter
  after the step: where every member's shard is a contiguous slot of the piece
  (`_member_slots`: q splits one mesh dim more, on the piece's first dims), in buckets of the
  plan's `grad_bucket_bytes` (`runtime.parallel.weight_gather`: a parameter pays its share of
  its bucket's collective); else one collective per parameter, in graph order on every rank
  of the stage, each issued without waiting for the previous; all done before the step
  returns: nothing hidden behind compute, as the planner prices it
  (`timing.param_candidates.parameter_prices`). Where the shard is a contiguous slot of the synced
  gradient, its gradient is that slot itself (no copy per step).
- ZeRO-2 (the plan's `gradient_sbp` is q): the gradient is not held in p. As autograd finishes a
  parameter's gradient of a micro-batch (a post-accumulate-grad hook), it is converted dual(p) -> q
  at once (a reduce-scatter; the buckets of `grad_sync` leave the parameter out), added into the
  shard's fp32 gradient and the parameter's freed: across micro-batches only the shard's gradient is
  held (1/n of the parameter's per device). The conversions run in line in backward, one per
  parameter per micro-batch, in autograd's order (the same on every rank of the stage: the same
  program); nothing hidden, as the planner prices them (`timing.param_candidates.parameter_prices`).
  After backward only the gather q -> p remains.
- Under a mixed recipe (`runtime.parallel.precision`) the shard is the fp32 master: the
  updated shards are gathered into the compute copies, in the compute dtype (half the bytes of
  fp32), and the whole master in p gives up its storage (`Weights.release`), but its fp32
  gradient, which the sync sums: 2 + 4 bytes per element of p beside the shard's, where an
  unsharded mixed parameter holds 2 + 4 + 4 (Megatron-Core's distributed optimizer).
- The shard is the weight's piece in q at the start (the conversion p -> q: a local slice
  where q only splits what p replicates), so the update is the one an unsharded optimizer makes
  on those elements: exact for elementwise optimizers (SGD, Adam, AdamW), as the Engine's.
- A gradient backward never reached enters the conversion as zeros (every rank takes part;
  ZeRO-2's shard gradient is then zeros).
  The parameter's gradient is then the synced one nowhere: `gradients` gives the shards'.
Reference: Rajbhandari et al. 2020 (ZeRO, section 5.1, P_os); Megatron-LM's distributed
optimizer (megatron/core/optimizer/distrib_optimizer.py: reduce-scatter, step on the shard,
all-gather of the updated parameters).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autosbp.boxing.steps import dual_nd_sbp, local_box
from autosbp.sbp import Mesh, NdSbp, Partial
from runtime.execute.collectives import group_ranks
from runtime.execute.instructions import Boxer, TensorFn
from runtime.parallel.grad_sync import Register, autograd_hook
from runtime.parallel.weight_gather import GatherBucket, GatheredParam, gather_buckets

__all__ = ["ShardedUpdate", "build_sharded_update"]


@dataclass(frozen=True, slots=True)
class _Sharded:
    """One parameter's shard and the conversions between it and the parameter."""

    param: torch.Tensor  # this rank's piece of the parameter, in p: its gradient's holder
    weight: torch.Tensor  # the piece the ops read: `param`, or a mixed recipe's compute copy
    shard: torch.Tensor  # the optimizer's tensor, in q
    to_shard: TensorFn  # dual(p) -> q: the gradient (may be a view of its input)
    # q -> p: the updated shard written into `weight`; returns the collectives still in flight.
    # None where a bucket of `weight_gather` writes it.
    to_param: Callable[[torch.Tensor], list[dist.Work]] | None
    in_backward: bool  # ZeRO-2: the gradient converted as backward makes it (`_scatter_now`)
    # ZeRO-1: p -> q of the gradient `grad_sync` synced (ZeRO-2: unused, `to_shard` runs)
    slice_synced: TensorFn


class ShardedUpdate:
    """The parameters of this rank's stage whose optimizer states lie in another layout."""

    def __init__(
        self,
        sharded: Mapping[str, _Sharded],
        layouts: Mapping[str, NdSbp],
        buckets: Sequence[GatherBucket] = (),
        register: Register = autograd_hook,
    ) -> None:
        self._sharded = dict(sharded)
        self._buckets = tuple(buckets)  # the bucketed gathers, in graph order
        self._broadcast = dist.get_backend() == "gloo"
        self.layouts = dict(layouts)  # name -> the layout of the tensor the optimizer steps
        for entry in self._sharded.values():
            if entry.in_backward:
                register(entry.param, _scatter_now(entry))

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._sharded)

    @property
    def held_as_shards(self) -> frozenset[str]:
        """The parameters whose weight the ops read is not the parameter (a mixed recipe's
        compute copy): the gather writes the copy, so the fp32 master is needed only as the
        shard (`precision.Weights.release`)."""
        return frozenset(n for n, e in self._sharded.items() if e.weight is not e.param)

    @property
    def unsynced(self) -> frozenset[str]:
        """The parameters the bucketed gradient sync leaves out: ZeRO-2's, whose gradients
        this converts in backward."""
        return frozenset(n for n, e in self._sharded.items() if e.in_backward)

    def optimized(self, parameters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Name -> the tensor the optimizer steps: the shard where states are sharded, else
        the parameter itself (in `parameters`' order)."""
        return {
            name: self._sharded[name].shard if name in self._sharded else param
            for name, param in parameters.items()
        }

    def zero_grad(self, zeroed: Callable[[torch.Tensor], bool]) -> None:
        """Before a step's first backward: the parameters' gradients zeroed in place (autograd
        accumulates into them: a buffer kept across steps, as Megatron-LM's grad buffer), but
        for those whose gradient is `zeroed` already (a view of a bucket, which the gradient
        sync clears and refills from the step's first backward: `GradSync.zero_grad`)."""
        with torch.no_grad():
            for entry in self._sharded.values():
                if entry.param.grad is not None and not zeroed(entry.param):
                    entry.param.grad.zero_()

    def scatter_gradients(self) -> None:
        """After backward and the gradient sync: each ZeRO-1 parameter's synced gradient
        converted into its shard's (ZeRO-2's were in backward)."""
        with torch.no_grad():
            for entry in self._sharded.values():
                if entry.in_backward:  # ZeRO-2: done in backward (zeros where never reached)
                    if entry.shard.grad is None:
                        entry.shard.grad = torch.zeros_like(entry.shard)
                    continue
                if entry.param.grad is None:  # backward never reached it (or the first step)
                    entry.param.grad = torch.zeros_like(entry.param)
                piece = entry.slice_synced(entry.param.grad)
                entry.shard.grad = _as_grad(piece, entry.shard)

    def gather_weights(self) -> None:
        """After the optimizer's step: the updated shards converted back into the weights
        the ops read (in their dtype), the buckets' (`weight_gather`) first (those gathered in
        place all started at once, then the buffered ones bucket by bucket, in graph order),
        then every other in graph order, each conversion's collectives issued without waiting
        for the previous, all waited for before returning."""
        works: list[dist.Work] = []
        with torch.no_grad():
            for bucket in self._buckets:
                if bucket.in_place:
                    works += bucket.start_in_place(self._broadcast)
            for bucket in self._buckets:
                if not bucket.in_place:
                    bucket.gather(self._broadcast)
            for entry in self._sharded.values():
                if entry.to_param is not None:
                    works += entry.to_param(entry.shard)
            for work in works:
                work.wait()

    def gradients(self) -> dict[str, tuple[torch.Tensor, NdSbp]]:
        """Name -> (the synced gradient, its layout) of the sharded parameters, from the end of
        a step to the next (zeros before the first)."""
        return {
            name: (e.shard.grad if e.shard.grad is not None else torch.zeros_like(e.shard),
                   self.layouts[name])
            for name, e in self._sharded.items()
        }  # fmt: skip


def _as_grad(piece: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """The synced gradient's piece as the shard's gradient: the piece itself where it already
    is one (same dtype, shape, contiguous: a slot of the bucket, read by the optimizer, valid
    until the next step zeroes the bucket), else a copy in the shard's dtype (no copy and no
    allocation per step on the common path)."""
    if piece.dtype == shard.dtype and piece.shape == shard.shape and piece.is_contiguous():
        return piece
    return piece.to(shard.dtype, copy=True)


def _scatter_now(entry: _Sharded) -> Callable[[torch.Tensor], None]:
    """ZeRO-2's hook on `entry.param`: its micro-batch's gradient converted into the shard's
    (added), the parameter's freed."""

    def hook(param: torch.Tensor) -> None:
        assert param.grad is not None
        with torch.no_grad():
            piece = entry.to_shard(param.grad)
            if entry.shard.grad is None:  # the first micro-batch's: a tensor of its own
                entry.shard.grad = piece.to(entry.shard.dtype, copy=True)
            else:
                entry.shard.grad.add_(piece)
        param.grad = None

    return hook


def build_sharded_update(
    parameters: Mapping[str, torch.Tensor],
    layouts: Mapping[str, NdSbp],
    state_layouts: Mapping[str, NdSbp],
    shapes: Mapping[str, tuple[int, ...]],
    boxer: Boxer,
    bucket_bytes: int,
    in_backward: frozenset[str] = frozenset(),
    register: Register = autograd_hook,
    weights: Mapping[str, torch.Tensor] | None = None,
) -> ShardedUpdate:
    """This rank's `ShardedUpdate` for its stage's `parameters` (name -> local piece in
    `layouts`), with their optimizer states in `state_layouts` (every stage's), the gradients
    of `in_backward` in them too (ZeRO-2). `weights`: name -> the piece the ops read where it
    is not the parameter (a mixed recipe's compute copy, `precision.Weights.compute`): the
    updated shards are gathered into it, in its dtype (Megatron-Core's distributed optimizer:
    bf16 parameters gathered from fp32 shards). A collective over the stage's ranks (the first
    shards are cut by conversion), in graph order."""
    sharded: dict[str, _Sharded] = {}
    bucketed: list[tuple[GatheredParam, dist.ProcessGroup]] = []
    for name, param in parameters.items():
        p, q = layouts[name], state_layouts[name]
        if p == q:
            continue
        shape = shapes[name]
        weight = param if weights is None else weights.get(name, param)
        with torch.no_grad():
            first = boxer.chain(p, q, shape, param.dtype)(param.detach())
        shard = first.to(torch.float32, copy=True).requires_grad_(True)
        slots = _member_slots(weight, p, q, shape, boxer)
        if slots is None:
            to_shard, to_param = _conversions(param, weight, p, q, shape, boxer)
        else:
            to_shard, to_param = _scatter(param, p, q, shape, boxer), None
            group = boxer.groups.get(_members(boxer, p, q))
            at = dict(slots)
            ordered = tuple(at[m] for m in dist.get_process_group_ranks(group))
            bucketed.append((GatheredParam(weight, shard, ordered), group))
        slot = _slot(p, q, shape, boxer.mesh, boxer.mesh.device_ids.index(dist.get_rank()))
        slice_synced = boxer.chain(p, q, shape, param.dtype) if slot is None else _view(slot)
        sharded[name] = _Sharded(
            param, weight, shard, to_shard, to_param, name in in_backward, slice_synced
        )
    layouts_stepped = {name: state_layouts[name] for name in parameters}
    return ShardedUpdate(sharded, layouts_stepped, gather_buckets(bucketed, bucket_bytes), register)


def _view(slot: tuple[slice, ...]) -> TensorFn:
    """p -> q where q's piece is `slot` of p's: the slot itself (a view, no copy)."""
    return lambda tensor: tensor[slot]


def _slot(
    p: NdSbp, q: NdSbp, shape: tuple[int, ...], mesh: Mesh, index: int
) -> tuple[slice, ...] | None:
    """Where the piece in q of the device at `index` lies inside its piece in p, or None where
    on some device of the mesh it does not lie inside (q cuts a dim p cuts already, in
    another order: the conversion moves data; every rank decides alike)."""
    found = None
    for k in range(mesh.size):
        coords = mesh.coords(k)
        outer, inner = local_box(shape, p, mesh, coords), local_box(shape, q, mesh, coords)
        if any(a < o or b > e for (o, e), (a, b) in zip(outer, inner, strict=True)):
            return None
        if k == index:
            found = tuple(slice(a - o, b - o) for (o, _), (a, b) in zip(outer, inner, strict=True))
    return found


def _scatter(
    param: torch.Tensor, p: NdSbp, q: NdSbp, shape: tuple[int, ...], boxer: Boxer
) -> TensorFn:
    """The gradient's conversion dual(p) -> q. With NCCL, a reduce-scatter. With gloo, whose
    reduce_scatter_tensor allocates three buffers the size of the whole tensor per call
    (measured, torch 2.13's ProcessGroupGloo: unpriced transients that set the peak), the same
    sum as an in-place all-reduce (the sync data parallelism runs) and this rank's slot of it
    taken (a view), wherever the shard is a slot of the parameter's piece (`_slot`)."""
    mesh = boxer.mesh
    slot = _slot(p, q, shape, mesh, mesh.device_ids.index(dist.get_rank()))
    if dist.get_backend() != "gloo" or slot is None:
        return boxer.chain(dual_nd_sbp(p), q, shape, param.dtype)
    reduce = boxer.chain(dual_nd_sbp(p), p, shape, param.dtype, donate=True)
    return lambda grad: reduce(grad)[slot]


def _conversions(
    param: torch.Tensor,
    weight: torch.Tensor,
    p: NdSbp,
    q: NdSbp,
    shape: tuple[int, ...],
    boxer: Boxer,
) -> tuple[TensorFn, Callable[[torch.Tensor], list[dist.Work]]]:
    """The gradient's conversion dual(p) -> q (`_scatter`) and, for a parameter no bucket of
    `weight_gather` takes, the updated shard's q -> p into `weight`, in its dtype: with NCCL
    an all-gather; with gloo, whose all_gather_into_tensor allocates three buffers the size
    of the whole tensor per call, the shard written into its slot of the zeroed weight and
    the slots summed by an in-place all-reduce (exact: each element is one rank's value plus
    zeros), wherever the shard is a slot of the parameter's piece (`_slot`)."""
    mesh = boxer.mesh
    slot = _slot(p, q, shape, mesh, mesh.device_ids.index(dist.get_rank()))
    to_shard = _scatter(param, p, q, shape, boxer)
    if dist.get_backend() != "gloo" or slot is None:
        gather = boxer.chain(q, p, shape, weight.dtype)

        def copy_gathered(shard: torch.Tensor) -> list[dist.Work]:
            weight.copy_(gather(shard.to(weight.dtype)))
            return []

        return to_shard, copy_gathered
    where = slot
    slots = tuple(Partial() if a != b else a for a, b in zip(p, q, strict=True))
    sum_slots = boxer.chain(slots, p, shape, weight.dtype, donate=True)

    def write(shard: torch.Tensor) -> list[dist.Work]:
        weight.zero_()
        weight[where].copy_(shard)
        out = sum_slots(weight)
        if out.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr():
            weight.copy_(out)
        return []

    return to_shard, write


def _members(boxer: Boxer, p: NdSbp, q: NdSbp) -> tuple[int, ...]:
    """The ranks along the one mesh dim where q splits what p replicates, through this rank."""
    mesh = boxer.mesh
    (d,) = [d for d, (a, b) in enumerate(zip(p, q, strict=True)) if a != b]
    return group_ranks(mesh, d, mesh.coords(mesh.device_ids.index(dist.get_rank())))


def _member_slots(
    param: torch.Tensor, p: NdSbp, q: NdSbp, shape: tuple[int, ...], boxer: Boxer
) -> list[tuple[int, tuple[slice, ...]]] | None:
    """(member rank, its slot in the parameter's piece) per member of the group q splits over,
    where q differs from p on one mesh dim and every slot is a contiguous view (a split of
    the piece's first dims): the parameters a bucket of `weight_gather` gathers (the planner
    prices them so: `memory.gather_buffers.gathers_in_bucket`). Else None."""
    mesh = boxer.mesh
    dims = [d for d, (a, b) in enumerate(zip(p, q, strict=True)) if a != b]
    if len(dims) != 1:
        return None
    coords = list(mesh.coords(mesh.device_ids.index(dist.get_rank())))
    out = []
    for k, member in enumerate(_members(boxer, p, q)):
        at = _slot(p, q, shape, mesh, mesh.index((*coords[: dims[0]], k, *coords[dims[0] + 1 :])))
        if at is None or not param[at].is_contiguous():
            return None
        out.append((member, at))
    return out
