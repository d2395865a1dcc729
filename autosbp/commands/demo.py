"""`autosbp demo`: plan a small GPT for the machine's cores, train it for real on Python's own
source in bf16 beside a plain PyTorch loop, then plan GPT-3 175B for 1024 A100s beside
Megatron-LM.

Lives here: the command's arguments and its three parts. Lives elsewhere: planning and training
with progress (`commands.train`: `plan_for`, `train_and_report`), the search (`planner`), the
GPT-3 model and Megatron-LM's plan (`zoo`), the data (`runtime.data.stdlib_text`), the plain loop
(`runtime.verify.plain_loop`), the curves (`timeline.curves`).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from autosbp.commands import positive_float, positive_int
from autosbp.commands.plan import print_notes, time_limit_notes
from autosbp.commands.profile import default_profile
from autosbp.commands.train import Recipe, plan_for, train_and_report, train_spec
from autosbp.plan import (
    Plan,
    format_bytes,
    format_seconds,
    hand_plan_table,
    save_plan,
    summary_table,
)
from terminal.progress import activity

SEQ = 64
DEMO_MODEL = (
    "gpt", {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "seq": SEQ, "batch": 16}
)  # fmt: skip
# The job's recipe: AdamW with decay on matrices, warmup then cosine to a tenth, clipping at 1.
CLIP = 1.0
RECIPE: dict[str, Any] = {
    "lr": 3e-3, "weight_decay": 0.1, "lr_schedule": "cosine", "warmup_steps": 20,
    "min_lr": 3e-4, "clip_grad_norm": CLIP, "eval_batches": 8,
}  # fmt: skip
TEXT: dict[str, Any] = {"data": "stdlib_text", "data_args": {"seq": SEQ},
        "eval_data": "stdlib_text", "eval_args": {"seq": SEQ, "split": "eval"}}  # fmt: skip


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument(
        "--out", default="autosbp-out", help="folder for the outputs (default: autosbp-out)"
    )
    parser.add_argument(
        "--nproc", type=positive_int, default=min(2, os.cpu_count() or 1),
        help="CPU processes, at most one per core (default: 2, or 1 on a one-core machine)",
    )  # fmt: skip
    parser.add_argument(
        "--steps", type=positive_int, default=200, help="training steps (default: 200)"
    )
    parser.add_argument(
        "--gpt3-layers", type=positive_int, default=96,
        help="depth of the GPT-3 175B planned in part 3 (default: 96, the real model)",
    )  # fmt: skip
    parser.add_argument(
        "--time-limit-s", type=positive_float, default=60.0,
        help="each search's time limit (parts 1 and 3); past it the best plan so far is used and "
        "the demo says the gap proven so far (default: 60)",
    )  # fmt: skip


def run(args: argparse.Namespace, console: Console) -> int:
    return _demo(args, console)


def _demo(args: argparse.Namespace, console: Console) -> int:
    """Plan the demo GPT for N CPU processes beside hand plans, train it on text in bf16 beside
    a plain PyTorch loop (curves, trace and timeline in the output folder); then plan GPT-3
    175B for 1024 A100s beside the Megatron-LM plan."""
    name, model_args = DEMO_MODEL
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile = default_profile(console)
    console.rule(f"1. plan a small GPT for {args.nproc} CPU processes in bf16 (profile {profile})")
    with time_limit_notes() as notes:
        plan = plan_for(
            name, model_args, "auto", args.nproc, profile, console, compare=True,
            time_limit_s=args.time_limit_s,
            recipe=Recipe("bf16", None, "adamw", CLIP),
        )  # fmt: skip
    console.print(summary_table(plan))
    print_notes(console, notes, plan)
    console.print(hand_plan_table(plan))
    path = save_plan(plan, out / "plan.json")
    console.rule(
        f"2. train it {args.steps} steps on Python's own source (byte tokens), beside a plain "
        "PyTorch loop"
    )
    trace, timeline, curves = out / "trace.json", out / "timeline.png", out / "loss.png"
    spec = train_spec(
        name, model_args, plan, args.steps, **RECIPE, **TEXT, profile=profile,
        eval_every=max(args.steps // 4, 1), metrics=str(out / "metrics.jsonl"),
    )  # fmt: skip
    code = train_and_report(spec, plan, console, trace=trace, timeline=timeline, curves=curves)
    console.rule(f"3. plan GPT-3 175B ({args.gpt3_layers} layers) for 1024 GPUs of DGX A100 nodes")
    gpt3_path = _gpt3(args.gpt3_layers, out, console, args.time_limit_s)
    console.print(
        f"outputs in {out.resolve()}: {curves.name} (the loss curves), {path.name} (read it "
        f"with `autosbp explain {path}`), {trace.name} (open in Perfetto), {timeline.name} "
        f"(predicted vs measured), {gpt3_path.name} (`autosbp show {gpt3_path}`)"
    )
    return code


def _gpt3(layers: int, out: Path, console: Console, time_limit_s: float) -> Path:
    """Plan GPT-3 175B on 1024 A100s and print it beside the Megatron-LM plan; save the plan."""
    from autosbp.capturing.rebatch import micro_batch_graphs
    from autosbp.planner.api import plan_graphs
    from autosbp.planner.space.configs import divisors
    from autosbp.zoo import GPT3_175B, gpt3_175b, gpt3_megatron

    hand, hand_count = gpt3_megatron(layers)
    counts = divisors(GPT3_175B["batch"])  # every micro-batch count: the search's whole space
    common: dict[str, Any] = {
        "profile": "dgx-a100", "devices": 1024, "memory_limit": None, "global_batch": None,
        "optimizer": "adam", "dtype": "bf16", "time_limit_s": time_limit_s,
    }  # fmt: skip
    planning = f"planning GPT-3 175B ({layers} layers) for 1024 A100s"
    with activity(console, planning) as act, time_limit_notes() as notes:
        act.update("capturing GPT-3 on the meta device")
        model, inputs = gpt3_175b(layers)
        graphs = micro_batch_graphs(
            model, inputs, tuple(sorted({*counts, hand_count})), name="gpt3-175b"
        )
        act.update("searching stages, meshes, micro-batches, recomputation and signatures")
        start = time.perf_counter()
        auto = plan_graphs(
            {c: graphs[c] for c in counts}, **common, strategy="auto",
            progress=lambda message: act.update(f"searching: {message}"),
        )  # fmt: skip
        searched = time.perf_counter() - start
        act.update(f"pricing the Megatron-LM plan {hand}")
        megatron = plan_graphs(
            {hand_count: graphs[hand_count]}, **common, strategy=hand, recompute="full"
        )
    console.print(summary_table(auto))
    print_notes(console, notes, auto)
    console.print(f"searched in {searched:.1f} s")
    console.print(
        _comparison("GPT-3 175B on 1024 A100s: auto vs Megatron-LM", auto, [(hand, megatron)])
    )
    return save_plan(auto, out / "gpt3-plan.json")


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
