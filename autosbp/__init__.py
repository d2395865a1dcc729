"""autosbp: find the fastest way to train a PyTorch model on N devices, and run it.

The public API is small; heavy modules (capture, planner, runtime) load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from autosbp.errors import AutosbpError
from autosbp.sbp import B, Mesh, P, S

__all__ = ["AutosbpError", "B", "Mesh", "P", "S", "capture"]

# name -> module that defines it; imported lazily by __getattr__.
_LAZY = {
    "capture": "autosbp.capture",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'autosbp' has no attribute {name!r}")
