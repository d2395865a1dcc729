"""How fast the planner plans at the frontier (GPT-3 175B on 1024 A100s, Megatron-LM's Table 1,
Llama 3 405B on 8192 and 16384 H100s), how GPT-3's search grows with depth, and how its plan
compares with every hand plan of a grid.

Run: python bench/plan_speed.py [--cases ...] [--time-limit-s 600] [--jobs N] [--busy N]
     python bench/plan_speed.py --layers 12 48 96 [--repeat 3] [--no-megatron] [--hand-grid]

The frontier table (the default; cases in `bench/frontier.py`): per case, in a process of its
own, as `autosbp plan` plans it: the capture time, the search's wall and CPU time (its worker
processes' included), status and proven gap, configurations / LP-bounded / solved, the plan's
predicted step and shape, and the peak RSS (the most of the process and of any one of its
workers). Then the anytime table of GPT-3/1024 and 1008B/3072: when the search first held a
plan, one within 5% and one within 1% of the best it proved. With --busy N, GPT-3/1024 again
beside N processes that spin a core each: under the default 60 s limit, then at 600 s; the
ratio of their plans says how much the limit cost, and the status whether it was proven.
Targets (issue "Planner III", quiet 2-core machine): GPT-3/1024 optimal in <= 10 s; every
Table 1 row gap <= 1% in <= 30 s; Llama 3 405B optimal in <= 60 s; RSS < 4 GB; beside two
busy processes GPT-3/1024 within 2% of the optimum at the default limit; anytime <= 5 s to 5%
and <= 10 s to 1%. The load before and after is printed beside the figures.

The depth study (--layers):

GPT-3 175B (hidden 12288, 96 heads, seq 2048, vocab 51200, global batch 1536, bf16, Adam) on
the dgx-a100 profile with 128 nodes, at the profile's memory limit (80 GB less the 10% reserve).
For each depth it prints the capture time (torch.export on the meta device, micro-batch graphs
for every count that divides the batch), the sound search's time (`planner.search`: every stage
count, stage mesh, micro-batch count and recomputation, best-first by proven bounds, one
signature per op: the least of --repeat searches, taken in turn across depths as the host
drifts, and the most beside it; and the least CPU time, which the host's other load inflates
less), the configurations of the space, bounded by an LP and solved, the status and the gap
proven over the whole space, the chosen plan, the ratio of each search time to the shallowest
one (of the least times, then turn by turn), and the process's peak RSS (an upper bound of the
deepest plan's: every depth's graphs are held at once). Targets (issue "Planner II"): search
<= 30 s at 96 layers on a 2-core machine, gap <= 1%, the 96/12 ratio reported, RSS < 2 GB.

Beside each auto plan it prices the Megatron-LM plan of Narayanan et al. 2021 for this model
(tensor parallel 8 inside a node, 16 pipeline stages, data parallel 8, micro-batches of one
sequence per data-parallel rank: 192 of them, full recomputation) with the same cost model; at
depths that 16 stages do not divide it uses as many stages as divide the layers (at most 16).
With --hand-grid it prices, at the deepest depth, every hand plan of the grid tp in {1, 2, 4,
8} x pp in {1, 2, 4, 8, 16} (dp the rest) x recomputation {none, selective, full}, each with its
best micro-batch count (searched: the counts dp divides the micro-batches of, >= pp), and prints
them beside auto, fastest first.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # this script's folder would shadow packages

from autosbp.capturing.graph import OpGraph  # noqa: E402
from autosbp.capturing.rebatch import micro_batch_graphs  # noqa: E402
from autosbp.errors import PlanError  # noqa: E402
from autosbp.plan import Plan  # noqa: E402
from autosbp.planner.api import plan_graphs  # noqa: E402
from autosbp.planner.search.entry import GraphMemo, divisors  # noqa: E402
from autosbp.zoo import GPT3_175B, gpt3_175b, gpt3_megatron  # noqa: E402
from bench.frontier import (  # noqa: E402
    ANYTIME,
    CASES,
    busy,
    in_process,
    print_anytime,
    print_table,
    run_case,
)

DEVICES = 1024
PROFILE = "dgx-a100"
COMMON: dict = {
    "profile": PROFILE, "devices": DEVICES, "memory_limit": None, "optimizer": "adam",
    "dtype": "bf16", "global_batch": GPT3_175B["batch"], "time_limit_s": 300,
}  # fmt: skip
GRID_TP, GRID_PP, GRID_RECOMPUTE = (1, 2, 4, 8), (1, 2, 4, 8, 16), ("none", "selective", "full")


@dataclass
class Depth:
    """One depth of the model: its captured graphs, then its searches' times and plans."""

    layers: int
    graphs: dict[int, OpGraph]
    hand: str  # the Megatron-LM strategy
    capture_s: float
    search_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    auto: Plan | None = None
    megatron: Plan | None = None


def capture(layers: int) -> Depth:
    """The micro-batch graphs of GPT-3 with `layers` layers (every count that divides the
    batch), and the time capturing took."""
    model, inputs = gpt3_175b(layers)
    hand, _ = gpt3_megatron(layers, DEVICES)
    start = time.perf_counter()
    graphs = micro_batch_graphs(model, inputs, divisors(GPT3_175B["batch"]), name=f"gpt3-{layers}l")
    return Depth(layers, graphs, hand, time.perf_counter() - start)


def plan_auto(graphs: dict[int, OpGraph]) -> Plan:
    """The plan `autosbp plan` makes for GPT-3 (tests/planner/test_planner.py holds them equal)."""
    return plan_graphs(graphs, **COMMON, strategy="auto")


def plan_megatron(
    graphs: dict[int, OpGraph], hand: str, recompute: str = "full", memo: GraphMemo | None = None
) -> Plan:
    """A hand plan priced by the same model: its micro-batch count searched unless it names one.
    `memo`: what earlier plans of these graphs computed of them (`search.graph_memo`)."""
    return plan_graphs(graphs, **COMMON, strategy=hand, recompute=recompute, memo=memo)


def search(depth: Depth) -> None:
    """One full search on the captured graphs: its times join the others, its plan is kept."""
    start, cpu = time.perf_counter(), _cpu_s()
    depth.auto = plan_auto(depth.graphs)
    depth.search_s.append(time.perf_counter() - start)
    depth.cpu_s.append(_cpu_s() - cpu)


def hand_grid(graphs: dict[int, OpGraph]) -> list[tuple[str, str, Plan | None, str]]:
    """Every hand plan of the grid (strategy, recomputation, its plan or None, why not); their
    searches share what depends only on the graphs (`search.graph_memo.GraphMemo`), as the
    searches of one `--compare` do."""
    rows: list[tuple[str, str, Plan | None, str]] = []
    memo = GraphMemo()
    for tp in GRID_TP:
        for pp in GRID_PP:
            strategy = f"megatron:tp={tp},pp={pp},dp={DEVICES // (tp * pp)}"
            for recompute in GRID_RECOMPUTE:
                try:
                    rows.append(
                        (strategy, recompute, plan_megatron(graphs, strategy, recompute, memo), "")
                    )
                except PlanError as exc:
                    rows.append((strategy, recompute, None, str(exc).split(". ")[0][:60]))
    return rows


def describe(plan: Plan) -> str:
    mesh = "x".join(map(str, plan.mesh_shape))
    return f"{len(plan.stages)}st x {mesh}, mb {plan.micro_batches}, {plan.recompute}"


def _cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--layers", type=int, nargs="+",
        help="the GPT-3 depth study at these depths (12 48 96) instead of the frontier table",
    )  # fmt: skip
    parser.add_argument("--no-megatron", action="store_true", help="skip the Megatron plan")
    parser.add_argument("--hand-grid", action="store_true", help="price the hand-plan grid too")
    parser.add_argument(
        "--repeat", type=int, default=3,
        help="searches per depth, taken in turn across depths (the host drifts); the least counts",
    )  # fmt: skip
    parser.add_argument("--cases", nargs="+", choices=list(CASES), help="frontier cases to run")
    parser.add_argument("--case", choices=list(CASES), help=argparse.SUPPRESS)  # one, as JSON
    parser.add_argument("--time-limit-s", type=float, default=600.0)
    parser.add_argument("--jobs", type=int, help="search processes (default: every core)")
    parser.add_argument(
        "--busy", type=int, default=0,
        help="also run GPT-3/1024 under the default 60 s limit beside N busy processes",
    )  # fmt: skip
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(CASES[args.case], args.time_limit_s, args.jobs)))
    elif args.layers:
        depth_study(args)
    else:
        frontier(args)


def frontier(args: argparse.Namespace) -> None:
    """The frontier table (each case in its own process), the anytime table, and with --busy
    GPT-3/1024 under the default limit beside busy processes."""
    names = args.cases or list(CASES)
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    print(f"load before: {' '.join(load)}; {os.cpu_count()} cores; jobs {args.jobs or 'all'}")
    rows = []
    for name in names:
        rows.append(in_process(name, args.time_limit_s, args.jobs))
        print(f"done {name}", file=sys.stderr)
    print_table(rows)
    print_anytime([r for r in rows if r["case"] in ANYTIME])
    if args.busy:
        spinning = busy(args.busy)
        try:
            loaded = [in_process(ANYTIME[0], limit, args.jobs) for limit in (60.0, 600.0)]
        finally:
            for p in spinning:
                p.kill()
        print(f"\nbeside {args.busy} busy processes: GPT-3/1024 at the default 60 s, then at 600 s")
        print_table(loaded)
        if all("error" not in r for r in loaded):
            ratio = loaded[0]["step_s"] / loaded[1]["step_s"]
            print(f"60 s plan / 600 s plan: {ratio:.4f} (proven: {loaded[0]['status']})")
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    print(f"load after: {' '.join(load)}")
    flags = f" --cases {' '.join(names)}" if args.cases else ""
    flags += f" --jobs {args.jobs}" if args.jobs else ""
    flags += f" --busy {args.busy}" if args.busy else ""
    print(f"regenerate: python bench/plan_speed.py --time-limit-s {args.time_limit_s:g}{flags}")


def depth_study(args: argparse.Namespace) -> None:
    depths = [capture(layers) for layers in args.layers]
    for turn in range(args.repeat):
        for depth in depths:
            search(depth)
            print(f"search {turn + 1}/{args.repeat}, {depth.layers} layers", file=sys.stderr)
    if not args.no_megatron:
        for depth in depths:
            depth.megatron = plan_megatron(depth.graphs, depth.hand)
    print_depths(depths)
    if args.hand_grid:
        print_grid(depths[-1])
    print(
        f"peak RSS of the process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"
    )
    print(
        f"regenerate: python bench/plan_speed.py --layers {' '.join(map(str, args.layers))} "
        f"--repeat {args.repeat}{' --hand-grid' if args.hand_grid else ''}"
    )


def print_depths(depths: list[Depth]) -> None:
    base = min(depths[0].search_s)
    print(
        f"{'layers':>6} {'capture s':>9} {'search s':>8} {'(most)':>6} {'cpu s':>6} "
        f"{'vs first':>8} {'configs/LP/solved':>17} {'status':>8} {'gap':>6} {'auto plan':<30} "
        f"{'step s':>7} {'megatron step s':>15} {'megatron/auto':>13}"
    )
    for depth in depths:
        auto, megatron = depth.auto, depth.megatron
        assert auto is not None
        search_s = min(depth.search_s)
        hand = f"{megatron.predicted.step_time_s:>15.2f}" if megatron else f"{'-':>15}"
        ratio = (
            f"{megatron.predicted.step_time_s / auto.predicted.step_time_s:>12.2f}x"
            if megatron
            else f"{'-':>13}"
        )
        effort = f"{auto.solver.configurations}/{auto.solver.bounded}/{auto.solver.solved}"
        print(
            f"{depth.layers:>6} {depth.capture_s:>9.1f} {search_s:>8.1f} "
            f"{max(depth.search_s):>6.1f} {min(depth.cpu_s):>6.1f} {search_s / base:>7.2f}x "
            f"{effort:>17} {auto.solver.status:>8} {auto.solver.gap:>6.2%} {describe(auto):<30} "
            f"{auto.predicted.step_time_s:>7.2f} {hand} {ratio}"
        )
    for depth in depths[1:]:
        turns = ", ".join(
            f"{a / b:.2f}x" for a, b in zip(depth.search_s, depths[0].search_s, strict=True)
        )
        print(f"{depth.layers} vs {depths[0].layers} layers, turn by turn: {turns}")


def print_grid(depth: Depth) -> None:
    auto = depth.auto
    assert auto is not None
    rows = hand_grid(depth.graphs)
    fitting = sorted(
        (r for r in rows if r[2] is not None), key=lambda r: r[2].predicted.step_time_s
    )
    print(
        f"\nauto vs the hand-plan grid, {depth.layers} layers ({len(fitting)} of {len(rows)} fit)"
    )
    print(f"{'plan':<28} {'recompute':>9} {'micro-batches':>13} {'step s':>7} {'vs auto':>8}")
    print(
        f"{'auto (' + describe(auto) + ')':<28} {auto.recompute:>9} {auto.micro_batches:>13} "
        f"{auto.predicted.step_time_s:>7.2f} {1:>7.2f}x"
    )
    for strategy, recompute, plan, _ in fitting:
        assert plan is not None
        step = plan.predicted.step_time_s
        print(
            f"{strategy.removeprefix('megatron:'):<28} {recompute:>9} {plan.micro_batches:>13} "
            f"{step:>7.2f} {step / auto.predicted.step_time_s:>7.2f}x"
        )
    for strategy, recompute, _, why in (r for r in rows if r[2] is None):
        print(f"{strategy.removeprefix('megatron:'):<28} {recompute:>9} does not fit: {why}")


if __name__ == "__main__":
    main()
