"""Benchmark: the MoE step on 2 gloo processes under expert parallelism and data parallelism,
predicted by the planner and measured by the runtime, side by side.

Run: python bench/moe.py [--steps 6] [--warmup 2] [--rounds 2]

What it measures: the zoo's `moe` (capacity-based top-2 routing, `autosbp.zoo`) at two sizes, each
under `dp` (every expert replicated, gradients all-reduced), `megatron:tp=1,pp=1,dp=2,ep=2` (each
process holds half of every layer's experts; tokens reach them and come back by all-to-all) and
`auto` (the planner's choice). Planning and measuring are bench/fidelity.py's, unchanged (the
cpu-gloo profile; `Engine.step` on 2 gloo processes, warmup + timed steps, rounds in alternating
order, the median of rank 0's timed steps; per-phase times; peak memory by RSS), so the figures
read like its table. Printed after its tables: per size, EP / DP predicted and measured (does the
cost model rank the two as the machine does?) and where auto put the experts. The two sizes
differ in what EP trades: `moe-tokens` has many tokens per expert weight (EP's all-to-all of
tokens against DP's all-reduce of expert gradients), `moe-experts` few tokens and 8 wide experts
(expert weights dominate, so does DP's all-reduce of their gradients).
Nothing here is fitted or tuned: it measures; the 2 cores are shared, so read every figure beside
the load average fidelity prints.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# As a script, bench/ would shadow the runtime and costmodel packages (see bench/fidelity.py).
sys.path[0] = str(Path(__file__).resolve().parents[1])

from rich.console import Console  # noqa: E402 - after the path fix above

from bench.fidelity import (  # noqa: E402
    PROFILE,
    Case,
    Row,
    measure,
    phase_table,
    plan_case,
    step_table,
)

# label -> (zoo name, arguments): steps of tens to hundreds of ms on one core, so compute and
# communication, not Python overhead, dominate
MOE_SIZES: dict[str, tuple[str, dict[str, Any]]] = {
    "moe-tokens": ("moe", {"layers": 2, "hidden": 128, "heads": 4, "experts": 4, "ffn": 512,
                           "vocab": 1024, "seq": 64, "batch": 16}),
    "moe-experts": ("moe", {"layers": 2, "hidden": 256, "heads": 4, "experts": 8, "ffn": 1024,
                            "vocab": 1024, "seq": 32, "batch": 4}),
}  # fmt: skip
EP = "megatron:tp=1,pp=1,dp=2,ep=2"


@dataclass(frozen=True, slots=True)
class MoeCase(Case):
    """fidelity's Case with a model from MOE_SIZES (the worker processes import this module to
    read it)."""

    @property
    def zoo_name(self) -> str:
        return MOE_SIZES[self.size][0]

    @property
    def model_args(self) -> dict[str, Any]:
        return MOE_SIZES[self.size][1]


STRATEGIES = ("dp", EP, "auto")


def ranking_lines(rows: list[Row]) -> list[str]:
    """Per size: EP / DP step time, predicted and measured, and where auto's experts went."""
    lines = []
    for size in MOE_SIZES:
        by = {r.case.strategy: r for r in rows if r.case.size == size}
        dp, ep, auto = by["dp"], by[EP], by["auto"]
        predicted = ep.predicted.step_s / dp.predicted.step_s
        measured = ep.measured.median_s / dp.measured.median_s
        agree = (predicted < 1) == (measured < 1)
        experts = sorted({p.sbp for n, p in auto.plan.params.items() if n.endswith("moe.w_in")})
        lines.append(
            f"{size}: EP / DP step time predicted {predicted:.2f}, measured {measured:.2f} "
            f"({'same' if agree else 'OPPOSITE'} ranking); auto's experts {', '.join(experts)}, "
            f"auto / best of dp, ep measured "
            f"{auto.measured.median_s / min(dp.measured.median_s, ep.measured.median_s):.2f}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per plan and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every case")
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 200))
    began, load_before = time.perf_counter(), os.getloadavg()
    planned = []
    for size in MOE_SIZES:
        for strategy in STRATEGIES:
            case = MoeCase(size, 2, strategy, "none")
            planned.append((case, *plan_case(case, PROFILE)))
    measured, _ = measure([(c, p) for c, p, _ in planned], args.steps, args.warmup, args.rounds)
    rows = [Row(case, plan, predicted, measured[case]) for case, plan, predicted in planned]
    command = "python bench/moe.py " + " ".join(argv if argv is not None else sys.argv[1:])
    console.print(step_table(rows, command.strip(), PROFILE))
    console.print(phase_table(rows))
    for line in ranking_lines(rows):
        console.print(line)
    console.print(
        f"load average (1/5/15 min) before {'/'.join(f'{x:.2f}' for x in load_before)}, after "
        f"{'/'.join(f'{x:.2f}' for x in os.getloadavg())}; bench took "
        f"{time.perf_counter() - began:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
