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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autosbp.commands import non_negative_float, non_negative_int, positive_float, positive_int
from autosbp.commands.capture import add_model_arguments
from autosbp.commands.preflight import check_job
from autosbp.commands.profile import FALLBACK_PROFILE, default_profile
from autosbp.errors import DataError, ExecutionError, PlanError
from autosbp.plan import Plan, load_plan, replicated_warning
from autosbp.plan.tables import shown
from costmodel.machine import LoadSample, load_average, load_note, usable_cores
from launching.backends import BACKENDS, device_and_backend
from runtime.defaults import (
    CHECKPOINT_EVERY,
    EVAL_BATCHES,
    OPTIMIZERS,
    SCHEDULES,
    STALL_TIMEOUT_S,
)
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
        "megatron:tp=T,pp=P,dp=D[,mb=M][,ep=E][,cp=C][,sp=1][,overlap=0|1|K] (see autosbp plan "
        "--help) (default: auto)",
    )
    parser.add_argument(
        "--profile",
        help="profile used when --plan is a strategy (default: with --device cpu, this "
        "machine's, measured the first time and cached; with cuda, cpu-gloo)",
    )  # fmt: skip
    parser.add_argument(
        "--steps", type=positive_int, default=10, help="training steps (default: 10)"
    )
    _add_data_arguments(parser)
    _add_recipe_arguments(parser)
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
        help="write every rank's spans (its firings, receives, collectives and update) as a "
        "Chrome trace (JSON) (default: none)",
    )  # fmt: skip
    parser.add_argument(
        "--stall-timeout", type=positive_float, default=STALL_TIMEOUT_S, metavar="SECONDS",
        help="stop the job when a rank makes no progress (no step, no firing) for this "
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
    _add_output_arguments(parser)


def _add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """What the job trains and evaluates on."""
    parser.add_argument(
        "--data", metavar="FILE.py:FUNCTION",
        help="the training data: a function returning a map-style Dataset whose items are "
        "tuples of per-sample tensors (one per model input, in forward's order) or an "
        "iterable of whole global batches; or a built-in data set: stdlib_text (byte tokens "
        "of Python's own source), token_file (default: the model's example inputs at every "
        "step)",
    )  # fmt: skip
    parser.add_argument(
        "--data-args", default="", metavar="K=V,...",
        help="keyword arguments of the data function (e.g. seq=64,split=train) (default: none)",
    )  # fmt: skip
    parser.add_argument(
        "--seed", type=non_negative_int, default=0,
        help="the data's shuffling: a new permutation each epoch from (seed, epoch) (default: 0)",
    )  # fmt: skip
    parser.add_argument(
        "--global-batch", type=positive_int, metavar="N",
        help="samples per step when the plan is made now (default: the example inputs' batch)",
    )  # fmt: skip
    parser.add_argument(
        "--eval-data", metavar="FILE.py:FUNCTION",
        help="held-out data, evaluated without gradients under the same plan (default: none)",
    )  # fmt: skip
    parser.add_argument("--eval-args", default="", metavar="K=V,...",
                        help="keyword arguments of the evaluation data function (default: "
                        "none)")  # fmt: skip
    parser.add_argument(
        "--eval-every", type=non_negative_int, default=0, metavar="N",
        help="evaluate every N steps, and after the last (default: 0, after the last only)",
    )  # fmt: skip
    parser.add_argument(
        "--eval-batches", type=positive_int, default=EVAL_BATCHES, metavar="N",
        help=f"global batches per evaluation, from the start of the set (default: {EVAL_BATCHES})",
    )  # fmt: skip


def _add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """How it trains: precision, optimizer, schedule, clipping."""
    parser.add_argument(
        "--dtype", choices=("fp32", "bf16", "fp16"),
        help="compute dtype of a plan made now: bf16 and fp16 run mixed precision, fp32 "
        "master weights, optimizer states and gradient accumulation (fp16 with dynamic loss "
        "scaling); the model itself is not cast (default: the model's own; a plan file's is "
        "its own)",
    )  # fmt: skip
    parser.add_argument(
        "--reduce-dtype", choices=("fp32", "bf16"),
        help="the dtype gradients are summed in across devices: bf16 halves the sync's bytes "
        "(default: fp32)",
    )  # fmt: skip
    parser.add_argument(
        "--optimizer", choices=OPTIMIZERS,
        help="the optimizer of a plan made now, its states priced in memory (default: adam; a "
        "plan file's is its own)",
    )  # fmt: skip
    parser.add_argument(
        "--lr", type=positive_float, default=1e-2,
        help="peak learning rate (default: 0.01)",
    )  # fmt: skip
    parser.add_argument(
        "--weight-decay", type=non_negative_float, default=0.0,
        help="adamw's decoupled weight decay, on parameters of 2 or more dimensions only (no "
        "decay on biases and norm weights) (default: 0)",
    )  # fmt: skip
    parser.add_argument(
        "--lr-schedule", choices=SCHEDULES, default="constant",
        help="after warmup: constant; linear or cosine down to --min-lr at the last step; wsd "
        "(warmup-stable-decay: flat, then linear to --min-lr over the last 20%% of the steps) "
        "(default: constant)",
    )  # fmt: skip
    parser.add_argument(
        "--warmup-steps", type=non_negative_int, default=0, metavar="N",
        help="steps over which the learning rate rises linearly to --lr (default: 0)",
    )  # fmt: skip
    parser.add_argument(
        "--min-lr", type=non_negative_float, default=0.0,
        help="the learning rate linear, cosine and wsd decay to (default: 0)",
    )  # fmt: skip
    parser.add_argument(
        "--clip-grad-norm", type=positive_float, metavar="C",
        help="scale the gradients so their global 2-norm (over every parallel dimension: "
        "tensor shards, stages, ZeRO shards, experts) is at most C; the plan prices it "
        "(default: no clipping)",
    )  # fmt: skip


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """What the job writes beside its table."""
    parser.add_argument(
        "--metrics", type=Path, metavar="FILE.jsonl",
        help="per step: loss, lr, grad_norm, samples/s, tokens/s, mfu, peak memory, data "
        "share; per evaluation: eval_loss; one JSON object a line (default: none)",
    )  # fmt: skip
    parser.add_argument(
        "--tensorboard", type=Path, metavar="DIR",
        help="the same metrics as TensorBoard scalars (needs the tensorboard package) "
        "(default: none)",
    )  # fmt: skip
    parser.add_argument(
        "--save-model", type=Path, metavar="PATH",
        help="after the last step, the whole state dict under the model's own names, for "
        "load_state_dict(strict=True) in plain PyTorch (.safetensors or .pt) (default: none)",
    )  # fmt: skip
    parser.add_argument(
        "--save-dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
        help="dtype of --save-model's floating tensors (default: fp32, the masters')",
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
    data_args = parse_model_args(args.data_args, "--data-args", DataError)
    eval_args = parse_model_args(args.eval_args, "--eval-args", DataError)
    _check_outputs(args)
    if args.skip_non_finite and args.check:
        raise ExecutionError(
            "--check compares every step's update with one device, and --skip-non-finite drops "
            "some updates; pass one of them."
        )
    first = _first_step(args.checkpoint_dir, args.checkpoint_every, args.resume, console)
    profile = args.profile or (None if device == "cpu" else FALLBACK_PROFILE)
    recipe = Recipe(args.dtype, args.reduce_dtype, args.optimizer, args.clip_grad_norm,
                    args.global_batch)  # fmt: skip
    plan = on_rank0(
        lambda: plan_for(args.model, model_args, args.plan, nproc, profile, console, recipe=recipe)
    )
    _check_data(args, plan, data_args, eval_args, model_args)
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
        data=args.data, data_args=data_args, seed=args.seed, eval_data=args.eval_data,
        eval_args=eval_args, eval_every=args.eval_every, eval_batches=args.eval_batches,
        weight_decay=args.weight_decay, lr_schedule=args.lr_schedule,
        warmup_steps=args.warmup_steps, min_lr=args.min_lr, clip_grad_norm=args.clip_grad_norm,
        profile=profile, save_model=_text(args.save_model), save_dtype=args.save_dtype,
        metrics=_text(args.metrics), tensorboard=_text(args.tensorboard),
    )  # fmt: skip
    return train_and_report(spec, plan, console, trace=args.trace)


def _check_outputs(args: argparse.Namespace) -> None:
    """What the job writes, refused before planning when it cannot be written."""
    if args.tensorboard is not None:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise ExecutionError(
                "--tensorboard needs the tensorboard package; install it with `pip install "
                "'autosbp[tensorboard]'` (or `pip install tensorboard`), or use --metrics "
                "FILE.jsonl."
            )
    if args.save_model is not None:
        from runtime.state.export import check_model_path

        check_model_path(args.save_model, args.save_dtype)


def _check_data(
    args: argparse.Namespace, plan: Plan, data_args: dict, eval_args: dict, model_args: dict
) -> None:
    """The data sets, read here before any process starts: each must call, return a data set
    (or an iterable of batches) whose items match the model's example inputs, and hold at
    least one global batch of the plan (`runtime.data` says what is wrong, naming the
    function). Every rank loads them again."""
    if args.data is None and args.eval_data is None:
        return
    from autosbp.plan.values import DTYPES
    from autosbp.zoo import load_model
    from runtime.data import BatchLayout, EvalLoader, RankLoader, input_specs, load_data

    _, example = load_model(args.model, model_args, device="meta")
    specs = input_specs(example, compute_dtype=DTYPES[plan.dtype])
    layout = BatchLayout.whole(plan.global_batch, specs, plan.micro_batches)
    if args.data is not None:
        RankLoader(load_data(args.data, data_args), layout, seed=args.seed)
    if args.eval_data is not None:
        data = load_data(args.eval_data, eval_args, flag="--eval-data", args_flag="--eval-args")
        EvalLoader(data, layout)


def _text(path: Path | None) -> str | None:
    return None if path is None else str(path)


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


@dataclass(frozen=True, slots=True)
class Recipe:
    """What the command line asks of a plan's recipe (None: the default for a plan made now,
    and whatever a plan file says)."""

    dtype: str | None = None
    reduce_dtype: str | None = None
    optimizer: str | None = None
    clip_grad_norm: float | None = None
    global_batch: int | None = None

    def check(self, plan: Plan, source: str) -> None:
        """A plan file made for another recipe is refused, naming what differs."""
        asked = {
            "--dtype": (self.dtype, plan.dtype),
            "--reduce-dtype": (self.reduce_dtype, plan.reduce_dtype),
            "--optimizer": (self.optimizer, plan.optimizer),
            "--global-batch": (self.global_batch, plan.global_batch),
        }
        for flag, (want, has) in asked.items():
            if want is not None and want != has:
                raise PlanError(
                    f"{source} was made for {flag} {has}, but this job asks for {flag} {want}; "
                    f"drop {flag} to train as the plan was priced, or make a plan with "
                    f"`autosbp plan ... {flag} {want}`."
                )
        if (self.clip_grad_norm is not None) != plan.clips_gradients:
            made = "with" if plan.clips_gradients else "without"
            raise PlanError(
                f"{source} was priced {made} gradient clipping; "
                + (
                    "pass --clip-grad-norm C as well, or make the plan without it."
                    if plan.clips_gradients
                    else "make a plan with `autosbp plan ... --clip-grad-norm`, or train without "
                    "--clip-grad-norm."
                )
            )


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
    recipe: Recipe = Recipe(),
) -> Plan:
    if plan_arg.endswith(".json") or Path(plan_arg).is_file():
        plan = load_plan(plan_arg)  # consistent in itself, or refused
        plan.check_world(nproc)
        recipe.check(plan, f"plan file {plan_arg}")
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
            dtype=recipe.dtype, reduce_dtype=recipe.reduce_dtype or "fp32",
            optimizer=recipe.optimizer or "adam", clip_grad_norm=recipe.clip_grad_norm,
            global_batch=recipe.global_batch,
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
    curves: Path | None = None,
) -> int:
    """Train `spec` under `plan`; with `trace`/`timeline`, write the measured firings as a
    Chrome trace and the predicted-vs-measured timeline PNG; with `curves` (a job with a data
    set), run the same recipe as a plain PyTorch loop on this process and draw both runs'
    losses in one PNG."""
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
            said = f"step {done.done}: loss {done.loss:.6f}"
            if done.eval_loss is not None:
                said += f", eval loss {done.eval_loss:.6f}"
            if done.tokens_per_s is not None:
                said += f", {done.tokens_per_s:,.0f} tokens/s"
            act.update(f"{said}, {done.step_s * 1e3:.1f} ms/step", completed=done.done)

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
    over = max((r.mfu for r in result.rows if r.mfu is not None), default=0.0)
    if over > 1.0:  # a peak below the rate measured: the MFU column would mislead
        console.print(
            f"note: MFU reads up to {over:.0%}: the profile ({printable(spec.profile or plan.profile)}) "
            f"states a {plan.dtype} peak below the rate this job ran at, so the column is not a "
            "share of the hardware's peak; measure this machine (`autosbp profile --refresh`) or "
            "read tokens/s.",
            soft_wrap=True,
        )
    if curves is not None:
        _beside_plain(spec, plan, result, curves, console)
    if (loaded := load_note(load)) is not None:
        console.print(f"note: {loaded}.", soft_wrap=True)
    if check:
        verdict = result.verdict()
        if not verdict.passed:
            raise ExecutionError(verdict.text)
        console.print(verdict.text)
    return 0


def _beside_plain(spec: TrainSpec, plan: Plan, result: Any, path: Path, console: Console) -> None:
    """The same recipe as a plain fp32 PyTorch loop on this process, its curve beside the
    job's (`runtime.verify.plain_loop`), the two compared in one line."""
    from autosbp.timeline.curves import Curve, draw_curves
    from runtime.verify.plain_loop import plain_losses

    with activity(
        console, f"the same {spec.steps} steps as a plain PyTorch loop (fp32, one process)"
    ):
        plain = plain_losses(spec, plan.global_batch, plan.optimizer)
    job = Curve(
        f"autosbp, {plan.strategy} plan on {plan.device_count} processes, {plan.dtype}",
        [r.loss for r in result.records], [(e.step, e.eval_loss) for e in result.evals],
    )  # fmt: skip
    draw_curves(path, [job, Curve("plain PyTorch loop, fp32", plain.losses, plain.evals)],
                title=f"{shown(spec.model)} on {spec.data}: loss per step")  # fmt: skip
    if result.evals and plain.evals:
        ours, theirs = result.evals[-1].eval_loss, plain.evals[-1][1]
        console.print(
            f"held-out loss after {spec.steps} steps: {ours:.4f} (autosbp) vs {theirs:.4f} "
            f"(plain PyTorch), {ours / theirs:.3f}x; curves written to {path}",
            soft_wrap=True,
        )


def _step_table(result: Any, model: str, plan: Plan, check: bool) -> Table:
    """One row per step (the first and last TABLE_ENDS of a long job): loss, learning rate,
    gradient norm (before clipping), tokens/s (samples/s for a model without token ids), MFU,
    with --check the comparison with one device, and the step's time (its slowest rank's);
    evaluations on rows of their own. Steps are counted from 1, as the progress line counts
    them ("step 10: loss ..." is the table's row 10)."""
    table = Table(
        title=f"{shown(model)}: {shown(plan.strategy)} plan, mesh "
        f"{'x'.join(map(str, plan.mesh_shape))}, {plan.dtype}"
    )
    metered = len(result.rows) == len(result.records)
    tokens = metered and any(r.tokens_per_s is not None for r in result.rows)
    rate = ("tokens/s" if tokens else "samples/s") if metered else None
    metrics = ("lr", "grad norm", rate, "MFU") if rate else ()
    for column in ("step", "loss", *metrics, *(CHECK_COLUMNS if check else ()), "time"):
        table.add_column(column, justify="right")
    if check:
        table.caption = "loss, gradients, buffers, updates: the worst error / bound (runtime/verify/step_check.py)"
    evals = {row.step: row for row in result.evals}
    rows = list(zip(result.records, result.step_times_s, strict=True))
    for index, (record, seconds) in enumerate(rows):
        if TABLE_ENDS <= index < len(rows) - TABLE_ENDS:
            if index == TABLE_ENDS:
                table.add_row(
                    f"({len(rows) - 2 * TABLE_ENDS} steps)", *("..." for _ in table.columns[1:])
                )
            continue
        loss = f"{record.loss:.6f}" + (" (skipped)" if record.skipped else "")
        cells = _metric_cells(result.rows[index], tokens) if metrics else ()
        extra = _check_cells(record.check) if check else ()
        table.add_row(str(record.step + 1), loss, *cells, *extra, f"{seconds * 1e3:.1f} ms")
        if (found := evals.get(record.step + 1)) is not None:
            blank = ("",) * (len(table.columns) - 2)
            table.add_row("[bold]eval[/]", f"[bold]{found.eval_loss:.6f}[/]", *blank)
    return table


def _metric_cells(row: Any, tokens: bool) -> tuple[str, ...]:
    """A step's metrics columns (`runtime.metrics.StepRow`)."""
    rate = row.tokens_per_s if tokens else row.samples_per_s
    mfu = "-" if row.mfu is None else f"{row.mfu:.1%}"
    return (f"{row.lr:.3g}", f"{row.grad_norm:.3g}", f"{rate:,.0f}", mfu)


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
