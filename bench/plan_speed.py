"""How fast the planner plans GPT-3 175B for 1024 A100s, and how that grows with depth.

Run: python bench/plan_speed.py [--layers 12 48 96] [--no-megatron]

GPT-3 175B (hidden 12288, 96 heads, seq 2048, vocab 51200, global batch 1536, bf16, Adam) on
the dgx-a100 profile with 128 nodes, at the profile's memory limit (80 GB less the 10% reserve).
For each depth it prints the capture time (torch.export on the meta device, micro-batch graphs
for every power-of-two count), the full search time (stage counts, stage meshes, micro-batch
counts, recomputation, one signature per op), the solver's status and gap, the chosen plan,
and the ratio of each search time to the shallowest one. Targets (issue "Planner"): search
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
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # this script's folder would shadow packages

from autosbp.plan import Plan  # noqa: E402
from autosbp.planner.api import plan_graphs  # noqa: E402
from autosbp.planner.search import powers_of_two_dividing  # noqa: E402
from autosbp.rebatch import micro_batch_graphs  # noqa: E402
from autosbp.zoo import GPT3_175B, gpt3_175b, gpt3_megatron  # noqa: E402

DEVICES = 1024
PROFILE = "dgx-a100"
COMMON: dict = {
    "profile": PROFILE, "devices": DEVICES, "memory_limit": None, "optimizer": "adam",
    "dtype": "bf16",
}  # fmt: skip


def measure(layers: int, with_megatron: bool) -> dict[str, object]:
    model, inputs = gpt3_175b(layers)
    counts = powers_of_two_dividing(GPT3_175B["batch"])
    hand, hand_count = gpt3_megatron(layers, DEVICES)
    wanted = (*counts, hand_count) if with_megatron else counts
    start = time.perf_counter()
    graphs = micro_batch_graphs(model, inputs, wanted, name=f"gpt3-{layers}l")
    captured = time.perf_counter() - start
    start = time.perf_counter()
    plan = plan_graphs(
        {c: graphs[c] for c in counts}, **COMMON, global_batch=GPT3_175B["batch"],
        strategy="auto", time_limit_s=60,
    )  # fmt: skip
    searched = time.perf_counter() - start
    row: dict[str, object] = {"capture_s": captured, "search_s": searched, "auto": plan}
    if with_megatron:
        row["megatron"] = plan_graphs(
            {hand_count: graphs[hand_count]}, **COMMON,
            global_batch=GPT3_175B["batch"], strategy=hand,
            recompute="full", time_limit_s=60,
        )  # fmt: skip
    return row


def describe(plan: Plan) -> str:
    mesh = "x".join(map(str, plan.mesh_shape))
    return f"{len(plan.stages)}st x {mesh}, mb {plan.micro_batches}, {plan.recompute}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 48, 96])
    parser.add_argument("--no-megatron", action="store_true", help="skip the Megatron plan")
    args = parser.parse_args()
    rows = []
    for layers in args.layers:
        rows.append((layers, measure(layers, not args.no_megatron)))
        print(f"{layers} layers done", file=sys.stderr, flush=True)
    base = float(rows[0][1]["search_s"])  # type: ignore[arg-type]
    print(
        f"{'layers':>6} {'capture s':>9} {'search s':>8} {'vs first':>8} {'status':>8} "
        f"{'gap':>6} {'auto plan':<34} {'step s':>7} {'megatron step s':>15} {'auto/megatron':>13}"
    )
    for layers, r in rows:
        auto: Plan = r["auto"]  # type: ignore[assignment]
        search_s = float(r["search_s"])  # type: ignore[arg-type]
        megatron: Plan | None = r.get("megatron")  # type: ignore[assignment]
        hand = f"{megatron.predicted.step_time_s:>15.2f}" if megatron else f"{'-':>15}"
        ratio = (
            f"{auto.predicted.step_time_s / megatron.predicted.step_time_s:>13.3f}"
            if megatron
            else f"{'-':>13}"
        )
        print(
            f"{layers:>6} {float(r['capture_s']):>9.1f} {search_s:>8.1f} "  # type: ignore[arg-type]
            f"{search_s / base:>7.2f}x {auto.solver.status:>8} {auto.solver.gap:>6.2%} "
            f"{describe(auto):<34} {auto.predicted.step_time_s:>7.2f} {hand} {ratio}"
        )
    print("regenerate: python bench/plan_speed.py --layers " + " ".join(map(str, args.layers)))


if __name__ == "__main__":
    main()
