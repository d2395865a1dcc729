"""End to end through the CLI: `autosbp demo` plans, trains on text on gloo processes beside a
plain PyTorch loop and plans GPT-3; `autosbp train --check` with a saved plan matches one
device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autosbp.cli import main
from autosbp.plan import load_plan


@pytest.mark.slow
@pytest.mark.dist
def test_demo_plans_trains_on_text_and_plans_gpt3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["demo", "--nproc", "2", "--steps", "8", "--gpt3-layers", "16", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "(autosbp) vs" in out and "(plain PyTorch)" in out  # the held-out losses, side by side
    assert "auto vs hand plans" in out
    assert "auto vs Megatron-LM" in out
    plan = load_plan(tmp_path / "plan.json")
    assert plan.device_count == 2 and plan.dtype == "bf16" and plan.clips_gradients
    assert load_plan(tmp_path / "gpt3-plan.json").device_count == 1024
    for name in ("loss.png", "timeline.png", "trace.json", "metrics.jsonl"):
        assert (tmp_path / name).stat().st_size > 0, name
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, 9))
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [2, 4, 6, 8]


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
