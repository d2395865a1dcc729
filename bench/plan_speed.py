"""How fast the planner plans GPT-3 175B for 1024 A100s, and how that grows with depth.

Run: python bench/plan_speed.py [--layers 12 48 96]

GPT-3 175B (hidden 12288, 96 heads, seq 2048, vocab 51200, global batch 1536, bf16) on the
dgx-a100 profile with 128 nodes. For each depth it prints the capture time (torch.export on the
meta device), the search time (every mesh shape: pricing, the ILP, assembling the plan), the
solver's status and gap, and the ratio of each search time to the shallowest one. Targets
(design.md section 5): search <= 30 s, gap <= 1%, 96 layers <= 2x the time of 12.

Scope note: the planner does not yet search pipeline stages, micro-batches or recomputation, and
without them GPT-3's activations for a whole 1536-sample batch do not fit in 80 GB at 96 layers.
So the memory limit is lifted here (NO_LIMIT_BYTES) and the timings measure the part of the
search that exists: mesh shapes, one signature per op, parameter layouts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path[0] = str(Path(__file__).resolve().parents[1])  # this script's folder would shadow packages

from autosbp.capturing import capture  # noqa: E402
from autosbp.planner.api import plan_graph  # noqa: E402
from autosbp.zoo import build_model  # noqa: E402

NO_LIMIT_BYTES = 1 << 60  # see the scope note
GPT3 = {"hidden": 12288, "heads": 96, "seq": 2048, "vocab": 51200, "batch": 1536}


def measure(layers: int) -> dict[str, float | str]:
    model, inputs = build_model("gpt", device="meta", layers=layers, **GPT3)
    model = model.to(torch.bfloat16)
    start = time.perf_counter()
    graph = capture(model, inputs, name=f"gpt3-{layers}l")
    captured = time.perf_counter() - start
    start = time.perf_counter()
    plan = plan_graph(
        graph, profile="dgx-a100", devices=1024, memory_limit=NO_LIMIT_BYTES, global_batch=1536,
        optimizer="adam", dtype="bf16", strategy="auto", time_limit_s=60,
    )  # fmt: skip
    searched = time.perf_counter() - start
    return {
        "capture_s": captured,
        "search_s": searched,
        "status": plan.solver.status,
        "gap": plan.solver.gap,
        "mesh": "x".join(map(str, plan.mesh_shape)),
        "step_s": plan.predicted.step_time_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 48, 96])
    args = parser.parse_args()
    rows = [(layers, measure(layers)) for layers in args.layers]
    base = rows[0][1]["search_s"]
    print(
        f"{'layers':>6} {'capture s':>10} {'search s':>9} {'vs first':>8} {'status':>8} {'gap':>7} {'mesh':>8} {'pred step s':>11}"
    )
    for layers, r in rows:
        print(
            f"{layers:>6} {r['capture_s']:>10.1f} {r['search_s']:>9.1f} {r['search_s'] / base:>7.2f}x "
            f"{r['status']:>8} {r['gap']:>7.2%} {r['mesh']:>8} {r['step_s']:>11.3f}"
        )
    print("regenerate: python bench/plan_speed.py --layers " + " ".join(map(str, args.layers)))


if __name__ == "__main__":
    main()
