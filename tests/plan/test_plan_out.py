"""Where `autosbp plan` writes: a default name from the model, strategy and device count, and
never over a file holding another model's or strategy's plan (or no plan) without --force."""

from __future__ import annotations

from pathlib import Path

import pytest

from autosbp.cli import main
from autosbp.commands.plan import default_out
from autosbp.plan import load_plan

MLP = ["plan", "mlp", "--devices", "2", "--time-limit-s", "30"]


@pytest.mark.parametrize(
    ("model", "strategy", "devices", "name"),
    [
        ("gpt", "auto", 8, "gpt-auto-8.json"),
        ("gpt", "megatron:tp=2,pp=2,dp=2", 8, "gpt-megatron-tp2-pp2-dp2-8.json"),
        ("path/to/my_model.py:build", "fsdp", 4, "my_model-fsdp-4.json"),
    ],
    ids=["zoo", "hand-plan", "model-file"],
)
def test_default_out(model: str, strategy: str, devices: int, name: str) -> None:
    assert default_out(model, strategy, devices) == Path(name)


def test_plan_never_replaces_another_plan_silently(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([*MLP, "--strategy", "dp"]) == 0
    dp = tmp_path / "mlp-dp-2.json"
    assert load_plan(dp).strategy == "dp"
    assert main([*MLP, "--strategy", "dp"]) == 0  # the same plan again: replaced
    capfd.readouterr()
    assert main([*MLP, "--strategy", "fsdp", "--out", str(dp)]) == 2  # another strategy
    err = capfd.readouterr().err.replace("\n", " ")
    assert "holds the dp plan of mlp for 2 devices" in err and "--force" in err, err
    assert load_plan(dp).strategy == "dp"  # untouched
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    assert main([*MLP, "--strategy", "dp", "--out", str(notes)]) == 2  # not a plan at all
    assert "not an autosbp plan" in capfd.readouterr().err
    assert notes.read_text() == '{"mine": 1}'
    assert main([*MLP, "--strategy", "fsdp", "--out", str(dp), "--force"]) == 0
    assert load_plan(dp).strategy == "fsdp"


def test_plan_refuses_a_file_it_cannot_replace_before_the_search(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """A file that is no plan, or a plan for another device count, is refused before the model
    is captured and searched (issue #31: after a search of minutes, once)."""
    monkeypatch.chdir(tmp_path)
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    assert main([*MLP, "--out", str(notes)]) == 2
    out, err = capfd.readouterr()
    assert "not an autosbp plan" in err and "samples/s" not in out, out  # no summary: no search
    assert main([*MLP, "--strategy", "dp"]) == 0
    capfd.readouterr()
    assert main(["plan", "mlp", "--devices", "4", "--out", "mlp-dp-2.json"]) == 2
    out, err = capfd.readouterr()
    err = err.replace("\n", " ")
    assert "holds a plan of mlp for 2 devices; this plan is for 4 devices" in err, err
    assert "samples/s" not in out, out
