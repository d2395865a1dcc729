"""`autosbp zoo`: the zoo's models, what each one is, and the arguments `--model-args` takes.

Lives here: the command's arguments and its table. Lives elsewhere: the models and their
arguments (`autosbp.zoo`: `model_arguments` reads each builder's signature, so this list cannot
drift from what `--model-args` accepts).
"""

from __future__ import annotations

import argparse
import inspect

from rich.console import Console
from rich.table import Table


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("model", nargs="?", help="one zoo model to describe (default: all of them)")


def run(args: argparse.Namespace, console: Console) -> int:
    from autosbp.zoo import ZOO_MODELS, build_model, model_arguments

    names = [args.model] if args.model else list(ZOO_MODELS)
    table = Table(title="zoo models (autosbp capture|plan|train MODEL --model-args k=v,...)")
    table.add_column("model")
    table.add_column("what it is", ratio=3)
    table.add_column("parameters", justify="right")
    table.add_column("--model-args and their defaults", ratio=2, overflow="fold")
    for name in names:
        arguments = model_arguments(name)  # refuses an unknown name, listing the zoo
        model, _ = build_model(name, device="meta")
        parameters = sum(p.numel() for p in model.parameters())
        table.add_row(
            name,
            (inspect.getdoc(type(model)) or type(model).__name__).splitlines()[0],
            f"{parameters:,}",
            ", ".join(f"{k}={v}" for k, v in arguments.items()),
        )
    console.print(table)
    console.print(
        "Every model also takes device= and seed=. A model of your own: "
        "path/to/file.py:function, returning (model, example_inputs) with model(*inputs) -> loss."
    )
    return 0
