"""A plan's tables read as tables wherever they are printed: `print(summary_table(plan))` in a
script, `str(...)`, and a rich console (the CLI). The oracle: rich's own rendering of the same
table on a plain console."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable

import pytest
from rich.console import Console
from rich.table import Table

from autosbp.plan import HandPlan, Plan, hand_plan_table, summary_table
from autosbp.plan.tables import TEXT_WIDTH
from tests.plan.test_plan_json import sample_plan


def with_hand_plans() -> Plan:
    return dataclasses.replace(sample_plan(), hand_plans=(HandPlan("dp", 0.02, 2048),))


TABLES: dict[str, Callable[[Plan], Table]] = {
    "summary": lambda plan: summary_table(plan),
    "hand-plans": lambda plan: hand_plan_table(plan),
}


@pytest.mark.parametrize("which", list(TABLES), ids=list(TABLES))
def test_table_prints_as_text(which: str, capsys: pytest.CaptureFixture[str]) -> None:
    table = TABLES[which](with_hand_plans())
    print(table)
    printed = capsys.readouterr().out
    assert "rich.table" not in printed and "object at 0x" not in printed
    plain = io.StringIO()
    Console(file=plain, width=TEXT_WIDTH, color_system=None, highlight=False).print(table)
    assert printed == plain.getvalue()  # the table, as rich draws it
    assert str(table) == printed.rstrip("\n")
    assert "mlp" in printed and "\x1b" not in printed  # the title; no control codes
    assert isinstance(table, Table)  # a rich console still prints it as a table
