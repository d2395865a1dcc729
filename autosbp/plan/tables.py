"""A plan for people: its summary table, its hand plans beside it, and the units they print in.

Lives here: `summary_table` and `hand_plan_table` (free functions of a plan,
as every view of a plan is), `TextTable` (a rich table that `print` and `str` render as text, so a
plan's summary reads as a table wherever it is printed), `format_seconds`, `format_bytes`.
Lives elsewhere: the plan's values and JSON (`plan.values`), the timeline chart
(`autosbp.timeline`), the CLI that prints them.

Invariant: every name from a plan is shown as text, never as terminal control characters or
rich markup (`terminal.text.printable`, `rich.markup.escape`).
"""

from __future__ import annotations

import io
import math
import re

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autosbp.plan.values import HandPlan, Plan
from terminal.text import printable

__all__ = ["TextTable", "format_bytes", "format_seconds", "hand_plan_table", "summary_table"]

TEXT_WIDTH = 120  # columns of a table rendered as text (`str`): a wide terminal's, as the CLI's


class TextTable(Table):
    """A rich Table that is also text: `print(table)` and `str(table)` render it (TEXT_WIDTH
    columns, no colour or control codes); a rich console prints it as any table."""

    def __str__(self) -> str:
        buffer = io.StringIO()
        Console(file=buffer, width=TEXT_WIDTH, color_system=None, highlight=False).print(self)
        return buffer.getvalue().rstrip("\n")


def summary_table(plan: Plan, main_weights: int = 6) -> TextTable:
    """A row per stage: devices, blocks, the SBP of the largest weights, time and memory."""
    table = TextTable(
        title=shown(
            f"{plan.model_name}: {plan.strategy} plan on {plan.device_count} x {plan.profile}"
        )
    )
    for column in (
        "stage", "devices", "mesh", "blocks", "largest weights (SBP)", "time/step", "peak memory",
    ):  # fmt: skip
        table.add_column(column)
    for index, stage in enumerate(plan.stages):
        # Repeated blocks show once: `blocks.*.mlp.fc.weight` (tied blocks share layouts).
        weights = {
            re.sub(r"\.\d+\.", ".*.", name): p
            for name, p in plan.params.items()
            if p.stage == index
        }
        largest = sorted(weights.items(), key=lambda item: -math.prod(item[1].shape))
        table.add_row(
            str(index),
            _span(stage.devices),
            "x".join(map(str, stage.mesh_shape)),
            _span(stage.blocks) if stage.blocks else "-",
            "\n".join(shown(f"{name} {p.sbp}") for name, p in largest[:main_weights]),
            format_seconds(stage.step_time_s),
            format_bytes(stage.peak_memory_bytes),
        )
    breakdown = ", ".join(
        f"{shown(k.removesuffix('_s'))} {format_seconds(v)}"
        for k, v in plan.predicted.breakdown.items()
    )
    table.caption = (
        f"step {format_seconds(plan.predicted.step_time_s)} ({breakdown}); "
        f"{plan.predicted.throughput_samples_per_s:.1f} samples/s; micro-batches "
        f"{plan.micro_batches}; recompute {plan.recompute}; solver {plan.solver.status}, gap "
        f"{plan.solver.gap:.2%}; search {plan.solver.seconds:.1f} s{plan.solver.effort()}"
    )
    if plan.replicated is not None:
        table.caption += f"; {plan.replicated.text()}"
    best = plan.best_hand_plan()
    if best is not None and best.step_time_s is not None and plan.predicted.step_time_s > 0:
        table.caption += (
            f"; best hand plan {shown(best.strategy)}: "
            f"{best.step_time_s / plan.predicted.step_time_s:.2f}x this plan's step time"
        )
    return table


def hand_plan_table(plan: Plan) -> TextTable:
    """The plan beside every hand plan priced with it."""
    table = TextTable(title=shown(f"{plan.model_name}: {plan.strategy} vs hand plans (predicted)"))
    for column in ("strategy", "step time", "vs this plan", "peak memory", "note"):
        table.add_column(column, justify="right" if column != "note" else "left")
    this = HandPlan(plan.strategy, plan.predicted.step_time_s, plan.predicted.peak_memory_bytes)
    for h in (this, *plan.hand_plans):
        table.add_row(
            shown(h.strategy),
            format_seconds(h.step_time_s) if h.step_time_s is not None else "-",
            _ratio(h, plan),
            format_bytes(h.peak_memory_bytes) if h.peak_memory_bytes is not None else "-",
            shown(h.note),
        )
    return table


def _ratio(hand: HandPlan, plan: Plan) -> str:
    if not hand.step_time_s or plan.predicted.step_time_s <= 0:
        return "-"
    return f"{hand.step_time_s / plan.predicted.step_time_s:.2f}x"


def shown(text: str) -> str:
    """Text from a plan as a rich table shows it: control characters escaped, markup inert."""
    return escape(printable(text))


def _span(values: tuple[int, ...]) -> str:
    """`(0, 1, 2, 3)` -> `0-3`; other tuples as a comma list."""
    if len(values) > 2 and list(values) == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ",".join(map(str, values))


def format_seconds(seconds: float) -> str:
    """`29.47 s` from a second up, `3.860 ms` below."""
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.3f} ms"


def format_bytes(nbytes: float) -> str:
    """`1.50 GiB`, `3.20 MiB`, `12.00 KiB` or `512 B`."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


REPLICATED_WARN_SHARE = 0.10  # the bar: more than a tenth of the work unsplit is loud


def replicated_warning(plan: Plan) -> str | None:
    """What to say loudly when more than REPLICATED_WARN_SHARE of the plan's FLOPs run whole on
    every device: how much, which ops lack a rule, and what to do."""
    found = plan.replicated
    if found is None or found.flops_share <= REPLICATED_WARN_SHARE:
        return None
    if found.no_rule_ops:
        fix = (
            f"{found.no_rule_flops_share:.0%} for want of an SBP rule ({', '.join(found.no_rule_ops)}): "
            "add rules in autosbp/rules/ (or rewrite those lines with ops that have one)"
        )
    else:
        fix = "every op has a rule: the planner chose it (its split costs more than it saves)"
    return (
        f"{found.flops_share:.0%} of the plan's FLOPs run whole on every device of a stage "
        f"(replicated), so more devices do not speed them up; {fix}."
    )
