"""runtime: executes a Plan on torch.distributed (docs/architecture.md, "The rooms in detail").

Decides nothing: every choice it runs is the plan's.

The public name is `Engine` (runtime.engine); it loads on first use, so importing a submodule
such as `runtime.execute.collectives` does not pull in the whole runtime.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Engine"]

_LAZY = {"Engine": "runtime.engine"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
