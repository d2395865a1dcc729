"""Benchmark: the planner's predicted step time against the runtime's measured one, per plan.

Run: python bench/fidelity.py [--steps 7] [--warmup 3] [--no-phases] [--quick]

What it measures ("Actor runtime" issue: the cost model must predict what the runtime does):
- per case (a zoo model at one size, a device count, a strategy): `plan_graph` on the cpu-gloo
  profile, then `runtime.train` of that plan on as many local gloo processes for `warmup` +
  `steps` steps; the measured step time is the median of rank 0's last `steps`. Printed:
  predicted and measured step time, their ratio measured / predicted, the relative error
  (predicted - measured) / measured, and the 1-minute load average when the run started (the
  2 cores are shared with other users: read every figure beside it).
- the median |relative error| over all cases (target: TARGET_REL_ERROR), and per device count.
- phases (unless --no-phases): every case again, in one spawn per device count, with the step
  cut into the phases `Engine.step` runs in order: forward + backward (the planner's compute +
  boxing terms), gradient sync (its bucketed sync term), optimizer (its update term), with one
  barrier before the sync (its wait, rank skew, is shown apart and priced at nothing); rank 0's
  median per phase against the planner's share, and the median ratio per phase over the cases;
  and how far this run's step (phases + wait) is from the train run's: the noise floor.
  The predicted sync is re-priced per parameter with the planner's own `BoxingPricer`; the
  predicted update is the planner's parameter term minus that sync.
- peak memory, in the phase run: per rank, the growth of the resident set (VmHWM, reset through
  /proc/self/clear_refs after the Engine is built and freed heap is trimmed) plus the local
  state it already held, the largest rank against `Plan.predicted.peak_memory_bytes`. It is an
  RSS estimate: it sees collective buffers, autograd temporaries and allocator slack that the
  planner does not model, and misses freed pages glibc reuses; "-" where /proc cannot be reset.

Not corrected for: the 4-process cases run 4 ranks (one thread each) on however many cores this
machine has (2 here), while the profile prices a device as one rank with a core of its own; the
table shows what that costs. Nothing here is fitted or tuned: it measures.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

# This file is bench/fidelity.py: as a script, its directory (holding bench/runtime.py and
# bench/costmodel.py) would shadow the runtime and costmodel packages.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from rich.console import Console  # noqa: E402 - after the path fix above
from rich.table import Table  # noqa: E402

from autosbp.boxing_steps import dual_nd_sbp  # noqa: E402
from autosbp.capturing import capture  # noqa: E402
from autosbp.graph import OpGraph, Role  # noqa: E402
from autosbp.plan import Plan  # noqa: E402
from autosbp.planner.api import ClusterPrices, plan_graph  # noqa: E402
from autosbp.planner.costs import BoxingPricer  # noqa: E402
from autosbp.sbp import Mesh, parse_nd_sbp  # noqa: E402
from autosbp.zoo import build_model  # noqa: E402
from costmodel import Cluster, load_profile  # noqa: E402
from costmodel.launch import run_workers  # noqa: E402
from runtime.train import TrainSpec, adam, train  # noqa: E402

PROFILE = "cpu-gloo"
TARGET_REL_ERROR = 0.15  # the target for the median |relative error|
PLANNER_TIME_LIMIT_S = 60.0  # plan_graph's default
WORKER_TIMEOUT_S = 300.0  # runtime.train's default
LR = 1e-2  # runtime.train's default (TrainSpec.lr); the phase run uses the same
MIB = 2**20
# Zoo models sized so a step takes well over 20 ms on one core (compute, not Python overhead,
# dominates) while the whole bench stays near 5 minutes: label -> (zoo name, arguments).
SIZES: dict[str, tuple[str, dict[str, Any]]] = {
    "mlp-512": ("mlp", {"layers": 4, "hidden": 512, "features": 512, "outputs": 512, "batch": 256}),
    "mlp-1024": (
        "mlp",
        {"layers": 4, "hidden": 1024, "features": 1024, "outputs": 1024, "batch": 128},
    ),
    "gpt-128": (
        "gpt",
        {"layers": 2, "hidden": 128, "heads": 4, "vocab": 2048, "seq": 64, "batch": 16},
    ),
    "gpt-256": (
        "gpt",
        {"layers": 2, "hidden": 256, "heads": 4, "vocab": 2048, "seq": 64, "batch": 16},
    ),
}
# (size label, devices, strategy): every strategy on 2 and 4 processes, spread over the sizes.
CASES: tuple[tuple[str, int, str], ...] = (
    ("mlp-512", 2, "auto"),
    ("mlp-512", 2, "dp"),
    ("mlp-512", 2, "fsdp"),
    ("mlp-1024", 2, "dp"),
    ("mlp-1024", 2, "megatron:tp=2,dp=1"),
    ("mlp-1024", 4, "auto"),
    ("mlp-1024", 4, "megatron:tp=2,dp=2"),
    ("gpt-128", 2, "auto"),
    ("gpt-128", 2, "fsdp"),
    ("gpt-128", 4, "dp"),
    ("gpt-256", 2, "dp"),
    ("gpt-256", 4, "megatron:tp=2,dp=2"),
)
QUICK_CASES = (("mlp-512", 2, "dp"), ("gpt-128", 2, "fsdp"))
PHASES = ("fwd_bwd", "sync", "optimizer")  # priced by the planner, run in this order
WAIT = "wait"  # measured only: the barrier the phase run adds before the sync (rank skew)


@dataclass(frozen=True, slots=True)
class Case:
    size: str
    devices: int
    strategy: str

    @property
    def zoo_name(self) -> str:
        return SIZES[self.size][0]

    @property
    def model_args(self) -> dict[str, Any]:
        return SIZES[self.size][1]


@dataclass(frozen=True, slots=True)
class Prediction:
    """The planner's step time and its parts, in seconds; peak memory per device in bytes."""

    step_s: float
    phase_s: dict[str, float]  # keys: PHASES
    peak_bytes: int


@dataclass(frozen=True, slots=True)
class Measured:
    """Rank 0's step times from runtime.train, and the load average when the run started."""

    step_times_s: tuple[float, ...]
    load_1min: float
    warmup: int

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_times_s[self.warmup :])


@dataclass(frozen=True, slots=True)
class PhaseTimes:
    """Per measured step, rank 0's seconds in each phase; the largest rank's peak estimate."""

    phase_s: dict[str, tuple[float, ...]]
    peak_bytes: int | None

    def median_s(self, phase: str) -> float:
        return statistics.median(self.phase_s[phase])


@dataclass(frozen=True, slots=True)
class Row:
    case: Case
    plan: Plan
    predicted: Prediction
    measured: Measured
    phases: PhaseTimes | None = None

    @property
    def ratio(self) -> float:
        return self.measured.median_s / self.predicted.step_s

    @property
    def rel_error(self) -> float:
        return (self.predicted.step_s - self.measured.median_s) / self.measured.median_s


# ------------------------------------------------------------------------------ predict
def plan_case(case: Case) -> tuple[Plan, Prediction]:
    model, inputs = build_model(case.zoo_name, device="meta", **case.model_args)
    graph = capture(model, list(inputs), name=case.zoo_name)
    plan = plan_graph(
        graph, profile=PROFILE, devices=case.devices, memory_limit=None, global_batch=None,
        optimizer="adam", dtype="fp32", strategy=case.strategy, time_limit_s=PLANNER_TIME_LIMIT_S,
    )  # fmt: skip
    return plan, predict_phases(graph, plan)


def predict_phases(graph: OpGraph, plan: Plan) -> Prediction:
    """The plan's breakdown regrouped into the phases the runtime runs one after the other."""
    parts = plan.predicted.breakdown
    sync_s = predicted_sync_s(graph, plan)
    phase_s = {
        "fwd_bwd": parts["compute_s"] + parts["comm_s"],
        "sync": sync_s,
        "optimizer": parts["optimizer_and_grad_sync_s"] - sync_s,
    }
    return Prediction(plan.predicted.step_time_s, phase_s, plan.predicted.peak_memory_bytes)


def predicted_sync_s(graph: OpGraph, plan: Plan) -> float:
    """Sum over parameters of the planner's bucketed gradient-sync price, dual(p) -> p."""
    hw = load_profile(plan.profile)
    per_node = int(hw.topology.devices_per_node.value)
    cluster = Cluster(hw, nodes=math.ceil(plan.device_count / per_node))
    mesh = Mesh(plan.mesh_shape, plan.mesh_dims, plan.stages[0].devices, plan.link_classes)
    pricer = BoxingPricer(ClusterPrices(cluster), mesh)
    total = 0.0
    for _, attrs in graph.nodes(Role.PARAMETER):
        layout = parse_nd_sbp(plan.params[attrs["name"]].sbp)
        total += pricer.bucketed_time_s(dual_nd_sbp(layout), layout, attrs["outputs"][0])
    return total


# ------------------------------------------------------------------------------ measure
def measure_case(case: Case, plan: Plan, steps: int, warmup: int) -> Measured:
    load = os.getloadavg()[0]
    spec = TrainSpec(
        case.zoo_name, case.model_args, plan.to_json(), steps=warmup + steps, lr=LR,
        timeout_s=WORKER_TIMEOUT_S,
    )  # fmt: skip
    return Measured(train(spec).step_times_s, load, warmup)


@dataclass(frozen=True, slots=True)
class PhaseJob:
    """What a phase worker runs: each case's plan, `warmup` + `steps` timed steps."""

    cases: tuple[Case, ...]
    plans: tuple[dict[str, Any], ...]  # Plan.to_json()
    steps: int
    warmup: int


def phase_worker(rank: int, world_size: int, job: PhaseJob) -> list[tuple[dict, int | None]]:
    """On every rank: per case, an Engine; timed steps cut into phases; the peak estimate."""
    from runtime.engine import Engine

    out = []
    for case, plan_json in zip(job.cases, job.plans, strict=True):
        model, inputs = build_model(case.zoo_name, **case.model_args)
        engine = Engine(
            model, Plan.from_json(plan_json), lambda ps: adam(ps, LR),
            example_inputs=inputs,
        )  # fmt: skip
        state_bytes = sum(t.nbytes for t in engine.state.values())
        tracking = reset_peak_rss()
        start_rss = rss_bytes("VmRSS")
        times = [timed_step(engine, inputs) for _ in range(job.warmup + job.steps)][job.warmup :]
        peak = rss_bytes("VmHWM") - start_rss + state_bytes if tracking else None
        out.append(({p: tuple(t[p] for t in times) for p in (*PHASES, WAIT)}, peak))
        del engine, model
    return out


def timed_step(engine: Any, batch: tuple[torch.Tensor, ...]) -> dict[str, float]:
    """`Engine.step`, statement for statement, with a clock between its phases and one barrier
    before the sync, so that a rank's wait for a slower one is not counted as sync time. A
    copy: the Engine has no phase hook (runtime/engine.py, `step`); keep the two in step."""
    import torch.distributed as dist

    from autosbp.schedule import split_micro_batches
    from runtime.engine import _sync_bucket

    engine.optimizer.zero_grad(set_to_none=True)
    start = time.perf_counter()
    for micro_batch in split_micro_batches(batch, engine.micro_batches):
        loss = engine.program.run(micro_batch)
        with torch.no_grad():
            float(engine._loss_value(loss.detach()))
        (engine._seed(loss) * (1.0 / engine.micro_batches)).backward()
    backward_done = time.perf_counter()
    dist.barrier()
    waited = time.perf_counter()
    with torch.no_grad():
        for bucket in engine._buckets:
            _sync_bucket(bucket)
    synced = time.perf_counter()
    engine.optimizer.step()
    done = time.perf_counter()
    return {
        "fwd_bwd": backward_done - start,
        WAIT: waited - backward_done,
        "sync": synced - waited,
        "optimizer": done - synced,
    }


def reset_peak_rss() -> bool:
    """Free what can be freed, return trimmed heap to the OS, and reset VmHWM to VmRSS (Linux
    clear_refs "5"). False where /proc does not allow it: no peak is reported then."""
    gc.collect()
    libc_name = ctypes.util.find_library("c")
    if libc_name and hasattr(ctypes.CDLL(libc_name), "malloc_trim"):
        ctypes.CDLL(libc_name).malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return True


def rss_bytes(field_name: str) -> int:
    """A `Vm*` line of /proc/self/status (kB there), in bytes."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field_name)


def measure_phases(rows: list[Row], steps: int, warmup: int) -> list[Row]:
    """One spawn per device count runs all its cases; the rows with their phases, same order."""
    timed: dict[Case, PhaseTimes] = {}
    for devices in sorted({row.case.devices for row in rows}):
        group = [row for row in rows if row.case.devices == devices]
        job = PhaseJob(
            tuple(r.case for r in group), tuple(r.plan.to_json() for r in group), steps, warmup
        )
        per_rank = run_workers(phase_worker, devices, (job,), timeout_s=WORKER_TIMEOUT_S)
        for i, row in enumerate(group):
            peaks = [ranks[i][1] for ranks in per_rank]
            peak = None if None in peaks else max(p for p in peaks if p is not None)
            timed[row.case] = PhaseTimes(per_rank[0][i][0], peak)
    return [replace(row, phases=timed[row.case]) for row in rows]


# ------------------------------------------------------------------------------ report
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _ratio(measured_s: float, predicted_s: float) -> float | None:
    return measured_s / predicted_s if predicted_s > 0 else None


def step_table(rows: list[Row], command: str) -> Table:
    table = Table(
        title=f"predicted vs measured step time ({PROFILE})", caption=f"regenerate: {command}"
    )
    for column in ("model", "size", "devices", "strategy", "mesh", "predicted ms",
                   "measured ms", "measured/pred", "rel error", "load 1m"):  # fmt: skip
        table.add_column(
            column, justify="left" if column in ("model", "size", "strategy") else "right"
        )
    for row in rows:
        size = ",".join(f"{k}={v}" for k, v in row.case.model_args.items())
        table.add_row(
            row.case.size, size, str(row.case.devices), row.case.strategy,
            "x".join(map(str, row.plan.mesh_shape)), _ms(row.predicted.step_s),
            _ms(row.measured.median_s), f"{row.ratio:.2f}", f"{row.rel_error:+.0%}",
            f"{row.measured.load_1min:.2f}",
        )  # fmt: skip
    return table


def phase_table(rows: list[Row]) -> Table:
    table = Table(title="per phase: predicted / measured ms (ratio), rank 0 medians")
    for column in ("model", "dev", "strategy", *PHASES, f"{WAIT} (meas)", "phases sum", "train median",
                   "peak MiB pred / meas"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("model", "strategy") else "right")
    for row in rows:
        assert row.phases is not None
        cells = []
        for phase in PHASES:
            pred, meas = row.predicted.phase_s[phase], row.phases.median_s(phase)
            ratio = _ratio(meas, pred)
            cells.append(f"{_ms(pred)} / {_ms(meas)}" + (f" ({ratio:.2f})" if ratio else ""))
        total = sum(row.phases.median_s(p) for p in (*PHASES, WAIT))
        peak = row.phases.peak_bytes
        memory = f"{row.predicted.peak_bytes / MIB:.0f} / " + (
            f"{peak / MIB:.0f}" if peak is not None else "-"
        )
        table.add_row(
            row.case.size, str(row.case.devices), row.case.strategy, *cells,
            _ms(row.phases.median_s(WAIT)), _ms(total),
            _ms(row.measured.median_s), memory,
        )  # fmt: skip
    return table


def summary_lines(rows: list[Row]) -> list[str]:
    errors = [abs(r.rel_error) for r in rows]
    median = statistics.median(errors)
    verdict = "meets" if median <= TARGET_REL_ERROR else "misses"
    lines = [f"median |relative error| over {len(rows)} plans: {median:.0%} ({verdict} the "
             f"target <= {TARGET_REL_ERROR:.0%})"]  # fmt: skip
    for devices in sorted({r.case.devices for r in rows}):
        group = [r for r in rows if r.case.devices == devices]
        lines.append(
            f"  {devices} processes: median |rel error| "
            f"{statistics.median(abs(r.rel_error) for r in group):.0%}, median ratio "
            f"{statistics.median(r.ratio for r in group):.2f} ({len(group)} plans)"
        )
    worst = sorted(rows, key=lambda r: abs(r.rel_error), reverse=True)[:3]
    for r in worst:
        parts = ", ".join(
            f"{k.removesuffix('_s')} {_ms(v)}" for k, v in r.plan.predicted.breakdown.items()
        )
        lines.append(
            f"worst: {r.case.size} {r.case.devices} dev {r.case.strategy}: ratio {r.ratio:.2f} "
            f"(predicted ms: {parts})"
        )
    return lines


def phase_summary_lines(rows: list[Row]) -> list[str]:
    """Median ratio per phase and device count, and how far the two runs of a plan disagree
    (the machine's own noise: no model can be judged closer than that)."""
    spread = statistics.median(
        abs(sum(r.phases.median_s(p) for p in (*PHASES, WAIT)) - r.measured.median_s)
        / r.measured.median_s
        for r in rows
        if r.phases is not None
    )
    lines = [
        f"repeatability: median |phase-run step - train-run step| / train-run step = {spread:.0%}"
    ]
    for devices in sorted({r.case.devices for r in rows}):
        cells = []
        for phase in PHASES:
            ratios = [
                x for r in rows if r.case.devices == devices and r.phases is not None
                if (x := _ratio(r.phases.median_s(phase), r.predicted.phase_s[phase]))
            ]  # fmt: skip
            median = f"{statistics.median(ratios):.2f}" if ratios else "-"
            cells.append(f"{phase} {median} (n={len(ratios)})")
        lines.append(
            f"median measured/predicted per phase, {devices} processes: " + ", ".join(cells)
        )
    return lines


# ------------------------------------------------------------------------------ driver
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7, help="measured steps per plan")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps first")
    parser.add_argument("--no-phases", action="store_true", help="skip the per-phase run")
    parser.add_argument("--quick", action="store_true", help="two small plans (a smoke test)")
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 200))
    began, load_before = time.perf_counter(), os.getloadavg()
    rows = []
    for size, devices, strategy in QUICK_CASES if args.quick else CASES:
        case = Case(size, devices, strategy)
        plan, predicted = plan_case(case)
        rows.append(Row(case, plan, predicted, measure_case(case, plan, args.steps, args.warmup)))
    command = "python bench/fidelity.py " + " ".join(argv if argv is not None else sys.argv[1:])
    console.print(step_table(rows, command.strip()))
    for line in summary_lines(rows):
        console.print(line)
    if not args.no_phases:
        rows = measure_phases(rows, args.steps, args.warmup)
        console.print(phase_table(rows))
        for line in phase_summary_lines(rows):
            console.print(line)
    console.print(
        f"cores {os.cpu_count()}, torch threads per rank max(1, cores // processes); load average "
        f"(1/5/15 min) before {'/'.join(f'{x:.2f}' for x in load_before)}, after "
        f"{'/'.join(f'{x:.2f}' for x in os.getloadavg())}; bench took {time.perf_counter() - began:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
