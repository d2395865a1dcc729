"""autosbp: find the fastest way to train a PyTorch model on N devices, and run it.

The public API is small; heavy modules (capture, planner, runtime) load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from autosbp.errors import AutosbpError
from autosbp.sbp import B, Mesh, P, S

__all__ = [
    "AutosbpError", "B", "Engine", "Mesh", "P", "Plan", "S", "auto_parallelize", "capture",
    "distribute", "explain",
]  # fmt: skip

# name -> module that defines it; imported lazily by __getattr__ (Engine and distribute live in
# runtime, which imports autosbp: loading them lazily keeps the arrows one-way at import time).
_LAZY = {
    "Engine": "runtime.engine",
    "Plan": "autosbp.plan",
    "auto_parallelize": "autosbp.planner.api",
    "capture": "autosbp.capturing",
    "distribute": "runtime.distribute",
    "explain": "autosbp.explanation",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'autosbp' has no attribute {name!r}")
