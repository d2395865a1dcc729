"""A job killed at any point of a checkpoint publish, or at a step, resumes from its last
complete checkpoint (issue #31 item 4: killed between the two renames, `--resume` trained from
step 0 and its first save deleted the good checkpoint left at DIR.old); two jobs on one folder.

Oracle: the uninterrupted run (`autosbp train mlp --nproc 2 --steps 6 --checkpoint-every 1`),
whose last checkpoint (after step 6) a killed-and-resumed run (`--checkpoint-every 2`) must
equal bit for bit (`test_a_killed_job_resumes_from_the_cli_as_if_uninterrupted` says why that
is exact; how often a job saves does not change its numbers). The kills are real: rank 1
SIGKILLs itself before step 3 (`runtime.verify.faults`), or rank 0's process SIGKILLs itself
just before (or halfway through) the K-th rename or removal of DIR, DIR.tmp or DIR.old
(tests/support/publish_kill/sitecustomize.py, on the ranks' PYTHONPATH). Those are, in order:
the first save's rename of DIR.tmp to DIR (1); the second save's move of DIR to DIR.old (2),
its rename of DIR.tmp to DIR (3), its removal of DIR.old (4).

The uninterrupted run is also issue 48 item 5's test (two jobs sharing one checkpoint folder
destroyed it): two identical `autosbp train ... --checkpoint-dir DIR --checkpoint-every 1`
jobs run at once (one in a new process, one in this test's); one must be refused before it
trains (naming the other's pid and host), and the other's checkpoint must be whole (every file's sha256 as its manifest says) and
the one every killed-and-resumed run here equals bit for bit.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from autosbp.cli import main
from autosbp.plan import save_plan
from autosbp.planner.api import auto_parallelize
from autosbp.zoo import build_model
from runtime.state.checkpoint import read_manifest
from runtime.state.checkpoint_lock import lock_path
from runtime.verify.faults import FAULT_ENV

HOOK_DIR = Path(__file__).resolve().parents[1] / "support" / "publish_kill"
REPO = Path(__file__).resolve().parents[2]

# (id, the rename or removal killed at (1-based), killed halfway through it, the step resumed at):
# the three states a resume must read apart (two CLI jobs each, the suite's time): no DIR but a
# DIR.tmp; DIR.old the only whole one (issue #31's loss); DIR whole beside a half-removed
# DIR.old. A kill at 2 (DIR and DIR.tmp whole) or at 4 before removing (DIR and DIR.old whole)
# leaves what these do: a DIR.tmp to drop, or a DIR.old to drop.
KILLS = [
    ("before-the-first-publish", 1, False, 0),
    ("between-the-renames", 3, False, 2),
    ("halfway-removing-the-old", 4, True, 4),
]


CLI_STEPS, CLI_EVERY, KILLED_AT = 6, 2, 3  # rank 1 dies before step 3: the step-2 save survives
CLI = "import sys; from autosbp.cli import main; sys.exit(main(sys.argv[1:]))"


def _train_argv(plan: Path, directory: Path, *extra: str) -> list[str]:
    return ["train", "mlp", "--nproc", "2", "--plan", str(plan), "--steps", str(CLI_STEPS),
            "--checkpoint-dir", str(directory), "--checkpoint-every", str(CLI_EVERY), *extra]  # fmt: skip


def _cli_train(plan: Path, directory: Path, *extra: str) -> int:
    return main(_train_argv(plan, directory, *extra))


def _saved_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every rank file (state and optimizer), keyed by rank and name."""
    manifest = read_manifest(directory)
    return {
        f"{record.rank}:{key}": tensor
        for record in manifest.files
        for key, tensor in torch.load(directory / record.name, weights_only=True).items()
    }


class Job(NamedTuple):
    pid: int
    code: int
    out: str
    err: str


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[Job]]:
    """The plan, the uninterrupted run's checkpoint directory, and the two jobs started on it
    together: one in a new process, then one in this one (whose imports are done: it takes
    the folder first, but either may win), both run to their end."""
    root = tmp_path_factory.mktemp("publish")
    model, inputs = build_model("mlp")
    plan = auto_parallelize(model, inputs, devices=2, strategy="dp", time_limit_s=10)
    plan_path = save_plan(plan, root / "plan.json")
    argv = ["train", "mlp", "--nproc", "2", "--plan", str(plan_path), "--steps", str(CLI_STEPS),
            "--checkpoint-dir", str(root / "whole"), "--checkpoint-every", "1"]  # fmt: skip
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    with pytest.MonkeyPatch.context() as patch:  # rank 1 steps slowly: the jobs overlap
        patch.setenv(FAULT_ENV, "rank=1,step=0,kind=slow")  # (this one's ranks start at once)
        other = subprocess.Popen([sys.executable, "-c", CLI, *argv], cwd=REPO, **pipes)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    here = Job(os.getpid(), code, out.getvalue(), err.getvalue())
    other_out, other_err = other.communicate(timeout=240)
    return plan_path, root / "whole", [here, Job(other.pid, other.returncode, other_out, other_err)]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(300)
def test_of_two_jobs_on_one_folder_one_is_refused_up_front_and_the_other_saves_whole(
    uninterrupted: tuple[Path, Path, list[Job]],
) -> None:
    _, whole, jobs = uninterrupted
    (made,) = [job for job in jobs if job.code == 0]
    (refused,) = [job for job in jobs if job.code != 0]
    assert refused.code == 2 and "Traceback" not in refused.err + made.err
    holder = f"is in use by the job of pid {made.pid} on host {socket.gethostname()}"
    assert holder in " ".join(refused.err.split()), refused.err
    assert "Wait for that job to end, or choose another folder" in " ".join(refused.err.split())
    assert "loss" not in refused.out and "step" not in refused.out  # it trained nothing
    manifest = read_manifest(whole)
    assert manifest.step == CLI_STEPS
    for record in manifest.files:
        data = (whole / record.name).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (record.size_bytes, record.sha256)
    assert not lock_path(whole).exists()  # released at the end


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("at", "midway", "resumed_at"), [k[1:] for k in KILLS], ids=[k[0] for k in KILLS]
)
def test_a_kill_during_a_publish_resumes_from_the_last_complete_checkpoint(
    uninterrupted: tuple[Path, Path, list[Job]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    at: int,
    midway: bool,
    resumed_at: int,
) -> None:
    plan_path, whole, _ = uninterrupted
    broken = tmp_path / "ckpt"
    hook = {  # a new interpreter runs it: the job's, hence its forkserver's and ranks'
        "PYTHONPATH": os.pathsep.join([str(HOOK_DIR), os.environ.get("PYTHONPATH") or str(REPO)]),
        "PUBLISH_KILL_DIR": str(broken),
        "PUBLISH_KILL_AT": str(at),
        "PUBLISH_KILL_MIDWAY": "1" if midway else "0",
    }
    killed = subprocess.run(
        [sys.executable, "-c", CLI, *_train_argv(plan_path, broken)], cwd=REPO, env={**os.environ, **hook},
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert killed.returncode == 2, killed.stderr  # rank 0 was killed
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


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_killed_job_resumes_from_the_cli_as_if_uninterrupted(
    uninterrupted: tuple[Path, Path, list[Job]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`autosbp train --checkpoint-dir D --checkpoint-every 2`: killed before step 3, the job
    has lost one step (at most 2); `--resume` trains steps 2..5, and its last checkpoint equals
    an uninterrupted run's bit for bit: the same plan, processes and kernels replay the same
    arithmetic, and a checkpoint restores the parameters and Adam's moments and step exactly."""
    plan_path, whole, _ = uninterrupted
    broken = tmp_path / "broken"
    with monkeypatch.context() as patch:
        patch.setenv(FAULT_ENV, f"rank=1,step={KILLED_AT},kind=kill")
        assert _cli_train(plan_path, broken) == 2
    saved_step = read_manifest(broken).step
    assert saved_step == 2 and KILLED_AT - saved_step <= CLI_EVERY
    assert _cli_train(plan_path, broken) == 2  # a checkpoint is never overwritten unasked
    assert "pass --resume to continue from it" in capsys.readouterr().err
    assert _cli_train(plan_path, broken, "--resume") == 0
    assert f"resuming from the checkpoint in {broken} at step 2" in capsys.readouterr().out
    assert read_manifest(broken).step == read_manifest(whole).step == 6
    got, want = _saved_tensors(broken), _saved_tensors(whole)
    assert got.keys() == want.keys()
    differ = [key for key in want if not torch.equal(got[key], want[key])]
    assert differ == [], f"resumed tensors differ from the uninterrupted run's: {differ}"
    assert _cli_train(plan_path, broken, "--resume") == 0  # nothing left: says so, trains nothing
    assert "nothing left to train" in capsys.readouterr().out
