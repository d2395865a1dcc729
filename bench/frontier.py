"""The frontier cases of `bench/plan_speed.py`: GPT-3 175B on 1024 A100s, every row of Megatron-LM's
Table 1 (Narayanan et al. 2021; /work/shared/reference/frontier.md: GPT, seq 2048, vocab 51200,
the published GPUs and global batches, DGX A100), and Llama 3 405B (Dubey et al. 2024: a
Hugging Face LlamaForCausalLM, 126 layers, hidden 16384, 128 heads, 8 KV heads, FFN 53248,
vocab 128256, seq 8192, batch 2048) on 8192 and 16384 H100s, each planned as `autosbp plan`
plans it (meta model in bf16, every micro-batch count that divides the batch, Adam, the
profile's memory less the reserve).

Lives here: the cases, one case planned in this process (`run_case`: capture, then the search,
with its effort: status, gap, when it found each better plan), and the table of all of them,
each case in a process of its own (its peak RSS its own). Lives elsewhere: the GPT-3 depth
study and the hand-plan grid (`plan_speed`), the search (`autosbp.planner.search`).
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
    from autosbp.planner.search import divisors

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
    from autosbp.planner.hand_plans import strategy_space
    from autosbp.planner.search import search
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
