"""Text from files and models made safe for a terminal.

Lives here: `printable` (control characters written as escapes) and `has_control`. Used
wherever text that came from an input file (a plan, a profile, a checkpoint, a model's code)
reaches the terminal: the CLI's error printer, and the loaders that refuse such text. At the
bottom layer so that every package can use it.

Why: a name holding ESC (0x1b) sequences clears the screen, moves the cursor or retitles the
terminal when printed as is; rich keeps ESC (it strips only a few other codes).
"""

from __future__ import annotations

import re

__all__ = ["has_control", "printable"]

# Unicode's control characters (category Cc: C0, DEL, C1), but newline and tab, which only
# shape a message's lines.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def has_control(text: str) -> bool:
    """Whether `text` holds a control character other than newline and tab."""
    return _CONTROL.search(text) is not None


def printable(text: str) -> str:
    """`text` with every control character but newline and tab written as a Python escape
    (`\\x1b`), so it shows what a file holds instead of acting on the terminal."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
