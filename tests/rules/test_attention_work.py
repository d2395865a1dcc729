"""The work attention's kernels do, against what the planner prices (`rules.work_fraction`).

Oracle: the SDPA calls each device's kernel makes, recorded as they run (a torch function mode
in each simulated device's thread; the real kernel runs): the scores a math kernel computes
(rows x keys of each call) and those its mask keeps (brute force: the mask's true elements),
per device, beside the dense product the op is counted at (`capturing.flops`); a kernel of plain
math (ring attention) by the score matrices it takes the log-sum-exp of (kept: the finite ones).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias
from torch.overrides import TorchFunctionMode

from autosbp.rules import local_op, nd_signatures, work_fraction
from autosbp.rules.context import seq_mesh_dims
from autosbp.rules.oracle import SimulatedComm, _Board, node_from_call, shard_inputs
from autosbp.sbp import Mesh, local_shape
from tests.support.op_comm_workers import SDPA

_SDPA_ARGS = [a.name for a in SDPA._schema.arguments]


class _Scores(TorchFunctionMode):
    """Per SDPA call: (scores computed, scores its mask keeps), summed."""

    def __init__(self) -> None:
        super().__init__()
        self.computed = self.kept = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in (F.scaled_dot_product_attention, SDPA):  # the kernel's call, or the op's own
            bound = dict(zip(_SDPA_ARGS, args, strict=False)) | kwargs
            q, k = bound["query"], bound["key"]
            rows, keys = q.shape[-2], k.shape[-2]
            mask = bound.get("attn_mask")
            if isinstance(mask, CausalBias):
                mask = mask._materialize()
            elif bound.get("is_causal"):
                mask = torch.ones(rows, keys, dtype=torch.bool).tril()
            heads = math.prod(q.shape[:-2])
            self.computed += heads * rows * keys
            self.kept += heads * (rows * keys if mask is None else int(mask.sum()))
        elif func is torch.logsumexp and kwargs.get("dim", args[1:2]) in (-1, (-1,)):
            scores = args[0]  # a kernel of plain math (ring): its scores, masked ones at -inf
            self.computed += scores.numel()
            self.kept += int(torch.isfinite(scores).sum())
        return func(*args, **kwargs)


def _node(rows: int, keys: int, causal: bool = True) -> object:
    q, k = torch.randn(1, 2, rows, 4), torch.randn(1, 2, keys, 4)
    return node_from_call(SDPA, (q, k, k), {"is_causal": causal})[0]


def _per_device_scores(node, sig, mesh_shape) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    mesh = Mesh.of(mesh_shape)
    inputs = [torch.randn(m.shape, dtype=torch.float64) for m in node.inputs]
    gen = torch.Generator().manual_seed(0)
    pieces = [
        shard_inputs(t, nd, mesh.shape, gen) for t, nd in zip(inputs, sig.inputs, strict=True)
    ]
    board = _Board(mesh)

    def run(index: int) -> tuple[int, int]:
        with _Scores() as scores:
            kernel = local_op(
                node, sig, mesh.shape, mesh.coords(index), SimulatedComm(board, index)
            )
            kernel([p[index] for p in pieces])
        return scores.computed, scores.kept

    with ThreadPoolExecutor(mesh.size) as pool:
        return [f.result(timeout=60) for f in [pool.submit(run, i) for i in range(mesh.size)]]


def _dense_share(node, sig, mesh_shape) -> float:  # type: ignore[no-untyped-def]
    """The dense scores times the planner's share of one device (`timing.candidates`: the least
    local / global size ratio among the op's tensors)."""
    metas, layouts = (*node.inputs, *node.outputs), (*sig.inputs, *sig.outputs)
    share = min(
        math.prod(local_shape(m.shape, nd, mesh_shape)) / m.numel
        for m, nd in zip(metas, layouts, strict=True)
    )
    q, k = node.inputs[0].shape, node.inputs[1].shape
    return math.prod(q[:-1]) * k[-2] * share


@pytest.mark.parametrize("mesh_shape", [(1,), (2,), (4,), (2, 2)], ids=str)
@pytest.mark.parametrize(("rows", "keys"), [(16, 16), (8, 16), (16, 8)], ids=str)
def test_every_signature_is_priced_at_the_scores_its_kernel_computes(rows, keys, mesh_shape):
    node = _node(rows, keys)
    for sig in nd_signatures(node, mesh_shape):
        scores = _per_device_scores(node, sig, mesh_shape)
        share = _dense_share(node, sig, mesh_shape)
        for computed, kept in scores:
            # a math kernel (skip 0) computes every score of its calls; a skipping one (1) the kept
            assert work_fraction(node, sig, mesh_shape, 0.0) == pytest.approx(computed / share)
            skipping = computed if sig.kernel == "ring" else kept  # ring's plain math skips none
            assert work_fraction(node, sig, mesh_shape, 1.0) == pytest.approx(skipping / share)
            assert work_fraction(node, None, mesh_shape, 1.0) <= kept / share + 1e-12
        if seq_mesh_dims(node, sig, mesh_shape):  # balanced: every device the same work
            assert len(set(scores)) == 1, scores


@pytest.mark.parametrize("masked", [True, False], ids=["causal-mask", "no-mask"])
def test_an_explicit_mask_or_no_causality_is_priced_dense(masked: bool) -> None:
    q = torch.randn(1, 2, 8, 4)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()  # causal, but data: no kernel skips it
    node = node_from_call(SDPA, (q, q, q, mask) if masked else (q, q, q), {})[0]
    for sig in nd_signatures(node, (2,)):
        assert work_fraction(node, sig, (2,), 1.0) == 1.0
