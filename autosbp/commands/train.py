"""`autosbp train MODEL ...` and `autosbp demo`: plan, then train under the plan on N processes.

Lives here: the two commands' arguments, making or loading the plan, and the per-step table
(loss beside single-device training with --check). Lives elsewhere: the training loop
(`runtime.train`, imported lazily: the CLI is the one place autosbp reaches into runtime),
planning (`planner`).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from autosbp.commands import positive_int
from autosbp.commands.capture import add_model_arguments
from autosbp.errors import ExecutionError, PlanError
from autosbp.plan import Plan, format_bytes, format_seconds

DEMO_MODEL = ("gpt", {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq": 16, "batch": 8})


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    if name == "demo":
        parser.add_argument(
            "--out", default="autosbp-out", help="folder for the plan (default: autosbp-out)"
        )
        parser.add_argument(
            "--nproc", type=positive_int, default=4, help="CPU processes (default: 4)"
        )
        parser.add_argument("--steps", type=positive_int, default=20)
        parser.add_argument(
            "--gpt3-layers", type=positive_int, default=96,
            help="depth of the GPT-3 175B planned in part 3 (default: 96, the real model)",
        )  # fmt: skip
        return
    add_model_arguments(parser)
    parser.add_argument(
        "--nproc", type=positive_int, required=True, help="number of processes (devices)"
    )
    parser.add_argument(
        "--plan",
        default="auto",
        help="a plan JSON file, or a strategy: auto, dp, fsdp, megatron:tp=T,pp=P,dp=D[,mb=M]",
    )
    parser.add_argument(
        "--profile", default="cpu-gloo", help="profile used when --plan is a strategy"
    )
    parser.add_argument("--steps", type=positive_int, default=10)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare every step with one device: loss and gradients against float64 within fp32 "
        "rounding, updates against the same optimizer (runtime/check.py)",
    )
    parser.add_argument(
        "--trace", type=Path, help="write every rank's actor firings as a Chrome trace (JSON)"
    )


def run(args: argparse.Namespace, console: Console) -> int:
    if args.command == "demo":
        return _demo(args, console)
    if args.meta:
        raise PlanError("`autosbp train` needs real parameters; drop --meta.")
    from autosbp.zoo import parse_model_args

    model_args = parse_model_args(args.model_args)
    plan = _plan_for(args.model, model_args, args.plan, args.nproc, args.profile, console)
    return _train_and_report(
        args.model, model_args, plan, args.steps, args.lr, args.check, console, trace=args.trace
    )


def _plan_for(
    model: str,
    model_args: dict,
    plan_arg: str,
    nproc: int,
    profile: str,
    console: Console,
    *,
    compare: bool = False,
) -> Plan:
    if plan_arg.endswith(".json") or Path(plan_arg).is_file():
        plan = Plan.load(plan_arg)
        plan.check_world(nproc)
        _check_plan_model(plan, model, model_args)
        return plan
    from autosbp.planner.api import auto_parallelize
    from autosbp.zoo import load_model

    with console.status(f"planning {model} ({plan_arg}) for {nproc} processes on {profile}"):
        module, inputs = load_model(model, model_args)
        return auto_parallelize(
            module, inputs, profile=profile, devices=nproc, strategy=plan_arg, name=model,
            compare=compare,
        )  # fmt: skip


def _check_plan_model(plan: Plan, model: str, model_args: dict) -> None:
    """Refuse a plan made for another model here, before any process starts (a worker would
    refuse it too, but only after launching, as a failed rank)."""
    from autosbp.capturing.export import capture_micro_batch
    from autosbp.zoo import load_model

    module, inputs = load_model(model, model_args, device="meta")
    graph = capture_micro_batch(module, inputs, plan.micro_batches, name=model)
    plan.check_model(graph.fingerprint(), f"model `{model}`")


def _train_and_report(
    model: str,
    model_args: dict,
    plan: Plan,
    steps: int,
    lr: float,
    check: bool,
    console: Console,
    *,
    trace: Path | None = None,
    timeline: Path | None = None,
) -> int:
    """Train under `plan`; with `trace`/`timeline`, write the measured firings as a Chrome trace
    and the predicted-vs-measured timeline PNG."""
    from autosbp.timeline import draw_timelines, predicted_events, write_chrome_trace
    from runtime.train import TrainSpec, train

    cores = os.cpu_count() or 1
    if plan.device_count > cores:
        console.print(
            f"note: {plan.device_count} processes share {cores} CPU cores, so each rank runs on "
            f"about {cores / plan.device_count:.2g} of a core; the plan's profile prices a device "
            "with a core of its own, so expect steps slower than predicted (the plan's choices "
            "stay valid)."
        )
    recording = trace is not None or timeline is not None
    spec = TrainSpec(model, model_args, plan.to_json(), steps, lr=lr, check=check, trace=recording)
    with console.status(f"training {steps} steps on {plan.device_count} processes"):
        result = train(spec)
    if trace is not None:
        write_chrome_trace(trace, list(result.events), metadata={"plan": plan.strategy})
        console.print(f"Chrome trace of every firing written to {trace} (open it in Perfetto)")
    if timeline is not None:
        draw_timelines(
            timeline, predicted_events(plan), list(result.events),
            title=f"{model}: {plan.strategy} plan, predicted vs measured (last step)",
        )  # fmt: skip
        console.print(f"predicted vs measured timeline written to {timeline}")
    table = Table(
        title=f"{model}: {plan.strategy} plan, mesh {'x'.join(map(str, plan.mesh_shape))}"
    )
    for column in ("step", "loss", *(CHECK_COLUMNS if check else ()), "time"):
        table.add_column(column, justify="right")
    if check:
        table.caption = (
            "loss, gradients, buffers, updates: the worst error / bound (runtime/check.py)"
        )
    for record, seconds in zip(result.records, result.step_times_s, strict=True):
        extra = _check_cells(record.check) if check else ()
        table.add_row(str(record.step), f"{record.loss:.6f}", *extra, f"{seconds * 1e3:.1f} ms")
    console.print(table)
    if check:
        verdict = result.verdict()
        if not verdict.passed:
            raise ExecutionError(verdict.text)
        console.print(verdict.text)
    return 0


CHECK_COLUMNS = ("one device (float64)", "loss", "gradients", "buffers", "updates")
"""With --check: the reference loss, then per kind the worst error / bound over the step's
tensors (at most 1x passes)."""


def _check_cells(check: Any) -> tuple[str, ...]:
    """A step's --check columns (`runtime.check_report.StepCheck`; rank 0 always has one)."""
    from runtime.check_report import Kind

    ratios = (check.ratio(kind) for kind in (Kind.LOSS, Kind.GRADIENT, Kind.BUFFER, Kind.UPDATE))
    return (
        f"{check.reference_loss:.6f}",
        *("-" if r is None else f"[{'green' if r <= 1 else 'red'}]{r:.2g}x" for r in ratios),
    )


def _demo(args: argparse.Namespace, console: Console) -> int:
    """Plan the demo GPT for N CPU processes, compare with hand plans, train it under the plan
    (trace and timeline in the output folder); then plan GPT-3 175B for 1024 A100s beside the
    Megatron-LM plan."""
    name, model_args = DEMO_MODEL
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console.rule(f"1. plan a small GPT for {args.nproc} CPU processes (profile cpu-gloo)")
    plan = _plan_for(name, model_args, "auto", args.nproc, "cpu-gloo", console, compare=True)
    console.print(plan.summary())
    console.print(plan.hand_plan_table())
    path = plan.save(out / "plan.json")
    console.rule(f"2. train it {args.steps} steps under the plan, beside single-device training")
    trace, timeline = out / "trace.json", out / "timeline.png"
    code = _train_and_report(
        name, model_args, plan, args.steps, 1e-2, True, console, trace=trace, timeline=timeline
    )
    console.rule(f"3. plan GPT-3 175B ({args.gpt3_layers} layers) for 1024 GPUs of DGX A100 nodes")
    gpt3_path = _gpt3(args.gpt3_layers, out, console)
    console.print(
        f"outputs in {out.resolve()}: {path.name} (read it with `autosbp explain {path}`), "
        f"{trace.name} (open in Perfetto), {timeline.name} (predicted vs measured), "
        f"{gpt3_path.name} (`autosbp show {gpt3_path}`)"
    )
    return code


def _gpt3(layers: int, out: Path, console: Console) -> Path:
    """Plan GPT-3 175B on 1024 A100s and print it beside the Megatron-LM plan; save the plan."""
    from autosbp.capturing.rebatch import micro_batch_graphs
    from autosbp.planner.api import plan_graphs
    from autosbp.planner.search import powers_of_two_dividing
    from autosbp.zoo import GPT3_175B, gpt3_175b, gpt3_megatron

    hand, hand_count = gpt3_megatron(layers)
    counts = powers_of_two_dividing(GPT3_175B["batch"])
    common: dict[str, Any] = {
        "profile": "dgx-a100", "devices": 1024, "memory_limit": None, "global_batch": None,
        "optimizer": "adam", "dtype": "bf16", "time_limit_s": 60.0,
    }  # fmt: skip
    with console.status("capturing GPT-3 on the meta device") as status:
        model, inputs = gpt3_175b(layers)
        graphs = micro_batch_graphs(model, inputs, (*counts, hand_count), name="gpt3-175b")
        status.update("searching stages, meshes, micro-batches, recomputation and signatures")
        start = time.perf_counter()
        auto = plan_graphs(
            {c: graphs[c] for c in counts}, **common, strategy="auto",
            progress=lambda message: status.update(f"searching: {message}"),
        )  # fmt: skip
        searched = time.perf_counter() - start
        status.update(f"pricing the Megatron-LM plan {hand}")
        megatron = plan_graphs(
            {hand_count: graphs[hand_count]}, **common, strategy=hand, recompute="full"
        )
    console.print(auto.summary())
    console.print(f"searched in {searched:.1f} s")
    console.print(
        _comparison("GPT-3 175B on 1024 A100s: auto vs Megatron-LM", auto, [(hand, megatron)])
    )
    return auto.save(out / "gpt3-plan.json")


def _comparison(title: str, auto: Plan, hand: list[tuple[str, Plan]]) -> Table:
    """Predicted step time and memory of `auto` and the hand plans (the same cost model)."""
    table = Table(title=f"{title} (predicted, same cost model)")
    columns = (
        "strategy",
        "stages",
        "mesh",
        "micro-batches",
        "recompute",
        "step time",
        "peak memory",
        "vs auto",
    )
    for column in columns:
        table.add_column(column, justify="right")
    for strategy, p in [("auto", auto), *hand]:
        table.add_row(
            strategy,
            str(len(p.stages)),
            "x".join(map(str, p.mesh_shape)),
            str(p.micro_batches),
            p.recompute,
            format_seconds(p.predicted.step_time_s),
            format_bytes(p.predicted.peak_memory_bytes),
            f"{p.predicted.step_time_s / auto.predicted.step_time_s:.2f}x",
        )
    return table
