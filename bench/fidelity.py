"""Benchmark: the planner's predicted step time against the runtime's measured one, per plan.

Run: python bench/fidelity.py [--steps 6] [--warmup 2] [--rounds 2] [--quick] [--profile P]

Profile: by default local CPU work's (`costmodel.machine_profile.default_profile_name`): this
machine's own, measured by the quick profiler first if it is not cached or the machine changed
(`--profile cpu-gloo` predicts with the shipped profile, measured on another machine).

What it measures ("Actor runtime" issue: the cost model must predict what the runtime does):
- per case (a zoo model at one size, a device count, a strategy, a recomputation mode):
  `plan_graph` on the profile (on the graph of one micro-batch where the strategy names
  a micro-batch count), then `runtime.engine.Engine.step` of that plan on as many local gloo
  processes, `warmup` + `steps` steps, with a `timeline.Recorder` on every rank. The measured
  step time is the median of rank 0's timed steps over every round. Printed: predicted and
  measured step time, their ratio measured / predicted, the relative error
  (predicted - measured) / measured, and the 1-minute load average when the case first ran
  (the 2 cores are shared with other users: read every figure beside it).
- rounds: every case runs `rounds` times, the cases of one device count in one spawn, in
  alternating order (forward, then reversed), so that a burst of load from other users falls on
  different cases; the spread between rounds is the machine's noise floor.
- the median |relative error| over all cases (target: TARGET_REL_ERROR), and per device count.
- phases, from the recorded spans of rank 0 (stage 0): forward + backward (from the step's
  start to the gradient sync: the planner's compute, boxing, pipeline bubble and transfers
  until stage 0's last backward), wait (how long after rank 0 the last rank of its stage
  reached the sync: rank skew, priced at nothing), gradient sync (from then to the sync's end:
  the planner's bucketed sync term less what the last backward hides, `sync_hidden_s`),
  optimizer (its update term), other (the rest of the step:
  the loss broadcast of pipelined plans). Predicted for stage 0: forward + backward is its last
  backward's end in the planner's own actor simulation (`schedule.simulate` of the plan's stage
  times); the sync is re-priced per stage-0 parameter with the planner's `BoxingPricer`; the
  update is the stage's `update_s` minus that sync.
- peak memory, in the first round: per rank, the growth of the resident set (VmHWM, reset
  through /proc/self/clear_refs after the Engine is built and freed heap is trimmed) plus the
  local state it already held, the largest rank against `Plan.predicted.peak_memory_bytes`. It
  is an RSS estimate: it sees collective buffers, autograd temporaries and allocator slack that
  the planner does not model, and misses freed pages glibc reuses; "-" where /proc cannot be
  reset.

- the machine's drift: in every spawn, before the cases, every rank times a 512^3 fp32 matmul,
  an add of 2^22 elements and the profiler's overhead chain (`OVERHEAD_OPS` autograd adds of
  one element; all ranks at once, the slowest rank, median of 5), printed per process count beside the profile's prices of the same ops (the profile was measured at
  another time), with the error of every prediction scaled by the probes' geometric mean as a
  diagnostic: which part of the error is the machine's state, which the model's. The target
  is the unscaled error.

Not corrected for: the 4-process cases run 4 ranks (one thread each) on however many cores this
machine has (2 here), while the profile prices a device as one rank with a core of its own; the
table shows what that costs. Nothing here is fitted or tuned: it measures.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# This file is bench/fidelity.py: as a script, its directory (holding bench/runtime.py and
# bench/costmodel.py) would shadow the runtime and costmodel packages.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from rich.console import Console  # noqa: E402 - after the path fix above
from rich.table import Table  # noqa: E402

from autosbp.boxing.steps import dual_nd_sbp  # noqa: E402
from autosbp.capturing.export import capture_micro_batch  # noqa: E402
from autosbp.capturing.graph import OpGraph, Role  # noqa: E402
from autosbp.plan import Plan  # noqa: E402
from autosbp.planner.api import ClusterPrices, plan_graph  # noqa: E402
from autosbp.planner.timing.candidates import BoxingPricer, sync_bucket_bytes  # noqa: E402
from autosbp.sbp import Mesh, parse_nd_sbp  # noqa: E402
from autosbp.schedule import simulate  # noqa: E402
from autosbp.zoo import build_model  # noqa: E402
from bench.fidelity_measure import (  # noqa: E402
    MEASURED_ONLY,
    PHASES,
    PROBES,
    Case,
    Measured,
    measure,
)
from costmodel import Cluster, load_profile  # noqa: E402
from costmodel.machine_profile import (  # noqa: E402
    cached_machine_profile,
    default_profile_name,
    measure_machine_profile,
)
from costmodel.profile_io import MACHINE_PROFILE  # noqa: E402

PROFILE = "cpu-gloo"  # the shipped CPU profile (bench/moe.py's); fidelity's default: this machine's
TARGET_REL_ERROR = 0.15  # the target for the median |relative error|
PLANNER_TIME_LIMIT_S = 60.0  # plan_graph's default
MIB = 2**20
# (size label, devices, strategy, recompute): mostly 2 processes (one core each on this
# machine), every strategy family, two pipelines, two recomputation modes, and two 4-process
# cases (oversubscribed here: see the header).
CASES: tuple[tuple[str, int, str, str], ...] = (
    ("mlp-512", 2, "dp", "none"),
    ("mlp-512", 2, "fsdp", "none"),
    ("mlp-1024", 2, "auto", "none"),
    ("mlp-1024", 2, "megatron:tp=2,dp=1", "none"),
    ("mlp-1024", 2, "megatron:tp=1,pp=2,dp=1,mb=4", "none"),
    ("gpt-128", 2, "dp", "none"),
    ("gpt-128", 2, "fsdp", "none"),
    ("gpt-128", 2, "megatron:tp=1,pp=2,dp=1,mb=4", "none"),
    ("gpt-256", 2, "dp", "full"),
    ("gpt-256", 2, "megatron:tp=2,dp=1", "selective"),
    ("mlp-1024", 4, "megatron:tp=1,pp=2,dp=2,mb=4", "none"),
    ("gpt-128", 4, "dp", "none"),
)
QUICK_CASES = (("mlp-512", 2, "dp", "none"), ("gpt-128", 2, "megatron:tp=1,pp=2,dp=1,mb=2", "none"))


@dataclass(frozen=True, slots=True)
class Prediction:
    """The planner's step time and stage 0's phases, in seconds; peak memory per device."""

    step_s: float
    phase_s: dict[str, float]  # keys: PHASES
    peak_bytes: int


@dataclass(frozen=True, slots=True)
class Row:
    case: Case
    plan: Plan
    predicted: Prediction
    measured: Measured

    @property
    def ratio(self) -> float:
        return self.measured.median_s / self.predicted.step_s

    @property
    def rel_error(self) -> float:
        return (self.predicted.step_s - self.measured.median_s) / self.measured.median_s


# ------------------------------------------------------------------------------ predict
def plan_case(case: Case, profile: str) -> tuple[Plan, Prediction]:
    model, inputs = build_model(case.zoo_name, device="meta", **case.model_args)
    graph = capture_micro_batch(model, list(inputs), case.micro_batches, name=case.zoo_name)
    plan = plan_graph(
        graph, profile=profile, devices=case.devices, memory_limit=None, global_batch=None,
        optimizer="adam", dtype="fp32", strategy=case.strategy, time_limit_s=PLANNER_TIME_LIMIT_S,
        micro_batches=case.micro_batches, recompute=case.recompute,
    )  # fmt: skip
    return plan, predict_phases(graph, plan, profile)


def predict_phases(graph: OpGraph, plan: Plan, profile: str) -> Prediction:
    """Stage 0's predicted step cut into the phases rank 0 runs one after the other."""
    stages = plan.stages
    timeline = simulate(
        len(stages), plan.micro_batches, lambda s: stages[s].forward_s,
        lambda s: stages[s].backward_s, lambda s: stages[s].send_s,
    )  # fmt: skip
    fwd_bwd_s = max(f.end_s for f in timeline.firings if f.stage == 0)
    sync_s = predicted_sync_s(graph, plan, profile, stage=0)
    phase_s = {
        "fwd_bwd": fwd_bwd_s,
        "sync": sync_s - stages[0].sync_hidden_s,  # what the last backward does not hide
        "optimizer": stages[0].update_s - sync_s,
    }
    return Prediction(plan.predicted.step_time_s, phase_s, plan.predicted.peak_memory_bytes)


def predicted_sync_s(graph: OpGraph, plan: Plan, profile: str, stage: int) -> float:
    """Sum over the stage's parameters of the planner's bucketed gradient-sync price."""
    hw = load_profile(profile)
    per_node = int(hw.topology.devices_per_node.value)
    cluster = Cluster(hw, nodes=math.ceil(plan.device_count / per_node))
    mesh = Mesh(plan.mesh_shape, plan.mesh_dims, plan.stages[stage].devices, plan.link_classes)
    pricer = BoxingPricer(ClusterPrices(cluster), mesh)
    bucket_bytes = sync_bucket_bytes(graph)
    total = 0.0
    for _, attrs in graph.nodes(Role.PARAMETER):
        param = plan.params[attrs.name]
        if param.stage == stage:
            layout = parse_nd_sbp(param.sbp)
            meta = attrs.outputs[0]
            total += pricer.bucketed_time_s(dual_nd_sbp(layout), layout, meta, bucket_bytes)
    return total


# ------------------------------------------------------------------------------ report
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _ratio(measured_s: float, predicted_s: float) -> float | None:
    return measured_s / predicted_s if predicted_s > 0 else None


def _spread(row: Row) -> float:
    """(largest - smallest) / median of the per-round median step times."""
    rounds = row.measured.round_medians_s
    return (max(rounds) - min(rounds)) / row.measured.median_s


def step_table(rows: list[Row], command: str, profile: str) -> Table:
    table = Table(
        title=f"predicted vs measured step time ({profile})", caption=f"regenerate: {command}"
    )
    for column in ("model", "dev", "strategy", "recompute", "mesh x stages", "predicted ms",
                   "measured ms", "measured/pred", "rel error", "round spread", "load 1m"):  # fmt: skip
        table.add_column(
            column, justify="left" if column in ("model", "strategy", "recompute") else "right"
        )
    for row in rows:
        mesh = "x".join(map(str, row.plan.mesh_shape)) + f" x {len(row.plan.stages)}"
        table.add_row(
            row.case.size, str(row.case.devices), row.case.strategy, row.plan.recompute, mesh,
            _ms(row.predicted.step_s), _ms(row.measured.median_s), f"{row.ratio:.2f}",
            f"{row.rel_error:+.0%}", f"{_spread(row):.0%}", f"{row.measured.load_1min:.2f}",
        )  # fmt: skip
    return table


def phase_table(rows: list[Row]) -> Table:
    table = Table(title="per phase, rank 0 (stage 0): predicted / measured ms (ratio), medians")
    for column in ("model", "dev", "strategy", *PHASES, *(f"{p} (meas)" for p in MEASURED_ONLY),
                   "peak MiB pred / meas"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("model", "strategy") else "right")
    for row in rows:
        cells = []
        for phase in PHASES:
            pred, meas = row.predicted.phase_s[phase], row.measured.phase_median_s(phase)
            ratio = _ratio(meas, pred)
            cells.append(f"{_ms(pred)} / {_ms(meas)}" + (f" ({ratio:.2f})" if ratio else ""))
        peak = row.measured.peak_bytes
        memory = f"{row.predicted.peak_bytes / MIB:.0f} / " + (
            f"{peak / MIB:.0f}" if peak is not None else "-"
        )
        table.add_row(
            row.case.size, str(row.case.devices), row.case.strategy, *cells,
            *(_ms(row.measured.phase_median_s(p)) for p in MEASURED_ONLY), memory,
        )  # fmt: skip
    return table


def summary_lines(rows: list[Row]) -> list[str]:
    errors = [abs(r.rel_error) for r in rows]
    median = statistics.median(errors)
    verdict = "meets" if median <= TARGET_REL_ERROR else "misses"
    lines = [f"median |relative error| over {len(rows)} plans: {median:.0%} ({verdict} the "
             f"target <= {TARGET_REL_ERROR:.0%}); median round spread (noise floor) "
             f"{statistics.median(_spread(r) for r in rows):.0%}"]  # fmt: skip
    for devices in sorted({r.case.devices for r in rows}):
        group = [r for r in rows if r.case.devices == devices]
        lines.append(
            f"  {devices} processes: median |rel error| "
            f"{statistics.median(abs(r.rel_error) for r in group):.0%}, median ratio "
            f"{statistics.median(r.ratio for r in group):.2f} ({len(group)} plans)"
        )
    for devices in sorted({r.case.devices for r in rows}):
        cells = []
        for phase in PHASES:
            ratios = [
                x for r in rows if r.case.devices == devices
                if (x := _ratio(r.measured.phase_median_s(phase), r.predicted.phase_s[phase]))
            ]  # fmt: skip
            median_ratio = f"{statistics.median(ratios):.2f}" if ratios else "-"
            cells.append(f"{phase} {median_ratio} (n={len(ratios)})")
        lines.append(
            f"  median measured/predicted per phase, {devices} processes: " + ", ".join(cells)
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


def drift_lines(probes: dict[tuple[int, str], float], profile: str, rows: list[Row]) -> list[str]:
    """Per device count, the probes measured during the bench against the profile's prices of
    the same ops, and (a diagnostic, not the target) the error with every prediction scaled by
    their drift."""
    cluster = Cluster(load_profile(profile))
    lines = []
    for devices in sorted({r.case.devices for r in rows}):
        cells, ratios = [], []
        for name, price in PROBES.items():
            priced, got = price(cluster), probes[(devices, name)]
            ratios.append(got / priced)
            cells.append(f"{name} {_ms(got)} ms vs {_ms(priced)} ms priced ({ratios[-1]:.2f}x)")
        drift = math.exp(statistics.fmean(map(math.log, ratios)))
        group = [r for r in rows if r.case.devices == devices]
        scaled = statistics.median(
            abs(r.measured.median_s / (drift * r.predicted.step_s) - 1) for r in group
        )
        lines.append(
            f"the machine, {devices} processes (all busy, slowest rank): " + ", ".join(cells)
            + f"; with every prediction x {drift:.2f} (their geometric mean; a diagnostic, not "
            f"the target) median |rel error| {scaled:.0%}"
        )  # fmt: skip
    return lines


# ------------------------------------------------------------------------------ driver
def machine_default(console: Console) -> str:
    """Local CPU work's default profile, this machine's measured now if it is not cached."""
    name = default_profile_name()
    cached = cached_machine_profile() if name == MACHINE_PROFILE else None
    if cached is not None and cached.profile is None:
        began = time.perf_counter()
        console.print(f"this machine's profile is {cached.why_not}: measuring it (quick)")
        measure_machine_profile()
        console.print(f"measured in {time.perf_counter() - began:.1f} s: {cached.path}")
    elif cached is not None and cached.profile is not None and cached.profile.machine:
        console.print(f"profile {name}: measured {cached.profile.machine.date} ({cached.path})")
    return name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per plan and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every case")
    parser.add_argument("--quick", action="store_true", help="two small plans (a smoke test)")
    parser.add_argument(
        "--profile",
        help="profile NAME|PATH to predict with (default: this machine's, measured if needed)",
    )
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 200))
    began, load_before = time.perf_counter(), os.getloadavg()
    args.profile = args.profile or machine_default(console)
    planned = []
    for size, devices, strategy, recompute in QUICK_CASES if args.quick else CASES:
        case = Case(size, devices, strategy, recompute)
        planned.append((case, *plan_case(case, args.profile)))
    measured, probes = measure(
        [(c, p) for c, p, _ in planned], args.steps, args.warmup, args.rounds
    )
    rows = [Row(case, plan, predicted, measured[case]) for case, plan, predicted in planned]
    command = "python bench/fidelity.py " + " ".join(argv if argv is not None else sys.argv[1:])
    console.print(step_table(rows, command.strip(), args.profile))
    console.print(phase_table(rows))
    for line in summary_lines(rows):
        console.print(line)
    for line in drift_lines(probes, args.profile, rows):
        console.print(line)
    console.print(
        f"cores {os.cpu_count()}, torch threads per rank max(1, cores // processes); load average "
        f"(1/5/15 min) before {'/'.join(f'{x:.2f}' for x in load_before)}, after "
        f"{'/'.join(f'{x:.2f}' for x in os.getloadavg())}; bench took {time.perf_counter() - began:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
