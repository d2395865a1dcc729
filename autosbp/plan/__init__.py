"""The Plan: what the planner decided, as frozen values and validated JSON (design 3.6).

Lives here, one module per responsibility: the values and their JSON (`format`: Plan and its
parts, save, load, digest), what a file must be to be read (`schema`), whether a plan is
consistent as a whole, alone and against its model (`checks`), and its tables for people
(`tables`). Lives elsewhere: how a plan is
found (`planner`), how it runs (runtime).
"""

from __future__ import annotations

from autosbp.plan.checks import check_plan, plan_problems
from autosbp.plan.format import (
    Alternative,
    HandPlan,
    NodePlan,
    ParamPlan,
    Plan,
    Predicted,
    SolverReport,
    StagePlan,
)
from autosbp.plan.schema import FORMAT, MAX_INT, VERSION, plan_schema, validate_plan_json
from autosbp.plan.tables import format_bytes, format_seconds

__all__ = [
    "FORMAT", "MAX_INT", "VERSION", "Alternative", "HandPlan", "NodePlan", "ParamPlan", "Plan",
    "Predicted", "SolverReport", "StagePlan", "check_plan", "format_bytes", "format_seconds",
    "plan_problems", "plan_schema", "validate_plan_json",
]  # fmt: skip
