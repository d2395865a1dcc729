"""Benchmark: the runtime's step time against torch's own training loops, as ratios.

Run: python bench/runtime.py [--steps 20] [--warmup 3] [--quick]

Rows, each with its target:
- data parallel: our Engine under the planner's `dp` plan on 2 gloo processes vs torch
  DistributedDataParallel on the same model, the same global batch (each DDP rank takes its
  half), the same optimizer (Adam); target ratio <= 1.05.
- dp with the distributed optimizer: our Engine under `megatron:tp=1,pp=1,dp=2,zero=1` (Adam's
  states split over the 2 gloo processes: gradients reduce-scattered, updated shards
  all-gathered) vs DDP with torch.distributed.optim.ZeroRedundancyOptimizer over Adam (each
  rank steps its share of whole parameters and broadcasts them); target <= 1.05.
- fsdp: our Engine under the planner's `fsdp` plan on 2 gloo processes vs torch FSDP2
  (`torch.distributed.fsdp.fully_shard` on each repeated block and the root,
  reshard_after_forward=True, its default prefetching), each rank half the batch, Adam; our
  gathers run as the plan says (`--regather`, `--prefetch N`: as asked instead, e.g. as FSDP2
  runs: `--regather --prefetch 1`); target <= 1.05.
- bf16 (issue #45): our Engine under `dp` and `fsdp` plans made in bf16 (bf16 compute, fp32
  masters, optimizer states and gradient sums) vs DDP with forward under
  `torch.autocast("cpu", bfloat16)` (fp32 weights and Adam) and vs FSDP2 with
  `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`; target <= 1.05; the
  losses agree to bf16's rounding (the two recipes round differently).
- one process: our Engine under a 1-device plan vs plain eager training (forward, backward,
  Adam) in the same process; target <= 1.05.
- 2-stage 1F1B: our Engine under the `megatron:tp=1,pp=2,dp=1,mb=4` plan vs
  torch.distributed.pipelining's `Schedule1F1B` (4 micro-batches, the loss scaled by 1/4, Adam
  per stage) on the same model cut at the same place: each torch stage holds exactly the
  parameters the plan puts on that stage (checked), so the blocks are dealt as
  autosbp.planner.space.stages.split_stages deals them; target <= 1.0.
- 2-stage interleaved 1F1B: our Engine under `megatron:tp=1,pp=2,dp=1,vp=2,mb=4` (2 chunks per
  rank) vs torch.distributed.pipelining's `ScheduleInterleaved1F1B` on the same 4 chunks (a
  `PipelineStage` per chunk, 2 per rank), on models of 4 blocks (one per chunk); target <= 1.0.
- cp=2 (issue #30): our Engine under `megatron:tp=1,pp=1,dp=1,cp=2` (the sequence split in two,
  causal attention's keys and values all-gathered, its halves balanced) on a long-sequence zoo
  gpt (`CONTEXT_MODELS`) vs the same training on one process with the whole sequence (eager, run
  on each rank at once: each rank is one such process, with its share of the cores); target
  <= 0.75 (set here: each process does half the work, plus the exchanges). Torch's own
  `context_parallel` (torch.distributed.tensor.experimental, torch 2.13) does not run on CPU: its
  sharding dispatch has no strategy for `aten._scaled_dot_product_flash_attention_for_cpu`
  (NotImplementedError), and under the math backend (`sdpa_kernel(SDPBackend.MATH)`) the causal
  mask, a plain tensor, meets the DTensor scores ("aten.add.Tensor got mixed torch.Tensor and
  DTensor"); so this row has no torch peer. A second row runs `...,cp=2,ring=1`: the ring kernel
  (keys and values passed around the ring, each step beside the step's compute).
- tp=2 overlapped (issue #47 item 2): our Engine under `megatron:tp=2,pp=1,dp=1` of a wide MLP
  whose row-parallel linears run in 4 chunks, each chunk's all-reduce started while the next
  computes, and in backward each chunk's dual all-reduce travelling while the chunk before runs
  its gradient matmuls (`NodePlan.overlap_chunks`, set on every such linear), vs the same plan
  run whole, stepped in turn; printed with the cpu-gloo profile's overlap efficiency beside it
  (what the planner assumes such overlap hides). No torch peer: the comparison is the plan
  without overlap. `--overlap` runs this row alone.

How it measures: both sides live in the same processes; after `warmup` steps of each, they take
turns step by step, so each pair of steps meets the same machine load (the cores may be shared).
A step's time is the slowest rank's. Printed: each side's median step time and the ratio, the
median over pairs of ours / torch (robust to load that drifts during the run). Each process runs
`cores // processes` threads on both sides (torch.set_num_threads). The loss both sides report
is compared: same init, same data, so the first step's losses must agree to LOSS_REL_TOL (else
the row is marked, as the two would not run the same computation), and the column shows the
largest difference over all steps (the trajectories drift apart slowly). Models are sized so
that compute, not Python overhead, dominates a step on a 2-core CPU, yet a run takes a few
minutes (--quick: under a minute).
Lives elsewhere: torch's loops (bench/runtime_peers.py), the runtime (runtime/engine.py), planning
(autosbp/planner), the worker launch (launching/workers.py).
"""

from __future__ import annotations

import argparse
import functools
import math
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

from autosbp.capturing.export import capture_micro_batch  # noqa: E402
from autosbp.plan import Plan  # noqa: E402
from autosbp.plan.values import DTYPES  # noqa: E402
from autosbp.planner.api import plan_graph  # noqa: E402
from autosbp.zoo import build_model  # noqa: E402
from bench.runtime_peers import LR, Reference, pipelining_step, torch_step  # noqa: E402
from launching.workers import run_workers  # noqa: E402

LOSS_REL_TOL = 1e-4  # first step, ours vs torch: the same computation up to fp32 reordering
WORKER_TIMEOUT_S = 600.0
# Model name -> (zoo model, its arguments). mlp: 4 square 1024 linears, batch 128 (about 5
# GFLOP a step), and at 2048 with 96 MiB of weights: 6 gradient buckets of at most 25 MiB, so
# both sides overlap the sync with backward; gpt: 2 layers of hidden 256 over 16 x 64 tokens.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mlp-1024": (
        "mlp",
        {"layers": 4, "hidden": 1024, "features": 1024, "outputs": 1024, "batch": 128},
    ),
    "mlp-2048": (
        "mlp",
        {"layers": 4, "hidden": 2048, "features": 2048, "outputs": 2048, "batch": 64},
    ),
    "gpt-small": (
        "gpt",
        {"layers": 2, "hidden": 256, "heads": 4, "vocab": 2048, "seq": 64, "batch": 16},
    ),
}
# cp=2: attention-heavy (seq 1024, hidden 128: causal attention's dense product, 4 b h L^2 d,
# is about 1.3x the linears' 24 b L c^2 per layer).
CONTEXT_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt-seq1024": (
        "gpt",
        {"layers": 2, "hidden": 128, "heads": 4, "vocab": 512, "seq": 1024, "batch": 2},
    ),
}
# The interleaved row's: 4 blocks, one per chunk of 2 stages x 2 chunks.
INTERLEAVED_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mlp-1024": MODELS["mlp-1024"],
    "gpt-small-4l": ("gpt", {**MODELS["gpt-small"][1], "layers": 4}),
}
QUICK_MODELS = {
    "mlp-512": ("mlp", {"layers": 2, "hidden": 512, "features": 512, "outputs": 512, "batch": 64})
}


@dataclass(frozen=True, slots=True)
class Comparison:
    """One kind of row: ours under `strategy` vs torch's `reference` loop on `processes` gloo
    processes, with the issue's target ratio (ours / torch)."""

    title: str
    processes: int
    strategy: str
    micro_batches: int
    reference: Reference
    target_ratio: float
    models: dict[str, tuple[str, dict[str, Any]]] | None = None  # None: the run's models
    dtype: str = "fp32"  # bf16: our mixed recipe, beside torch's (`Reference.DDP_AMP`, ...)
    loss_tol: float = 1e-4  # the first step's losses, ours vs torch (LOSS_REL_TOL in fp32)


COMPARISONS = (
    Comparison("dp vs DDP", 2, "dp", 1, Reference.DDP, 1.05),
    Comparison("fsdp vs FSDP2", 2, "fsdp", 1, Reference.FSDP2, 1.05),
    Comparison(
        "dp zero=1 vs DDP + ZeroRedundancyOptimizer", 2, "megatron:tp=1,pp=1,dp=2,zero=1", 1,
        Reference.DDP_ZERO, 1.05,
    ),
    Comparison("1 process vs eager", 1, "auto", 1, Reference.EAGER, 1.05),
    Comparison(
        "2-stage 1F1B vs Schedule1F1B", 2, "megatron:tp=1,pp=2,dp=1,mb=4", 4,
        Reference.PIPELINING, 1.0,
    ),
    Comparison(
        "2-stage interleaved vs ScheduleInterleaved1F1B", 2, "megatron:tp=1,pp=2,dp=1,vp=2,mb=4",
        4, Reference.INTERLEAVED, 1.0, INTERLEAVED_MODELS,
    ),
    # issue #45: bf16 compute with fp32 masters on both sides; the losses differ by bf16's
    # rounding of two different recipes (autocast casts per op, ours keeps bf16 copies):
    # 2^-8 of the loss, with room
    Comparison("bf16 dp vs DDP + autocast", 2, "dp", 1, Reference.DDP_AMP, 1.05,
               dtype="bf16", loss_tol=2e-2),
    Comparison("bf16 fsdp vs FSDP2 + MixedPrecisionPolicy", 2, "fsdp", 1, Reference.FSDP2_MP,
               1.05, dtype="bf16", loss_tol=2e-2),
)  # fmt: skip

CONTEXT = Comparison(
    "cp=2 vs whole sequence", 2, "megatron:tp=1,pp=1,dp=1,cp=2", 1, Reference.WHOLE, 0.75
)
CONTEXT_RING = Comparison(
    "cp=2 ring vs whole sequence",
    2,
    "megatron:tp=1,pp=1,dp=1,cp=2,ring=1",
    1,
    Reference.WHOLE,
    0.75,
)


@dataclass(frozen=True, slots=True)
class Job:
    """What every worker runs: per model, ours (a plan) against torch's loop."""

    models: dict[str, tuple[str, dict[str, Any]]]
    plans: dict[str, dict[str, Any]]  # model name -> Plan JSON
    reference: Reference
    threads: int
    warmup: int
    steps: int
    gathers: tuple[bool, int] | None = None  # (re-gather every parameter, prefetch depth)


@dataclass(frozen=True, slots=True)
class Timing:
    ours_s: tuple[float, ...]
    torch_s: tuple[float, ...]
    ours_losses: tuple[float, ...]
    torch_losses: tuple[float, ...]  # NaN on a rank that sees no loss (an early stage)


# ------------------------------------------------------------------------------ workers
def bench_worker(rank: int, world_size: int, job: Job) -> dict[str, Timing]:
    """On every rank: per model, an Engine and torch's loop (eager, DDP or a pipeline stage),
    stepped in alternating rounds; per-step times of this rank."""
    from runtime.engine import Engine
    from runtime.parallel.gathers import GatherPolicy

    torch.set_num_threads(job.threads)
    out: dict[str, Timing] = {}
    for name, (zoo_name, kwargs) in job.models.items():
        model, inputs = build_model(zoo_name, seed=0, **kwargs)
        plan = Plan.from_json(job.plans[name])
        policy = None
        if job.gathers is not None:
            regather, depth = job.gathers
            names = frozenset(n for n, _ in model.named_parameters()) if regather else frozenset()
            policy = GatherPolicy(depth, names)
        engine = Engine(
            model, plan, lambda params: torch.optim.Adam(params, lr=LR), example_inputs=inputs,
            gathers=policy,
        )  # fmt: skip
        if job.reference in (Reference.PIPELINING, Reference.INTERLEAVED):
            reference = pipelining_step(zoo_name, kwargs, inputs, plan, rank)
        else:
            reference = torch_step(zoo_name, kwargs, inputs, rank, world_size, job.reference)
        out[name] = _alternate(functools.partial(engine.step, inputs), reference, job)
    return out


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
    models: dict[str, tuple[str, dict[str, Any]]], comparison: Comparison, profile: str
) -> dict[str, dict[str, Any]]:
    plans = {}
    for name, (zoo_name, kwargs) in models.items():
        model, inputs = build_model(zoo_name, device="meta", seed=0, **kwargs)
        graph = capture_micro_batch(
            model, inputs, comparison.micro_batches, name=zoo_name, dtype=DTYPES[comparison.dtype]
        )
        plan = plan_graph(
            graph, profile=profile, devices=comparison.processes, memory_limit=None,
            global_batch=None, optimizer="adam", dtype=comparison.dtype,
            strategy=comparison.strategy, time_limit_s=60,
            micro_batches=comparison.micro_batches,
        )  # fmt: skip
        plans[name] = plan.to_json()
    return plans


def run_row(
    models: dict[str, tuple[str, dict[str, Any]]], comparison: Comparison, args: argparse.Namespace
) -> dict[str, Timing]:
    """Plan, spawn the workers, and fold their timings: a step takes the slowest rank; torch's
    loss is the mean over the ranks that see one (DDP: each rank's half; a pipeline: the last
    stage)."""
    processes = comparison.processes
    job = Job(
        models, _plans(models, comparison, args.profile), comparison.reference, _threads(processes),
        args.warmup, args.steps,
        (args.regather, args.prefetch) if args.regather or args.prefetch is not None else None,
    )  # fmt: skip
    per_rank = run_workers(bench_worker, processes, (job,), timeout_s=WORKER_TIMEOUT_S)
    return {
        name: Timing(
            _slowest([r[name].ours_s for r in per_rank]),
            _slowest([r[name].torch_s for r in per_rank]),
            per_rank[0][name].ours_losses,  # the full loss, the same on every rank
            _mean_reported([r[name].torch_losses for r in per_rank]),
        )
        for name in models
    }


def context_rows(args: argparse.Namespace) -> list[tuple[Comparison, str, Timing]]:
    """The cp=2 rows (issue #30) on their own models, the all-gather kernel and the ring's: run
    unless --only or --models names others."""
    if args.only not in (None, CONTEXT.reference.value) or args.models:
        return []
    return [
        (comparison, name, t)
        for comparison in (CONTEXT, CONTEXT_RING)
        for name, t in run_row(CONTEXT_MODELS, comparison, args).items()
    ]


def _threads(processes: int) -> int:
    """Threads per process on both sides: the cores shared out, as run_workers does."""
    return max(1, (os.cpu_count() or 1) // processes)


def _mean_reported(per_rank: list[tuple[float, ...]]) -> tuple[float, ...]:
    """Per step, the mean over the ranks whose loss is not NaN."""
    return tuple(
        statistics.fmean(x for x in step if not math.isnan(x))
        for step in zip(*per_rank, strict=True)
    )


def _slowest(per_rank: list[tuple[float, ...]]) -> tuple[float, ...]:
    return tuple(max(step) for step in zip(*per_rank, strict=True))


def _rel_diffs(timing: Timing) -> list[float]:
    """|ours - torch| / |torch| of the loss, per step (warm-up steps first)."""
    pairs = zip(timing.ours_losses, timing.torch_losses, strict=True)
    return [abs(a - b) / max(abs(b), 1e-30) for a, b in pairs]


def _table(rows: list[tuple[Comparison, str, Timing]], command: str) -> Table:
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
        "loss rel diff (max)",
    ):
        table.add_column(column, justify="left" if column in ("comparison", "model") else "right")
    for comparison, model, timing in rows:
        ours, theirs = statistics.median(timing.ours_s), statistics.median(timing.torch_s)
        pairs = zip(timing.ours_s, timing.torch_s, strict=True)
        ratio = statistics.median(a / b for a, b in pairs)
        mark = "[green]" if ratio <= comparison.target_ratio else "[red]"
        diffs = _rel_diffs(timing)
        same = diffs[0] <= comparison.loss_tol
        loss_text = f"{max(diffs):.1e}" if same else f"[red]{diffs[0]:.1e} at step 1"
        procs = comparison.processes
        table.add_row(
            comparison.title, model, f"{procs} x {_threads(procs)}", f"{ours * 1e3:.1f}",
            f"{theirs * 1e3:.1f}", f"{mark}{ratio:.3f}", f"<= {comparison.target_ratio}",
            loss_text,
        )  # fmt: skip
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="measured steps per side")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps per side first")
    parser.add_argument("--quick", action="store_true", help="one small mlp, few steps")
    parser.add_argument(
        "--only", choices=[r.value for r in Reference], help="the rows against this loop only"
    )
    parser.add_argument("--models", help="comma-separated names of MODELS (default: all)")
    parser.add_argument(
        "--overlap", action="store_true", help="the overlapped tp=2 row only (issue #47 item 2)"
    )
    parser.add_argument(
        "--regather", action="store_true", help="ours: free every gathered weight after forward"
    )
    parser.add_argument("--prefetch", type=int, help="ours: gathers this many blocks ahead")
    parser.add_argument(
        "--profile", default="cpu-gloo",
        help="the profile our plans are made with (default: cpu-gloo, the shipped one; "
        "`machine`: this machine's, measured on first use). The bf16 rows need one whose bf16 "
        "rate is this machine's: cpu-gloo's (1.7 GFLOP/s, measured on a CPU without bf16 "
        "units) makes `dp` split the sequence instead of the batch",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.regather and args.prefetch is None:
        args.prefetch = 0
    if args.overlap:
        Console().print(overlap_row(args))
        return 0
    models = QUICK_MODELS if args.quick else MODELS
    if args.models:
        models = {name: MODELS[name] for name in args.models.split(",")}
    comparisons = [c for c in COMPARISONS if args.only in (None, c.reference.value)]
    if args.quick:
        args.steps, args.warmup = min(args.steps, 6), min(args.warmup, 1)
    console = Console(width=max(Console().width, 130))
    rows = [
        (comparison, name, timing)
        for comparison in comparisons
        for name, timing in run_row(comparison.models or models, comparison, args).items()
    ] + context_rows(args)
    if args.only is None and not args.models:
        console.print(overlap_row(args))
    command = "python bench/runtime.py " + " ".join(argv if argv is not None else sys.argv[1:])
    console.print(_table(rows, command.strip()))
    return 0


# ------------------------------------------------------------------------------ tp overlap row
OVERLAP_MODEL = {"layers": 4, "hidden": 1024, "features": 512, "outputs": 64, "batch": 256}
OVERLAP_CHUNKS = 4


def overlap_worker(rank: int, world_size: int, job: Job) -> Timing:
    """On every rank: an Engine per plan (overlapped, whole), stepped in turn; per-step times."""
    from runtime.engine import Engine

    torch.set_num_threads(job.threads)
    model, inputs = build_model("mlp", seed=0, **OVERLAP_MODEL)
    twin, _ = build_model("mlp", seed=0, **OVERLAP_MODEL)
    engines = [
        Engine(
            m,
            Plan.from_json(job.plans[k]),
            lambda ps: torch.optim.Adam(ps, lr=LR),
            example_inputs=inputs,
        )
        for m, k in ((model, "overlapped"), (twin, "whole"))
    ]
    return _alternate(*(functools.partial(e.step, inputs) for e in engines), job)


def overlap_row(args: argparse.Namespace) -> str:
    """The overlapped tp=2 row: its step time and the whole plan's, their ratio, the profile's
    overlap efficiency."""
    from costmodel.cluster import Cluster
    from costmodel.profile_io import load_profile

    model, inputs = build_model("mlp", device="meta", seed=0, **OVERLAP_MODEL)
    plan = plan_graph(
        capture_micro_batch(model, inputs, 1, name="mlp"), profile="cpu-gloo", devices=2,
        memory_limit=None, global_batch=None, optimizer="adam", dtype="fp32",
        strategy="megatron:tp=2,pp=1,dp=1,mb=1", time_limit_s=60,
    ).to_json()  # fmt: skip
    overlapped = {**plan, "nodes": dict(plan["nodes"])}
    head = f"linear_{OVERLAP_MODEL['layers'] + 1}"
    for name, node in plan["nodes"].items():  # the hidden layers' row-parallel linears
        if node["op"] == "aten.linear.default" and node["outputs"] == ["P"] and name != head:
            overlapped["nodes"][name] = {**node, "overlap_chunks": OVERLAP_CHUNKS}
    job = Job({}, {"overlapped": overlapped, "whole": plan}, Reference.EAGER, _threads(2),
              args.warmup, args.steps, None)  # fmt: skip
    timing = _fold(run_workers(overlap_worker, 2, (job,), timeout_s=WORKER_TIMEOUT_S))
    ours, whole = statistics.median(timing.ours_s), statistics.median(timing.torch_s)
    efficiency = Cluster(load_profile("cpu-gloo"), nodes=1).overlap_efficiency
    return (
        f"tp=2 overlapped (mlp {OVERLAP_MODEL}, {OVERLAP_CHUNKS} chunks): {ours * 1e3:.1f} ms vs "
        f"the same plan whole {whole * 1e3:.1f} ms, ratio {statistics.median(_ratios(timing)):.3f}; "
        f"cpu-gloo overlap efficiency {efficiency:.3f}"
    )


def _fold(per_rank: list[Timing]) -> Timing:
    return Timing(
        _slowest([r.ours_s for r in per_rank]), _slowest([r.torch_s for r in per_rank]),
        per_rank[0].ours_losses, per_rank[0].torch_losses,
    )  # fmt: skip


def _ratios(timing: Timing) -> list[float]:
    return [a / b for a, b in zip(timing.ours_s, timing.torch_s, strict=True)]


if __name__ == "__main__":
    sys.exit(main())
