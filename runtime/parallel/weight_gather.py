"""The distributed optimizer's weight gather, bucketed: after the step, the updated shards of
many parameters go back into every member's weights in a few collectives instead of one (or
one per member) per parameter.

Lives here: `GatherBucket` (parameters whose shards are contiguous slots of their weight
pieces, over one group, in graph order up to the plan's bucket bytes) and `gather_buckets`
(the buckets of a stage's sharded parameters). Lives elsewhere: which parameters are sharded,
their shards and the other gathers (`runtime.parallel.sharded_update`); the price
(`autosbp.planner.memory.gather_buffers.gathers_in_bucket`, `parameter_prices`).

How a bucket gathers: one flat buffer in the weights' dtype, in regions of equal size, one per
member in the group's rank order; region k holds member k's slots of every parameter of the
bucket, one after another in bucket order. This rank writes its shards into its region, the
regions are exchanged (gloo: one broadcast per member, which allocates nothing; other
backends: one in-place all-gather into the buffer, which is the same layout), and every
member's slot is copied out into the parameter. A parameter pays its bytes' share of its
bucket's collective, as the gradient sync's buckets (`runtime.parallel.grad_sync`). A piece of
at least `GATHER_IN_PLACE_BYTES` has a bucket of its own and no buffer: its shard is written
into its own slot and the slots are exchanged in place (one broadcast per member, or one
all-gather into the piece), priced as a collective of its own
(`memory.gather_buffers.shares_gather_bucket`).

Invariants: every rank of a group builds the same buckets in the same order (graph order, the same
program), and gathers them in that order (the in-place ones all started before the others,
`sharded_update.gather_weights`: they hold no buffer, and their exchanges queue back to back where
one at a time had each wait for the last); one bucket's buffer is alive at a time (a transient of at
most the bucket bytes, held only during the gather, and freed when it ends); the values written are
the shards' cast to the weight's dtype, as the unbucketed gather writes them. Reference:
Megatron-LM's distributed optimizer (megatron/core/distributed/param_and_grad_buffer.py: the updated
parameters all-gathered bucket by bucket); torch DDP's bucketing (Li et al. 2020).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autosbp.overlap import GATHER_IN_PLACE_BYTES
from runtime.execute.collectives import all_gather_single

__all__ = ["GatherBucket", "GatheredParam", "gather_buckets"]

Slot = tuple[slice, ...]


@dataclass(frozen=True, slots=True)
class GatheredParam:
    """One parameter of a bucket: its weight piece, this rank's updated shard, and each
    member's slot of the piece (in `members` order); every slot has the shard's element count
    and is contiguous."""

    param: torch.Tensor
    shard: torch.Tensor
    slots: tuple[Slot, ...]

    @property
    def numel(self) -> int:
        return self.shard.numel()

    @property
    def in_place(self) -> bool:
        """Gathered in place, in a bucket of its own (`GATHER_IN_PLACE_BYTES`)."""
        return self.param.numel() * self.param.element_size() >= GATHER_IN_PLACE_BYTES


@dataclass(slots=True)
class GatherBucket:
    """Parameters gathered over one group with one exchange of a flat buffer."""

    group: dist.ProcessGroup
    members: tuple[int, ...]  # global ranks, in the group's rank order
    dtype: torch.dtype
    params: list[GatheredParam] = field(default_factory=list)

    @property
    def region_numel(self) -> int:
        """Elements of one member's region: its slots of every parameter."""
        return sum(p.numel for p in self.params)

    @property
    def in_place(self) -> bool:
        """One parameter, gathered in its own piece (no buffer: `start_in_place`)."""
        return len(self.params) == 1 and self.params[0].in_place

    def gather(self, broadcast: bool) -> None:
        """This rank's shards into every member's weights through the bucket's buffer
        (`broadcast`: one broadcast per member, else one all-gather); returns when they are
        written. An in-place bucket starts its exchange with `start_in_place` instead."""
        assert not self.in_place, "an in-place bucket is gathered by start_in_place"
        region, own = self.region_numel, self.members.index(dist.get_rank())
        flat = torch.empty(
            region * len(self.members), dtype=self.dtype, device=self.params[0].shard.device
        )
        regions = flat.split(region)
        offset = 0
        for p in self.params:  # this rank's shards, cast to the weights' dtype
            regions[own][offset : offset + p.numel].view_as(p.shard).copy_(p.shard)
            offset += p.numel
        if broadcast:
            works = [
                dist.broadcast(regions[k], src=m, group=self.group, async_op=True)
                for k, m in enumerate(self.members)
            ]
        else:
            works = [all_gather_single(flat, regions[own], group=self.group, async_op=True)]
        for work in works:
            assert work is not None
            work.wait()
        offset = 0
        for p in self.params:
            for slot, piece in zip(p.slots, regions, strict=True):
                target = p.param[slot]
                target.copy_(piece[offset : offset + p.numel].view(target.shape))
            offset += p.numel
        # Freed here, not when the last reference goes: a collective's work may hold the buffer
        # on gloo's worker thread after the wait, and free it there at some later time.
        flat.untyped_storage().resize_(0)

    def start_in_place(self, broadcast: bool) -> list[dist.Work]:
        """The one parameter's shard into its own slot, then the slots' exchange in the piece
        itself started (one all-gather where the slots are the piece's regions in member
        order): the piece is written when the works returned are waited for."""
        (p,) = self.params
        own = p.slots[self.members.index(dist.get_rank())]
        p.param[own].view_as(p.shard).copy_(p.shard)
        start, size = p.param.data_ptr(), p.numel * p.param.element_size()
        in_order = p.param.is_contiguous() and all(
            p.param[slot].data_ptr() == start + k * size for k, slot in enumerate(p.slots)
        )
        if broadcast or not in_order:
            works = [
                dist.broadcast(p.param[slot], src=m, group=self.group, async_op=True)
                for slot, m in zip(p.slots, self.members, strict=True)
            ]
        else:
            flat, mine = p.param.view(-1), p.param[own].view(-1)
            works = [all_gather_single(flat, mine, group=self.group, async_op=True)]
        return [work for work in works if work is not None]


def gather_buckets(
    entries: Sequence[tuple[GatheredParam, dist.ProcessGroup]], bucket_bytes: int
) -> list[GatherBucket]:
    """`entries` (in graph order, each with the group it gathers over) dealt into buckets:
    a parameter joins the open bucket of its group and dtype unless its weight piece would
    take the bucket's buffer past `bucket_bytes`, else it opens one (a parameter larger than
    the cap, or gathered in place, has a bucket of its own)."""
    buckets: list[GatherBucket] = []
    open_buckets: dict[tuple[tuple[int, ...], torch.dtype], GatherBucket] = {}
    for param, group in entries:
        members = tuple(dist.get_process_group_ranks(group))
        if param.in_place:
            buckets.append(GatherBucket(group, members, param.param.dtype, [param]))
            continue
        key = (members, param.param.dtype)
        bucket = open_buckets.get(key)
        size = param.param.element_size() * len(members)
        if bucket is None or size * (bucket.region_numel + param.numel) > bucket_bytes:
            bucket = GatherBucket(group, members, param.param.dtype)
            open_buckets[key] = bucket
            buckets.append(bucket)
        bucket.params.append(param)
    return buckets
