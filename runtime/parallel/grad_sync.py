"""Gradient sync overlapped with backward: DDP's buckets, on the plan's layouts.

Lives here: `GradSync` (the buckets of one rank, hooks that launch a bucket's all-reduce as soon
as the last micro-batch's backward has finished every gradient in it, and `finish`, which
launches what is left, waits, and puts the synced gradients back), `sync_patterns` and
`build_sync_groups` (the process groups it runs on), `build_grad_sync` (both, for one rank).
Lives elsewhere: the step that arms it (`runtime.parallel.pipeline`), the layouts and the bucket
cap (the plan: its `grad_bucket_bytes`, what the planner priced), the price of the overlap
(`autosbp.schedule.exposed_sync_s`).

Invariants:
- A parameter in layout p ends backward with its gradient in dual(p); the sync boxes it to p: a
  sum over the mesh dims where p is B (of more than one device). One all-reduce over the ranks
  that share the other coordinates sums over all those dims at once (the boxing chain sums over
  one dim after the other: the same sum).
- Buckets: parameters with the same summed dims and dtype, in reverse graph order (the order in
  which backward finishes them), at most `bucket_bytes` each (DDP's bucket_cap_mb). A bucket's
  flat buffer lives across steps (a fresh one per step cost mlp-2048, 96 MiB of weights, about
  5% of its step against DDP, measured), and the gradients are views of it (DDP's
  gradient_as_bucket_view): `zero_grad` sets them to None, the first backward of a step that
  finishes one (its post-accumulate hook) copies it into its view and hands the view back, the
  later micro-batches accumulate into it in place, and the all-reduce runs on it without a
  copy, so a bucketed gradient is held once, as the planner counts it (a copy held the
  bucket's gradients twice from the launch on: 17% over the predicted peak of mlp's auto plan
  on 4 processes, measured by tests/runtime/test_memory.py), and no step zeroes the buckets (a
  pass over every gradient: 5 ms of mlp-1024's 90 ms step on 2 gloo processes, where the copy
  replaces the add into zeros). A view backward never reached is zeroed at launch; its
  gradient is None after `finish`, as without buckets. The first step, before the buffer
  exists, copies at launch.
- Every rank launches its buckets in bucket order (a ready bucket waits for the ones before it),
  so the collectives of a group meet in the same order everywhere. They run on process groups of
  their own: they never interleave with the boxing collectives backward runs meanwhile.
- Only the last backward that adds to a gradient launches (`arm`, given the parameters it
  finishes: under interleaving each chunk's last backward finishes its own, and an earlier
  chunk's come before the rank's last firing); earlier ones still accumulate. A leaf's
  gradient is accumulated once per backward call, so when its hook fires in the backward armed
  for it the gradient is final. Parameters backward never reaches are synced (as zeros) by
  `finish`.
- The sum runs in the gradients' dtype (a mixed recipe's fp32 masters'), or in the plan's
  reduce dtype where that is lower (`reduce_dtype`: bf16 halves the bytes): such a bucket
  casts its gradients into a wire buffer of that dtype at launch and back after the wait, so
  the gradients are tensors of their own, not views (its wire is the transient).
- Hooks are registered through `register` (`runtime.parallel.precision.Weights.register`: a
  master's gradient is added in by its compute copy's bridge, not by autograd).
- Every wait is bounded by the world's timeout.
Reference: torch DDP's Reducer (Li et al. 2020, "PyTorch Distributed", section 3.2.3: bucketing,
overlap, launch in bucket order); torch.Tensor.register_post_accumulate_grad_hook.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autosbp.sbp import Broadcast, Mesh, NdSbp
from runtime.execute.groups import ProcessGroups

__all__ = ["GradSync", "build_grad_sync", "build_sync_groups", "summed_dims", "sync_patterns"]

Pattern = tuple[int, ...]  # the mesh dims a gradient is summed over
Register = Callable[[torch.Tensor, Callable[[torch.Tensor], None]], None]


def autograd_hook(param: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> None:
    """The default `Register`: autograd's own post-accumulate-grad hook."""
    param.register_post_accumulate_grad_hook(fn)


def summed_dims(layout: NdSbp, mesh_shape: Sequence[int]) -> Pattern:
    """The mesh dims a parameter in `layout` sums its gradient over: where it is B on more than
    one device."""
    return tuple(
        d
        for d, (sbp, size) in enumerate(zip(layout, mesh_shape, strict=True))
        if isinstance(sbp, Broadcast) and size > 1
    )


def sync_patterns(layouts: Iterable[NdSbp], mesh_shape: Sequence[int]) -> list[Pattern]:
    """Every non-empty `summed_dims` among `layouts`, sorted: the same list on every rank when
    every rank passes the layouts of every parameter of the plan."""
    return sorted({p for layout in layouts if (p := summed_dims(layout, mesh_shape))})


def build_sync_groups(meshes: Sequence[Mesh], patterns: Sequence[Pattern]) -> ProcessGroups:
    """A group per (mesh, pattern, fixed other coordinates). A collective over the world: call on
    every rank with the same meshes and patterns, in the same order."""
    groups = ProcessGroups()
    for mesh in meshes:
        for pattern in patterns:
            groups.add_groups(mesh, mesh.groups_over(pattern))
    return groups


def build_grad_sync(
    params: Mapping[str, torch.Tensor],
    layouts: Mapping[str, NdSbp],
    trained: Iterable[str],
    meshes: Sequence[Mesh],
    mesh: Mesh,
    timeout: datetime.timedelta,
    bucket_bytes: int,
    deferred: Collection[str] = (),
    *,
    register: Register = autograd_hook,
    reduce_dtype: torch.dtype | None = None,
) -> GradSync:
    """This rank's `GradSync` for `params` (its stage's, on `mesh`), on groups of every pattern
    of the plan's parameters `trained` (of every stage: a collective over the world), in
    buckets of at most `bucket_bytes` (the plan's `grad_bucket_bytes`)."""
    patterns = sync_patterns([layouts[name] for name in trained], mesh.shape)
    groups = build_sync_groups(meshes, patterns)
    return GradSync(
        params, layouts, mesh, groups, timeout, bucket_bytes, deferred=deferred,
        register=register, reduce_dtype=reduce_dtype,
    )  # fmt: skip


@dataclass(slots=True)
class _Bucket:
    """Gradients synced by one all-reduce: flattened into `flat` at launch, split back after."""

    params: tuple[torch.Tensor, ...]
    group: dist.ProcessGroup
    wire: torch.dtype | None = None  # the reduce dtype, where lower than the gradients'
    waiting: int = 0  # gradients the armed backward has not finished yet
    work: dist.Work | None = None
    flat: torch.Tensor | None = None  # the gradients' buffer (their views), or the wire


class GradSync:
    """Syncs the gradients of `params` (name -> this rank's shard, in graph order) in their
    `layouts` on `mesh` (this rank's stage) through `groups` (`build_sync_groups`). The
    gradients of `deferred` parameters are not autograd's to accumulate (`runtime.parallel.prefetch`
    adds them in): whoever does calls `gradient_ready` once per backward. `register` hooks
    the others (`autograd_hook`, or a mixed recipe's bridge); `reduce_dtype` sums in a lower
    dtype than the gradients' (None: theirs)."""

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        layouts: Mapping[str, NdSbp],
        mesh: Mesh,
        groups: ProcessGroups,
        timeout: datetime.timedelta,
        bucket_bytes: int,
        deferred: Collection[str] = (),
        *,
        register: Register = autograd_hook,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        self.timeout = timeout
        self.buckets: list[_Bucket] = []
        self.launched_in_backward = 0  # buckets the last armed backward launched itself
        self._bucket_of: dict[torch.Tensor, _Bucket] = {}
        self._next = 0  # the next bucket to launch
        self._stepping = False  # armed in this step (`arm` .. `finish`)
        self._armed: set[torch.Tensor] = set()  # whose next hook finishes their gradient
        self._reached: set[torch.Tensor] = set()  # gradients the armed backward finished
        self._view_of: dict[torch.Tensor, torch.Tensor] = {}  # once its bucket's buffer exists
        coords = mesh.coords(mesh.device_ids.index(dist.get_rank()))
        open_buckets: dict[tuple[Pattern, torch.dtype], _Bucket] = {}
        for name in reversed(list(params)):
            param, pattern = params[name], summed_dims(layouts[name], mesh.shape)
            if not pattern:
                continue  # split (or alone) on every mesh dim: the gradient is already in place
            bucket = open_buckets.get((pattern, param.dtype))
            if bucket is None or _nbytes(bucket.params) + param.nbytes > bucket_bytes:
                wire = reduce_dtype if reduce_dtype not in (None, param.dtype) else None
                bucket = _Bucket((), groups.get(mesh.group_of(coords, pattern)), wire)
                open_buckets[(pattern, param.dtype)] = bucket
                self.buckets.append(bucket)
            bucket.params += (param,)
            self._bucket_of[param] = bucket
            if name not in deferred:
                register(param, self.gradient_ready)

    def zero_grad(self) -> None:
        """Before a step's first backward: every bucketed gradient None (its first backward
        puts it into its view: `gradient_ready`)."""
        for param in self._bucket_of:
            param.grad = None

    def view_for(self, param: torch.Tensor) -> torch.Tensor | None:
        """`param`'s view of its bucket, where its gradient goes (None before the first launch
        made the buffer, and for a parameter in no bucket or in one summed in a lower dtype)."""
        return self._view_of.get(param)

    def holds(self, param: torch.Tensor) -> bool:
        """Whether `param`'s gradient is a view of a bucket (`zero_grad` clears it)."""
        return param in self._bucket_of

    def arm(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Launch buckets from now on, as backward finishes the gradients of `params` (default:
        every one): call right before the backward that finishes them (the last micro-batch's
        of their chunk). The step's first call resets the buckets."""
        if not self._stepping:
            for bucket in self.buckets:
                bucket.waiting, bucket.work = len(bucket.params), None
            self._next, self.launched_in_backward, self._stepping = 0, 0, True
        wanted = self._bucket_of if params is None else params
        self._armed.update(p for p in wanted if p in self._bucket_of)

    def finish(self) -> None:
        """Launch the buckets not launched yet, wait for all, and set every synced gradient
        (parameters whose gradient is None stay None)."""
        assert self._stepping, "GradSync.finish without arm: call arm before the last backward"
        self._stepping = False
        self._armed.clear()
        self._launch(len(self.buckets))
        for bucket in self.buckets:
            assert bucket.work is not None and bucket.flat is not None
            bucket.work.wait(self.timeout)
            if bucket.wire is not None:  # summed in the reduce dtype: back into the gradients
                with torch.no_grad():
                    pieces = bucket.flat.split([p.numel() for p in bucket.params])
                    for param, piece in zip(bucket.params, pieces, strict=True):
                        if param in self._reached:
                            assert param.grad is not None
                            param.grad.copy_(piece.view(param.shape))
                        else:
                            param.grad = None
                bucket.flat = None  # the wire is a transient
                continue
            for param in bucket.params:
                param.grad = self._view_of[param] if param in self._reached else None
        self._reached.clear()

    def gradient_ready(self, param: torch.Tensor) -> None:
        """`param`'s gradient is final for this backward (autograd's post-accumulate hook, or
        whoever adds a `deferred` parameter's gradient in). A parameter split on every mesh
        dim (in no bucket) has nothing to sync."""
        bucket = self._bucket_of.get(param)
        if bucket is None:
            return
        self._into_view(param)
        if param not in self._armed:
            return  # an earlier micro-batch: its gradients still accumulate
        assert bucket.work is None, "a gradient accumulated twice in one backward"
        self._reached.add(param)
        bucket.waiting -= 1
        ready = self._next
        while ready < len(self.buckets) and self.buckets[ready].waiting == 0:
            ready += 1
        before = self._next
        self._launch(ready)
        self.launched_in_backward += self._next - before

    def _into_view(self, param: torch.Tensor) -> None:
        """A gradient of its own (the step's first backward to reach it) copied into its view
        of the bucket, which becomes the gradient (the later ones accumulate into it). A
        bucket summed in a lower dtype has no views: its gradients stay their own."""
        view, grad = self._view_of.get(param), param.grad
        if view is not None and grad is not None and grad.data_ptr() != view.data_ptr():
            with torch.no_grad():
                view.copy_(grad)
            param.grad = view

    def _launch(self, until: int) -> None:
        """Start the all-reduce of every bucket before `until` not started yet, in order."""
        with torch.no_grad():
            for bucket in self.buckets[self._next : until]:
                if bucket.wire is not None:
                    bucket.flat = self._wire(bucket)
                    bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)
                    continue
                if bucket.flat is None:  # the first step: kept across steps from now on
                    like = bucket.params[0]
                    size = sum(p.numel() for p in bucket.params)
                    bucket.flat = torch.zeros(size, dtype=like.dtype, device=like.device)
                    self._view_of.update(zip(bucket.params, _views(bucket), strict=True))
                for param in bucket.params:
                    if param.grad is None:  # backward never reached it: zeros are synced
                        self._view_of[param].zero_()
                    self._into_view(param)  # the first step's, of their own till now
                bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)
        self._next = max(self._next, until)

    def _wire(self, bucket: _Bucket) -> torch.Tensor:
        """The bucket's gradients cast into one buffer of its reduce dtype (zeros where backward
        never reached one: every rank takes part)."""
        assert bucket.wire is not None
        pieces = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
            for p in bucket.params
        ]
        return torch.cat(pieces).to(bucket.wire)


def _views(bucket: _Bucket) -> list[torch.Tensor]:
    """Each parameter's piece of the bucket's flat buffer, shaped like the parameter."""
    assert bucket.flat is not None
    pieces = bucket.flat.split([p.numel() for p in bucket.params])
    return [piece.view_as(p) for piece, p in zip(pieces, bucket.params, strict=True)]


def _nbytes(params: Sequence[torch.Tensor]) -> int:
    return sum(p.nbytes for p in params)
