"""The few error classes users see. Each message says what failed, why, and how to fix it.

Lives here: the error hierarchy only. Raise these for bad user input (models, SBPs, profiles,
plans, CLI arguments); use `assert` for internal invariants. The CLI prints `AutosbpError`
messages without a traceback and exits non-zero.
"""

from __future__ import annotations


class AutosbpError(Exception):
    """Base of every user-facing error: the message is one paragraph (cause and fix)."""


class SbpError(AutosbpError, ValueError):
    """An SBP, nD SBP or mesh that does not fit a tensor (bad dim, non-divisible split, rank)."""


class CaptureError(AutosbpError):
    """A model that cannot be captured into an operator graph."""


class ProfileError(AutosbpError):
    """A hardware profile that is missing, malformed, or of another schema version."""


class PlanError(AutosbpError):
    """No plan fits (memory), or a plan does not match the model, world size or profile."""


class ExecutionError(AutosbpError):
    """A distributed run failed: a timeout, a dead rank, a mismatched collective."""
