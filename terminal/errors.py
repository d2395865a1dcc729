"""The root of the project's user-facing errors, at the bottom so that every package can raise it.

Lives here: `AutosbpError`, whose message is one paragraph (what failed, why, how to fix it)
that the CLI prints without a traceback. Lives elsewhere: each room's own errors, beside the code
that raises them (`launching.errors`, `costmodel.errors`, `autosbp.errors`, which re-exports them
all for users).
"""

from __future__ import annotations

__all__ = ["AutosbpError"]


class AutosbpError(Exception):
    """Base of every user-facing error: the message is one paragraph (cause and fix)."""
