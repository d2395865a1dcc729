"""The other way to get a world: this process is one rank that torchrun started (multi-node jobs).

Lives here: `torchrun_world` (this process's rank, read from torchrun's environment, or None when
torchrun did not start it), `join_torchrun_world` (init the process group through torchrun's
store), and `process_group_backend` (what `init_process_group` is given for a job's backend,
shared with `launching.workers`). Lives elsewhere: starting local ranks ourselves
(`launching.workers.run_workers`), what a rank does (`runtime.jobs`).

Invariants:
- Backends: "gloo" (CPU tensors) or "nccl", which joins the world as "cpu:gloo,cuda:nccl": CUDA
  tensors go through NCCL, the few CPU tensors of start-up (the plans' digests, a step's time)
  through gloo, since NCCL has no CPU path.
- A job under torchrun is watched by torchrun's agent (it ends every rank when one exits), not
  by `launching.workers`: there, the collectives' timeout bounds every wait.
- With "nccl", a rank takes the GPU of its local rank before it joins.
- Where OMP_NUM_THREADS is unset, a rank takes its share of this machine's cores
  (`threads_per_rank`), as a spawned local rank does (`launching.rank`).
Reference: torch.distributed.run's documentation, "Environment Variables".
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from launching.backends import BACKENDS
from launching.errors import ExecutionError

__all__ = [
    "BACKENDS", "TorchrunWorld", "join_torchrun_world", "process_group_backend",
    "threads_per_rank", "torchrun_world",
]  # fmt: skip

# What torchrun sets for each rank; TORCHELASTIC_RUN_ID alone says a process was started by it.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def process_group_backend(backend: str) -> str:
    """What `init_process_group` is given for a job's backend (see the header's invariants)."""
    if backend not in BACKENDS:
        raise ExecutionError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}.")
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


@dataclass(frozen=True, slots=True)
class TorchrunWorld:
    """This process's place in a world that torchrun started: global rank, world size, rank on
    this node and ranks on this node."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def torchrun_world(environ: Mapping[str, str] | None = None) -> TorchrunWorld | None:
    """This process's rank when torchrun started it (its environment says so: TORCHELASTIC_RUN_ID,
    or RANK, WORLD_SIZE and LOCAL_RANK), else None. ExecutionError when the environment is
    half there or not numbers, naming the variables."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in env and not all(
        k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    ):
        return None
    missing = [k for k in TORCHRUN_VARIABLES if k not in env]
    fix = "launch with `torchrun ... -m autosbp.cli train ...`, which sets them all"
    if missing:
        raise ExecutionError(
            f"this process looks started by torchrun but its environment lacks {', '.join(missing)}; "
            f"{fix}."
        )
    try:
        rank, world, local = (int(env[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    except ValueError:
        shown = ", ".join(f"{k}={env.get(k)!r}" for k in (*TORCHRUN_VARIABLES, "LOCAL_WORLD_SIZE"))
        raise ExecutionError(
            f"torchrun's variables are not whole numbers ({shown}); {fix}."
        ) from None
    if not (0 <= rank < world and 0 <= local < local_world):
        raise ExecutionError(
            f"torchrun's variables contradict each other: RANK={rank}, WORLD_SIZE={world}, "
            f"LOCAL_RANK={local}, LOCAL_WORLD_SIZE={local_world}; {fix}."
        )
    return TorchrunWorld(rank, world, local, local_world)


def threads_per_rank(world: TorchrunWorld, env: Mapping[str, str], cores: int) -> int | None:
    """Intra-op threads for this rank where OMP_NUM_THREADS is unset (None where it is set:
    the user's choice). torchrun sets it to 1 only when a node runs more than one process, so
    with --nproc-per-node 1 every rank would take every core; two such ranks on one machine
    (a loopback rendezvous) ran 10-40x slower. The cores are shared by the ranks on this machine:
    LOCAL_WORLD_SIZE of them, or the whole world where the rendezvous is on loopback."""
    if env.get("OMP_NUM_THREADS"):
        return None
    host = env.get("MASTER_ADDR", "")
    loopback = host in ("localhost", "::1") or host.startswith("127.")
    here = world.world_size if loopback else world.local_world_size
    return max(1, cores // max(1, here))


def _cores() -> int:
    """The cores this process may run on (its affinity, which containers and taskset narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def join_torchrun_world(world: TorchrunWorld, backend: str, timeout_s: float) -> None:
    """Join the world torchrun started (its MASTER_ADDR:MASTER_PORT store); with "nccl", this
    rank takes the GPU of its local rank first. Collectives time out after `timeout_s`."""
    pg_backend = process_group_backend(backend)
    threads = threads_per_rank(world, os.environ, _cores())
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # and for whatever this rank starts
    if backend == "nccl":
        import torch

        torch.cuda.set_device(world.local_rank)
    dist.init_process_group(
        pg_backend, rank=world.rank, world_size=world.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )  # fmt: skip
