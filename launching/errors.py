"""The error of a distributed run that failed: a timeout, a dead rank, a mismatched collective."""

from __future__ import annotations

from terminal.errors import AutosbpError

__all__ = ["ExecutionError"]


class ExecutionError(AutosbpError):
    """A distributed run failed: a timeout, a dead rank, a mismatched collective."""
