"""One rank of a training job: its engine, its data, the steps, evaluation, metrics,
checkpoints and the trained model written out.

Lives here: `train_worker` (the loop: each step's learning rate, this rank's pieces of the
batch, the engine's step, the check against one device, a checkpoint, the step's metrics
gathered from every rank; evaluations every `eval_every` steps and after the last; the model
out) and `RankResult` (what a rank hands back). Lives elsewhere: what the job is (`runtime.job_spec`:
`TrainSpec`; `runtime.jobs`: launching the ranks, the results), the engine (`runtime.engine`), the data
(`runtime.data`), the optimizer and schedule (`runtime.optim`), the rows (`runtime.metrics`),
checkpoints (`runtime.state.checkpoint`), writing a model (`runtime.state.export`).

Invariants:
- Every rank runs the same collectives in the same order: the step, the check, the save, one
  all-reduce of the step's measurements (time, loading time, peak memory: each rank's
  largest), the evaluations.
- The data's order depends on the seed and the samples consumed only (`runtime.data`), and the
  learning rate on the step only (`runtime.optim.LrSchedule`): a resumed job (the loader's
  state, the loss scale and the step from the checkpoint) trains on exactly the batches, at
  exactly the rates, the uninterrupted one would.
- Without a data set, the batch is the model's example inputs at every step, rank 0's on
  every rank (the demo's task of old: fit them).
- With `check`, every rank loads the whole global batch (rank 0's reference needs it).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import astuple, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from autosbp.errors import ExecutionError, NonFiniteError
from autosbp.plan import Plan
from autosbp.timeline import Recorder
from launching.workers import STARTUP_S, report_progress
from runtime.metrics import EvalRow, MetricsSink, StepRow, Throughput, peak_memory_bytes
from runtime.optim import LrSchedule, OptimizerRecipe
from runtime.parallel.precision import LossScale
from runtime.verify.faults import inject_fault
from runtime.verify.finite import NonFinite
from runtime.verify.one_device import disable_dropout
from runtime.verify.step_check import StepChecker

if TYPE_CHECKING:
    from runtime.data import EvalLoader, RankLoader
    from runtime.engine import Engine
    from runtime.job_spec import TrainSpec

__all__ = ["RankResult", "train_worker"]

# report_progress(done=...) values of a step (the launcher carries them to `train`'s on_step)
DONE_FIELDS = ("done", "loss", "step_s", "lr", "grad_norm", "tokens_per_s", "mfu", "eval_loss")


@dataclass
class RankResult:
    """What a rank hands back: per step (step, loss, check, skipped), each step's time (the
    slowest rank's), its firings (with `trace`), and on rank 0 the metrics rows."""

    records: list[tuple] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    events: list[tuple] = field(default_factory=list)
    rows: list[StepRow] = field(default_factory=list)
    evals: list[EvalRow] = field(default_factory=list)


def train_worker(
    rank: int,
    world_size: int,
    spec: TrainSpec,
    on_step: Callable[[tuple[float, ...]], None] | None = None,
) -> RankResult:
    """One rank of the job. Every finished step is reported to the launcher
    (`report_progress(done=...)`, the values of DONE_FIELDS) and handed to `on_step`."""
    job = _Job.build(rank, spec)
    result = RankResult()
    with _sink(rank, spec, append=job.first > 0) as sink:
        for step in range(job.first, spec.steps):
            _train_step(job, step, world_size, result, sink, on_step)
    job.write_model()
    recorder = job.progress.recorder
    result.events = [astuple(e) for e in recorder.events] if recorder is not None else []
    return result


def _train_step(
    job: _Job,
    step: int,
    world_size: int,
    result: RankResult,
    sink: MetricsSink | None,
    on_step: Callable[[tuple[float, ...]], None] | None,
) -> None:
    """One step of the loop: learning rate, batch, step, check, checkpoint, measurements,
    evaluation, and the step reported."""
    spec, rank = job.spec, dist.get_rank()
    job.progress.step = step
    report_progress(f"step {step}")
    inject_fault(rank, step)
    lr = job.schedule.apply(job.engine.optimizer, step)
    batch, load_s = job.next_batch()
    start = time.perf_counter()
    skipped = job.engine.skipped_steps
    loss = _step(job, spec, step, batch)
    took_s = time.perf_counter() - start
    check = job.checker.after_step(step, batch, loss) if job.checker else None
    job.save(step)
    step_s, load_s, peak = _slowest(took_s, load_s, peak_memory_bytes(job.device))
    was_skipped = job.engine.skipped_steps > skipped
    row = job.throughput.row(
        step=step + 1, loss=loss, lr=lr, grad_norm=job.engine.grad_norm, step_s=step_s,
        load_s=load_s, peak_bytes=peak, peak_flops=job.peak_flops,
        devices=world_size, skipped=was_skipped,
    )  # fmt: skip
    eval_row = job.evaluate(step)
    result.records.append((step, loss, check, was_skipped))
    result.times.append(step_s)
    result.rows.append(row)
    if eval_row is not None:
        result.evals.append(eval_row)
    values = (
        step + 1, loss, step_s, lr, row.grad_norm, _nan(row.tokens_per_s), _nan(row.mfu),
        _nan(eval_row.eval_loss if eval_row else None),
    )  # fmt: skip
    report_progress(f"step {step} done", done=values)
    if sink is not None:
        sink.write(row)
        if eval_row is not None:
            sink.write(eval_row)
    if on_step is not None:
        on_step(values)


@contextlib.contextmanager
def _sink(rank: int, spec: TrainSpec, *, append: bool) -> Iterator[MetricsSink | None]:
    """Rank 0's metrics file and TensorBoard writer, where asked (a resumed job appends)."""
    if rank != 0 or (spec.metrics is None and spec.tensorboard is None):
        yield None
        return
    from pathlib import Path

    sink = MetricsSink(
        Path(spec.metrics) if spec.metrics else None,
        Path(spec.tensorboard) if spec.tensorboard else None,
        append=append,
    )
    try:
        yield sink
    finally:
        sink.close()


@dataclass
class _Job:
    """What one rank trains with."""

    spec: TrainSpec
    engine: Engine
    device: torch.device
    inputs: tuple[torch.Tensor, ...]
    schedule: LrSchedule
    throughput: Throughput
    peak_flops: float | None
    progress: _Progress
    first: int
    model: torch.nn.Module
    loader: RankLoader | None = None
    eval_loader: EvalLoader | None = None
    checker: StepChecker | None = None

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
        progress = _Progress(_recorder(rank, plan) if spec.trace else None)
        report_progress("building the engine", grace_s=STARTUP_S)
        recipe = OptimizerRecipe(plan.optimizer, spec.lr, spec.weight_decay)
        engine = Engine(
            model, plan, recipe, example_inputs=inputs, recorder=progress,
            non_finite=NonFinite.SKIP if spec.skip_non_finite else NonFinite.STOP,
            clip_grad_norm=spec.clip_grad_norm,
        )  # fmt: skip
        job = cls(
            spec, engine, device, inputs,
            LrSchedule(spec.lr, spec.steps, spec.lr_schedule, spec.warmup_steps, spec.min_lr),
            Throughput.of(engine.graph, plan.micro_batches, plan.global_batch),
            _peak_flops(plan, spec.profile), progress, 0, model,
        )  # fmt: skip
        extra = job.resume()
        job.open_data(extra.get("data"))
        if spec.check:  # rank 0 compares each step with one device (runtime.verify.step_check);
            # resumed, the optimizer's restored state is unknown to the reference: updates
            # go unchecked
            optimizer = recipe if job.first == 0 else None
            job.checker = StepChecker(engine, model, inputs, optimizer, dropout)
        return job

    # ---- data
    def open_data(self, state: dict[str, Any] | None) -> None:
        """The loaders of the job's data sets (every rank opens them: a bad one is refused
        everywhere alike), the training one where the checkpoint left it."""
        from runtime.data import BatchLayout, EvalLoader, RankLoader, load_data

        spec = self.spec
        layout = self.engine.batch_layout()
        if spec.check:  # the reference needs the whole batch on rank 0: every rank reads it
            layout = BatchLayout.whole(layout.global_batch, layout.inputs, layout.micro_batches)
        if spec.data is not None:
            report_progress("opening the data set", grace_s=STARTUP_S)
            data = load_data(spec.data, spec.data_args)
            self.loader = RankLoader(data, layout, seed=spec.seed, state=state, device=self.device)
        if spec.eval_data is not None:
            report_progress("opening the evaluation data set", grace_s=STARTUP_S)
            data = load_data(spec.eval_data, spec.eval_args, flag="--eval-data",
                             args_flag="--eval-args")  # fmt: skip
            self.eval_loader = EvalLoader(data, self.engine.batch_layout(), device=self.device)

    def next_batch(self) -> tuple[Any, float]:
        """This step's batch (this rank's pieces; with `check`, the whole batch) and the
        seconds it took to load."""
        if self.loader is None:
            return self.inputs, 0.0
        pieces, info = next(self.loader)
        if self.spec.check:  # whole micro-batches: one global batch, as step() takes it
            batch = tuple(torch.cat([_tensor(p[i]) for p in pieces]) for i in range(len(pieces[0])))
            return batch, info.load_s
        return pieces, info.load_s

    # ---- evaluation
    def evaluate(self, step: int) -> EvalRow | None:
        """The mean loss over up to `eval_batches` evaluation batches, every `eval_every`
        steps and after the last (None when not due, or without evaluation data)."""
        spec, done = self.spec, step + 1
        if self.eval_loader is None:
            return None
        if done != spec.steps and not (spec.eval_every and done % spec.eval_every == 0):
            return None
        start = time.perf_counter()
        losses: list[float] = []
        for pieces, _ in self.eval_loader:
            report_progress(f"step {step}: evaluating batch {len(losses)}")
            losses.append(self.engine.evaluate(pieces))
            if spec.eval_batches is not None and len(losses) == spec.eval_batches:
                break
        mean = sum(losses) / len(losses)
        if not torch.isfinite(torch.tensor(mean)):
            raise ExecutionError(
                f"evaluation after step {done}: the loss over {len(losses)} batches of "
                f"{spec.eval_data} is {mean}, not finite; the model diverged (a lower --lr, "
                "--clip-grad-norm 1.0, warmup) or the evaluation data holds values the model "
                "cannot take."
            )
        return EvalRow(done, mean, len(losses), time.perf_counter() - start)

    # ---- checkpoints and the model out
    def resume(self) -> dict[str, Any]:
        """The first step to train and the checkpoint's job state (the data position, the
        loss scale): the checkpoint's with `resume` and one in `checkpoint_dir`, else
        nothing (a collective: every rank looks at the same directory)."""
        from pathlib import Path

        from runtime.state.checkpoint import MANIFEST, load_checkpoint
        from runtime.state.checkpoint_format import recover_checkpoint

        spec = self.spec
        if not spec.resume or spec.checkpoint_dir is None:
            return {}
        recover_checkpoint(spec.checkpoint_dir)  # a save killed between its renames
        if not (Path(spec.checkpoint_dir) / MANIFEST).is_file():
            return {}  # the job was stopped before its first checkpoint
        report_progress(f"loading the checkpoint in {spec.checkpoint_dir}", grace_s=STARTUP_S)
        manifest = load_checkpoint(self.engine, spec.checkpoint_dir)
        extra = dict(manifest.extra)
        self.first = manifest.step
        older = manifest.loss_scale is None and "loss_scale" in extra  # the trainer's own, once
        if older and self.engine.loss_scale is not None:
            self.engine.loss_scale = LossScale.from_state(extra["loss_scale"])
        return extra

    def save(self, step: int) -> None:
        """A checkpoint after every `checkpoint_every`-th step and after the last one, with the
        job's own state beside the engine's."""
        from runtime.state.checkpoint import save_checkpoint

        spec, done = self.spec, step + 1
        if spec.checkpoint_dir is None:
            return
        if done % spec.checkpoint_every and done != spec.steps:
            return
        report_progress(f"step {step}: saving a checkpoint", grace_s=STARTUP_S)
        extra: dict[str, Any] = {  # what `autosbp export` writes the model out with
            "model_keys": list(self.model.state_dict()),
            "tied": dict(self.engine.shards.tied),
        }
        if self.loader is not None:
            extra["data"] = self.loader.state()
        save_checkpoint(self.engine, spec.checkpoint_dir, step=done, extra=extra)

    def write_model(self) -> None:
        """With `save_model`: the whole state dict under the model's own names, written by
        rank 0 (a collective: every rank assembles)."""
        from runtime.state.export import model_state, write_model

        if self.spec.save_model is None:
            return
        report_progress("writing the model", grace_s=STARTUP_S)
        state = model_state(self.engine.full_state_dict(), self.model)
        if dist.get_rank() == 0:
            write_model(state, self.spec.save_model, self.spec.save_dtype)


def _step(job: _Job, spec: TrainSpec, step: int, batch: Any) -> float:
    """One step of the engine; a nan or inf stops the job here, naming the step (counted from
    1, as the table) and what is left (the checkpoint saved before it is never touched: no
    save follows)."""
    try:
        return float(job.engine.step(batch))
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
        raise ExecutionError(
            f"step {step + 1}: {exc.what}, so the job stopped before that step's update (the "
            f"parameters are those the step began with).{saved} Fix the cause (a lower --lr, "
            "--clip-grad-norm, warmup, the data, an op that overflows in its dtype), or pass "
            "--skip-non-finite to skip such steps' updates as large-scale trainers do."
        ) from None


def _slowest(took_s: float, load_s: float, peak: int) -> tuple[float, float, int]:
    """Each of a step's measurements at its largest over the ranks (one all-reduce; a CPU
    tensor: gloo carries it for either backend). The others wait here for rank 0's check."""
    value = torch.tensor([took_s, load_s, float(peak)], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value[0]), float(value[1]), int(value[2])


def _peak_flops(plan: Plan, profile: str | None) -> float | None:
    """The peak FLOP/s in the plan's dtype of `profile` (the job's), else of the plan's own
    profile by name; None where neither can be read (MFU then goes unreported)."""
    from costmodel import load_profile
    from costmodel.errors import ProfileError

    try:
        peaks = load_profile(profile or plan.profile).device.peak_flops
    except ProfileError:  # a profile cached on another machine: no peak to divide by
        return None
    return float(getattr(peaks, plan.dtype).base)


def _tensor(piece: torch.Tensor | None) -> torch.Tensor:
    assert piece is not None, "a whole layout reads every input"
    return piece


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def _recorder(rank: int, plan: Plan) -> Recorder:
    dist.barrier()  # one origin for every rank (perf_counter is one clock per machine)
    stage = next(s for s, st in enumerate(plan.stages) if rank in st.devices)
    return Recorder(rank, stage)


def _device(kind: str) -> torch.device:
    """Where this rank's tensors live: the CPU, or the GPU of its local rank (torchrun's
    LOCAL_RANK; a spawned job's ranks are all local)."""
    import os

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


class _Progress:
    """The Engine's span hook in a job: each span it starts is this rank's progress and
    activity for the launcher's watchdog (`report_progress`, a few microseconds); with a
    Recorder, the spans are recorded too."""

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
