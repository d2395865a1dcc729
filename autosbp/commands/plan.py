"""`autosbp plan MODEL ...`: find a plan and write it as JSON.

Lives here: the command's arguments and output, and where a plan is written (`default_out`,
`refuse_replacing`: never over another model's or strategy's plan without --force). Lives
elsewhere: the search (`planner`),
the plan format (`plan`), model loading (`zoo`), the model arguments (`commands.capture`: the
model is built on the meta device unless --materialize; planning reads shapes only).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from autosbp.commands import positive_float, positive_int
from autosbp.commands.capture import add_model_arguments, load_from_args
from autosbp.commands.profile import default_profile
from autosbp.errors import AutosbpError, PlanError
from autosbp.plan import (
    Plan,
    hand_plan_table,
    load_plan,
    replicated_warning,
    save_plan,
    summary_table,
)
from autosbp.planner.space.recomputation import partial_blocks
from terminal.progress import activity
from terminal.text import printable

GIB = 2**30


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    add_model_arguments(parser, meta_by_default=True)
    parser.add_argument(
        "--profile",
        help="a shipped profile name (`autosbp profiles`) or a profile JSON path (default: "
        "this machine's, measured the first time and cached; see `autosbp profiles`)",
    )  # fmt: skip
    parser.add_argument(
        "--devices", type=positive_int, required=True, help="number of devices to plan for"
    )
    parser.add_argument(
        "--memory-gib",
        type=positive_float,
        help="memory limit per device (default: the profile's minus 10%%)",
    )
    parser.add_argument(
        "--global-batch",
        type=positive_int,
        help="samples per step: the example inputs are resized to it before capture (default: "
        "their own batch)",
    )
    _add_search_arguments(parser)
    _add_output_arguments(parser)


def _add_search_arguments(parser: argparse.ArgumentParser) -> None:
    """What the search explores and prices: strategy, recomputation, micro-batches, dtype,
    optimizer, and its time and processes."""
    parser.add_argument(
        "--strategy",
        default="auto",
        help="auto (the search; auto:max_vp=V interleaves at most V chunks per device, "
        "default 1: plain 1F1B; auto:zb1 searches the zero-bubble schedule too; both: "
        "auto:max_vp=2,zb1), dp, fsdp or "
        "megatron:tp=T,pp=P,dp=D[,mb=M][,ep=E][,cp=C][,sp=1][,overlap=0|1|K][,vp=V]"
        "[,schedule=zb1][,recompute=MODE] "
        "(M micro-batches; E: expert-parallel degree, experts split over E of the D "
        "data-parallel devices; C: context-parallel degree, the sequence split in attention; V: "
        "model chunks per pipeline stage, interleaved 1F1B, M a multiple of P; sp=1: sequence "
        "parallelism; overlap=1: every row-parallel matmul that can runs in chunks beside its "
        "all-reduce or reduce-scatter, overlap=K in K chunks, overlap=0 never, absent: the "
        "search's choice; schedule=zb1: "
        "zero bubble, ZB-H1, the backward split into input and weight gradients; recompute=MODE: "
        "as --recompute) (default: auto)",
    )
    parser.add_argument(
        "--recompute",
        default="auto",
        type=_recompute_mode,
        help="activation recomputation: none, selective (attention cores), mlp (MLP "
        "activations), full (every block), full:K (the first K blocks of each stage) "
        "(default: auto, the fastest that fits: full:K among them where none does not fit)",
    )
    parser.add_argument(
        "--micro-batches",
        type=positive_int,
        help="micro-batches (gradient-accumulation steps) per batch (default: searched, every "
        "count that divides the batch)",
    )
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        help="training dtype: the model's floating parameters, buffers and inputs are cast to it "
        "before capture, and priced in it (default: the model's own)",
    )
    parser.add_argument(
        "--optimizer",
        default="adam",
        choices=("adam", "sgd", "sgd_momentum"),
        help="its states count in memory and its update in time (default: adam)",
    )
    parser.add_argument(
        "--time-limit-s",
        type=positive_float,
        default=60.0,
        help="the whole search's time limit; past it the best plan so far is returned with the "
        "gap proven so far (default: 60)",
    )
    parser.add_argument(
        "--jobs",
        type=positive_int,
        help="processes the search runs in (default: every core; a space of fewer than 64 "
        "configurations is searched in one)",
    )


def _recompute_mode(text: str) -> str:
    """`--recompute`: auto, a mode of `RECOMPUTE_MODES`, or full:K."""
    if text != "auto":
        try:
            partial_blocks(text)
        except PlanError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """What is shown beside the plan and where it is written."""
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also price the usual hand plans (dp, fsdp, megatron:...) and show them beside",
    )
    parser.add_argument(
        "--out", type=Path,
        help="where to write the plan (default: MODEL-STRATEGY-DEVICES.json, e.g. "
        "gpt-auto-8.json); a file holding another model's or strategy's plan is never replaced "
        "without --force",
    )  # fmt: skip
    parser.add_argument(
        "--force", action="store_true",
        help="replace --out even if it holds something else (default: refuse)",
    )  # fmt: skip


def run(args: argparse.Namespace, console: Console) -> int:
    from autosbp.planner.api import auto_parallelize, in_dtype

    out = args.out or default_out(args.model, args.strategy, args.devices)
    refuse_replacing_early(out, args.devices, force=args.force)  # before a search of minutes
    model, inputs = load_from_args(args)
    if args.dtype is not None:  # the command built the model: it may cast it, real or meta
        inputs = in_dtype(model, inputs, args.dtype, owned=True)
    profile = default_profile(console, args.profile)
    what = f"planning {printable(args.model)} for {args.devices} devices of {printable(profile)}"
    with activity(console, what) as act, time_limit_notes() as notes:
        plan = auto_parallelize(
            model,
            inputs,
            name=args.model,
            micro_batches=args.micro_batches,
            profile=profile,
            devices=args.devices,
            memory_limit=None if args.memory_gib is None else int(args.memory_gib * GIB),
            global_batch=args.global_batch,
            optimizer=args.optimizer,
            dtype=args.dtype,
            strategy=args.strategy,
            recompute=args.recompute,
            time_limit_s=args.time_limit_s,
            progress=act.update,
            compare=args.compare,
            jobs=args.jobs,
        )
    console.print(summary_table(plan))
    print_notes(console, notes, plan)
    if plan.hand_plans:
        console.print(hand_plan_table(plan))
    refuse_replacing(out, plan, force=args.force)
    path = save_plan(plan, out)
    console.print(f"plan written to {path}")
    return 0


@contextlib.contextmanager
def time_limit_notes() -> Iterator[list[str]]:
    """Collect what the planner's `TimeLimitWarning`s say inside the block (for the command to
    print in its own words after the plan); every other warning is shown as usual."""
    from autosbp.planner.search.entry import TimeLimitWarning
    from autosbp.rules import UnknownOpWarning

    notes: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TimeLimitWarning)
        warnings.simplefilter("always", UnknownOpWarning)
        yield notes
    said: set[str] = set()
    for found in caught:
        if issubclass(found.category, TimeLimitWarning):
            notes.append(f"time limit reached: {found.message}")
        elif issubclass(found.category, UnknownOpWarning):
            if str(found.message) not in said:  # once, however many captures said it
                said.add(str(found.message))
                notes.append(f"note: {found.message}")
        else:
            warnings.showwarning(found.message, found.category, found.filename, found.lineno)


def print_notes(console: Console, notes: list[str], plan: Plan | None = None) -> None:
    """The planner's warnings in the command's words (no source line), and, loudly, a plan
    whose FLOPs run replicated for the most part (`replicated_warning`)."""
    for note in notes:
        kind, _, text = note.partition(": ")
        console.print(f"[bold yellow]{kind}:[/]", escape(printable(text)))
    loud = replicated_warning(plan) if plan is not None else None
    if loud:
        console.print("[bold red]warning:[/]", escape(printable(loud)))


def default_out(model: str, strategy: str, devices: int) -> Path:
    """MODEL-STRATEGY-DEVICES.json in this folder: a file's stem for a model file
    (`path/to/m.py:build` -> m), strategies without their punctuation
    (megatron:tp=2,pp=2,dp=2 -> megatron-tp2-pp2-dp2)."""
    stem = Path(model.split(":", 1)[0]).stem if ":" in model else model
    words = re.findall(r"[A-Za-z0-9_.]+", f"{stem} {strategy}".replace("=", ""))
    return Path(f"{'-'.join(words)}-{devices}.json")


def _plan_in(path: Path) -> Plan | None:
    """The plan an existing `path` holds, or None where it holds something else."""
    try:
        return load_plan(path)
    except AutosbpError:
        return None


def refuse_replacing_early(path: Path, devices: int, *, force: bool) -> None:
    """What `refuse_replacing` can tell before the search: `path` holds no plan, or a plan for
    another device count (the model's fingerprint and the strategy are compared after)."""
    if force or not path.exists():
        return
    old = _plan_in(path)
    if old is None:
        holds = "something that is not an autosbp plan"
    else:
        if old.device_count == devices:
            return
        holds = f"a plan of {printable(old.model_name)} for {old.device_count} devices"
    raise PlanError(
        f"{path} exists and holds {holds}; this plan is for {devices} devices. Pass another "
        "--out, or --force to replace it."
    )


def refuse_replacing(path: Path, plan: Plan, *, force: bool) -> None:
    """PlanError when `path` exists and holds anything but a plan of the same model (graph
    fingerprint), strategy and device count, unless `force`: a plan never silently replaces
    another model's or strategy's plan, nor a file that is no plan."""
    if force or not path.exists():
        return
    old = _plan_in(path)
    if old is None:
        holds = "something that is not an autosbp plan"
    else:
        same = (old.fingerprint, old.strategy, old.device_count) == (
            plan.fingerprint, plan.strategy, plan.device_count,
        )  # fmt: skip
        if same:
            return  # the same plan, planned again
        holds = (
            f"the {printable(old.strategy)} plan of {printable(old.model_name)} for "
            f"{old.device_count} devices"
        )
    raise PlanError(
        f"{path} exists and holds {holds}; this is the {printable(plan.strategy)} plan of "
        f"{printable(plan.model_name)} for {plan.device_count} devices. Pass another --out, or "
        "--force to replace it."
    )
