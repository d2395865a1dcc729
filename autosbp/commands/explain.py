"""`autosbp explain PLAN [--node NAME] [--all]`: the signatures a plan chose, and why one node got
its own.

Lives here: the command's arguments and output: the plan's ops under their module paths (the
placeholders and views too with --all), the ops one module holds (`--node blocks.0.attn`), or
one op's priced alternatives (`--node blocks.0.attn.qkv`). Lives elsewhere: finding nodes by
path and the alternatives' table (`explanation`), the plan format (`plan`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from autosbp.errors import PlanError
from autosbp.plan import load_plan
from terminal.text import printable


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("plan", metavar="PLAN", help="a plan JSON file written by `autosbp plan`")
    parser.add_argument(
        "--node",
        help="a module path as the model names it (blocks.0.attn.qkv: what its op would cost "
        "under each signature; blocks.0.attn: the ops it holds) or a node name from the listing "
        "(default: list every op)",
    )
    parser.add_argument(
        "--all",
        action="store_true",
        help="list the placeholders (parameters, buffers, inputs) and views too (default: the "
        "ops only)",
    )


def run(args: argparse.Namespace, console: Console) -> int:
    from autosbp.explanation import explain, find_nodes, nodes_table, shown, unknown_node

    plan = load_plan(Path(args.plan))
    mesh = "x".join(map(str, plan.mesh_shape))
    if args.node is None:
        names = [name for name, node in plan.nodes.items() if args.all or shown(node)]
        what = "every node" if args.all else "its ops (--all: with placeholders and views)"
        title = escape(f"{printable(plan.model_name)}: {what}, mesh {mesh}")
        console.print(nodes_table(plan, names, title))
        return 0
    found = find_nodes(plan, args.node, every=args.all)
    if not found:
        raise PlanError(unknown_node(plan, args.node))
    if len(found) == 1:
        console.print(explain(plan, found[0]).table())
        return 0
    title = escape(
        f"{printable(args.node)}: {len(found)} ops on mesh {mesh} (`--node NODE` prices one's "
        "alternatives)"
    )
    console.print(nodes_table(plan, found, title))
    return 0
