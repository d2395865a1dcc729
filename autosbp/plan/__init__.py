"""The Plan: what the planner decided, as frozen values and validated JSON (docs/architecture.md, "The plan").

Lives here, one module per responsibility: the values and their JSON (`values`: Plan and its
parts, digest), its files (`files`: load_plan, save_plan), what a file must be to be read
(`schema`), whether a plan is consistent as a whole, alone and against its model (`checks`), its
tables for people (`tables`) and its DTensor view (`dtensor`): a plan is data, and each of these
is a free function of it. Lives elsewhere: how a plan is found (`planner`), how it runs
(runtime).
"""

from __future__ import annotations

from autosbp.plan.checks import check_plan, plan_problems
from autosbp.plan.dtensor import device_mesh, placements
from autosbp.plan.files import load_plan, save_plan, write_atomically
from autosbp.plan.recompute import recomputed_nodes
from autosbp.plan.schema import FORMAT, MAX_INT, VERSION, plan_schema, validate_plan_json
from autosbp.plan.tables import (
    format_bytes,
    format_seconds,
    hand_plan_table,
    replicated_warning,
    summary_table,
)
from autosbp.plan.values import (
    Alternative,
    HandPlan,
    NodePlan,
    ParamPlan,
    Plan,
    Precision,
    Predicted,
    Replicated,
    SolverReport,
    StagePlan,
)

__all__ = [
    "FORMAT", "MAX_INT", "VERSION", "Alternative", "HandPlan", "NodePlan", "ParamPlan", "Plan",
    "Precision", "Predicted", "Replicated", "SolverReport", "StagePlan", "check_plan", "device_mesh", "format_bytes",
    "format_seconds", "hand_plan_table", "load_plan", "placements", "plan_problems", "plan_schema",
    "recomputed_nodes", "replicated_warning", "save_plan", "summary_table", "validate_plan_json", "write_atomically",
]  # fmt: skip
