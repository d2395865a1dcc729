"""Module-level worker for the check's tests (spawned by `launching.workers.run_workers`): the real
training job (`runtime.trainer.train_worker`) with `check`, optionally with a bug injected.

Lives here: `run_checked`, which runs each case's job on every rank and returns rank 0's
`StepCheck`s, and `FAULTS`, the injected bugs: each is a way a runtime can be wrong that the
check must catch, patched into this process only (never into the code under test):
- `grad-scale`: the optimizer receives one parameter's gradient times (1 + 1e-3), under any
  plan (each rank scales its piece of its stage's first parameter);
- `all-reduce-average`: a boxing all-reduce averages instead of summing (a wrong boxing step);
- `sync-twice`: the gradient sync all-reduces every bucket a second time, so each gradient is
  summed over its replicas twice (a partial value summed again);
- `no-gather`: the distributed optimizer steps its shards but never converts them back into
  the weights (`ShardedUpdate.gather_weights` does nothing): the weights miss the update;
- `no-accumulate`: ZeRO-2's hook puts each micro-batch's reduce-scattered gradient in the
  shard's instead of adding it: with micro-batches, the shards keep the last one's only.
And one variant that is not a bug (`ALL_GATHER`): the weight-gather buckets exchanged by one
all-gather, as on backends other than gloo (`runtime.parallel.weight_gather`), here on gloo;
and two more (`IN_PLACE`, `IN_PLACE_ALL_GATHER`): every piece gathered in place, as pieces of
`GATHER_IN_PLACE_BYTES` or more are, by broadcasts and by one all-gather.
Lives elsewhere: the cases and what they must show (tests/runtime/test_check.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from runtime.engine import Engine
from runtime.jobs import TrainSpec
from runtime.parallel.grad_sync import GradSync
from runtime.parallel.sharded_update import ShardedUpdate
from runtime.parallel.weight_gather import GatherBucket
from runtime.trainer import train_worker
from runtime.verify.verdict import StepCheck
from tests.support.shared_captures import shares_captures

SCALE = 1 + 1e-3  # grad-scale's factor: the smallest error the issue asks the check to catch


@contextlib.contextmanager
def _grad_scale() -> Iterator[None]:
    init = Engine.__init__

    def scaled(self: Engine, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        first = next(iter(self.parameters.values()))
        step = self.optimizer.step  # this engine's optimizer only, not the reference's

        def scaled_step(*step_args: Any, **step_kwargs: Any) -> Any:
            if first.grad is not None:
                first.grad.mul_(SCALE)
            return step(*step_args, **step_kwargs)

        self.optimizer.step = scaled_step  # type: ignore[method-assign]

    with mock.patch.object(Engine, "__init__", scaled):
        yield


@contextlib.contextmanager
def _all_reduce_average() -> Iterator[None]:
    all_reduce = dist.all_reduce

    def average(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        work = all_reduce(tensor, *args, **kwargs)
        # the boxing steps' blocking all-reduce of values (not the step's integer agreement on
        # a non-finite value, runtime.verify.finite)
        if not kwargs.get("async_op", False) and tensor.is_floating_point():
            tensor.div_(dist.get_world_size(kwargs.get("group")))
        return work

    with mock.patch("runtime.execute.collectives.dist.all_reduce", average):
        yield


@contextlib.contextmanager
def _sync_twice() -> Iterator[None]:
    finish = GradSync.finish

    def twice(self: GradSync) -> None:
        finish(self)
        for bucket in self.buckets:
            assert bucket.flat is not None
            dist.all_reduce(bucket.flat, group=bucket.group)

    with mock.patch.object(GradSync, "finish", twice):
        yield


@contextlib.contextmanager
def _no_accumulate() -> Iterator[None]:
    def overwrite(entry: Any) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            assert param.grad is not None
            with torch.no_grad():
                entry.shard.grad = entry.to_shard(param.grad).to(entry.shard.dtype, copy=True)
            param.grad = None

        return hook

    with mock.patch("runtime.parallel.sharded_update._scatter_now", overwrite):
        yield


@contextlib.contextmanager
def _no_gather() -> Iterator[None]:
    with mock.patch.object(ShardedUpdate, "gather_weights", return_value=None):
        yield


@contextlib.contextmanager
def _all_gather_buckets() -> Iterator[None]:
    gather = GatherBucket.gather
    with mock.patch.object(GatherBucket, "gather", lambda self, broadcast: gather(self, False)):
        yield


@contextlib.contextmanager
def _in_place(all_gather: bool) -> Iterator[None]:
    with (
        mock.patch("runtime.parallel.weight_gather.GATHER_IN_PLACE_BYTES", 0),
        _all_gather_buckets() if all_gather else contextlib.nullcontext(),
    ):
        yield


ALL_GATHER = "all-gather-buckets"
IN_PLACE = "in-place-gathers"
IN_PLACE_ALL_GATHER = "in-place-all-gathers"
FAULTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "none": contextlib.nullcontext,
    "grad-scale": _grad_scale,
    "all-reduce-average": _all_reduce_average,
    "sync-twice": _sync_twice,
    "no-gather": _no_gather,
    "no-accumulate": _no_accumulate,
    ALL_GATHER: _all_gather_buckets,
    IN_PLACE: lambda: _in_place(all_gather=False),
    IN_PLACE_ALL_GATHER: lambda: _in_place(all_gather=True),
}


@shares_captures
def run_checked(
    rank: int, world_size: int, cases: list[tuple[str, TrainSpec, str]]
) -> dict[str, list[StepCheck]]:
    """Per case (id, job, fault name): the job's step checks on rank 0 (empty elsewhere)."""
    out = {}
    for case_id, spec, fault in cases:
        with FAULTS[fault]():
            rows = train_worker(rank, world_size, spec).records
        out[case_id] = [
            row[2] for row in rows if row[2] is not None
        ]  # (step, loss, check, skipped)
    return out
