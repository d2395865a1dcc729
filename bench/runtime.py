"""Benchmark: the runtime's step time against torch's own training loops, as ratios.

Run: python bench/runtime.py [--steps 20] [--warmup 3] [--quick]

Rows (design.md section 5, targets from the "Actor runtime" issue):
- data parallel: our Engine under the planner's `dp` plan on 2 gloo processes vs torch
  DistributedDataParallel on the same model, the same global batch (each DDP rank takes its
  half), the same optimizer (Adam); target ratio <= 1.05.
- one process: our Engine under a 1-device plan vs plain eager training (forward, backward,
  Adam) in the same process; target <= 1.05.
- 1F1B pipeline vs torch.distributed.pipelining: not supported yet (no pipeline stages in the
  runtime); printed as such.

How it measures: both sides live in the same processes; after `warmup` steps of each, they take
turns step by step, so each pair of steps meets the same machine load (the cores may be shared).
A step's time is the slowest rank's. Printed: each side's median step time and the ratio, the
median over pairs of ours / torch (robust to load that drifts during the run). Each process runs
`cores // processes` threads on both sides (torch.set_num_threads). The loss both sides
report is compared as a sanity check (same init, same data: the same trajectory). Models are
sized so that compute, not Python overhead, dominates a step on a 2-core CPU, yet a run takes
about a minute.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# This file is bench/runtime.py: as a script, its directory would shadow the runtime package.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch.distributed as dist  # noqa: E402 - after the path fix above
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from autosbp.capturing import capture  # noqa: E402
from autosbp.planner.api import plan_graph  # noqa: E402
from autosbp.zoo import build_model  # noqa: E402
from costmodel.launch import run_workers  # noqa: E402

TARGET_RATIO = 1.05  # the target for both rows
LR = 1e-3
WORKER_TIMEOUT_S = 600.0
# Model name -> (zoo model, its arguments). mlp: 6 square 1024 linears, batch 128 (about 5
# GFLOP a step); gpt: 2 layers of hidden 256 over 16 x 64 tokens.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mlp-1024": (
        "mlp",
        {"layers": 4, "hidden": 1024, "features": 1024, "outputs": 1024, "batch": 128},
    ),
    "gpt-small": (
        "gpt",
        {"layers": 2, "hidden": 256, "heads": 4, "vocab": 2048, "seq": 64, "batch": 16},
    ),
}
QUICK_MODELS = {
    "mlp-512": ("mlp", {"layers": 2, "hidden": 512, "features": 512, "outputs": 512, "batch": 64})
}


@dataclass(frozen=True, slots=True)
class Job:
    """What every worker runs: per model, ours (a plan) against torch's loop."""

    models: dict[str, tuple[str, dict[str, Any]]]
    plans: dict[str, dict[str, Any]]  # model name -> Plan JSON
    threads: int
    warmup: int
    steps: int


@dataclass(frozen=True, slots=True)
class Timing:
    ours_s: tuple[float, ...]
    torch_s: tuple[float, ...]
    ours_losses: tuple[float, ...]
    torch_losses: tuple[float, ...]


# ------------------------------------------------------------------------------ workers
def bench_worker(rank: int, world_size: int, job: Job) -> dict[str, Timing]:
    """On every rank: per model, an Engine and torch's loop (DDP on more than one process),
    stepped in alternating rounds; per-step times of this rank."""
    from autosbp.plan import Plan
    from runtime.engine import Engine

    torch.set_num_threads(job.threads)
    out: dict[str, Timing] = {}
    for name, (zoo_name, kwargs) in job.models.items():
        model, inputs = build_model(zoo_name, seed=0, **kwargs)
        engine = Engine(
            model,
            Plan.from_json(job.plans[name]),
            lambda params: torch.optim.Adam(params, lr=LR),
            example_inputs=inputs,
        )
        reference = _torch_step(zoo_name, kwargs, inputs, rank, world_size)
        out[name] = _alternate(functools.partial(engine.step, inputs), reference, job)
    return out


def _torch_step(
    zoo_name: str, kwargs: dict[str, Any], inputs: tuple[torch.Tensor, ...], rank: int, world: int
) -> Callable[[], float]:
    """Torch's own training step on a fresh copy of the model: eager on one process, DDP with
    this rank's slice of the batch on several."""
    model, _ = build_model(zoo_name, seed=0, **kwargs)
    local = inputs
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
        local = tuple(t.chunk(world)[rank] for t in inputs)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = model(*local)
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    return step


def _alternate(ours: Callable[[], float], theirs: Callable[[], float], job: Job) -> Timing:
    """Warm-up steps of each side, then one step of each in turn (a pair meets the same machine
    load), every step started together on all ranks."""
    times: dict[str, list[float]] = {"ours": [], "torch": []}
    losses: dict[str, list[float]] = {"ours": [], "torch": []}
    sides = (("ours", ours), ("torch", theirs))
    for side, step in sides:
        losses[side] += [step() for _ in range(job.warmup)]
    for _ in range(job.steps):
        for side, step in sides:
            dist.barrier()
            start = time.perf_counter()
            losses[side].append(step())
            times[side].append(time.perf_counter() - start)
    return Timing(
        *(tuple(times[s]) for s in ("ours", "torch")),
        *(tuple(losses[s]) for s in ("ours", "torch")),
    )


# ------------------------------------------------------------------------------ driver
def _plans(
    models: dict[str, tuple[str, dict[str, Any]]], devices: int, strategy: str
) -> dict[str, dict[str, Any]]:
    plans = {}
    for name, (zoo_name, kwargs) in models.items():
        model, inputs = build_model(zoo_name, device="meta", seed=0, **kwargs)
        graph = capture(model, list(inputs), name=zoo_name)
        plan = plan_graph(
            graph, profile="cpu-gloo", devices=devices, memory_limit=None, global_batch=None,
            optimizer="adam", dtype="fp32", strategy=strategy, time_limit_s=60,
        )  # fmt: skip
        plans[name] = plan.to_json()
    return plans


def run_row(
    models: dict[str, tuple[str, dict[str, Any]]], processes: int, args: argparse.Namespace
) -> dict[str, Timing]:
    """Plan, spawn `processes` workers, and fold their timings: a step takes the slowest rank."""
    strategy = "dp" if processes > 1 else "auto"
    job = Job(
        models, _plans(models, processes, strategy), _threads(processes), args.warmup, args.steps
    )
    per_rank = run_workers(bench_worker, processes, (job,), timeout_s=WORKER_TIMEOUT_S)
    return {
        name: Timing(
            _slowest([r[name].ours_s for r in per_rank]),
            _slowest([r[name].torch_s for r in per_rank]),
            per_rank[0][name].ours_losses,  # the full loss, the same on every rank
            _mean([r[name].torch_losses for r in per_rank]),  # DDP: each rank's half's loss
        )
        for name in models
    }


def _threads(processes: int) -> int:
    """Threads per process on both sides: the cores shared out, as run_workers does."""
    return max(1, (os.cpu_count() or 1) // processes)


def _mean(per_rank: list[tuple[float, ...]]) -> tuple[float, ...]:
    return tuple(statistics.fmean(step) for step in zip(*per_rank, strict=True))


def _slowest(per_rank: list[tuple[float, ...]]) -> tuple[float, ...]:
    return tuple(max(step) for step in zip(*per_rank, strict=True))


def _table(rows: list[tuple[str, str, int, Timing | None]], command: str) -> Table:
    table = Table(
        title="autosbp runtime vs torch (step time, median)", caption=f"regenerate: {command}"
    )
    for column in (
        "comparison",
        "model",
        "procs x threads",
        "ours ms",
        "torch ms",
        "ratio",
        "target",
        "loss rel diff",
    ):
        table.add_column(column, justify="left" if column in ("comparison", "model") else "right")
    for comparison, model, procs, timing in rows:
        if timing is None:
            table.add_row(
                comparison, model, str(procs), "-", "-", "not supported yet", "<= 1.00", "-"
            )
            continue
        ours, theirs = statistics.median(timing.ours_s), statistics.median(timing.torch_s)
        pairs = zip(timing.ours_s, timing.torch_s, strict=True)
        ratio = statistics.median(a / b for a, b in pairs)
        mark = "[green]" if ratio <= TARGET_RATIO else "[red]"
        drift = max(
            abs(a - b) / max(abs(b), 1e-30)
            for a, b in zip(timing.ours_losses, timing.torch_losses, strict=True)
        )
        table.add_row(
            comparison, model, f"{procs} x {_threads(procs)}", f"{ours * 1e3:.1f}", f"{theirs * 1e3:.1f}",
            f"{mark}{ratio:.3f}", f"<= {TARGET_RATIO}", f"{drift:.1e}",
        )  # fmt: skip
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="measured steps per side")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps per side first")
    parser.add_argument("--quick", action="store_true", help="one small mlp, few steps")
    args = parser.parse_args(argv)
    models = QUICK_MODELS if args.quick else MODELS
    if args.quick:
        args.steps, args.warmup = min(args.steps, 6), min(args.warmup, 1)
    console = Console(width=max(Console().width, 120))
    dp = run_row(models, 2, args)
    single = run_row(models, 1, args)
    rows: list[tuple[str, str, int, Timing | None]] = [
        *(("dp vs DDP", name, 2, dp[name]) for name in models),
        *(("1 process vs eager", name, 1, single[name]) for name in models),
        ("1F1B vs torch pipelining", "-", 2, None),
    ]
    command = "python bench/runtime.py " + " ".join(argv if argv is not None else sys.argv[1:])
    console.print(_table(rows, command.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
