"""The frontier cases of `bench/plan_speed.py`: GPT-3 175B on 1024 A100s, every row of Megatron-LM's
Table 1 (Narayanan et al. 2021; /work/shared/reference/frontier.md: GPT, seq 2048, vocab 51200,
the published GPUs and global batches, DGX A100), and Llama 3 405B (Dubey et al. 2024: a
Hugging Face LlamaForCausalLM, 126 layers, hidden 16384, 128 heads, 8 KV heads, FFN 53248,
vocab 128256, seq 8192, batch 2048) on 8192 and 16384 H100s, each planned as `autosbp plan`
plans it (meta model in bf16, every micro-batch count that divides the batch, Adam, the
profile's memory less the reserve).

Lives here: the cases, one case planned in this process (`run_case`: capture, then the search,
with its effort: status, gap, when it found each better plan), and the table of all of them,
each case in a process of its own (its peak RSS its own); and the published layouts priced by
our model (`python bench/frontier.py --published [--cases ...]`: each Table 1 row at its
tp/pp with full recomputation and the interleaving `INTERLEAVED` assumes, Llama 3 405B at
TP8 PP16 interleaved with gradients and optimizer states sharded;
predicted step and TFLOP/s per GPU beside the published ones). Lives elsewhere: the GPT-3 depth
study and the hand-plan grid (`plan_speed`), the search (`autosbp.planner.search.entry`).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # "gpt" (the zoo's) or "llama" (Hugging Face)
    shape: dict[str, int]
    batch: int
    devices: int
    profile: str


def _gpt(name: str, layers: int, hidden: int, heads: int, devices: int, batch: int) -> Case:
    shape = {"layers": layers, "hidden": hidden, "heads": heads, "seq": 2048, "vocab": 51200}
    return Case(name, "gpt", shape, batch, devices, "dgx-a100")


LLAMA3_405B = {
    "layers": 126, "hidden": 16384, "heads": 128, "kv_heads": 8, "ffn": 53248, "vocab": 128256,
    "seq": 8192,
}  # fmt: skip
TABLE1 = [  # params, layers, hidden, heads, GPUs, global batch (Narayanan et al. 2021, Table 1)
    ("1.7B", 24, 2304, 24, 32, 512), ("3.6B", 30, 3072, 32, 64, 512),
    ("7.5B", 36, 4096, 32, 128, 512), ("18.4B", 40, 6144, 48, 256, 1024),
    ("39.1B", 48, 8192, 64, 512, 1536), ("76.1B", 60, 10240, 80, 1024, 1792),
    ("145.6B", 80, 12288, 96, 1536, 2304), ("310.1B", 96, 16384, 128, 1920, 2160),
    ("529.6B", 105, 20480, 128, 2520, 2520), ("1008B", 128, 25600, 160, 3072, 3072),
]  # fmt: skip
CASES: dict[str, Case] = {
    "gpt3-175b/1024": _gpt("gpt3-175b/1024", 96, 12288, 96, 1024, 1536),
    **{
        f"{p}/{gpus}": _gpt(f"{p}/{gpus}", layers, hidden, heads, gpus, batch)
        for p, layers, hidden, heads, gpus, batch in TABLE1
    },
    "llama3-405b/8192": Case("llama3-405b/8192", "llama", LLAMA3_405B, 2048, 8192, "dgx-h100"),
    "llama3-405b/16384": Case("llama3-405b/16384", "llama", LLAMA3_405B, 2048, 16384, "dgx-h100"),
}
ANYTIME = ("gpt3-175b/1024", "1008B/3072")


def build(case: Case) -> tuple[Any, tuple[Any, ...]]:
    """The case's model on the meta device in bf16, and its inputs at the global batch."""
    from autosbp.planner.api import in_dtype
    from autosbp.zoo import build_model

    if case.model == "gpt":
        model, inputs = build_model("gpt", device="meta", batch=case.batch, **case.shape)
    else:
        model, inputs = _llama(case)
    return model, in_dtype(model, inputs, "bf16", owned=True)


def _llama(case: Case) -> tuple[Any, tuple[Any, ...]]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT))
    from tests.support.real_models import LossOf

    s = case.shape
    config = LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], max_position_embeddings=s["seq"],
        attention_dropout=0.0, rope_theta=500000.0, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.train()
    ids = torch.zeros((case.batch, s["seq"]), dtype=torch.long, device="meta")
    return LossOf(model, ("input_ids", "labels")), (ids, ids)


def run_case(case: Case, time_limit_s: float, jobs: int | None) -> dict[str, Any]:
    """Capture and search one case here, as `autosbp plan` does; what it found and what it cost."""
    from autosbp.capturing.rebatch import micro_batch_graphs
    from autosbp.planner.search.entry import divisors

    model, inputs = build(case)
    start = time.perf_counter()
    graphs = micro_batch_graphs(model, inputs, divisors(case.batch), name=case.name)
    capture_s = time.perf_counter() - start
    print(f"{case.name}: captured in {capture_s:.1f} s", file=sys.stderr, flush=True)
    cpu, start = os.times(), time.perf_counter()
    found = _search(case, graphs, time_limit_s, jobs)
    search_s, after = time.perf_counter() - start, os.times()
    effort, problem = found.effort, found.problem
    assert effort is not None
    self_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    children_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    return {
        "case": case.name, "capture_s": capture_s, "search_s": search_s,
        "cpu_s": after.user + after.system - cpu.user - cpu.system,
        "children_cpu_s": after.children_user + after.children_system
        - cpu.children_user - cpu.children_system,
        "status": effort.status, "gap": effort.gap, "step_s": found.prediction.step_time_s,
        "plan": f"{problem.split.num_stages}st x {'x'.join(map(str, problem.mesh.shape))}, "
        f"mb {problem.micro_batches}, {problem.recompute}",
        "configurations": effort.configurations, "bounded": effort.bounded,
        "solved": effort.solved, "found": effort.found, "rss_gib": self_gib,
        "children_rss_gib": children_gib, "limit_reached": effort.limit_reached,
    }  # fmt: skip


def _search(case: Case, graphs: dict, time_limit_s: float, jobs: int | None):
    """`planner.api._plan`'s search of `auto`, kept whole (`Found`, with its effort)."""
    from autosbp.planner.api import MEMORY_RESERVE_FRACTION, ClusterPrices
    from autosbp.planner.search.entry import search
    from autosbp.planner.space.strategy import strategy_space
    from costmodel import Cluster, load_profile

    hw = load_profile(case.profile)
    per_node = int(hw.topology.devices_per_node.value)
    cluster = Cluster(hw, nodes=-(-case.devices // per_node))
    limit = int(cluster.memory_bytes * (1 - MEMORY_RESERVE_FRACTION))
    first = graphs[min(graphs)]
    blocks = len({a.block for _, a in first.nodes() if a.block is not None})

    def link_of(shape: tuple[int, ...], mesh_dim: int) -> str:
        return cluster.link_class_for_mesh_dim(shape, mesh_dim).value

    space = replace(strategy_space("auto", "auto", blocks), micro_batches=tuple(sorted(graphs)))
    return search(
        graphs.__getitem__, case.batch, case.devices, ClusterPrices(cluster), link_of, space,
        optimizer="adam", memory_limit_bytes=limit, time_limit_s=time_limit_s,
        devices_per_node=per_node, jobs=jobs,
    )  # fmt: skip


def in_process(name: str, time_limit_s: float, jobs: int | None) -> dict[str, Any]:
    """`run_case` of `name` in a fresh process (`plan_speed.py --case`): its own peak RSS."""
    command = [sys.executable, str(ROOT / "bench" / "plan_speed.py"), "--case", name]
    command += ["--time-limit-s", str(time_limit_s)]
    if jobs is not None:
        command += ["--jobs", str(jobs)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"case": name, "error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(lines[-1])


def busy(processes: int) -> list[subprocess.Popen]:
    """`processes` processes that spin a core each until killed."""
    spin = "while True: pass"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(processes)]


def print_table(rows: list[dict[str, Any]], say: Callable[[str], None] = print) -> None:
    say(
        f"{'case':<19} {'capture s':>9} {'search s':>8} {'cpu s':>6} {'status':>8} {'gap':>6} "
        f"{'configs/LP/solved':>17} {'step s':>7} {'plan':<28} {'RSS GiB':>7}"
    )
    for row in rows:
        if "error" in row:
            say(f"{row['case']:<19} failed: {row['error'][:100]}")
            continue
        effort = f"{row['configurations']}/{row['bounded']}/{row['solved']}"
        cpu = row["cpu_s"] + row["children_cpu_s"]
        rss = max(row["rss_gib"], row["children_rss_gib"])
        say(
            f"{row['case']:<19} {row['capture_s']:>9.1f} {row['search_s']:>8.1f} {cpu:>6.1f} "
            f"{row['status']:>8} {row['gap']:>6.2%} {effort:>17} {row['step_s']:>7.2f} "
            f"{row['plan']:<28} {rss:>7.2f}"
        )


def print_anytime(rows: list[dict[str, Any]], say: Callable[[str], None] = print) -> None:
    """Per case, when the search first held a plan within 5% and within 1% of the best it
    proved (of the optimum where it proved it optimal)."""
    say(f"\n{'anytime':<19} {'first plan s':>12} {'<= 5% s':>8} {'<= 1% s':>8} {'best s':>7}")
    for row in rows:
        if "error" in row or not row["found"]:
            continue
        best = row["step_s"]

        def within(share: float, row: dict = row, best: float = best) -> str:
            t = next((t for t, s in row["found"] if s <= best * (1 + share)), None)
            return "-" if t is None else f"{t:.1f}"

        say(
            f"{row['case']:<19} {row['found'][0][0]:>12.1f} {within(0.05):>8} "
            f"{within(0.01):>8} {best:>7.2f}"
        )


# ------------------------------------------------------------------ the published layouts
# (tp, pp) per Table 1 row (Narayanan et al. 2021; /work/shared/reference/frontier.md), each row
# with full recomputation and one sequence per micro-batch per data-parallel rank.
TABLE1_LAYOUTS = {
    "1.7B": (1, 1), "3.6B": (2, 1), "7.5B": (4, 1), "18.4B": (8, 1), "39.1B": (8, 2),
    "76.1B": (8, 4), "145.6B": (8, 8), "310.1B": (8, 16), "529.6B": (8, 35), "1008B": (8, 64),
}  # fmt: skip
TABLE1_TFLOPS = {
    "1.7B": 137, "3.6B": 138, "7.5B": 142, "18.4B": 135, "39.1B": 138, "76.1B": 140,
    "145.6B": 148, "310.1B": 155, "529.6B": 163, "1008B": 163,
}  # fmt: skip
# Which rows ran the interleaved schedule, and with how many chunks per device v (Narayanan et
# al. 2021 section 2.2.2 introduces it): /work/shared/reference/frontier.md is silent ("to be
# read in its text, not confirmed here"). Assumed: every pipelined row interleaved, v the least
# divisor > 1 of its layers per stage (the least interleaving that splits stages evenly; the
# schedule needs the micro-batches per rank a multiple of pp, which every row meets).
INTERLEAVED: dict[str, int] = {
    "39.1B": 2, "76.1B": 3, "145.6B": 2, "310.1B": 2, "529.6B": 3, "1008B": 2,
    "llama3-405b": 2,
}  # fmt: skip
# Llama 3 405B (Dubey et al. 2024, Table 4, section 3.3; frontier.md): TP8 PP16, the rest data
# parallel, 16M tokens per batch (2048 sequences of 8192, one per micro-batch: 32 micro-batches
# per rank at DP64, 16 at DP128), weights, gradients and optimizer states sharded over data
# parallelism with weights not resharded after forward, a schedule modified from interleaved
# 1F1B (v unstated: v=2 assumed, `INTERLEAVED`); recomputation unstated (the search's choice:
# memory decides). The sharding priced: zero=1, Megatron-Core's distributed optimizer (states
# sharded, one reduce-scatter of gradients per step); our zero=2 shards gradients too but
# reduce-scatters them every micro-batch in line with backward (+7.4 s at 8192 with v=1), a
# price Llama 3's overlapped sharding does not pay in full. Published TFLOP/s per GPU.
LLAMA3_LAYOUTS = {"llama3-405b/8192": (8, 16, 430), "llama3-405b/16384": (8, 16, 400)}
LLAMA3_ZERO = 1
NO_MEMORY_LIMIT = 2**60  # bytes a device: `--unlimited`


def published_strategy(
    name: str, tp: int, pp: int, devices: int, batch: int, zero: int, vp: int | None = None
) -> str:
    """The hand plan of a published layout: one sequence per micro-batch per data-parallel
    rank (batch / dp micro-batches), the row's interleaving where `INTERLEAVED` states it (or
    `vp` chunks a stage where given: the assumption tried another way)."""
    dp = devices // (tp * pp)
    strategy = f"megatron:tp={tp},pp={pp},dp={dp},mb={batch // dp}"
    strategy += f",zero={zero}" if zero else ""
    vp = vp if vp is not None else INTERLEAVED.get(name)
    return strategy + (f",vp={vp}" if vp and vp > 1 else "")


def model_flops(case: Case, parameters: int) -> float:
    """Flops of one training step as the publications count them: Table 1's
    96 B s l h^2 (1 + s/6h + V/16lh) (full recomputation's extra forward included) for the
    GPTs; for Llama 3, 6 N per token plus attention's 12 l h s per token (no recomputation),
    N the parameter count."""
    s = case.shape
    seq, layers, hidden, vocab = s["seq"], s["layers"], s["hidden"], s["vocab"]
    if case.model == "gpt":
        extra = 1 + seq / (6 * hidden) + vocab / (16 * layers * hidden)
        return 96 * case.batch * seq * layers * hidden**2 * extra
    tokens = case.batch * seq
    return tokens * (6 * parameters + 12 * layers * hidden * seq)


def published_row(name: str, vp: int | None = None, unlimited: bool = False) -> dict[str, Any]:
    """One published layout priced by our model: the hand plan at the layout (full
    recomputation for Table 1; the search's choice of recomputation for Llama 3), its
    predicted step and TFLOP/s per GPU beside the published TFLOP/s and the step it implies.
    `vp`: chunks a stage instead of `INTERLEAVED`'s; `unlimited`: no memory limit and no
    recomputation (what the layout would take where memory were no bound)."""
    from autosbp.capturing.rebatch import micro_batch_graphs
    from autosbp.planner.api import plan_graphs

    case = CASES[name]
    if case.model == "gpt":
        row = name.split("/")[0]
        (tp, pp), published, zero, recompute = TABLE1_LAYOUTS[row], TABLE1_TFLOPS[row], 0, "full"
    else:
        (tp, pp, published), zero, recompute = LLAMA3_LAYOUTS[name], LLAMA3_ZERO, "auto"
    strategy = published_strategy(name.split("/")[0], tp, pp, case.devices, case.batch, zero, vp)
    recompute = "none" if unlimited else recompute
    model, inputs = build(case)
    parameters = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    count = int(strategy.split("mb=")[1].split(",")[0])
    graphs = micro_batch_graphs(model, inputs, (count,), name=name)
    capture_s = time.perf_counter() - start
    plan = plan_graphs(
        graphs, profile=case.profile, devices=case.devices,
        memory_limit=NO_MEMORY_LIMIT if unlimited else None,
        global_batch=case.batch, optimizer="adam", dtype="bf16", strategy=strategy,
        time_limit_s=300, recompute=recompute,
    )  # fmt: skip
    flops = model_flops(case, parameters)
    step = plan.predicted.step_time_s
    published_step = flops / (case.devices * published * 1e12)
    return {
        "case": name, "strategy": strategy.removeprefix("megatron:"), "recompute": plan.recompute,
        "capture_s": capture_s, "step_s": step, "published_step_s": published_step,
        "tflops": flops / (case.devices * step) / 1e12, "published_tflops": published,
        "peak_gib": max(s.peak_memory_bytes for s in plan.stages) / 2**30,
    }  # fmt: skip


def print_published(rows: list[dict[str, Any]], say: Callable[[str], None] = print) -> None:
    say(
        f"{'case':<19} {'layout':<34} {'recompute':>9} {'step s':>7} {'published s':>11} "
        f"{'ratio':>6} {'TFLOP/s':>7} {'published':>9} {'peak GiB':>8} {'capture s':>9}"
    )
    for r in rows:
        if "error" in r:
            say(f"{r['case']:<19} failed: {r['error'][:110]}")
            continue
        say(
            f"{r['case']:<19} {r['strategy']:<34} {r['recompute']:>9} {r['step_s']:>7.2f} "
            f"{r['published_step_s']:>11.2f} {r['step_s'] / r['published_step_s']:>6.3f} "
            f"{r['tflops']:>7.1f} {r['published_tflops']:>9} {r['peak_gib']:>8.1f} "
            f"{r['capture_s']:>9.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    """`--published [--cases NAME ...]`: the published layouts' table, each row in a process
    of its own (`--row NAME` prints one row's JSON)."""
    import argparse

    parser = argparse.ArgumentParser(description="The published layouts priced by our model.")
    parser.add_argument("--published", action="store_true", help="the published layouts' table")
    parser.add_argument("--cases", nargs="*", help="names of CASES (default: every published)")
    parser.add_argument("--row", help="one row, as JSON (what --published runs per case)")
    parser.add_argument("--vp", type=int, help="model chunks a stage (default: INTERLEAVED's)")
    parser.add_argument(
        "--unlimited", action="store_true", help="no memory limit and no recomputation"
    )
    args = parser.parse_args(argv)
    if args.row:
        print(json.dumps(published_row(args.row, args.vp, args.unlimited)))
        return 0
    options = [*(["--vp", str(args.vp)] if args.vp else []), *(["--unlimited"] * args.unlimited)]
    names = args.cases or [n for n in CASES if n != "gpt3-175b/1024"]
    rows = []
    for name in names:
        command = [sys.executable, str(Path(__file__).resolve()), "--row", name, *options]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            rows.append({"case": name, "error": (done.stderr.strip().splitlines() or ["?"])[-1]})
        else:
            rows.append(json.loads(lines[-1]))
        print(f"done {name}", file=sys.stderr, flush=True)
    print_published(rows)
    flags = f" --cases {' '.join(names)}" if args.cases else ""
    flags += "".join(f" {option}" for option in options)
    print(f"regenerate: python bench/frontier.py --published{flags}")
    return 0


if __name__ == "__main__":
    sys.path[0] = str(ROOT)  # as a script, bench/ would shadow the costmodel package
    sys.exit(main())
