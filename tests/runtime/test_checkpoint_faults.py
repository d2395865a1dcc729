"""A job killed at any point of a checkpoint publish resumes from its last complete checkpoint
(issue #31 item 4: killed between the two renames, `--resume` trained from step 0 and its first
save deleted the good checkpoint left at DIR.old).

Oracle: the uninterrupted run (`autosbp train mlp --nproc 2 --steps 6 --checkpoint-every 2`,
saving after steps 2, 4 and 6), whose last checkpoint a killed-and-resumed run must equal bit
for bit (tests/runtime/test_checkpoint.py says why that is exact). The kill is real: rank 0's
process SIGKILLs itself just before (or halfway through) the K-th rename or removal of DIR,
DIR.tmp or DIR.old (tests/support/publish_kill/sitecustomize.py, on the ranks' PYTHONPATH).
Those are, in order: the first save's rename of DIR.tmp to DIR (1); the second save's move of
DIR to DIR.old (2), its rename of DIR.tmp to DIR (3), its removal of DIR.old (4).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from autosbp.plan import save_plan
from autosbp.planner.api import auto_parallelize
from autosbp.zoo import build_model
from runtime.state.checkpoint import read_manifest
from tests.runtime.test_checkpoint import _cli_train, _saved_tensors

HOOK_DIR = Path(__file__).resolve().parents[1] / "support" / "publish_kill"
REPO = Path(__file__).resolve().parents[2]

# (id, the rename or removal killed at (1-based), killed halfway through it, the step resumed at)
KILLS = [
    ("before-the-first-publish", 1, False, 0),
    ("before-moving-the-old-aside", 2, False, 2),
    ("between-the-renames", 3, False, 2),
    ("before-removing-the-old", 4, False, 4),
    ("halfway-removing-the-old", 4, True, 4),
]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The plan and the uninterrupted run's checkpoint directory."""
    root = tmp_path_factory.mktemp("publish")
    model, inputs = build_model("mlp")
    plan = auto_parallelize(model, inputs, devices=2, strategy="dp", time_limit_s=10)
    plan_path = save_plan(plan, root / "plan.json")
    assert _cli_train(plan_path, root / "whole") == 0
    return plan_path, root / "whole"


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("at", "midway", "resumed_at"), [k[1:] for k in KILLS], ids=[k[0] for k in KILLS]
)
def test_a_kill_during_a_publish_resumes_from_the_last_complete_checkpoint(
    uninterrupted: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    at: int,
    midway: bool,
    resumed_at: int,
) -> None:
    plan_path, whole = uninterrupted
    broken = tmp_path / "ckpt"
    with monkeypatch.context() as patch:
        paths = [str(HOOK_DIR), os.environ.get("PYTHONPATH") or str(REPO)]
        patch.setenv("PYTHONPATH", os.pathsep.join(paths))
        patch.setenv("PUBLISH_KILL_DIR", str(broken))
        patch.setenv("PUBLISH_KILL_AT", str(at))
        patch.setenv("PUBLISH_KILL_MIDWAY", "1" if midway else "0")
        assert _cli_train(plan_path, broken) == 2  # rank 0 was killed
    capsys.readouterr()
    assert _cli_train(plan_path, broken, "--resume") == 0
    out = capsys.readouterr().out
    if resumed_at:
        assert f"resuming from the checkpoint in {broken} at step {resumed_at}" in out
    else:
        assert "resuming" not in out
    assert ("put back from ckpt.old" in out) == (at == 3)
    assert read_manifest(broken).step == read_manifest(whole).step == 6
    got, want = _saved_tensors(broken), _saved_tensors(whole)
    assert got.keys() == want.keys()
    differ = [key for key in want if not torch.equal(got[key], want[key])]
    assert differ == [], f"resumed tensors differ from the uninterrupted run's: {differ}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no .tmp or .old left
