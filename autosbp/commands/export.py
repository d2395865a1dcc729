"""`autosbp export CHECKPOINT_DIR --out PATH`: the model of a sharded checkpoint, whole, in one
file plain PyTorch loads.

Lives here: the command's arguments. Lives elsewhere: reading and assembling the checkpoint
and writing the file (`runtime.state.export`, imported lazily: this command and `train` are
the CLI's reach into runtime), the format (`runtime.state.checkpoint`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from terminal.progress import activity
from terminal.text import printable


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument(
        "checkpoint", type=Path, metavar="CHECKPOINT_DIR",
        help="a checkpoint folder written by `autosbp train --checkpoint-dir` (any plan)",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, required=True, metavar="PATH",
        help="the model file to write: .safetensors or .pt (no default: required)",
    )  # fmt: skip
    parser.add_argument(
        "--save-dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
        help="dtype of the floating tensors written (default: fp32, the masters')",
    )  # fmt: skip


def run(args: argparse.Namespace, console: Console) -> int:
    from runtime.state.export import check_model_path, checkpoint_state, write_model

    check_model_path(args.out, args.save_dtype)
    with activity(console, f"assembling {printable(str(args.checkpoint))}"):
        state = checkpoint_state(args.checkpoint)
        path = write_model(state, args.out, args.save_dtype)
    console.print(
        f"{len(state)} tensors written to {printable(str(path))}: load them with "
        "model.load_state_dict(..., strict=True)",
        soft_wrap=True,
    )
    return 0
