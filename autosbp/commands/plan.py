"""`autosbp plan MODEL ...`: find a plan and write it as JSON; `autosbp explain plan.json`.

Lives here: the two commands' arguments and output. Lives elsewhere: the search (`planner`),
the plan format (`plan`), model loading (`zoo`), the model arguments (`commands.capture`: the
model is built on the meta device unless --materialize; planning reads shapes only).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from autosbp.commands import positive_float, positive_int
from autosbp.commands.capture import add_model_arguments, load_from_args
from autosbp.plan import Plan

GIB = 2**30


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    if name == "explain":
        parser.add_argument(
            "plan", metavar="PLAN", help="a plan JSON file written by `autosbp plan`"
        )
        parser.add_argument("--node", help="show one node's signature (default: every parameter)")
        return
    add_model_arguments(parser, meta_by_default=True)
    parser.add_argument(
        "--profile", default="cpu-gloo", help="a shipped profile name or a profile JSON path"
    )
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
    parser.add_argument(
        "--strategy",
        default="auto",
        help="auto, dp, fsdp or megatron:tp=T,pp=P,dp=D[,mb=M] (M micro-batches)",
    )
    parser.add_argument(
        "--recompute",
        default="auto",
        choices=("auto", "none", "selective", "full"),
        help="activation recomputation (default: auto, the fastest that fits)",
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
        "--compare",
        action="store_true",
        help="also price the usual hand plans (dp, fsdp, megatron:...) and show them beside",
    )
    parser.add_argument(
        "--out", default="plan.json", help="where to write the plan (default: plan.json)"
    )


def run(args: argparse.Namespace, console: Console) -> int:
    if args.command == "explain":
        return _explain(args, console)
    from autosbp.planner.api import auto_parallelize, in_dtype

    model, inputs = load_from_args(args)
    if args.dtype is not None:  # the command built the model: it may cast it, real or meta
        inputs = in_dtype(model, inputs, args.dtype, owned=True)
    with console.status(f"planning for {args.devices} devices of {args.profile}") as status:
        plan = auto_parallelize(
            model,
            inputs,
            name=args.model,
            micro_batches=args.micro_batches,
            profile=args.profile,
            devices=args.devices,
            memory_limit=None if args.memory_gib is None else int(args.memory_gib * GIB),
            global_batch=args.global_batch,
            optimizer=args.optimizer,
            dtype=args.dtype,
            strategy=args.strategy,
            recompute=args.recompute,
            time_limit_s=args.time_limit_s,
            progress=lambda text: status.update(f"planning: {text}"),
            compare=args.compare,
        )
    console.print(plan.summary())
    if plan.hand_plans:
        console.print(plan.hand_plan_table())
    path = plan.save(args.out)
    console.print(f"plan written to {path}")
    return 0


def _explain(args: argparse.Namespace, console: Console) -> int:
    plan = Plan.load(Path(args.plan))
    if args.node is not None:
        from autosbp.explanation import explain

        console.print(explain(plan, args.node).table())
        return 0
    table = Table(
        title=f"{plan.model_name}: signatures on mesh {'x'.join(map(str, plan.mesh_shape))}"
    )
    for column in ("node", "op", "inputs", "outputs"):
        table.add_column(column)
    for name, node in plan.nodes.items():
        table.add_row(name, node.op, " ".join(node.inputs), " ".join(node.outputs))
    console.print(table)
    return 0
