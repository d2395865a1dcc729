"""How fast the planner plans GPT-3 175B for 1024 A100s, and how that grows with depth.

Run: python bench/plan_speed.py [--layers 12 48 96] [--no-megatron] [--repeat 3]

GPT-3 175B (hidden 12288, 96 heads, seq 2048, vocab 51200, global batch 1536, bf16, Adam) on
the dgx-a100 profile with 128 nodes, at the profile's memory limit (80 GB less the 10% reserve).
For each depth it prints the capture time (torch.export on the meta device, micro-batch graphs
for every power-of-two count), the full search time (stage counts, stage meshes, micro-batch
counts, recomputation, one signature per op: the least of --repeat searches, taken in turn
across depths as the host drifts, and the most beside it), the configurations the search
reached, bounded by an LP and solved, the solver's status and gap, the chosen plan,
and the ratio of each search time to the shallowest one (of the least times, then turn by
turn: searches of one turn ran minutes apart at most). Targets (issue "Planner"): search
<= 30 s on a 2-core machine, gap <= 1%, 96 layers <= 2x the time of 12.

Beside each auto plan it prices the Megatron-LM plan of Narayanan et al. 2021 for this model
(tensor parallel 8 inside a node, 16 pipeline stages, data parallel 8, micro-batches of one
sequence per data-parallel rank: 192 of them, full recomputation) with the same cost model; at depths
that 16 stages do not divide it uses as many stages as divide the layers (at most 16).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # this script's folder would shadow packages

from autosbp.capturing.graph import OpGraph  # noqa: E402
from autosbp.capturing.rebatch import micro_batch_graphs  # noqa: E402
from autosbp.plan import Plan  # noqa: E402
from autosbp.planner.api import plan_graphs  # noqa: E402
from autosbp.planner.search import powers_of_two_dividing  # noqa: E402
from autosbp.zoo import GPT3_175B, gpt3_175b, gpt3_megatron  # noqa: E402

DEVICES = 1024
PROFILE = "dgx-a100"
COMMON: dict = {
    "profile": PROFILE, "devices": DEVICES, "memory_limit": None, "optimizer": "adam",
    "dtype": "bf16",
}  # fmt: skip


@dataclass
class Depth:
    """One depth of the model: its captured graphs, then its searches' times and plans."""

    layers: int
    graphs: dict[int, OpGraph]
    counts: tuple[int, ...]  # micro-batch counts the search tries
    hand: tuple[str, int]  # the Megatron-LM strategy and its micro-batch count
    capture_s: float
    search_s: list[float] = field(default_factory=list)
    auto: Plan | None = None
    megatron: Plan | None = None


def capture(layers: int, with_megatron: bool) -> Depth:
    """The micro-batch graphs of GPT-3 with `layers` layers, and the time capturing took."""
    model, inputs = gpt3_175b(layers)
    counts = powers_of_two_dividing(GPT3_175B["batch"])
    hand, hand_count = gpt3_megatron(layers, DEVICES)
    wanted = (*counts, hand_count) if with_megatron else counts
    start = time.perf_counter()
    graphs = micro_batch_graphs(model, inputs, wanted, name=f"gpt3-{layers}l")
    return Depth(layers, graphs, counts, (hand, hand_count), time.perf_counter() - start)


def search(depth: Depth) -> None:
    """One full search on the captured graphs: its time joins the others, its plan is kept."""
    start = time.perf_counter()
    depth.auto = plan_graphs(
        {c: depth.graphs[c] for c in depth.counts}, **COMMON, global_batch=GPT3_175B["batch"],
        strategy="auto", time_limit_s=60,
    )  # fmt: skip
    depth.search_s.append(time.perf_counter() - start)


def price_megatron(depth: Depth) -> None:
    hand, hand_count = depth.hand
    depth.megatron = plan_graphs(
        {hand_count: depth.graphs[hand_count]}, **COMMON, global_batch=GPT3_175B["batch"],
        strategy=hand, recompute="full", time_limit_s=60,
    )  # fmt: skip


def describe(plan: Plan) -> str:
    mesh = "x".join(map(str, plan.mesh_shape))
    return f"{len(plan.stages)}st x {mesh}, mb {plan.micro_batches}, {plan.recompute}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 48, 96])
    parser.add_argument("--no-megatron", action="store_true", help="skip the Megatron plan")
    parser.add_argument(
        "--repeat", type=int, default=3,
        help="searches per depth, taken in turn across depths (the host drifts); the least counts",
    )  # fmt: skip
    args = parser.parse_args()
    depths = [capture(layers, not args.no_megatron) for layers in args.layers]
    for turn in range(args.repeat):
        for depth in depths:
            search(depth)
            print(f"search {turn + 1}/{args.repeat}, {depth.layers} layers", file=sys.stderr)
    if not args.no_megatron:
        for depth in depths:
            price_megatron(depth)
    base = min(depths[0].search_s)
    print(
        f"{'layers':>6} {'capture s':>9} {'search s':>8} {'(most)':>6} {'vs first':>8} "
        f"{'configs/LP/solved':>17} {'status':>8} {'gap':>6} {'auto plan':<34} {'step s':>7} "
        f"{'megatron step s':>15} {'auto/megatron':>13}"
    )
    for depth in depths:
        auto, megatron = depth.auto, depth.megatron
        assert auto is not None
        search_s = min(depth.search_s)
        hand = f"{megatron.predicted.step_time_s:>15.2f}" if megatron else f"{'-':>15}"
        ratio = (
            f"{auto.predicted.step_time_s / megatron.predicted.step_time_s:>13.3f}"
            if megatron
            else f"{'-':>13}"
        )
        effort = f"{auto.solver.configurations}/{auto.solver.bounded}/{auto.solver.solved}"
        print(
            f"{depth.layers:>6} {depth.capture_s:>9.1f} {search_s:>8.1f} "
            f"{max(depth.search_s):>6.1f} {search_s / base:>7.2f}x {effort:>17} {auto.solver.status:>8} "
            f"{auto.solver.gap:>6.2%} {describe(auto):<34} {auto.predicted.step_time_s:>7.2f} "
            f"{hand} {ratio}"
        )
    for depth in depths[1:]:
        turns = ", ".join(
            f"{a / b:.2f}x" for a, b in zip(depth.search_s, depths[0].search_s, strict=True)
        )
        print(f"{depth.layers} vs {depths[0].layers} layers, turn by turn: {turns}")
    print(
        f"regenerate: python bench/plan_speed.py --layers {' '.join(map(str, args.layers))} "
        f"--repeat {args.repeat}"
    )


if __name__ == "__main__":
    main()
