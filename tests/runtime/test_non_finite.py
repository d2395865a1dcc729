"""A nan or inf stops the job at its step (issue #29): the error names the step and what is not
finite (the loss, or the first parameter whose gradient is not), the exit is non-zero, and the
checkpoint saved before it is the one a job that ended there saves; `--skip-non-finite` makes
such steps skip their update and the job go on.

The model reaches a nan at its third step by itself: with Adam at lr 1 its scalar `a` moves 0 ->
1 -> 1.98 (the first step moves it by exactly lr, the second by 0.98), so 1.5 - a turns negative
at step 3 (the table's numbering, from 1: the error names that step, issue #48). Its square root is then nan in the loss, or, under `torch.where(a < 1.5, sqrt, 0)`, a
finite loss whose gradient is nan (0 / nan in sqrt's backward).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from autosbp.cli import main
from runtime.parallel.grad_norm import _not_finite
from runtime.state.checkpoint_format import read_manifest

MODEL = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, where):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.a = nn.Parameter(torch.zeros(()))
        self.where = where

    def forward(self, x, y):
        fit = (self.fc(x) - y).pow(2).mean()
        if self.where:
            return fit + torch.where(self.a < 1.5, torch.sqrt(1.5 - self.a), 0.0)
        return fit + torch.sqrt(1.5 - self.a)


def build(where=False):
    torch.manual_seed(0)  # the same weights in every job: the checkpoints compare bit for bit
    g = torch.Generator().manual_seed(0)
    return Net(where), (torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g))
"""
NAN_STEP = 3  # as the table numbers steps (from 1): two steps complete before it


def _train(model: Path, *extra: str, where: bool = False) -> int:
    argv = ["train", f"{model}:build", "--nproc", "2", "--plan", "dp", "--lr", "1",
            "--model-args", f"where={str(where).lower()}", *extra]  # fmt: skip
    return main(argv)


def _parameters(directory: Path) -> dict[str, torch.Tensor]:
    """Rank 0's saved tensors (dp: whole copies), every key of its file."""
    manifest = read_manifest(directory)
    record = next(r for r in manifest.files if r.rank == 0)
    return torch.load(directory / record.name, weights_only=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "nan_model.py"
    path.write_text(MODEL)
    return path


@pytest.fixture(scope="module")
def ended(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The oracle of a stopped or skipping job: the checkpoint of a job asked for exactly the
    steps before the nan."""
    directory = tmp_path_factory.mktemp("ended") / "ckpt"
    assert _train(model, "--steps", str(NAN_STEP - 1), "--checkpoint-dir", str(directory)) == 0
    return directory


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_nan_loss_stops_the_job_at_its_step_with_the_checkpoint_intact(
    model: Path, ended: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stopped = tmp_path / "stopped"
    code = _train(
        model, "--steps", "5", "--checkpoint-dir", str(stopped), "--checkpoint-every", "2"
    )
    err = capsys.readouterr().err
    assert code != 0
    assert f"step {NAN_STEP}: the loss is nan, so the job stopped" in err, err
    assert f"The checkpoint in {stopped} (after 2 steps) is intact" in err, err
    assert "--skip-non-finite" in err and "Traceback" not in err, err
    assert read_manifest(stopped).step == read_manifest(ended).step == 2
    got, want = _parameters(stopped), _parameters(ended)
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_nan_gradient_under_a_finite_loss_names_its_parameter(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _train(model, "--steps", "4", where=True) != 0
    err = capsys.readouterr().err
    assert f"step {NAN_STEP}: the gradient of `a` is not finite (nan or inf)" in err, err
    assert "No checkpoint" not in err  # no --checkpoint-dir: nothing said of one


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_skip_non_finite_skips_the_updates_and_goes_on(
    model: Path, ended: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    skipped = tmp_path / "skipped"
    assert _train(model, "--steps", "4", "--skip-non-finite", "--checkpoint-dir", str(skipped)) == 0
    out = capsys.readouterr().out
    assert out.count("nan (skipped)") == 2, out  # steps 3 and 4: a no longer moves
    got, want = _parameters(skipped), _parameters(ended)
    # no update since step 2: every parameter as after 2 steps (Adam's state too)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


def test_skip_non_finite_with_check_is_refused(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _train(model, "--steps", "2", "--skip-non-finite", "--check") != 0
    assert "pass one of them" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("grads", "flagged"),
    [
        ([torch.ones(4), torch.full((3,), 1e30)], []),  # squares overflow fp32: still finite
        ([torch.ones(4), torch.tensor([1.0, math.nan])], [1]),
        ([torch.tensor([-math.inf]), torch.full((2,), 1e30), torch.zeros(2)], [0]),
    ],
    ids=["overflowing-squares-are-finite", "nan", "inf-beside-overflow"],
)
def test_the_two_norm_screen_flags_exactly_the_non_finite_gradients(
    grads: list[torch.Tensor], flagged: list[int]
) -> None:
    """Oracle: torch.isfinite over every element (the 2-norm screens, the max-norm confirms)."""
    expected = [i for i, g in enumerate(grads) if not bool(torch.isfinite(g).all())]
    assert expected == flagged
    norms = torch.stack(torch._foreach_norm(grads, 2))
    assert _not_finite(grads, norms) == flagged
