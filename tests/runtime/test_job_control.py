"""Job control (issue #18): no deadline but a progress watchdog, ranks that die with their
parent, ranks that agree on the plan and start from rank 0's weights, a loopback-only job.

- watchdog: a job that keeps reporting runs past the old whole-job deadline (timeout + start-up
  allowance); one that stops is ended at the stall timeout, naming the rank stuck outside a
  collective and the one waiting in it, with their stacks (launcher and `autosbp train`);
- parent death: SIGKILL or SIGTERM to `autosbp train` leaves no process of the job 5 s later
  (found by a marker in their environment, never by name), and the job listened on loopback
  only while it ran;
- ranks given different plans through the API stop at once, naming the ranks (before: a hang
  until the collective timeout); so do ranks whose models capture different graphs, naming both
  fingerprints (issue #48: before, the rank whose graph missed the plan's fingerprint refused
  alone, and no rank was told two graphs were meant to run one job);
- initial state: ranks whose models start from different weights and buffers all train rank 0's
  (oracle: rank 0's model), and a model file that seeds from os.urandom passes `--check`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autosbp
import launching.workers
from autosbp.cli import main
from autosbp.plan import Plan
from launching.errors import ExecutionError
from launching.workers import report_progress, run_workers
from runtime.engine import Engine
from runtime.verify.faults import FAULT_ENV, SLOW_STEP_S
from tests.support.bad_inputs_corpus import MODELS

REPO = Path(__file__).resolve().parents[2]
MARKER_ENV = "AUTOSBP_TEST_MARKER"  # in a job's environment: how the test finds its processes
PARENT_DEATH_S = 5.0  # the bar: no rank left this long after the parent died
# Start-up of 2 ranks (interpreter, torch, a capture) is 5-15 s on 2 shared cores; a failure or
# stall ends the job within seconds of its cause. Far below the jobs' 600 s default.
BUDGET_S = 60.0
STALL_S = 1.5  # the launcher-level stall timeout: short, far above one all-reduce (~1 ms)
REPORT_EVERY_S = 0.1


# ---- the watchdog ------------------------------------------------------------------------------


def reporting_worker(rank: int, world_size: int, seconds: float, stuck_rank: int) -> int:
    """All-reduce and report every REPORT_EVERY_S for about `seconds` (a round count every rank
    agrees on: a deadline read on each rank's clock let a late rank run one all-reduce more than
    its peer, which had finished); then `stuck_rank` (if a rank) sleeps without reporting while
    the others wait in the next all-reduce."""
    x, rounds = torch.ones(1), round(seconds / REPORT_EVERY_S)
    for done in range(1, rounds + 1):
        dist.all_reduce(x)
        report_progress(f"round {done}")
        time.sleep(REPORT_EVERY_S)
    if rank == stuck_rank:
        time.sleep(10 * STALL_S)  # stuck in its own code: no report, no collective
    dist.all_reduce(x)
    return rounds


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_a_stalled_rank_is_named_with_where_it_is() -> None:
    start = time.monotonic()
    with pytest.raises(ExecutionError) as info:
        run_workers(reporting_worker, 2, (0.5, 1), timeout_s=STALL_S)
    message = str(info.value)
    assert message.startswith("ranks [0, 1] of 2 (pid 0: "), message
    assert f"made no progress for {STALL_S:g} s (the stall timeout)" in message
    assert "rank 1 outside any collective; rank 0 waiting in a collective" in message
    assert "rank 1: last reported `round " in message
    stack_of_1 = message.split("Python stack of rank 1 (innermost call first):")[1]
    assert "in reporting_worker" in stack_of_1 and "rank.py" not in stack_of_1
    assert "distributed_c10d.py" in message.split("Python stack of rank 0")[1].split("\n")[1]
    assert time.monotonic() - start < BUDGET_S


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(120)
def test_train_names_a_stalled_rank(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(FAULT_ENV, "rank=1,step=2,kind=hang")  # spawned ranks inherit it
    start = time.monotonic()
    argv = ["train", "mlp", "--nproc", "2", "--plan", "dp", "--steps", "5", "--stall-timeout", "3"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    # Which ranks' timers ran out first is a race (both reported step 2 within milliseconds);
    # where each one is, is not.
    assert re.match(r"error: (rank [01]|ranks \[0, 1\]) of 2", err), err
    assert "rank 1 outside any collective" in err and "rank 1: last reported `step 2`" in err
    assert "in inject_fault" in err.split("Python stack of rank 1")[1]
    assert time.monotonic() - start < BUDGET_S


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(180)
def test_train_runs_past_the_old_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """`autosbp train` with a 2 s stall timeout and a 10 s start-up allowance in the parent (it
    was 60 s): the old launcher's deadline for the whole job was 12 s. Rank 1's steps take
    SLOW_STEP_S (1 s, under the stall timeout) each, so 14 steps outlast that deadline whatever
    the machine's speed, and the job finishes."""
    startup_s, stall_s, steps = 10.0, 2.0, 14
    assert steps * SLOW_STEP_S > startup_s + stall_s
    monkeypatch.setattr(launching.workers, "STARTUP_S", startup_s)
    monkeypatch.setenv(FAULT_ENV, "rank=1,step=0,kind=slow")
    start = time.monotonic()
    argv = ["train", "mlp", "--nproc", "2", "--plan", "dp", "--steps", str(steps),
            "--stall-timeout", str(stall_s)]  # fmt: skip
    assert main(argv) == 0
    assert time.monotonic() - start > startup_s + stall_s


# ---- the parent dies ---------------------------------------------------------------------------


def _job_pids(marker: str) -> set[int]:
    """Processes whose environment holds `marker`: the job and its ranks, nothing else."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    pids.add(int(entry.name))
            except OSError:  # gone, or not ours to read
                continue
    return pids


def _listening(pids: set[int]) -> list[str]:
    """Local addresses (hex, as /proc/net shows them) of the TCP sockets `pids` listen on."""
    inodes = set()
    for pid in pids:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        inodes |= {link[8:-1] for link in links if link.startswith("socket:[")}
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(fields[1].rsplit(":", 1)[0])
    return found


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_ranks_die_with_their_parent(sig: signal.Signals, tmp_path: Path) -> None:
    """`autosbp train`, killed once it trains (a checkpoint of a step exists)."""
    checkpoint = tmp_path / "ckpt"
    argv = ["-m", "autosbp.cli", "train", "mlp", "--nproc", "2", "--plan", "dp", "--steps",
            "1000000", "--checkpoint-dir", str(checkpoint), "--checkpoint-every", "1"]  # fmt: skip

    def training(pids: set[int]) -> bool:
        return (checkpoint / "manifest.json").exists()

    _kill_the_parent(argv, training, sig, check_sockets=True)


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc (Linux)")
def test_ranks_die_with_their_parent_while_they_import() -> None:
    """The launcher killed while its ranks import the worker's module (20 s, as torch's can
    take on a loaded machine): a rank's parent-death signal is set before it imports anything
    slow, so none outlives its parent by PARENT_DEATH_S (when it was set after importing,
    ranks lived on for the length of their import)."""
    script = (
        "import os; from launching.workers import run_workers; from tests.support.slow_import_worker "
        "import SLOW_IMPORT_ENV, idle; os.environ[SLOW_IMPORT_ENV] = '1'; "
        "run_workers(idle, 2, timeout_s=120)"
    )

    def spawned(pids: set[int]) -> bool:
        return len(pids) >= 4  # the launcher, multiprocessing's tracker, 2 ranks

    _kill_the_parent(["-c", script], spawned, signal.SIGKILL, check_sockets=False, wait_s=1.0)


def _kill_the_parent(
    argv: list[str],
    ready: Callable[[set[int]], bool],
    sig: signal.Signals,
    *,
    check_sockets: bool,
    wait_s: float = 0.0,
) -> None:
    """Start `python *argv` with a marker, wait until `ready` (then `wait_s`), send `sig` to
    it, and assert that no process of the job is left PARENT_DEATH_S later."""
    marker = uuid.uuid4().hex
    job = subprocess.Popen(
        [sys.executable, *argv], env={**os.environ, MARKER_ENV: marker}, cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not ready(_job_pids(marker)):
            assert job.poll() is None and time.monotonic() < deadline, "the job never got ready"
            time.sleep(0.05)
        time.sleep(wait_s)
        pids = _job_pids(marker)
        if check_sockets:
            assert set(_listening(pids)) <= LOOPBACK, _listening(pids)
        os.kill(job.pid, sig)
        job.wait(timeout=PARENT_DEATH_S)
        died = time.monotonic()
        while _job_pids(marker) and time.monotonic() < died + PARENT_DEATH_S:
            time.sleep(0.1)
        assert _job_pids(marker) == set()
    finally:
        for pid in _job_pids(marker):  # ours (they carry our marker): never leave them running
            os.kill(pid, signal.SIGKILL)
        if job.poll() is None:
            job.kill()


# ---- what every rank agrees on -----------------------------------------------------------------


def different_plans_worker(rank: int, world_size: int, plans: list[dict]) -> None:
    """Rank r builds its Engine under plans[r]."""
    model, inputs = _mlp()
    Engine(model, Plan.from_json(plans[rank]), torch.optim.SGD, example_inputs=inputs)


def _mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    from autosbp.zoo import build_model

    return build_model("mlp")


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_ranks_with_different_plans_stop_at_once_naming_them() -> None:
    model, inputs = _mlp()
    plans = [
        autosbp.auto_parallelize(model, inputs, devices=2, strategy=s, time_limit_s=10).to_json()
        for s in ("dp", "fsdp")
    ]
    start = time.monotonic()
    with pytest.raises(ExecutionError) as info:
        run_workers(different_plans_worker, 2, (plans,), timeout_s=120.0)
    message = str(info.value)
    assert "PlanError: the ranks hold 2 different plans (ranks [0]: sha256 " in message
    assert "; ranks [1]: sha256 " in message and "Load one plan file on every rank" in message
    assert time.monotonic() - start < BUDGET_S  # not the collective timeout


class Chained(nn.Module):
    """Per key of `order` an add of that key's buffer, one after the other: the graph follows
    the order (a loop over a set whose body differs per process is the same in real code)."""

    def __init__(self, order: tuple[str, ...]) -> None:
        super().__init__()
        self.order = order
        for key in sorted(order):
            self.register_buffer(f"{key}_shift", torch.full((4,), float(len(key))))
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for key in self.order:
            x = x * 0.5 + getattr(self, f"{key}_shift")
        return (self.fc(x) - y).pow(2).mean()


ORDERS = [("full", "sliding"), ("sliding", "full")]  # rank r loops in ORDERS[r]


def chained_worker(rank: int, world_size: int, plan: dict) -> None:
    """Rank r builds its Engine for Chained(ORDERS[r]) under `plan` (made for ORDERS[0])."""
    model = Chained(ORDERS[rank])
    inputs = (torch.randn(4, 4), torch.randn(4, 4))
    Engine(model, Plan.from_json(plan), torch.optim.SGD, example_inputs=inputs)


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_ranks_with_different_graphs_stop_at_once_naming_both_fingerprints() -> None:
    inputs = (torch.randn(4, 4), torch.randn(4, 4))
    graphs = [autosbp.capture(Chained(order), inputs).fingerprint() for order in ORDERS]
    assert graphs[0] != graphs[1]  # the two ranks' models do differ
    plan = autosbp.auto_parallelize(Chained(ORDERS[0]), inputs, devices=2, strategy="dp")
    start = time.monotonic()
    with pytest.raises(ExecutionError) as info:
        run_workers(chained_worker, 2, (plan.to_json(),), timeout_s=120.0)
    message = str(info.value)
    assert "CaptureError: the ranks captured 2 different graphs of model `Chained`" in message
    assert f"ranks [0]: fingerprint {graphs[0]}; ranks [1]: fingerprint {graphs[1]}" in message
    assert "PYTHONHASHSEED" in message
    assert time.monotonic() - start < BUDGET_S  # not the collective timeout


class Scaled(nn.Module):
    """A linear layer and a random buffer: both must start from rank 0's values."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("scale", torch.rand(4) + 0.5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * self.scale - y).pow(2).mean()


def _scaled(seed: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(seed)
    data = torch.Generator().manual_seed(0)
    return Scaled(), (torch.randn(8, 4, generator=data), torch.randn(8, 4, generator=data))


def initial_state_worker(rank: int, world_size: int, plan: dict) -> dict[str, list]:
    """A model initialized with seed `rank`: the Engine's whole state before any step."""
    model, inputs = _scaled(seed=rank)
    engine = Engine(model, Plan.from_json(plan), torch.optim.SGD, example_inputs=inputs)
    return {name: t.tolist() for name, t in engine.full_state_dict().items()}


@pytest.mark.dist
@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_every_rank_starts_from_rank0s_parameters_and_buffers(strategy: str) -> None:
    plan = autosbp.auto_parallelize(*_scaled(0), devices=2, strategy=strategy, time_limit_s=10)
    states = run_workers(initial_state_worker, 2, (plan.to_json(),), timeout_s=120.0)
    rank0 = {name: t.tolist() for name, t in _scaled(seed=0)[0].state_dict().items()}
    rank1 = {name: t.tolist() for name, t in _scaled(seed=1)[0].state_dict().items()}
    assert all(rank0[name] != rank1[name] for name in rank0)  # the ranks did start apart
    assert states == [rank0, rank0]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_model_seeded_from_urandom_trains_like_one_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each rank's process draws its own initial weights; the job trains rank 0's, as one
    device would (`--check`: before, it failed blaming 'a rule or boxing step')."""
    (tmp_path / "bad_models.py").write_text(MODELS)
    model = f"{tmp_path}/bad_models.py:unseeded"
    argv = ["train", model, "--nproc", "2", "--plan", "dp", "--steps", "3", "--check"]
    assert main(argv) == 0, capsys.readouterr().err
    assert "matches single-device training" in capsys.readouterr().out


# ---- where a rank starts -----------------------------------------------------------------------
SURROUNDINGS_ENV = "AUTOSBP_TEST_SURROUNDINGS"


def _surroundings(rank: int, world_size: int) -> tuple[str | None, str | None, str, str]:
    return (
        os.environ.get(SURROUNDINGS_ENV), os.environ.get("AUTOSBP_DEFAULT_PROFILE"), os.getcwd(),
        sys.path[0],
    )  # fmt: skip


@pytest.mark.dist
def test_ranks_start_in_the_callers_environment_folder_and_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Ranks fork from a forkserver that an earlier world started (with that moment's
    environment, folder and path), yet see the caller's as they are at the call: a variable
    set and one removed since (`launching.rank.worker`), another working folder and first
    import path (multiprocessing's preparation)."""
    run_workers(_surroundings, 2, timeout_s=60)  # the server runs from here on, if not before
    monkeypatch.setenv(SURROUNDINGS_ENV, "set after the server started")
    monkeypatch.delenv("AUTOSBP_DEFAULT_PROFILE")  # tests/conftest.py's, the server's too
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    got = run_workers(_surroundings, 2, timeout_s=60)
    assert got == [("set after the server started", None, str(tmp_path), str(tmp_path))] * 2
