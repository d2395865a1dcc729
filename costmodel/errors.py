"""The root of the project's user-facing errors, at the bottom layer so every package can raise it.

`autosbp.errors` re-exports these and adds the planner's own; users catch `AutosbpError`.
"""

from __future__ import annotations


class AutosbpError(Exception):
    """Base of every user-facing error: the message is one paragraph (cause and fix)."""


class ProfileError(AutosbpError):
    """A hardware profile that is missing, malformed, or of another schema version."""


class ExecutionError(AutosbpError):
    """A distributed run failed: a timeout, a dead rank, a mismatched collective."""
