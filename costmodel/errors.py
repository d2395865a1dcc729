"""The cost model's error: a hardware profile that cannot be used.

The root (`AutosbpError`) lives in `terminal.errors`; `autosbp.errors` re-exports every
user-facing error for users.
"""

from __future__ import annotations

from terminal.errors import AutosbpError

__all__ = ["ProfileError"]


class ProfileError(AutosbpError):
    """A hardware profile that is missing, malformed, or of another schema version."""
