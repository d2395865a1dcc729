"""The measuring half of bench/fidelity.py: the cases' models, the workers that step each plan
and the marks they record, the machine's probes, peak memory from /proc.

Lives here: `Case` (a zoo model at one size, a device count, a strategy, a recomputation mode),
`Measured`, the spawned `case_worker` and `measure` (every case `rounds` times, alternating order),
`PROBES` (what the machine runs at beside what the profile prices). Lives elsewhere: the planner's
prediction per phase, the tables and the driver (bench/fidelity.py, whose header says what is
measured and how to read it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autosbp.plan import Plan
from autosbp.planner.space.strategy import strategy_space
from autosbp.planner.timing.candidates import BACKWARD_FACTOR
from autosbp.zoo import build_model
from costmodel import Cluster
from costmodel.measure.worker import OVERHEAD_OPS
from launching.workers import run_workers
from runtime.jobs import adam

WORKER_TIMEOUT_S = 600.0  # one spawn runs every case of a device count
LR = 1e-2  # runtime.jobs's default (TrainSpec.lr)
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
PHASES = ("fwd_bwd", "sync", "optimizer")  # priced by the planner, run in this order
MEASURED_ONLY = ("wait", "other")  # rank skew before the sync; the rest of the step


@dataclass(frozen=True, slots=True)
class Case:
    size: str
    devices: int
    strategy: str
    recompute: str

    @property
    def zoo_name(self) -> str:
        return SIZES[self.size][0]

    @property
    def model_args(self) -> dict[str, Any]:
        return SIZES[self.size][1]

    @property
    def micro_batches(self) -> int:
        """The count the strategy names (mb=M), else 1: the graph the planner is given."""
        counts = strategy_space(self.strategy).micro_batches
        return counts[0] if counts else 1


@dataclass(frozen=True, slots=True)
class Measured:
    """Rank 0's timed steps (all rounds), per phase, with each round's median step time; the
    largest rank's peak estimate (first round); the load average when the case first ran."""

    step_s: tuple[float, ...]
    phase_s: dict[str, tuple[float, ...]]  # keys: PHASES + MEASURED_ONLY
    round_medians_s: tuple[float, ...]
    peak_bytes: int | None
    load_1min: float

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)

    def phase_median_s(self, phase: str) -> float:
        return statistics.median(self.phase_s[phase])


# ------------------------------------------------------------------------------ measure
@dataclass(frozen=True, slots=True)
class Job:
    """What the workers of one spawn run: each case's plan, `warmup` + `steps` steps, in order."""

    cases: tuple[Case, ...]
    plans: tuple[dict[str, Any], ...]  # Plan.to_json()
    steps: int
    warmup: int
    track_memory: bool


# Per timed step, perf_counter seconds (one clock for every process of the machine): step
# start, sync start, sync end, optimizer start, optimizer end, step end.
StepMarks = tuple[float, float, float, float, float, float]


Probes = dict[str, float]  # probe name -> seconds per call, this rank
# What the machine runs at while the bench measures, beside the profile's price of the same
# work (the profile was measured at another time: the two differ by the machine's drift):
# name -> its price on a cluster. The autograd probe is OVERHEAD_OPS adds on one element, forward
# and backward: that many ops at the per-op floor, each priced 1 + BACKWARD_FACTOR times.
PROBES: dict[str, Callable[[Cluster], float]] = {
    "matmul 512^3": lambda c: c.op_time_s(2.0 * 512**3, 3.0 * 512**2 * 4, "fp32"),
    "add of 2^22": lambda c: c.op_time_s(2.0**22, 3.0 * 2**22 * 4, "fp32"),
    f"{OVERHEAD_OPS} autograd adds": (
        lambda c: OVERHEAD_OPS * (1 + BACKWARD_FACTOR) * c.op_time_s(1, 12, "fp32")
    ),
}


def time_probes() -> Probes:
    """Every rank at once (all ranks busy, as in a step): the median of 5 repeats of 10 calls."""
    import torch
    import torch.distributed as dist

    a, b, c = (torch.randn(512, 512) for _ in range(3))
    x, y, z = (torch.randn(2**22) for _ in range(3))
    leaf = torch.randn(1, requires_grad=True)

    def autograd_adds() -> None:
        out = leaf
        for _ in range(OVERHEAD_OPS):
            out = out + 1.0
        out.backward()

    calls = {
        "matmul 512^3": lambda: torch.matmul(a, b, out=c),
        "add of 2^22": lambda: torch.add(x, y, out=z),
        f"{OVERHEAD_OPS} autograd adds": autograd_adds,
    }
    out = {}
    for name, call in calls.items():
        call()
        repeats = []
        for _ in range(5):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(10):
                call()
            repeats.append((time.perf_counter() - start) / 10)
        out[name] = statistics.median(repeats)
    return out


def case_worker(
    rank: int, world_size: int, job: Job
) -> tuple[Probes, list[tuple[list[StepMarks], int | None]]]:
    """On every rank: the probes; per case, an Engine with a Recorder; the marks of each timed
    step; the peak estimate (or None)."""
    import torch.distributed as dist

    from autosbp.timeline import Recorder
    from runtime.engine import Engine

    probes = time_probes()
    out = []
    for case, plan_json in zip(job.cases, job.plans, strict=True):
        plan = Plan.from_json(plan_json)
        model, inputs = build_model(case.zoo_name, **case.model_args)
        stage = next(s for s, st in enumerate(plan.stages) if rank in st.devices)
        recorder = Recorder(rank, stage, origin_s=0.0)  # absolute perf_counter times
        engine = Engine(
            model, plan, lambda ps: adam(ps, LR), example_inputs=inputs, recorder=recorder
        )
        state_bytes = sum(t.untyped_storage().nbytes() for t in engine.state.values())
        tracking = job.track_memory and reset_peak_rss()
        start_rss = rss_bytes("VmRSS")
        dist.barrier()
        marks = []
        for step in range(job.warmup + job.steps):
            begin = time.perf_counter()
            engine.step(inputs)
            end = time.perf_counter()
            spans = {e.kind: e for e in recorder.mark_step() if e.micro_batch is None}
            sync, opt = spans["grad_sync"], spans["optimizer"]
            if step >= job.warmup:
                marks.append((begin, sync.start_s, sync.end_s, opt.start_s, opt.end_s, end))
        peak = rss_bytes("VmHWM") - start_rss + state_bytes if tracking else None
        out.append((marks, peak))
        del engine, model
    return probes, out


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


def phases_of(marks: list[list[StepMarks]], peers: tuple[int, ...]) -> dict[str, list[float]]:
    """Rank 0's phases per step (see the header) from every rank's marks of one case; `peers`
    are the ranks of rank 0's stage, whose sync rank 0 waits for."""
    out: dict[str, list[float]] = {p: [] for p in ("step", *PHASES, *MEASURED_ONLY)}
    for i, (begin, sync_in, sync_out, opt_in, opt_out, end) in enumerate(marks[0]):
        last_in = max(marks[r][i][1] for r in peers)
        sync_s = max(0.0, sync_out - max(sync_in, last_in))
        parts = {
            "fwd_bwd": sync_in - begin,
            "wait": (sync_out - sync_in) - sync_s,
            "sync": sync_s,
            "optimizer": opt_out - opt_in,
        }
        parts["other"] = (end - begin) - sum(parts.values())
        for phase, value in (("step", end - begin), *parts.items()):
            out[phase].append(value)
    return out


def measure(
    rows: list[tuple[Case, Plan]], steps: int, warmup: int, rounds: int
) -> tuple[dict[Case, Measured], dict[tuple[int, str], float]]:
    """Every case `rounds` times, one spawn per device count and round, alternating order; the
    probes: per device count and name, the median over its spawns of the slowest rank's time."""
    collected: dict[Case, list[tuple[dict[str, list[float]], int | None, float]]] = {}
    probed: dict[tuple[int, str], list[float]] = {}
    for round_index in range(rounds):
        for devices in sorted({case.devices for case, _ in rows}):
            group = [(c, p) for c, p in rows if c.devices == devices]
            group = group if round_index % 2 == 0 else group[::-1]
            load = os.getloadavg()[0]
            job = Job(
                tuple(c for c, _ in group), tuple(p.to_json() for _, p in group), steps, warmup,
                track_memory=round_index == 0,
            )  # fmt: skip
            results = run_workers(case_worker, devices, (job,), timeout_s=WORKER_TIMEOUT_S)
            for name in PROBES:
                probed.setdefault((devices, name), []).append(max(p[name] for p, _ in results))
            per_rank = [cases for _, cases in results]
            for i, (case, plan) in enumerate(group):
                peaks = [ranks[i][1] for ranks in per_rank]
                peak = None if None in peaks else max(p for p in peaks if p is not None)
                phases = phases_of([ranks[i][0] for ranks in per_rank], plan.stages[0].devices)
                collected.setdefault(case, []).append((phases, peak, load))
    out = {}
    for case, runs in collected.items():
        merged = {k: tuple(x for phases, _, _ in runs for x in phases[k]) for k in runs[0][0]}
        step_s = merged.pop("step")
        out[case] = Measured(
            step_s, merged, tuple(statistics.median(r[0]["step"]) for r in runs), runs[0][1],
            runs[0][2],
        )  # fmt: skip
    return out, {key: statistics.median(times) for key, times in probed.items()}
