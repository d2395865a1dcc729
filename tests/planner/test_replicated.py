"""The plan states the share of its FLOPs that runs whole on every device, and why (issue #29):
in the JSON (`replicated`), in the summary, and loudly past 10%, in the command's words. The
oracle: an op without a rule has the all-B signature only, so every one of its nodes runs
replicated: that share, from the captured graph's flops, is the plan's `no_rule_flops_share`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autosbp.capturing.export import capture
from autosbp.capturing.graph import Role
from autosbp.cli import main
from autosbp.plan import Plan, summary_table
from autosbp.planner.api import auto_parallelize
from autosbp.zoo import build_model
from tests.support.unruled_models import build

MODEL = f"{Path(__file__).resolve().parents[1] / 'support' / 'unruled_models.py'}:build"


@pytest.mark.filterwarnings("ignore::autosbp.rules.UnknownOpWarning")
def test_the_share_of_ops_without_a_rule_is_stated() -> None:
    graph = capture(*build())
    flops = {n: a.flops for n, a in graph.nodes(Role.COMPUTE)}
    unruled = sum(f for n, f in flops.items() if graph.node(n).op == "aten.prod.default")
    plan = auto_parallelize(*build(), devices=2, time_limit_s=10)
    found = Plan.from_json(json.loads(json.dumps(plan.to_json()))).replicated
    assert found is not None and found == plan.replicated
    assert found.no_rule_ops == ("aten.prod.default",)
    assert found.no_rule_flops_share == pytest.approx(unruled / sum(flops.values()), rel=1e-12)
    assert found.flops_share >= found.no_rule_flops_share


def test_a_data_parallel_plan_replicates_nothing() -> None:
    plan = auto_parallelize(*build_model("mlp"), devices=2, strategy="dp", time_limit_s=10)
    assert plan.replicated is not None and plan.replicated.flops_share == 0.0


def test_an_older_plan_without_the_statement_loads() -> None:
    data = auto_parallelize(*build_model("mlp"), devices=2, strategy="dp").to_json()
    del data["replicated"]
    plan = Plan.from_json(data)
    assert plan.replicated is None and "replicated" not in str(summary_table(plan).caption)


def test_the_command_warns_loudly_in_its_own_words(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", MODEL, "--devices", "2", "--out", str(out)]) == 0
    text = capsys.readouterr()
    said = " ".join((text.out + text.err).split())
    assert "warning: " in said and "of the plan's FLOPs run whole on every device" in said
    assert "for want of an SBP rule (aten.prod.default)" in said
    assert "note: 1 op(s) have no SBP rule" in said
    assert "UnknownOpWarning" not in said and "warn_unknown_ops(ops)" not in said  # no raw line
    assert json.loads(out.read_text())["replicated"]["no_rule_ops"] == ["aten.prod.default"]
