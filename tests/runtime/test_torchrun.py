"""torchrun's environment read by `launching.torchrun` (a rank's place, or refusals naming the
variables), and the backends a job joins with. The real thing, `autosbp train` under torchrun
with 2 local processes and `--check`, runs as the README writes it (tests/cli/test_readme.py)."""

from __future__ import annotations

import pytest

from launching.errors import ExecutionError
from launching.torchrun import TorchrunWorld, process_group_backend, torchrun_world

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
