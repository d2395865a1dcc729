"""The `autosbp` command: one subcommand per verb, each in the module that owns it.

Lives here: argument dispatch, the console, and error handling (an `AutosbpError` prints its
one-paragraph message without a traceback and exits 2). Each command module exposes
`configure(parser)` and `run(args, console) -> int`; modules are imported only when their
command runs, so `autosbp --help` stays fast and `train` alone pulls in the runtime.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape

from autosbp.errors import AutosbpError
from terminal.text import printable

# (command, module, one-line help). The module owns the command's arguments and behaviour.
COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("capture", "autosbp.commands.capture", "capture a model and summarize its operator graph"),
    ("plan", "autosbp.commands.plan", "find the fastest plan that fits and write it as JSON"),
    ("explain", "autosbp.commands.explain", "show the signatures a plan chose, by module path"),
    (
        "show",
        "autosbp.commands.show",
        "show a plan's predicted step timeline, beside a measured trace",
    ),
    (
        "train",
        "autosbp.commands.train",
        "train a model under a plan on N local processes, or as one rank under torchrun",
    ),
    (
        "export",
        "autosbp.commands.export",
        "write the model of a sharded checkpoint as one file plain PyTorch loads",
    ),
    (
        "demo",
        "autosbp.commands.demo",
        "plan and train a small GPT on text in bf16 beside PyTorch, then plan GPT-3 175B",
    ),
    ("profile", "autosbp.commands.profile", "measure this machine's op and collective costs"),
    ("profiles", "autosbp.commands.profile", "list the shipped hardware profiles"),
    ("zoo", "autosbp.commands.zoo", "list the zoo's models and the arguments --model-args takes"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autosbp", description="Auto-parallel planning and execution for PyTorch training."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name, help_text in COMMANDS:
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.set_defaults(_module=module_name)
        _module(module_name).configure(cmd, name)
    return parser


def _module(name: str):
    return importlib.import_module(name)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler or `kill` ending the job) raised where the CLI runs, so that it
    unwinds as Ctrl-C does: ranks stopped, files closed, one line said."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def main(argv: Sequence[str] | None = None) -> int:
    # Piped or captured output gets room for the plan tables (a terminal keeps its own width).
    # emoji=False: a name such as `models.py:llama` is text, not the emoji code `:llama:`
    console = Console(
        stderr=False, highlight=False, emoji=False, width=None if sys.stdout.isatty() else 120
    )
    err_console = Console(stderr=True, highlight=False, emoji=False)
    args = build_parser().parse_args(argv)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # not if an embedding program set one
        signal.signal(signal.SIGTERM, _terminate)
    try:
        return int(_module(args._module).run(args, console) or 0)
    except AutosbpError as exc:
        message = escape(printable(str(exc)))  # names from input files: shown, not obeyed
        err_console.print(f"[bold red]error:[/] {message}", markup=True, soft_wrap=True)
        return 2
    except Terminated:
        err_console.print("terminated (SIGTERM)")
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
