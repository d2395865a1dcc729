"""Llama 3 405B's long-context stage priced (issue #30): sequence 131072 on 16384 H100, the
published layout TP8 CP16 PP16 DP8 (Dubey et al. 2024, Table 4: 380 TFLOP/s per GPU, 16M tokens
per batch: 128 sequences) as a hand plan, beside what auto finds under the same cost model.

Run: python bench/context.py [--time-limit-s 60] [--layers 126] [--skip-auto]

The model is Llama-shaped and written out (`Llama`): 126 layers, hidden 16384, 128 heads with
8 KV heads (grouped-query attention, causal SDPA with enable_gqa), SwiGLU FFN 53248, RMSNorm,
vocabulary 128256, bf16, Adam. Rotary embeddings are left out (elementwise ops beside attention;
Hugging Face's Llama builds a (batch, 1, L, L) mask tensor that at L = 131072 would be priced
as 2^34 elements per sequence, which the published run never materializes). TFLOP/s per GPU:
6 x parameters x tokens (+ attention's 12 x layers x hidden x seq per token, the causal half)
per step, over the predicted step and the GPUs: the model FLOPs the paper counts. Causal
attention is priced at what the profile's flash kernel computes (dgx-h100's
efficiency.causal_skip, `rules.work_fraction`), not at the dense product capture counts.
Lives elsewhere: the frontier's planning table (`plan_speed.py`, `frontier.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = {"hidden": 16384, "heads": 128, "kv_heads": 8, "ffn": 53248, "vocab": 128256}
SEQ, BATCH, DEVICES, PUBLISHED_TFLOPS = 131072, 128, 16384, 380.0
PUBLISHED = "megatron:tp=8,cp=16,pp=16,dp=8"


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, hidden // heads
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, kv_heads * self.dim, bias=False)
        self.v = nn.Linear(hidden, kv_heads * self.dim, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, self.heads, self.dim).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.dim).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, c))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def model_flops_per_step(model: nn.Module, layers: int) -> float:
    params = sum(p.numel() for p in model.parameters())
    tokens = SEQ * BATCH
    attention = 12 * layers * SHAPE["hidden"] * SEQ / 2  # per token, causal
    return (6 * params + attention) * tokens


def plan(strategy: str, layers: int, time_limit_s: float) -> dict:
    from autosbp.planner.api import auto_parallelize

    with torch.device("meta"):
        model = Llama(layers, **SHAPE).to(torch.bfloat16)
        ids = torch.zeros((BATCH, SEQ), dtype=torch.long)
    start = time.perf_counter()
    found = auto_parallelize(
        model, (ids, ids), profile="dgx-h100", devices=DEVICES, strategy=strategy,
        recompute="auto", time_limit_s=time_limit_s, dtype="bf16",
    )  # fmt: skip
    wall = time.perf_counter() - start
    step = found.predicted.step_time_s
    attention = {
        (tuple(n.inputs), n.exchanges) for n in found.nodes.values() if "scaled_dot" in n.op
    }
    flops = model_flops_per_step(model, layers)
    return {
        "strategy": strategy, "wall_s": round(wall, 1), "step_s": step,
        "tflops_per_gpu": flops / step / DEVICES / 1e12,
        "stages": len(found.stages), "mesh": list(found.stages[0].mesh_shape),
        "micro_batches": found.micro_batches, "recompute": found.recompute,
        "peak_gib": found.predicted.peak_memory_bytes / 2**30,
        "status": found.solver.status, "gap": found.solver.gap,
        "attention": [[list(ins), list(ex)] for ins, ex in sorted(attention)],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit-s", type=float, default=60.0)
    parser.add_argument("--layers", type=int, default=126)
    parser.add_argument("--skip-auto", action="store_true")
    args = parser.parse_args()
    print(f"load {os.getloadavg()[0]:.2f}; published {PUBLISHED_TFLOPS} TFLOP/s per GPU")
    for strategy in [PUBLISHED] + ([] if args.skip_auto else ["auto"]):
        print(json.dumps(plan(strategy, args.layers, args.time_limit_s)), flush=True)


if __name__ == "__main__":
    main()
