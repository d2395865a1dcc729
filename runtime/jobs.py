"""Train a model under a plan on N local processes or under torchrun, optionally checked against
one device.

Lives here: `TrainSpec` (what to train: a model spec the workers can rebuild, a plan, steps,
checkpoints, backend and device), `train_worker` (one rank: an Engine and, with `check`, a
`StepChecker` that compares every step with one device on rank 0), `train` (spawn the ranks, or
be this rank of torchrun's world; collect one row per step; hand each finished step to
`on_step` as it happens), `torchrun_job` and `made_on_rank0` (the CLI's torchrun path: join
the world, make the plan once). Used by `autosbp train` and `autosbp demo`. Lives elsewhere: the
engine (`runtime.engine`), the launcher and its watchdog (`launching.workers`), torchrun's
environment (`launching.torchrun`), model loading (`autosbp.zoo`), the check
(`runtime.verify.step_check`, dropout off: `runtime.verify.one_device`), checkpoints
(`runtime.state.checkpoint`).

A measured step's time (one definition, here and in `autosbp.timeline.measured_step_s`): its
slowest rank's, from entering the step to leaving it. Each rank times its `Engine.step`; the
ranks take the maximum (an all-reduce after the step and its check, so rank 0's float64
reference never counts in a step of the others: they wait for it there).

The batch is the model's example inputs at every step (the demo's task is to fit them), rank 0's
on every rank, so the single-device reference sees exactly what the plan sees; parameters start
from rank 0's values (the Engine broadcasts them).
Job control: every step and every actor firing is reported to the launcher (`_Progress`), whose
watchdog ends the job when a rank makes no progress for `stall_timeout_s`; there is no deadline
for the job. With `checkpoint_dir`, the state is saved every `checkpoint_every` steps and after
the last, so a killed job loses at most that many steps; `resume` continues from the checkpoint
there (its optimizer step count is the number of steps trained: checkpoints need Adam). The
optimizer is the plan's (`plan_optimizer`: fused Adam, SGD or SGD with momentum), the one whose
states and update the planner priced.
A testing hook, `runtime.verify.faults.FAULT_ENV`, makes one rank fail at one step.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from autosbp.errors import AutosbpError, ExecutionError, NonFiniteError
from autosbp.plan import Plan
from autosbp.timeline import Event, Recorder
from launching.torchrun import TorchrunWorld, join_torchrun_world, torchrun_world
from launching.workers import COLLECTIVE_MARGIN_S, STARTUP_S, report_progress, run_workers
from runtime.defaults import CHECKPOINT_EVERY, STALL_TIMEOUT_S
from runtime.verify.faults import inject_fault
from runtime.verify.finite import NonFinite
from runtime.verify.one_device import disable_dropout
from runtime.verify.step_check import StepChecker
from runtime.verify.verdict import StepCheck, Verdict, judge

T = TypeVar("T")


@dataclass(frozen=True)
class TrainSpec:
    model: str
    model_args: dict[str, Any]
    plan: dict[str, Any]  # Plan.to_json(): plain data crosses process boundaries
    steps: int
    lr: float = 1e-2
    check: bool = False
    stall_timeout_s: float = STALL_TIMEOUT_S  # no progress this long on a rank ends the job
    trace: bool = False  # record every actor firing of every rank (TrainResult.events)
    checkpoint_dir: str | None = None  # save the state here (runtime.state.checkpoint)
    checkpoint_every: int = CHECKPOINT_EVERY  # steps between saves; and after the last step
    resume: bool = False  # continue from the checkpoint in checkpoint_dir, if there is one
    backend: str = "gloo"  # or "nccl" (launching.torchrun.process_group_backend)
    device: str = "cpu"  # or "cuda": each rank takes the GPU of its local rank
    skip_non_finite: bool = False  # a nan/inf loss or gradient skips the update, not the job


@dataclass(frozen=True, slots=True)
class StepProgress:
    """A finished step as rank 0 saw it, handed to `train`'s `on_step` while the job runs."""

    done: int  # steps trained so far (a resumed job starts past 0)
    steps: int  # the job's last step count (TrainSpec.steps)
    loss: float
    step_s: float  # the slowest rank's time of this step (the header's definition)


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

    def verdict(self) -> Verdict:
        """The check's verdict over every step (with TrainSpec.check)."""
        return judge([r.check for r in self.records if r.check is not None])


def adam(params: Any, lr: float) -> torch.optim.Adam:
    """Adam as one fused kernel: the update the planner prices (costs.OPTIMIZER_BYTES_PER_ELEMENT);
    torch's default per-tensor loop moves about 3x the bytes on CPU (bench/fidelity.py)."""
    return torch.optim.Adam(params, lr=lr, fused=True)


SGD_MOMENTUM = 0.9  # the plan's `sgd_momentum`: one state per parameter, as the planner counts


def plan_optimizer(kind: str, lr: float) -> Callable[[Any], torch.optim.Optimizer]:
    """The optimizer factory a plan was priced for (`Plan.optimizer`): fused Adam, plain SGD, or
    SGD with momentum SGD_MOMENTUM (the states the planner's memory counted: 2, 0 and 1)."""
    if kind == "adam":
        return lambda ps: adam(ps, lr)
    if kind == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=lr, fused=True)
    if kind == "sgd_momentum":
        return lambda ps: torch.optim.SGD(ps, lr=lr, momentum=SGD_MOMENTUM, fused=True)
    raise ExecutionError(
        f"the plan is for optimizer {kind!r}, which training does not know (adam, sgd, "
        "sgd_momentum); make the plan again with `autosbp plan --optimizer adam`."
    )


def check_spec(spec: TrainSpec, plan: Plan) -> None:
    """What a job refuses before any process starts: a plan's optimizer it cannot train with,
    checkpoints without Adam (a checkpoint counts the steps trained by Adam's `step`) and of an
    interleaved plan."""
    plan_optimizer(plan.optimizer, spec.lr)
    if spec.checkpoint_dir is not None and plan.optimizer != "adam":
        raise ExecutionError(
            f"checkpoints need the plan's optimizer to be adam (they count the steps trained by "
            f"Adam's step), but the plan is for {plan.optimizer}; train without "
            "--checkpoint-dir, or make the plan with `autosbp plan --optimizer adam`."
        )
    if spec.checkpoint_dir is not None:
        from runtime.state.checkpoint_load import refuse_interleaved

        refuse_interleaved(plan.virtual_stages, "save")


def train(spec: TrainSpec, on_step: Callable[[StepProgress], None] | None = None) -> TrainResult:
    """Run `spec`: on `plan.device_count` spawned local processes, or, in a process that torchrun
    started, as this rank of torchrun's world (joined here unless `torchrun_job` did). Returns
    rank 0's records (every rank's firings with `spec.trace`; under torchrun, on rank 0 only).
    `on_step` receives each finished step while the job runs (in this process; under torchrun,
    on rank 0 only)."""
    plan = Plan.from_json(spec.plan)
    check_spec(spec, plan)
    world = torchrun_world()
    if world is not None:
        with torchrun_job(world, spec.backend, spec.stall_timeout_s):
            return _train_here(world, spec, on_step)
    nproc = plan.device_count

    def on_done(rank: int, values: tuple[float, ...]) -> None:
        if rank == 0 and on_step is not None:
            done, loss, step_s = values[:3]
            on_step(StepProgress(int(done), spec.steps, loss, step_s))

    results = run_workers(
        train_worker, nproc, (spec,), backend=spec.backend, timeout_s=spec.stall_timeout_s,
        job="training", on_done=on_done,
    )  # fmt: skip
    records, times, _ = results[0]
    events = tuple(Event(*row) for _, _, rows in results for row in rows)
    return TrainResult(tuple(StepRecord(*row) for row in records), tuple(times), events)


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
    records, times, rows = train_worker(
        world.rank, world.world_size, spec, on_step if world.rank == 0 else None
    )
    gathered: list[Any] = [None] * world.world_size
    dist.all_gather_object(gathered, rows)
    events = tuple(Event(*row) for part in gathered for row in part)
    return TrainResult(tuple(StepRecord(*row) for row in records), tuple(times), events)


def train_worker(
    rank: int,
    world_size: int,
    spec: TrainSpec,
    on_step: Callable[[StepProgress], None] | None = None,
) -> tuple[list[tuple], list[float], list[tuple]]:
    """One rank of the job: (rows (step, loss, check), each step's time (the slowest rank's),
    this rank's firings with `spec.trace`). Every finished step is reported to the launcher
    (`report_progress(done=(steps done, loss, step time))`) and handed to `on_step`."""
    job = _Job.build(rank, spec)
    rows: list[tuple] = []
    times: list[float] = []
    for step in range(job.first, spec.steps):
        job.progress.step = step
        report_progress(f"step {step}")
        inject_fault(rank, step)
        start = time.perf_counter()
        skipped = job.engine.skipped_steps
        loss = _step(job, spec, step)
        took_s = time.perf_counter() - start
        check = job.checker.after_step(step, job.inputs, loss) if job.checker else None
        _checkpoint(job.engine, spec, step)
        step_s = _slowest_rank_s(took_s)  # the others wait here for rank 0's check
        rows.append((step, loss, check, job.engine.skipped_steps > skipped))
        times.append(step_s)
        report_progress(f"step {step} done", done=(step + 1, loss, step_s))
        if on_step is not None:
            on_step(StepProgress(step + 1, spec.steps, loss, step_s))
    recorder = job.progress.recorder
    events = [astuple(e) for e in recorder.events] if recorder is not None else []
    return rows, times, events


@dataclass(frozen=True)
class _Job:
    """What one rank trains with: its engine, the batch, the checker (with `check`), the span
    hook, and the first step (past 0 when resumed)."""

    engine: Any
    inputs: tuple[torch.Tensor, ...]
    checker: StepChecker | None
    progress: _Progress
    first: int

    @classmethod
    def build(cls, rank: int, spec: TrainSpec) -> _Job:
        from autosbp.zoo import load_model
        from runtime.engine import Engine
        from runtime.state.startup import from_rank0

        device = _device(spec.device)
        report_progress("loading the model", grace_s=STARTUP_S)
        model, inputs = load_model(spec.model, spec.model_args)
        model = model.to(device)
        inputs = tuple(from_rank0(x.to(device)) for x in inputs)  # one batch, rank 0's
        dropout = disable_dropout(model) if spec.check else ()
        plan = Plan.from_json(spec.plan)
        recorder = None
        if spec.trace:
            dist.barrier()  # one origin for every rank (perf_counter is one clock per machine)
            stage = next(s for s, st in enumerate(plan.stages) if rank in st.devices)
            recorder = Recorder(rank, stage)
        progress = _Progress(recorder)
        report_progress("building the engine", grace_s=STARTUP_S)
        make_optimizer = plan_optimizer(plan.optimizer, spec.lr)  # the one the plan priced
        engine = Engine(
            model, plan, make_optimizer, example_inputs=inputs, recorder=progress,
            non_finite=NonFinite.SKIP if spec.skip_non_finite else NonFinite.STOP,
        )  # fmt: skip
        first = _resume(engine, spec)
        checker = None
        if (
            spec.check
        ):  # rank 0 compares each step with one device (runtime.verify.step_check); resumed,
            # the optimizer's restored state is unknown to the reference: updates go unchecked
            optimizer = make_optimizer if first == 0 else None
            checker = StepChecker(engine, model, inputs, optimizer, dropout)
        return cls(engine, inputs, checker, progress, first)


def _step(job: _Job, spec: TrainSpec, step: int) -> float:
    """One step of the engine; a nan or inf stops the job here, naming the step and what is
    left (the checkpoint saved before it is never touched: no save follows)."""
    try:
        return float(job.engine.step(job.inputs))
    except NonFiniteError as exc:
        saved = ""
        if spec.checkpoint_dir is not None:
            last = max(job.first, step // spec.checkpoint_every * spec.checkpoint_every)
            saved = (
                f" The checkpoint in {spec.checkpoint_dir} (after {last} step"
                f"{'s' if last != 1 else ''}) is intact: --resume continues from it."
                if last
                else " No checkpoint was saved before it."
            )
        raise ExecutionError(  # the table's numbering: its first step is 1
            f"step {step + 1}: {exc.what}, so the job stopped before that step's update (the "
            f"parameters are those the step began with).{saved} Fix the cause (a lower --lr, "
            "the data, an op that overflows in its dtype), or pass --skip-non-finite to skip such "
            "steps' updates as large-scale trainers do."
        ) from None


def _device(kind: str) -> torch.device:
    """Where this rank's tensors live: the CPU, or the GPU of its local rank (torchrun's
    LOCAL_RANK; a spawned job's ranks are all local)."""
    if kind == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    if not torch.cuda.is_available() or local >= torch.cuda.device_count():
        raise ExecutionError(
            f"--device cuda: local rank {local} needs GPU {local}, but this machine has "
            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} that torch can "
            "use; start at most one process per GPU, or train with --device cpu."
        )
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def _slowest_rank_s(seconds: float) -> float:
    """The largest of every rank's `seconds` (a CPU tensor: gloo carries it for either backend)."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


class _Progress:
    """The Engine's span hook in a job: each actor firing it starts is this rank's progress and
    activity for the launcher's watchdog (`report_progress`, a few microseconds); with a
    Recorder, firings are recorded too."""

    def __init__(self, recorder: Recorder | None) -> None:
        self.recorder = recorder
        self.step = 0

    def span(
        self, kind: str, micro_batch: int | None = None, chunk: int = 0
    ) -> contextlib.AbstractContextManager[None]:
        of = "" if micro_batch is None else f" of micro-batch {micro_batch}"
        report_progress(f"step {self.step}: {kind}{of}")
        if self.recorder is None:
            return contextlib.nullcontext()
        return self.recorder.span(kind, micro_batch, chunk)


def _resume(engine: Any, spec: TrainSpec) -> int:
    """The first step to train: the checkpoint's step count with `resume` and a checkpoint in
    `checkpoint_dir`, else 0 (a collective: every rank looks at the same directory)."""
    from runtime.state.checkpoint import MANIFEST, load_checkpoint
    from runtime.state.checkpoint_format import recover_checkpoint

    if not spec.resume or spec.checkpoint_dir is None:
        return 0
    recover_checkpoint(spec.checkpoint_dir)  # a save killed between its renames
    if not (Path(spec.checkpoint_dir) / MANIFEST).is_file():
        return 0  # the job was stopped before its first checkpoint
    report_progress(f"loading the checkpoint in {spec.checkpoint_dir}", grace_s=STARTUP_S)
    return load_checkpoint(engine, spec.checkpoint_dir).optimizer_step


def _checkpoint(engine: Any, spec: TrainSpec, step: int) -> None:
    """Save after every `checkpoint_every`-th step and after the last one."""
    from runtime.state.checkpoint import save_checkpoint

    done = step + 1
    if spec.checkpoint_dir is None:
        return
    if done % spec.checkpoint_every == 0 or done == spec.steps:
        report_progress(f"step {step}: saving a checkpoint", grace_s=STARTUP_S)
        save_checkpoint(engine, spec.checkpoint_dir)
