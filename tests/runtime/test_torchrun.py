"""torchrun's environment read by `launching.torchrun` (a rank's place, or refusals naming the
variables), and the backends a job joins with. The real thing, `autosbp train` under torchrun
with 2 local processes and `--check`, runs as docs/cluster.md writes it (tests/cli/test_readme.py)."""

from __future__ import annotations

import pytest

from launching.errors import ExecutionError
from launching.torchrun import (
    TorchrunWorld,
    process_group_backend,
    threads_per_rank,
    torchrun_world,
)

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


@pytest.mark.parametrize(
    ("env", "world", "cores", "want"),
    [
        pytest.param({"OMP_NUM_THREADS": "3"}, TorchrunWorld(0, 2, 0, 1), 16, None, id="set"),
        pytest.param({"MASTER_ADDR": "node0"}, TorchrunWorld(0, 16, 0, 1), 16, 16, id="own-node"),
        pytest.param({"MASTER_ADDR": "node0"}, TorchrunWorld(0, 16, 0, 4), 16, 4, id="4-per-node"),
        pytest.param({"MASTER_ADDR": "localhost"}, TorchrunWorld(1, 2, 0, 1), 2, 1, id="loopback"),
        pytest.param({"MASTER_ADDR": "127.0.0.1"}, TorchrunWorld(1, 4, 0, 1), 2, 1, id="crowded"),
    ],
)
def test_threads_per_rank(
    env: dict[str, str], world: TorchrunWorld, cores: int, want: int | None
) -> None:
    """torchrun sets OMP_NUM_THREADS only when a node runs several processes: otherwise each
    rank takes its share of the cores of its machine (the whole world's, on loopback)."""
    assert threads_per_rank(world, env, cores) == want
