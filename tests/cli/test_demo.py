"""End to end through the CLI: `autosbp demo` plans, trains on gloo processes and matches one
device; `autosbp train --check` with a saved plan does the same for another model."""

from __future__ import annotations

from pathlib import Path

import pytest

from autosbp.cli import main
from autosbp.plan import load_plan


@pytest.mark.slow
@pytest.mark.dist
def test_demo_plans_trains_and_matches_one_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["demo", "--nproc", "2", "--steps", "3", "--gpt3-layers", "16", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "matches single-device training" in out
    assert "auto vs hand plans" in out
    assert "auto vs Megatron-LM" in out
    assert load_plan(tmp_path / "plan.json").device_count == 2
    assert load_plan(tmp_path / "gpt3-plan.json").device_count == 1024
    assert (tmp_path / "timeline.png").stat().st_size > 0
    assert (tmp_path / "trace.json").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.dist
def test_train_with_a_saved_plan_and_micro_batches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan_path = tmp_path / "plan.json"
    args = ["mlp", "--model-args", "batch=8"]
    assert (
        main(["plan", *args, "--devices", "2", "--micro-batches", "2", "--out", str(plan_path)])
        == 0
    )
    assert load_plan(plan_path).micro_batches == 2
    code = main(
        ["train", *args, "--nproc", "2", "--plan", str(plan_path), "--steps", "3", "--check"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "matches single-device training" in out
