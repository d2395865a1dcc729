"""What one Llama block keeps for backward, as the planner prices it, with its RMSNorms eager and
fused (`autosbp.capturing.fused_norms`): issue 47 item 4's figure.

Lives here: one row per case (Llama 3 405B's block at its published sequence, one sequence per
micro-batch, bf16, one device: nothing sharded; and the tests' tiny Llama), each captured twice
on the meta device, once with capture's norm pass off (the eager graph, as before it) and once
with it. The bytes are the planner's own (`planner.memory.kept.kept_for_backward`, per block:
outputs kept by their producer, the intermediates backward keeps, values only their consumers
keep), for block 1 (block 0 reads the embedding, the last the final norm). Lives elsewhere: the
pass, the kernel, their tests (tests/capturing/test_fused_norms.py), the measured peaks
(tests/runtime/test_fused_norms_runtime.py), the published layouts priced whole
(`bench/frontier.py --published`).

Run: `python bench/fused_norms.py` (a minute on 2 cores: two captures of a 2-layer 405B on
fake tensors).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autosbp.capturing import export
from autosbp.capturing.graph import OpGraph, Role
from autosbp.planner.memory.kept import kept_for_backward
from autosbp.planner.space.ties import twin_key

CASES = {  # name: (hidden, heads, kv heads, ffn, vocab, sequence)
    "llama3-405b": (16384, 128, 8, 53248, 128256, 8192),
    "tiny": (32, 4, 2, 64, 128, 16),
}
BLOCK = 1


def build(name: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.support.real_models import LossOf

    hidden, heads, kv_heads, ffn, vocab, seq = CASES[name]
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=3,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq,
        attention_dropout=0.0, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.train()
    ids = torch.zeros((1, seq), dtype=torch.long, device="meta")
    return LossOf(model, ("input_ids", "labels")), (ids, ids)


def capture(name: str, fused: bool) -> OpGraph:
    model, inputs = build(name)
    if fused:
        return export.capture(model, inputs, name=name)
    pass_on = export.fuse_norms
    export.fuse_norms = lambda program: []  # the eager graph: capture as before the pass
    try:
        return export.capture(model, inputs, name=name)
    finally:
        export.fuse_norms = pass_on


def block_kept_bytes(graph: OpGraph, block: int) -> dict[str, int]:
    """The bytes block `block` keeps per micro-batch on one device, by kind, as the planner
    counts them (`kept_for_backward` with every node its own representative, recomputation
    none; every layout whole, so a kept use is its producer's tensor where it is the value's
    only holder)."""
    identity = {n: n for n in graph.order}
    kept = kept_for_backward(graph, identity, "none")
    out = {"outputs": 0, "intermediates": 0, "uses": 0}
    for name, attrs in graph.nodes(Role.COMPUTE):
        if attrs.block != block:
            continue
        out["outputs"] += sum(attrs.outputs[o].nbytes for o in kept.outputs_of(name))
        out["intermediates"] += kept.extra_bytes.get(name, 0)
        for u in graph.graph.predecessors(name):
            producer = graph.node(u)
            if producer.role is not Role.COMPUTE:
                continue  # parameters and inputs: model state, counted apart
            for use in kept.uses.get(twin_key(graph, identity, u, name), ()):
                if use.sole:
                    out["uses"] += producer.outputs[use.out_idx].nbytes
    return out


def row(name: str) -> dict[str, Any]:
    start = time.perf_counter()
    eager, fused = (block_kept_bytes(capture(name, f), BLOCK) for f in (False, True))
    return {"case": name, "eager": eager, "fused": fused, "s": time.perf_counter() - start}


def main() -> int:
    print(
        f"{'case':<12} {'eager bytes':>15} {'fused bytes':>15} {'saved bytes':>15} {'saved GiB':>9}"
    )
    for name in CASES:
        r = row(name)
        eager, fused = sum(r["eager"].values()), sum(r["fused"].values())
        print(
            f"{name:<12} {eager:>15,} {fused:>15,} {eager - fused:>15,} "
            f"{(eager - fused) / 2**30:>9.3f}  ({r['s']:.0f} s; by kind {r['eager']} -> "
            f"{r['fused']})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
