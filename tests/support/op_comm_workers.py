"""Module-level worker for tests/rules/test_context.py (spawned by `launching.workers.run_workers`):
context-parallel attention's kernel run on real gloo groups, forward and backward.

Lives here: `run_attention`, which on every rank builds the SDPA node of each case, its kernel
for the case's signature through `runtime.execute.op_comm.GroupComm` (with a timeline
`Recorder`), runs it on this rank's pieces of float64 inputs and backward through a weighted
sum, and returns its output and input-gradient pieces and the number of "exchange" spans.
Lives elsewhere: the cases, the single-device reference and the comparison (the test).
"""

from __future__ import annotations

from typing import Any

import torch

from autosbp.layout import shard_tensor
from autosbp.rules import NdSignature, local_op
from autosbp.rules.oracle import node_from_call
from autosbp.sbp import Mesh, parse_nd_sbp
from autosbp.timeline import Recorder
from runtime.execute.groups import build_groups
from runtime.execute.op_comm import GroupComm

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def attention_inputs(case: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """The case's query, key, value and output weight (float64, seeded: the same on every rank)."""
    gen = torch.Generator().manual_seed(case["seed"])
    b, h, kv, seq, e = case["shape"]

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return draw(b, h, seq, e), draw(b, kv, seq, e), draw(b, kv, seq, e + 2), draw(b, h, seq, e + 2)


def attention_node(case: dict[str, Any]) -> Any:
    q, k, v, _ = attention_inputs(case)
    kwargs = {"is_causal": case["causal"], "enable_gqa": q.shape[1] != k.shape[1]}
    return node_from_call(SDPA, (q, k, v), kwargs)[0]


def run_attention(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = []
    for case in cases:
        mesh = Mesh.of(tuple(case["mesh"]))
        coords = mesh.coords(rank)
        layout = parse_nd_sbp(case["layout"])
        node = attention_node(case)
        sig = NdSignature((layout,) * 3, (layout,), case.get("kernel", ""))
        comm = GroupComm(mesh, coords, build_groups([mesh]))
        comm.span_hook = recorder = Recorder(rank, 0)
        kernel = local_op(node, sig, mesh.shape, coords, comm)
        *qkv, weight = (shard_tensor(t, layout, mesh, coords) for t in attention_inputs(case))
        leaves = [t.clone().requires_grad_() for t in qkv]
        (out,) = kernel(leaves)
        (out * weight).sum().backward()
        spans = sum(1 for e in recorder.events if e.kind == "exchange")
        grads = [t.grad.detach().numpy() for t in leaves]  # type: ignore[union-attr]
        # numpy arrays: a tensor would cross the queue as shared memory this process frees
        results.append({"out": out.detach().numpy(), "grads": grads, "spans": spans})
    return results
