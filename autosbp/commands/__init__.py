"""CLI command modules: each has `configure(parser, name)` and `run(args, console) -> int`.

Lives here too: the argument types the command modules share (`positive_int`, `positive_float`,
`non_negative_int`, `non_negative_float`),
so a count or size that is zero or negative is refused by argparse (usage line, exit 2) before
anything is loaded, planned or launched.
"""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}; e.g. 4")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}; e.g. 16 or 0.5")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"must be a whole number >= 0, got {text!r}; e.g. 0 or 100"
        )
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}; e.g. 0 or 0.1")
    return value
