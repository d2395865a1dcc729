"""`autosbp capture MODEL`: capture a model and print a summary of its operator graph.

Lives here: the command's arguments and the summary (nodes, parameters, flops, op families,
repeated blocks, ops without an SBP rule, what capture absorbed and which eager norms it fused), and how every command names a model
(`add_model_arguments`, `load_from_args`: capture and plan build it on the meta device, since
they read shapes only). Lives elsewhere: loading models (`zoo`), capture
(`capture`), op families (`flops`). Those import torch, so they load in `run`, not at import:
`autosbp --help` configures every command.
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from terminal.progress import activity
from terminal.text import printable

if TYPE_CHECKING:
    from autosbp.capturing.graph import OpGraph, OpNode


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    add_model_arguments(parser, meta_by_default=True)


def add_model_arguments(parser: argparse.ArgumentParser, *, meta_by_default: bool = False) -> None:
    """MODEL, --model-args and --meta: how every command that takes a model names it. With
    `meta_by_default` (commands that only read shapes: capture, plan) the model is built on the
    meta device unless --materialize asks for real weights."""
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="a zoo model name (e.g. gpt; `autosbp zoo` lists them with their arguments) or "
        "path/to/file.py:function returning (model, example_inputs)",
    )
    parser.add_argument(
        "--model-args",
        default="",
        metavar="K=V,...",
        help="model arguments, e.g. layers=4,hidden=256 (values parsed as int/float/bool/str; "
        "`autosbp zoo` lists a zoo model's, with their defaults) (default: none, the model's "
        "defaults)",
    )
    device = parser.add_mutually_exclusive_group()
    device.add_argument(
        "--meta",
        action="store_true",
        help="build the model on the meta device (no parameter memory; for large models)"
        + (" (the default here)" if meta_by_default else ""),
    )
    if meta_by_default:
        device.add_argument(
            "--materialize",
            action="store_true",
            help="build the model with real weights and inputs on the CPU (default: on the meta "
            "device, no memory): the graph is the same (capture traces shapes only), and the "
            "checks capture assumes hold (an `if` whose branch only raises, an assert) are run on "
            "the example inputs' values",
        )
    parser.set_defaults(meta_by_default=meta_by_default, materialize=False)


def load_from_args(args: argparse.Namespace) -> tuple[Any, Any]:
    """(model, example_inputs) named by the arguments of `add_model_arguments`: on the meta
    device with --meta, or by default for commands that only read shapes (no --materialize)."""
    from autosbp.zoo import load_model, parse_model_args

    meta = args.meta or (args.meta_by_default and not args.materialize)
    return load_model(
        args.model, parse_model_args(args.model_args), device="meta" if meta else None
    )


def run(args: argparse.Namespace, console: Console) -> int:
    from autosbp.capturing.export import capture

    with activity(console, f"capturing {printable(args.model)}") as act:
        act.update("building the model")
        model, inputs = load_from_args(args)
        act.update("tracing on fake tensors")
        opgraph = capture(model, inputs, name=args.model)
    print_summary(opgraph, console)
    return 0


def print_summary(opgraph: OpGraph, console: Console) -> None:
    """The totals, a table of op families, the repeated blocks and the ops without a rule."""
    from autosbp.capturing.graph import Role

    params = [a.outputs[0] for _, a in opgraph.parameters()]
    compute = [a for _, a in opgraph.nodes(Role.COMPUTE)]
    console.print(f"[bold]model[/]       {opgraph.model_name}")
    console.print(f"nodes       {opgraph.graph.number_of_nodes()} ({len(compute)} compute)")
    console.print(
        f"parameters  {len(params)} tensors, {_count(sum(t.numel for t in params))} values, "
        f"{_bytes(sum(t.nbytes for t in params))}"
    )
    console.print(f"forward     {_count(sum(a.flops for a in compute))}FLOP")
    console.print(f"captured in {opgraph.meta.get('capture_s', 0.0):.1f} s")
    console.print(_family_table(compute))
    console.print(_blocks_line(opgraph, compute))
    unknown = ", ".join(opgraph.unknown_ops) or "none"
    console.print(f"ops without an SBP rule (all-B fallback): {unknown}")
    for line in opgraph.meta.get("absorbed", ()):
        console.print(f"absorbed: {printable(line)}", soft_wrap=True)
    for line in opgraph.meta.get("fused_norms", ()):
        console.print(f"norm: {printable(line)}", soft_wrap=True)


def _family_table(compute: list[OpNode]) -> Table:
    from autosbp.capturing.flops import op_family

    nodes: Counter[str] = Counter()
    flops: dict[str, float] = defaultdict(float)
    ops: dict[str, set[str]] = defaultdict(set)
    for attrs in compute:
        family = op_family(attrs.op)
        nodes[family] += 1
        flops[family] += attrs.flops
        ops[family].add(attrs.op.removeprefix("aten.").split(".")[0])
    table = Table(title="nodes by op family")
    for column, justify in (
        ("family", "left"),
        ("nodes", "right"),
        ("FLOP", "right"),
        ("share", "right"),
        ("ops", "left"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    total = sum(flops.values()) or 1.0
    for family, count in nodes.most_common():
        table.add_row(
            family,
            str(count),
            _count(flops[family]),
            f"{100 * flops[family] / total:.1f}%",
            ", ".join(sorted(ops[family])),
        )
    return table


def _blocks_line(opgraph: OpGraph, compute: list[OpNode]) -> str:
    sizes = Counter(a.block for a in compute if a.block is not None)
    if not sizes:
        return "repeated blocks: none found"
    container = opgraph.meta.get("block_container") or "<top>"
    per_block = sorted(set(sizes.values()))
    return (
        f"repeated blocks: {len(sizes)} x `{container}.<k>`, "
        f"{'/'.join(map(str, per_block))} compute nodes per block"
    )


def _count(value: float) -> str:
    """1.2e12 -> "1.20 T" (decimal prefixes)."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.2f} {prefix}"
    return f"{value:.0f} "


def _bytes(value: int) -> str:
    for factor, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if value >= factor:
            return f"{value / factor:.2f} {unit}"
    return f"{value} B"
