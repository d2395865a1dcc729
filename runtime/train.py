"""Train a model under a plan on N local processes, optionally checked against one device.

Lives here: `TrainSpec` (what to train: a model spec the workers can rebuild, a plan, steps,
checkpoints), `train_worker` (one rank: an Engine and, with `check`, a `StepChecker` that
compares every step with one device on rank 0), `train` (launch, collect, one row per step).
Used by `autosbp train` and `autosbp demo`. Lives elsewhere: the engine (`runtime.engine`), the
launcher and its watchdog (`costmodel.launch`), model loading (`autosbp.zoo`), the check
(`runtime.check`), checkpoints (`runtime.checkpoint`).

The batch is the model's example inputs at every step (the demo's task is to fit them), rank 0's
on every rank, so the single-device reference sees exactly what the plan sees; parameters start
from rank 0's values (the Engine broadcasts them).
Job control: every step and every actor firing is reported to the launcher (`_Progress`), whose
watchdog ends the job when a rank makes no progress for `stall_timeout_s`; there is no deadline
for the job. With `checkpoint_dir`, the state is saved every `checkpoint_every` steps and after
the last, so a killed job loses at most that many steps; `resume` continues from the checkpoint
there (its optimizer step count is the number of steps trained: the job's optimizer is Adam).
A testing hook, `FAULT_ENV`, makes one rank fail at one step (tests/test_failures.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Any

import torch

from autosbp.errors import ExecutionError
from autosbp.plan import Plan
from autosbp.timeline import Event, Recorder
from costmodel.launch import STARTUP_S, report_progress, run_workers
from runtime.check import StepChecker, disable_dropout
from runtime.check_report import StepCheck, Verdict, judge

FAULT_ENV = "AUTOSBP_FAULT"
"""Testing hook: "rank=R,step=S,kind=K" makes rank R fail just before its step S (0-based) by K:
`exit` (os._exit(1)), `kill` (SIGKILL to itself), `raise` (a RuntimeError) or `hang` (sleeps,
reporting no progress); `slow` makes each of its steps from S on SLOW_STEP_S longer (progress
still reported every step). Tests use it to check that one failed rank stops the whole job with
a message naming it, and that a slow job is not one."""
SLOW_STEP_S = 1.0
# No progress for this long ends a job (`autosbp train --stall-timeout`): far beyond one actor
# firing of a model that trains on this machine (milliseconds to seconds), short enough that a
# wedged job does not hold its machine for long. Collectives time out a few seconds later
# (costmodel.launch.COLLECTIVE_MARGIN_S), so the watchdog names the stalled ranks first.
STALL_TIMEOUT_S = 600.0
CHECKPOINT_EVERY = 100  # steps between checkpoints by default (`--checkpoint-every`)


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
    checkpoint_dir: str | None = None  # save the state here (runtime.checkpoint)
    checkpoint_every: int = CHECKPOINT_EVERY  # steps between saves; and after the last step
    resume: bool = False  # continue from the checkpoint in checkpoint_dir, if there is one


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    check: StepCheck | None = None  # with TrainSpec.check, on rank 0: against one device


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


def train(spec: TrainSpec, on_step: Callable[[StepRecord], None] | None = None) -> TrainResult:
    """Run `spec` on `plan.device_count` gloo processes and return rank 0's records (and every
    rank's firings with `spec.trace`)."""
    nproc = Plan.from_json(spec.plan).device_count
    results = run_workers(
        train_worker, nproc, (spec,), timeout_s=spec.stall_timeout_s, job="training"
    )
    records, times, _ = results[0]
    out = tuple(StepRecord(*row) for row in records)
    for record in out:
        if on_step is not None:
            on_step(record)
    events = tuple(Event(*row) for _, _, rows in results for row in rows)
    return TrainResult(out, tuple(times), events)


def train_worker(
    rank: int, world_size: int, spec: TrainSpec
) -> tuple[list[tuple], list[float], list[tuple]]:
    import torch.distributed as dist

    from autosbp.zoo import load_model
    from runtime.engine import Engine
    from runtime.startup import from_rank0

    report_progress("loading the model", grace_s=STARTUP_S)
    model, inputs = load_model(spec.model, spec.model_args)
    inputs = tuple(from_rank0(x) for x in inputs)  # one batch, however the model draws it
    dropout = disable_dropout(model) if spec.check else ()
    plan = Plan.from_json(spec.plan)
    recorder = None
    if spec.trace:
        dist.barrier()  # one origin for every rank (perf_counter is one clock per machine)
        stage = next(s for s, st in enumerate(plan.stages) if rank in st.devices)
        recorder = Recorder(rank, stage)
    progress = _Progress(recorder)
    report_progress("building the engine", grace_s=STARTUP_S)
    engine = Engine(
        model, plan, lambda params: adam(params, spec.lr), example_inputs=inputs, recorder=progress
    )
    first = _resume(engine, spec)
    checker = None
    if spec.check:  # rank 0 compares each step with one device (runtime.check); resumed, the
        # optimizer's restored state is unknown to the reference: its updates go unchecked
        optimizer = (lambda ps: adam(ps, spec.lr)) if first == 0 else None
        checker = StepChecker(engine, model, inputs, optimizer, dropout)
    rows: list[tuple] = []
    times: list[float] = []
    for step in range(first, spec.steps):
        progress.step = step
        report_progress(f"step {step}")
        _inject_fault(rank, step)
        start = time.perf_counter()
        loss = engine.step(inputs)
        times.append(time.perf_counter() - start)
        rows.append((step, loss, checker.after_step(step, inputs, loss) if checker else None))
        _checkpoint(engine, spec, step)
    events = [astuple(e) for e in recorder.events] if recorder is not None else []
    return rows, times, events


class _Progress:
    """The Engine's span hook in a job: each actor firing it starts is this rank's progress and
    activity for the launcher's watchdog (`report_progress`, a few microseconds); with a
    Recorder, firings are recorded too."""

    def __init__(self, recorder: Recorder | None) -> None:
        self.recorder = recorder
        self.step = 0

    def span(
        self, kind: str, micro_batch: int | None = None
    ) -> contextlib.AbstractContextManager[None]:
        of = "" if micro_batch is None else f" of micro-batch {micro_batch}"
        report_progress(f"step {self.step}: {kind}{of}")
        if self.recorder is None:
            return contextlib.nullcontext()
        return self.recorder.span(kind, micro_batch)


def _resume(engine: Any, spec: TrainSpec) -> int:
    """The first step to train: the checkpoint's step count with `resume` and a checkpoint in
    `checkpoint_dir`, else 0 (a collective: every rank looks at the same directory)."""
    from runtime.checkpoint import MANIFEST, load_checkpoint

    if not spec.resume or spec.checkpoint_dir is None:
        return 0
    if not (Path(spec.checkpoint_dir) / MANIFEST).is_file():
        return 0  # the job was stopped before its first checkpoint
    report_progress(f"loading the checkpoint in {spec.checkpoint_dir}", grace_s=STARTUP_S)
    return load_checkpoint(engine, spec.checkpoint_dir).optimizer_step


def _checkpoint(engine: Any, spec: TrainSpec, step: int) -> None:
    """Save after every `checkpoint_every`-th step and after the last one."""
    from runtime.checkpoint import save_checkpoint

    done = step + 1
    if spec.checkpoint_dir is None:
        return
    if done % spec.checkpoint_every == 0 or done == spec.steps:
        report_progress(f"step {step}: saving a checkpoint", grace_s=STARTUP_S)
        save_checkpoint(engine, spec.checkpoint_dir)


def _inject_fault(rank: int, step: int) -> None:
    """Fail here if FAULT_ENV names this rank and step (a testing hook)."""
    value = os.environ.get(FAULT_ENV)
    if not value:
        return
    kinds = "exit, kill, raise, hang or slow"
    try:
        fields = dict(item.split("=", 1) for item in value.split(","))
        (at_rank, at_step), kind = (int(fields["rank"]), int(fields["step"])), fields["kind"]
    except (KeyError, ValueError):
        raise ExecutionError(
            f"{FAULT_ENV}={value!r} is not rank=R,step=S,kind=K (K: {kinds})."
        ) from None
    if kind == "slow" and rank == at_rank and step >= at_step:
        time.sleep(SLOW_STEP_S)  # a slow step, but progress: each step reports
        return
    if (rank, step) != (at_rank, at_step) or kind == "slow":
        return
    if kind == "exit":
        os._exit(1)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "raise":
        raise RuntimeError(f"fault injected by {FAULT_ENV}={value}")
    if kind == "hang":
        while True:  # stuck in its own code: no progress, no collective
            time.sleep(1.0)
    raise ExecutionError(f"{FAULT_ENV}={value!r}: unknown kind {kind!r} ({kinds}).")
