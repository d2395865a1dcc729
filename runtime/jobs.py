"""A training job: its ranks launched on N local processes or joined under torchrun, and what it
reports (`TrainResult`).

Lives here: `check_spec` (what a job refuses before any process starts), `train` (spawn the ranks,
or be this rank of torchrun's world; hand each finished step to `on_step` as it happens),
`torchrun_job` and `made_on_rank0` (the CLI's torchrun path: join the world, make the plan
once). Used by `autosbp train` and `autosbp demo`. Lives elsewhere: what a job is
(`runtime.job_spec.TrainSpec`, re-exported here), one rank's loop (`runtime.trainer`), the engine (`runtime.engine`), the launcher and its watchdog
(`launching.workers`), torchrun's environment (`launching.torchrun`), model loading
(`autosbp.zoo`), the data (`runtime.data`), the check (`runtime.verify.step_check`),
checkpoints (`runtime.state.checkpoint`).

A measured step's time (one definition, here and in `autosbp.timeline.measured_step_s`): its
slowest rank's, from entering the step to leaving it. Each rank times its `Engine.step`; the
ranks take the maximum (an all-reduce after the step and its check, so rank 0's float64
reference never counts in a step of the others: they wait for it there).

Job control: every step and every span the Engine runs (each firing) is reported to the
launcher, whose watchdog
ends the job when a rank makes no progress for `stall_timeout_s`; there is no deadline for the
job. With `checkpoint_dir`, the state is saved every `checkpoint_every` steps and after the
last, so a killed job loses at most that many steps; `resume` continues from the checkpoint
there, with the data where it was, under any plan and any optimizer. One live job per folder:
`autosbp train` holds it (`runtime.state.checkpoint_lock`; a caller of `train` holds it with
`hold_checkpoint_dir`). The optimizer is the plan's kind (`runtime.optim`), the one whose
states and update the planner priced. A testing hook, `runtime.verify.faults.FAULT_ENV`,
makes one rank fail at one step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from autosbp.errors import AutosbpError
from autosbp.plan import Plan
from autosbp.timeline import Event
from launching.torchrun import TorchrunWorld, join_torchrun_world, torchrun_world
from launching.workers import COLLECTIVE_MARGIN_S, run_workers
from runtime.job_spec import TrainSpec
from runtime.metrics import EvalRow, StepRow
from runtime.optim import LrSchedule, OptimizerRecipe
from runtime.trainer import DONE_FIELDS, RankResult, train_worker
from runtime.verify.verdict import StepCheck, Verdict, judge

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StepProgress:
    """A finished step as rank 0 saw it, handed to `train`'s `on_step` while the job runs."""

    done: int  # steps trained so far (a resumed job starts past 0)
    steps: int  # the job's last step count (TrainSpec.steps)
    loss: float
    step_s: float  # the slowest rank's time of this step (the header's definition)
    lr: float = math.nan
    grad_norm: float = math.nan
    tokens_per_s: float | None = None
    mfu: float | None = None
    eval_loss: float | None = None  # where this step ended with an evaluation

    @classmethod
    def of(cls, values: tuple[float, ...], steps: int) -> StepProgress:
        """From the values a rank reports (`runtime.trainer.DONE_FIELDS`; NaN: none)."""
        got = dict(zip(DONE_FIELDS, values, strict=False))

        def maybe(key: str) -> float | None:
            value = got.get(key, math.nan)
            return None if math.isnan(value) else value

        return cls(
            int(got["done"]), steps, got["loss"], got["step_s"], got.get("lr", math.nan),
            got.get("grad_norm", math.nan), maybe("tokens_per_s"), maybe("mfu"),
            maybe("eval_loss"),
        )  # fmt: skip


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    check: StepCheck | None = None  # with TrainSpec.check, on rank 0: against one device
    skipped: bool = False  # with TrainSpec.skip_non_finite: a nan/inf step made no update


@dataclass(frozen=True)
class TrainResult:
    records: tuple[StepRecord, ...]
    step_times_s: tuple[float, ...] = field(default=())
    events: tuple[Event, ...] = field(default=())  # every rank's firings, with TrainSpec.trace
    rows: tuple[StepRow, ...] = field(default=())  # rank 0's metrics per step
    evals: tuple[EvalRow, ...] = field(default=())

    def verdict(self) -> Verdict:
        """The check's verdict over every step (with TrainSpec.check)."""
        return judge([r.check for r in self.records if r.check is not None])


def adam(params: Any, lr: float) -> torch.optim.Adam:
    """Adam as one fused kernel: the update the planner prices (costs.OPTIMIZER_BYTES_PER_ELEMENT);
    torch's default per-tensor loop moves about 3x the bytes on CPU (bench/fidelity.py)."""
    return torch.optim.Adam(params, lr=lr, fused=True)


def check_spec(spec: TrainSpec, plan: Plan) -> None:
    """What a job refuses before any process starts: an optimizer or schedule that makes no
    sense, clipping the plan did not price, a model path that cannot be written."""
    OptimizerRecipe(plan.optimizer, spec.lr, spec.weight_decay)
    LrSchedule(spec.lr, spec.steps, spec.lr_schedule, spec.warmup_steps, spec.min_lr)
    if (spec.clip_grad_norm is not None) != plan.clips_gradients:
        from runtime.engine import clip_refusal

        raise clip_refusal(plan, spec.clip_grad_norm)
    if spec.eval_data is None and spec.eval_every:
        raise AutosbpError(
            "--eval-every needs --eval-data FILE.py:FUNCTION (or a built-in data set): the "
            "data to evaluate on."
        )
    if spec.save_model is not None:
        from pathlib import Path

        from runtime.state.export import check_model_path

        check_model_path(Path(spec.save_model), spec.save_dtype)


def train(spec: TrainSpec, on_step: Callable[[StepProgress], None] | None = None) -> TrainResult:
    """Run `spec`: on `plan.device_count` spawned local processes, or, in a process that torchrun
    started, as this rank of torchrun's world (joined here unless `torchrun_job` did). Returns
    rank 0's records and metrics (every rank's firings with `spec.trace`; under torchrun, on
    rank 0 only). `on_step` receives each finished step while the job runs (in this process;
    under torchrun, on rank 0 only)."""
    plan = Plan.from_json(spec.plan)
    check_spec(spec, plan)
    world = torchrun_world()
    if world is not None:
        with torchrun_job(world, spec.backend, spec.stall_timeout_s):
            return _train_here(world, spec, on_step)
    nproc = plan.device_count

    def on_done(rank: int, values: tuple[float, ...]) -> None:
        if rank == 0 and on_step is not None:
            on_step(StepProgress.of(values, spec.steps))

    results = run_workers(
        train_worker, nproc, (spec,), backend=spec.backend, timeout_s=spec.stall_timeout_s,
        job="training", on_done=on_done,
    )  # fmt: skip
    return _result(results[0], [row for r in results for row in r.events])


def _result(first: RankResult, events: list[tuple]) -> TrainResult:
    return TrainResult(
        tuple(StepRecord(*row) for row in first.records), tuple(first.times),
        tuple(Event(*row) for row in events), tuple(first.rows), tuple(first.evals),
    )  # fmt: skip


@contextlib.contextmanager
def torchrun_job(world: TorchrunWorld, backend: str, stall_timeout_s: float) -> Iterator[None]:
    """This process as `world`'s rank for the job's life: joined (unless already), left after.
    Collectives time out as a spawned job's do (the stall timeout and a margin)."""
    if dist.is_initialized():
        yield
        return
    join_torchrun_world(world, backend, stall_timeout_s + COLLECTIVE_MARGIN_S)
    try:
        yield
        # Leave together: a rank that tears its process group down while a peer still finishes
        # (rank 0's check) was seen to abort in gloo's teardown under load ("terminate called
        # without an active exception", once in 3 suite runs; not reproduced in 16 runs alone).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def made_on_rank0(make: Callable[[], T]) -> T:
    """`make()` on rank 0 of the world, its result on every rank (pickled: a Plan's JSON, say).
    An AutosbpError on rank 0 is raised on every rank, with rank 0's message, so no rank waits
    for a value that never comes."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = (True, make())
        except AutosbpError as exc:
            box[0] = (False, exc)
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _train_here(
    world: TorchrunWorld, spec: TrainSpec, on_step: Callable[[StepProgress], None] | None
) -> TrainResult:
    """This rank's part of a torchrun job; rank 0 gathers every rank's firings."""

    def report(values: tuple[float, ...]) -> None:
        if on_step is not None:
            on_step(StepProgress.of(values, spec.steps))

    mine = train_worker(world.rank, world.world_size, spec, report if world.rank == 0 else None)
    gathered: list[Any] = [None] * world.world_size
    dist.all_gather_object(gathered, mine.events)
    return _result(mine, [row for part in gathered for row in part])
