"""`autosbp train` under torchrun: one rank per process, read from torchrun's environment
(`costmodel.torchrun`), the plan made once on rank 0, `--check` against one device. The real
thing: torchrun (torch.distributed.run --standalone) with 2 local processes, gloo on the CPU,
as a 2-node job runs with --nnodes 2 and a rendezvous endpoint instead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from autosbp.timeline import read_trace
from costmodel.errors import ExecutionError
from costmodel.torchrun import TorchrunWorld, process_group_backend, torchrun_world

REPO = Path(__file__).resolve().parents[1]
FULL = {
    "TORCHELASTIC_RUN_ID": "job",
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29500",
}


@pytest.mark.parametrize(
    ("environ", "want"),
    [
        pytest.param({}, None, id="not-torchrun"),
        pytest.param({"RANK": "0"}, None, id="rank-alone-is-not-torchrun"),
        pytest.param(FULL, TorchrunWorld(3, 4, 1, 2), id="second-node"),
        pytest.param(
            {k: v for k, v in FULL.items() if k != "LOCAL_WORLD_SIZE"},
            TorchrunWorld(3, 4, 1, 4),
            id="no-local-world-size",
        ),
    ],
)
def test_torchrun_world(environ: dict[str, str], want: TorchrunWorld | None) -> None:
    assert torchrun_world(environ) == want


@pytest.mark.parametrize(
    ("change", "words"),
    [
        pytest.param({"MASTER_PORT": None}, "lacks MASTER_PORT", id="half-there"),
        pytest.param({"RANK": "two"}, "not whole numbers", id="not-a-number"),
        pytest.param({"RANK": "4"}, "contradict each other", id="rank-past-world"),
    ],
)
def test_torchrun_world_refuses(change: dict[str, str | None], words: str) -> None:
    environ = {k: v for k, v in {**FULL, **change}.items() if v is not None}
    with pytest.raises(ExecutionError, match=words):
        torchrun_world(environ)


@pytest.mark.parametrize(
    ("backend", "want"),
    [("gloo", "gloo"), ("nccl", "cpu:gloo,cuda:nccl")],
    ids=["gloo", "nccl-with-gloo-for-cpu"],
)
def test_process_group_backend(backend: str, want: str) -> None:
    assert process_group_backend(backend) == want


def test_train_under_torchrun_with_two_processes(tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "autosbp.cli", "train", "mlp", "--plan", "dp", "--steps", "2", "--check",
        "--device", "cpu", "--backend", "gloo", "--trace", str(trace),
    ]  # fmt: skip
    # this checkout first on the path (the ranks run from tmp_path), gloo on loopback
    path = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
    env = {**os.environ, "PYTHONPATH": path, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert out.count("mlp: dp plan, mesh 2") == 1, out  # rank 0 alone prints the table
    assert "matches single-device training" in out, out  # --check's verdict
    assert "training 2 steps on 2 processes: done" in out and "ms/step, 2/2" in out, out
    written = read_trace(trace)  # written once, by rank 0, with every rank's firings
    assert {e.rank for e in written.events} == {0, 1}
    assert written.plan_digest is not None
