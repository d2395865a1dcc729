"""Plan files: a plan read whole and checked, or written whole, never half.

Lives here: `load_plan` (JSON as the schema says, then consistent in itself: `checks.check_plan`
without a model), `save_plan`, and `write_atomically` (every file autosbp writes for people,
plans, traces and charts: a temporary file renamed into place). Lives elsewhere: the values and
their JSON (`plan.values`), the schema (`plan.schema`), the checks (`plan.checks`).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from autosbp.errors import PlanError
from autosbp.plan.checks import check_plan
from autosbp.plan.schema import read_plan_text
from autosbp.plan.values import Plan

__all__ = ["load_plan", "save_plan", "write_atomically"]


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """The plan in `path`: JSON as the schema says, consistent in itself (`check_plan` without a
    model); PlanError naming the file and the fix otherwise."""
    path = Path(path)
    plan = Plan.from_json(read_plan_text(path), source=str(path))
    check_plan(plan, source=f"plan file {path}")
    return plan


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> Path:
    """Write `plan` as JSON to `path` (atomically: a crash never leaves half a file)."""
    text = json.dumps(plan.to_json(), indent=1) + "\n"
    return write_atomically(
        Path(path), lambda tmp: tmp.write_text(text), "plan", " (`--out` on the command line)"
    )


def write_atomically(
    path: Path, write: Callable[[Path], object], what: str, hint: str = ""
) -> Path:
    """Call `write(tmp)`, then rename tmp to `path`: a failure never leaves half a file. Every
    file autosbp writes for people goes through here (plans, traces, timeline charts)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):  # a read-only folder refuses the cleanup too
            tmp.unlink(missing_ok=True)
        raise PlanError(
            f"cannot write the {what} to {path} ({exc.strerror or exc}); choose a path in an "
            f"existing, writable directory{hint}."
        ) from None
    return path
