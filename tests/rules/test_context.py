"""Context-parallel attention: communication inside an op, from its rule to its price to gloo.

Oracles: the op on whole tensors (one device) for every sequence-split signature on simulated
devices (threads exchanging in memory, float64); torch autograd on one device for the kernel's
forward and backward on 2 and 4 gloo processes (all-gather of keys and values, its reduce-scatter
in backward, the causal halves swapped with the mirrored device); the cost model's collective
prices summed by hand for the planner's node cost (the one hook, `planner.timing.op_exchanges`).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from autosbp.capturing.rebatch import micro_batch_graphs
from autosbp.layout import assemble_tensor
from autosbp.planner.api import ClusterPrices
from autosbp.planner.problem.build import price_graph
from autosbp.planner.timing.candidates import BACKWARD_FACTOR
from autosbp.rules import NdSignature, exchanges, nd_signatures
from autosbp.rules.context import seq_mesh_dims
from autosbp.rules.oracle import node_from_call, run_global, simulate
from autosbp.sbp import Mesh, parse_nd_sbp
from autosbp.zoo import build_model
from costmodel import Cluster, load_profile
from tests.support.op_comm_workers import SDPA, attention_inputs, attention_node, run_attention
from tests.support.worlds import cases_by_world

# (batch, heads, kv heads, sequence, head dim); GQA where kv heads < heads
SHAPES = {"mha": (2, 4, 4, 16, 8), "gqa": (1, 4, 2, 16, 8)}


def _cp_signatures(node, mesh_shape):
    return [s for s in nd_signatures(node, mesh_shape) if seq_mesh_dims(node, s, mesh_shape)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=str)
@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=str)
def test_every_sequence_split_signature_equals_one_device(causal, shape, mesh_shape) -> None:
    case = {"seed": 0, "shape": SHAPES[shape], "causal": causal}
    node = attention_node(case)
    inputs = attention_inputs(case)[:3]
    reference = run_global(node, inputs)[0]
    sigs = _cp_signatures(node, mesh_shape)
    assert sigs, "the sequence-split row is offered"
    for sig in sigs:
        out = simulate(node, sig, mesh_shape, inputs).outputs[0]
        # float64: a different summation order differs by a few ulps of the largest value
        assert torch.allclose(out, reference, rtol=0, atol=1e-12), sig


def test_row_needs_two_halves_per_device_when_causal() -> None:
    node = attention_node({"seed": 0, "shape": (1, 2, 2, 12, 4), "causal": True})
    assert _cp_signatures(node, (2,)) and _cp_signatures(node, (3,))  # 12 = 2 x 2 x 3
    assert not _cp_signatures(node, (4,))  # 12 rows cannot give 4 devices two halves each


# ---- on gloo: forward and backward against one device's autograd ------------------------------

CASES = {  # (id, shape, causal, mesh, layout, kernel: "" all-gather, "ring")
    2: [
        ("causal-mha", "mha", True, (2,), "S(2)", ""),
        ("full-gqa", "gqa", False, (2,), "S(2)", ""),
        ("ring-causal-mha", "mha", True, (2,), "S(2)", "ring"),
        ("ring-full-gqa", "gqa", False, (2,), "S(2)", "ring"),
    ],
    4: [
        ("causal-gqa-4", "gqa", True, (4,), "S(2)", ""),
        ("causal-heads-x-seq", "gqa", True, (2, 2), "S(1)S(2)", ""),
        ("causal-seq-x-seq", "mha", True, (2, 2), "S(2)S(2)", ""),
        ("ring-causal-gqa-4", "gqa", True, (4,), "S(2)", "ring"),
        ("ring-full-mha-4", "mha", False, (4,), "S(2)", "ring"),
        ("ring-causal-seq-x-heads", "gqa", True, (2, 2), "S(2)S(1)", "ring"),
    ],
}


def _cases(world: int) -> list[dict]:
    return [
        {"id": i, "seed": 1, "shape": SHAPES[s], "causal": c, "mesh": m, "layout": lay, "kernel": k}
        for i, s, c, m, lay, k in CASES[world]
    ]


worlds = functools.cache(cases_by_world(run_attention, _cases, timeout_s=120))


def _reference(case: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    q, k, v, weight = attention_inputs(case)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(
        *leaves, is_causal=case["causal"], enable_gqa=q.shape[1] != k.shape[1]
    )
    (out * weight).sum().backward()
    return out.detach(), [t.grad for t in leaves]  # type: ignore[misc]


@pytest.mark.dist
@pytest.mark.parametrize(
    ("world", "case_id"), [(w, c[0]) for w, cases in CASES.items() for c in cases], ids=str
)
def test_kernel_on_gloo_trains_like_one_device(world: int, case_id: str) -> None:
    case = next(c for c in _cases(world) if c["id"] == case_id)
    per_rank = worlds(world)[case_id]
    mesh, layout = Mesh.of(tuple(case["mesh"])), parse_nd_sbp(case["layout"])
    out, grads = _reference(case)
    got = assemble_tensor([torch.from_numpy(r["out"]) for r in per_rank], layout, mesh)
    assert torch.allclose(got, out, rtol=0, atol=1e-12)
    for k, grad in enumerate(grads):
        got = assemble_tensor([torch.from_numpy(r["grads"][k]) for r in per_rank], layout, mesh)
        assert torch.allclose(got, grad, rtol=0, atol=1e-11), ("query", "key", "value")[k]
    # The timeline shows every exchange: per seq-split mesh dim an all-gather and its
    # reduce-scatter (ring: n - 1 steps each way); causal, the swaps forward and backward (none
    # on a self-paired device).
    node = attention_node(case)
    sig = NdSignature((layout,) * 3, (layout,), case["kernel"])
    assert sig in nd_signatures(node, mesh.shape)
    declared = exchanges(node, sig, mesh.shape)
    assert max(r["spans"] for r in per_rank) == len(declared)


# ---- the price: the hook's term is in the node's cost --------------------------------------------


def test_node_cost_adds_the_declared_exchanges() -> None:
    prices = ClusterPrices(Cluster(load_profile("dgx-a100"), nodes=1))
    mesh = Mesh((4,), ("cp",), link_classes=("intra_node",))
    model, inputs = build_model(
        "gpt", device="meta", layers=1, hidden=64, heads=4, seq=32, vocab=128, batch=2
    )
    graph = micro_batch_graphs(model, inputs, (1,), name="gpt")[1]
    priced = price_graph(graph, mesh, prices)
    name = next(n for n, a in graph.nodes() if a.op == "aten.scaled_dot_product_attention.default")
    found, attrs = priced.strategies[name], graph.node(name)
    cp = [
        i
        for i, s in enumerate(found.candidates)
        if seq_mesh_dims(attrs, s, mesh.shape) and not s.kernel
    ]
    plain = [i for i, s in enumerate(found.candidates) if not exchanges(attrs, s, mesh.shape)]
    assert cp and plain
    for i in cp:
        declared = exchanges(attrs, found.candidates[i], mesh.shape)
        kinds = sorted({e.kind for e in declared})
        assert kinds == ["all_gather", "reduce_scatter", "send_recv"]

        def time_s(e) -> float:
            if e.kind == "send_recv":
                return prices.p2p_time_s(e.message_bytes, "intra_node")
            return prices.collective_time_s(e.kind, e.message_bytes, 4, "intra_node")

        comm_f = sum(time_s(e) for e in declared if not e.backward)
        comm_b = sum(time_s(e) for e in declared if e.backward)
        assert comm_f > 0 and comm_b > 0
        compute_f = found.forward_s[i] - comm_f
        assert math.isclose(found.compute_s[i], (1 + BACKWARD_FACTOR) * compute_f + comm_f + comm_b)
        # the gathered keys and values stay until backward: 3 of 4 sequence chunks more
        _, k, v = (m.nbytes for m in attrs.inputs)
        assert math.isclose(found.held_bytes[i], (k + v) * 3 / 4)
    for i in plain:  # no exchanges: today's price
        assert math.isclose(found.compute_s[i], (1 + BACKWARD_FACTOR) * found.forward_s[i])


@pytest.mark.parametrize("mask_rows", [16, 1], ids=["per-row", "broadcast-rows"])
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=str)
def test_an_explicit_mask_splits_with_the_rows(mask_rows: int, mesh_shape) -> None:
    # Hugging Face's Llama passes its causal mask as a (batch, 1, L, S) tensor.
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(2, 1, mask_rows, 16, generator=gen) < 0.6
    mask |= torch.eye(mask_rows, 16, dtype=torch.bool)  # no row masked whole (NaN either way)
    node, inputs = node_from_call(SDPA, (q, k, v, mask))
    reference = run_global(node, inputs)[0]
    sigs = _cp_signatures(node, mesh_shape)
    assert sigs
    for sig in sigs:
        out = simulate(node, sig, mesh_shape, inputs).outputs[0]
        assert torch.allclose(out, reference, rtol=0, atol=1e-12), sig
