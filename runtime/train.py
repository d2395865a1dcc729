"""Train a model under a plan on N local processes, optionally checked against one device.

Lives here: `TrainSpec` (what to train: a model spec the workers can rebuild, a plan, steps),
`train_worker` (one rank: an Engine and, with `check`, a `StepChecker` that compares every step
with one device on rank 0), `train` (launch, collect, one row per step). Used by `autosbp train`
and `autosbp demo`. Lives elsewhere: the engine (`runtime.engine`), the launcher
(`costmodel.launch`), model loading (`autosbp.zoo`), the check (`runtime.check`).

The batch is the model's example inputs at every step (the demo's task is to fit them), so the
single-device reference sees exactly what the plan sees; parameters start from the same seed.
A testing hook, `FAULT_ENV`, makes one rank fail at one step (tests/test_failures.py).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import astuple, dataclass, field
from typing import Any

import torch

from autosbp.errors import ExecutionError
from autosbp.plan import Plan
from autosbp.timeline import Event
from costmodel.launch import run_workers
from runtime.check import StepChecker, disable_dropout
from runtime.check_report import StepCheck, Verdict, judge

FAULT_ENV = "AUTOSBP_FAULT"
"""Testing hook: "rank=R,step=S,kind=K" makes rank R fail just before its step S (0-based) by K:
`exit` (os._exit(1)), `kill` (SIGKILL to itself) or `raise` (a RuntimeError). Tests use it to
check that one failed rank stops the whole job with a message naming it."""


@dataclass(frozen=True)
class TrainSpec:
    model: str
    model_args: dict[str, Any]
    plan: dict[str, Any]  # Plan.to_json(): plain data crosses process boundaries
    steps: int
    lr: float = 1e-2
    check: bool = False
    timeout_s: float = 300.0
    trace: bool = False  # record every actor firing of every rank (TrainResult.events)


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
    results = run_workers(train_worker, nproc, (spec,), timeout_s=spec.timeout_s, job="training")
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
    import time

    import torch.distributed as dist

    from autosbp.timeline import Recorder
    from autosbp.zoo import load_model
    from runtime.engine import Engine

    model, inputs = load_model(spec.model, spec.model_args)
    dropout = disable_dropout(model) if spec.check else ()
    plan = Plan.from_json(spec.plan)
    recorder = None
    if spec.trace:
        dist.barrier()  # one origin for every rank (perf_counter is one clock per machine)
        stage = next(s for s, st in enumerate(plan.stages) if rank in st.devices)
        recorder = Recorder(rank, stage)
    engine = Engine(
        model, plan, lambda params: adam(params, spec.lr), example_inputs=inputs, recorder=recorder
    )
    checker = None
    if spec.check:  # rank 0 compares each step with one device (runtime.check)
        checker = StepChecker(engine, model, inputs, lambda ps: adam(ps, spec.lr), dropout)
    rows: list[tuple] = []
    times: list[float] = []
    for step in range(spec.steps):
        _inject_fault(rank, step)
        start = time.perf_counter()
        loss = engine.step(inputs)
        times.append(time.perf_counter() - start)
        rows.append((step, loss, checker.after_step(step, inputs, loss) if checker else None))
    events = [astuple(e) for e in recorder.events] if recorder is not None else []
    return rows, times, events


def _inject_fault(rank: int, step: int) -> None:
    """Fail here if FAULT_ENV names this rank and step (a testing hook)."""
    value = os.environ.get(FAULT_ENV)
    if not value:
        return
    try:
        fields = dict(item.split("=", 1) for item in value.split(","))
        at, kind = (int(fields["rank"]), int(fields["step"])), fields["kind"]
    except (KeyError, ValueError):
        raise ExecutionError(
            f"{FAULT_ENV}={value!r} is not rank=R,step=S,kind=K (K: exit, kill or raise)."
        ) from None
    if (rank, step) != at:
        return
    if kind == "exit":
        os._exit(1)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "raise":
        raise RuntimeError(f"fault injected by {FAULT_ENV}={value}")
    raise ExecutionError(f"{FAULT_ENV}={value!r}: unknown kind {kind!r} (exit, kill or raise).")
