"""`autosbp train MODEL ...`: plan, then train under the plan on N processes (or as one rank
under torchrun).

Lives here: the command's arguments, making or loading the plan (`plan_for`), the checkpoint
arguments against their folder, training with progress and the per-step table (loss beside
single-device training with --check: `train_and_report`, `train_spec`), used by `autosbp demo`
too (`commands.demo`).
Lives elsewhere: the training loop, its watchdog and checkpoints (`runtime.jobs`, imported
lazily: the CLI is the one place autosbp reaches into runtime), what is checked before launch
(`commands.preflight`), planning (`planner`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autosbp.commands import positive_float, positive_int
from autosbp.commands.capture import add_model_arguments
from autosbp.commands.preflight import check_job
from autosbp.commands.profile import FALLBACK_PROFILE, default_profile
from autosbp.errors import ExecutionError, PlanError
from autosbp.plan import Plan, load_plan, replicated_warning
from autosbp.plan.tables import shown
from costmodel.machine import LoadSample, load_average, load_note, usable_cores
from launching.backends import BACKENDS, device_and_backend
from runtime.defaults import CHECKPOINT_EVERY, STALL_TIMEOUT_S
from terminal.progress import activity
from terminal.text import printable

if TYPE_CHECKING:
    from runtime.jobs import TrainSpec

TABLE_ENDS = 20  # a long job's table shows its first and last steps this many each


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    add_model_arguments(parser)
    parser.add_argument(
        "--nproc", type=positive_int,
        help="processes (devices), started here on this machine; under torchrun, its world "
        "(default: torchrun's WORLD_SIZE; required without torchrun)",
    )  # fmt: skip
    parser.add_argument(
        "--plan",
        default="auto",
        help="a plan JSON file, or a strategy planned now: auto (the search), dp, fsdp, "
        "megatron:tp=T,pp=P,dp=D[,mb=M][,ep=E][,cp=C] (default: auto)",
    )
    parser.add_argument(
        "--profile",
        help="profile used when --plan is a strategy (default: with --device cpu, this "
        "machine's, measured the first time and cached; with cuda, cpu-gloo)",
    )  # fmt: skip
    parser.add_argument(
        "--steps", type=positive_int, default=10, help="training steps (default: 10)"
    )
    parser.add_argument(
        "--lr", type=positive_float, default=1e-2, help="Adam's learning rate (default: 0.01)"
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"),
        help="where each rank computes: cpu, or cuda (the GPU of its local rank) (default: cuda "
        "when torch sees a GPU, else cpu)",
    )  # fmt: skip
    parser.add_argument(
        "--backend", choices=BACKENDS,
        help="torch.distributed backend: gloo, or nccl (GPUs only) (default: nccl with --device "
        "cuda, else gloo)",
    )  # fmt: skip
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare every step with one device: loss and gradients against float64 within fp32 "
        "rounding, updates against the same optimizer (runtime/verify/step_check.py)",
    )
    parser.add_argument(
        "--trace", type=Path,
        help="write every rank's actor firings as a Chrome trace (JSON) (default: none)",
    )  # fmt: skip
    parser.add_argument(
        "--stall-timeout", type=positive_float, default=STALL_TIMEOUT_S, metavar="SECONDS",
        help="stop the job when a rank makes no progress (no step, no actor firing) for this "
        f"long; a job that progresses runs as long as it needs (default: {STALL_TIMEOUT_S:g} "
        "s)",
    )  # fmt: skip
    parser.add_argument(
        "--checkpoint-dir", type=Path, metavar="DIR",
        help="save the parameters and optimizer state in DIR every --checkpoint-every steps "
        "and after the last one (a new or empty folder; --resume to continue one) (default: no "
        "checkpoints)",
    )  # fmt: skip
    parser.add_argument(
        "--checkpoint-every", type=positive_int, metavar="N",
        help=f"steps between checkpoints: a killed job loses at most N (default: {CHECKPOINT_EVERY})",
    )  # fmt: skip
    parser.add_argument(
        "--skip-non-finite", action="store_true",
        help="a step whose loss or a gradient is nan or inf makes no update and the job goes on "
        "(its row says skipped), as large-scale trainers do (default: the job stops at that "
        "step, naming it, its checkpoint intact)",
    )  # fmt: skip
    parser.add_argument(
        "--resume", action="store_true",
        help="continue from the checkpoint in --checkpoint-dir up to --steps (from the start if "
        "the job saved none yet)",
    )  # fmt: skip


def run(args: argparse.Namespace, console: Console) -> int:
    if args.meta:
        raise PlanError("`autosbp train` needs real parameters; drop --meta.")
    from launching.torchrun import torchrun_world
    from runtime.jobs import made_on_rank0, torchrun_job

    device, backend = device_and_backend(args.device, args.backend)
    world = torchrun_world()
    if world is None:
        if args.nproc is None:
            raise ExecutionError(
                "--nproc N is needed: the number of processes to start on this machine (or "
                "launch with torchrun, whose world sets it)."
            )
        return _train_command(args, args.nproc, device, backend, console, lambda make: make())
    if args.nproc not in (None, world.world_size):
        raise ExecutionError(
            f"--nproc {args.nproc} contradicts torchrun's world of {world.world_size} processes; "
            "drop --nproc under torchrun (its --nnodes x --nproc-per-node sets the world)."
        )
    quiet = Console(quiet=True)  # rank 0 alone prints: one table, not one per rank
    with torchrun_job(world, backend, args.stall_timeout):
        return _train_command(
            args, world.world_size, device, backend, console if world.rank == 0 else quiet,
            made_on_rank0,
        )  # fmt: skip


def _train_command(
    args: argparse.Namespace,
    nproc: int,
    device: str,
    backend: str,
    console: Console,
    on_rank0: Callable[[Callable[[], Any]], Any],
) -> int:
    """`_train_held`, the checkpoint folder held by this job from before it is looked into
    until the job ends (one live job per folder: `runtime.state.checkpoint_lock`)."""
    if args.checkpoint_dir is None:
        return _train_held(args, nproc, device, backend, console, on_rank0)
    from runtime.state.checkpoint_lock import hold_checkpoint_dir

    with hold_checkpoint_dir(args.checkpoint_dir, on_rank0):
        return _train_held(args, nproc, device, backend, console, on_rank0)


def _train_held(
    args: argparse.Namespace,
    nproc: int,
    device: str,
    backend: str,
    console: Console,
    on_rank0: Callable[[Callable[[], Any]], Any],
) -> int:
    """Make or load the plan (on rank 0 under torchrun: `on_rank0`), then train under it."""
    from autosbp.zoo import parse_model_args
    from runtime.jobs import TrainSpec

    model_args = parse_model_args(args.model_args)
    if args.skip_non_finite and args.check:
        raise ExecutionError(
            "--check compares every step's update with one device, and --skip-non-finite drops "
            "some updates; pass one of them."
        )
    first = _first_step(args.checkpoint_dir, args.checkpoint_every, args.resume, console)
    profile = args.profile or (None if device == "cpu" else FALLBACK_PROFILE)
    plan = on_rank0(lambda: plan_for(args.model, model_args, args.plan, nproc, profile, console))
    if first >= args.steps:
        console.print(
            f"{args.checkpoint_dir} holds {first} trained steps, and --steps is {args.steps}: "
            "nothing left to train (raise --steps to train further).",
            soft_wrap=True,
        )
        return 0
    if first:
        console.print(
            f"resuming from the checkpoint in {args.checkpoint_dir} at step {first}", soft_wrap=True
        )
    spec = TrainSpec(
        args.model, model_args, plan.to_json(), args.steps, lr=args.lr, check=args.check,
        stall_timeout_s=args.stall_timeout,
        checkpoint_dir=None if args.checkpoint_dir is None else str(args.checkpoint_dir),
        checkpoint_every=args.checkpoint_every or CHECKPOINT_EVERY, resume=args.resume,
        backend=backend, device=device, skip_non_finite=args.skip_non_finite,
    )  # fmt: skip
    return train_and_report(spec, plan, console, trace=args.trace)


def train_spec(model: str, model_args: dict, plan: Plan, steps: int, **options: Any) -> TrainSpec:
    """A `runtime.jobs.TrainSpec` (imported here: the CLI reaches into runtime from this module
    only)."""
    from runtime.jobs import TrainSpec

    return TrainSpec(model, model_args, plan.to_json(), steps, **options)


def _first_step(directory: Path | None, every: int | None, resume: bool, console: Console) -> int:
    """The step the job starts from (the checkpoint's with --resume, else 0), or an error
    naming the argument to fix: a checkpoint is never overwritten without --resume, and a
    folder that holds something else is never taken for one."""
    from runtime.state.checkpoint_format import MANIFEST, read_manifest, recover_checkpoint

    if directory is None:
        if resume or every is not None:
            flag = "--resume" if resume else "--checkpoint-every"
            raise ExecutionError(
                f"{flag} needs --checkpoint-dir DIR, the folder the job keeps its checkpoint in."
            )
        return 0
    if recover_checkpoint(directory):
        console.print(
            f"{directory}: a save was killed between its two renames; its last complete "
            f"checkpoint was put back from {directory.name}.old",
            markup=False,
            soft_wrap=True,
        )
    holds = (directory / MANIFEST).is_file()
    if directory.exists() and not holds and (not directory.is_dir() or any(directory.iterdir())):
        raise ExecutionError(
            f"--checkpoint-dir {directory} exists and is not a checkpoint (no {MANIFEST}); "
            "choose a new folder (it is created) or an empty one."
        )
    if not holds:
        return 0  # a new job, or one stopped before its first checkpoint (--resume)
    manifest = read_manifest(directory)
    if not resume:
        raise ExecutionError(
            f"--checkpoint-dir {directory} holds a checkpoint of "
            f"{printable(manifest.model_name)} after {manifest.step} steps; pass "
            "--resume to continue from it, or choose another folder (a job never overwrites "
            "another's checkpoint)."
        )
    return manifest.step


def plan_for(
    model: str,
    model_args: dict,
    plan_arg: str,
    nproc: int,
    profile: str | None,  # None: local CPU work's default (`commands.profile.default_profile`)
    console: Console,
    *,
    compare: bool = False,
    time_limit_s: float = 60.0,
) -> Plan:
    if plan_arg.endswith(".json") or Path(plan_arg).is_file():
        plan = load_plan(plan_arg)  # consistent in itself, or refused
        plan.check_world(nproc)
        with activity(console, f"checking {printable(plan_arg)} against the model") as act:
            act.update(f"capturing {printable(model)} on the meta device")  # seconds, for GPT-3
            check_job(plan, model, model_args, source=f"plan file {plan_arg}")
        return plan
    from autosbp.planner.api import auto_parallelize
    from autosbp.zoo import load_model
    from launching.torchrun import torchrun_world

    profile = default_profile(console, profile, may_measure=torchrun_world() is None)
    what = f"planning {printable(model)} ({printable(plan_arg)}) for {nproc} processes on {profile}"
    with activity(console, what) as act:
        act.update("building the model")
        module, inputs = load_model(model, model_args)
        plan = auto_parallelize(
            module, inputs, profile=profile, devices=nproc, strategy=plan_arg, name=model,
            compare=compare, progress=act.update, time_limit_s=time_limit_s,
        )  # fmt: skip
        act.update("checking the plan against the model")
        check_job(plan, model, model_args, source=f"the {plan_arg} plan")  # is it trainable?
    loud = replicated_warning(plan)
    if loud:
        console.print("[bold red]warning:[/]", escape(printable(loud)))
    return plan


def train_and_report(
    spec: TrainSpec,
    plan: Plan,
    console: Console,
    *,
    trace: Path | None = None,
    timeline: Path | None = None,
) -> int:
    """Train `spec` under `plan`; with `trace`/`timeline`, write the measured firings as a
    Chrome trace and the predicted-vs-measured timeline PNG."""
    import dataclasses

    from autosbp.timeline import draw_timelines, predicted_events, write_chrome_trace
    from launching.torchrun import torchrun_world
    from runtime.jobs import StepProgress, train

    steps, check = spec.steps, spec.check
    world = torchrun_world()
    writes = world is None or world.rank == 0  # under torchrun, rank 0 writes the files
    cores = os.cpu_count() or 1
    if plan.device_count > cores and world is None:
        console.print(
            f"note: {plan.device_count} processes share {cores} CPU cores, so each rank runs on "
            f"about {cores / plan.device_count:.2g} of a core; the plan's profile prices a device "
            "with a core of its own, so expect steps slower than predicted (the plan's choices "
            "stay valid)."
        )
    spec = dataclasses.replace(spec, trace=trace is not None or timeline is not None)
    with activity(console, f"training {steps} steps on {plan.device_count} processes") as act:
        act.update("starting the ranks", total=steps)

        def on_step(done: StepProgress) -> None:
            act.update(
                f"step {done.done}: loss {done.loss:.6f}, {done.step_s * 1e3:.1f} ms/step",
                completed=done.done,
            )

        load_before = load_average()
        result = train(spec, on_step)
    here = plan.device_count if world is None else world.local_world_size
    load = LoadSample(load_before, load_average(), usable_cores(), here)
    if not writes:
        return 0  # under torchrun, rank 0 reports the job (its records hold the checks)
    if trace is not None:
        write_chrome_trace(
            trace, list(result.events), plan_digest=plan.digest(),
            metadata={"strategy": plan.strategy, "load": load.to_json()},
        )  # fmt: skip
        console.print(f"Chrome trace of every firing written to {trace} (open it in Perfetto)")
    if timeline is not None:
        draw_timelines(
            timeline, predicted_events(plan), list(result.events),
            title=printable(f"{spec.model}: {plan.strategy} plan, predicted vs measured (last step)"),
        )  # fmt: skip
        console.print(f"predicted vs measured timeline written to {timeline}")
    table = _step_table(result, spec.model, plan, check)
    console.print(table)
    if (loaded := load_note(load)) is not None:
        console.print(f"note: {loaded}.", soft_wrap=True)
    if check:
        verdict = result.verdict()
        if not verdict.passed:
            raise ExecutionError(verdict.text)
        console.print(verdict.text)
    return 0


def _step_table(result: Any, model: str, plan: Plan, check: bool) -> Table:
    """One row per step (the first and last TABLE_ENDS of a long job): loss, with --check the
    comparison with one device, and the step's time (its slowest rank's). Steps are counted
    from 1, as the progress line counts them ("step 10: loss ..." is the table's row 10)."""
    table = Table(
        title=f"{shown(model)}: {shown(plan.strategy)} plan, mesh "
        f"{'x'.join(map(str, plan.mesh_shape))}"
    )
    for column in ("step", "loss", *(CHECK_COLUMNS if check else ()), "time"):
        table.add_column(column, justify="right")
    if check:
        table.caption = "loss, gradients, buffers, updates: the worst error / bound (runtime/verify/step_check.py)"
    rows = list(zip(result.records, result.step_times_s, strict=True))
    for index, (record, seconds) in enumerate(rows):
        if TABLE_ENDS <= index < len(rows) - TABLE_ENDS:
            if index == TABLE_ENDS:
                table.add_row(
                    f"({len(rows) - 2 * TABLE_ENDS} steps)", *("..." for _ in table.columns[1:])
                )
            continue
        extra = _check_cells(record.check) if check else ()
        loss = f"{record.loss:.6f}" + (" (skipped)" if record.skipped else "")
        table.add_row(str(record.step + 1), loss, *extra, f"{seconds * 1e3:.1f} ms")
    return table


CHECK_COLUMNS = ("one device (float64)", "loss", "gradients", "buffers", "updates")
"""With --check: the reference loss, then per kind the worst error / bound over the step's
tensors (at most 1x passes)."""


def _check_cells(check: Any) -> tuple[str, ...]:
    """A step's --check columns (`runtime.verify.verdict.StepCheck`; rank 0 always has one)."""
    from runtime.verify.verdict import Kind

    ratios = (check.ratio(kind) for kind in (Kind.LOSS, Kind.GRADIENT, Kind.BUFFER, Kind.UPDATE))
    return (
        f"{check.reference_loss:.6f}",
        *("-" if r is None else f"[{'green' if r <= 1 else 'red'}]{r:.2g}x" for r in ratios),
    )
