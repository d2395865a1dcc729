"""The planner's boxing prices: its caches (interned layouts, chains per divisibility pattern,
per-use tables shared by edges) give exactly what pricing every pair afresh gives.

Oracle: `plan_boxing` on the real shape, each step priced by the cost model, no cache between
tensors. Prices come from the shipped spec profile of a DGX A100 node.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from autosbp.boxing import canonical_shape, dual_nd_sbp, plan_boxing
from autosbp.capturing.graph import TensorMeta
from autosbp.capturing.rebatch import micro_batch_graphs
from autosbp.errors import SbpError
from autosbp.planner.api import ClusterPrices
from autosbp.planner.problem.priced import price_graph
from autosbp.planner.timing.candidates import BoxingPricer
from autosbp.sbp import B, Mesh, NdSbp, P, S
from autosbp.zoo import build_model
from costmodel import Cluster, load_profile

MESH = Mesh((2, 2), ("a", "b"), link_classes=("inter_node", "intra_node"))


def fresh_time_s(prices: ClusterPrices, src: NdSbp, dst: NdSbp, meta: TensorMeta) -> float:
    """One boxing priced from scratch: the chain planned for this very shape."""
    if src == dst:
        return 0.0
    try:
        chain = plan_boxing(src, dst, meta.shape, MESH, dtype=meta.dtype)
    except SbpError:
        return math.inf
    return sum(BoxingPricer(prices, MESH).step_time_s(step) for step in chain)


@pytest.mark.parametrize(
    ("shape", "mesh_shape", "expected"),
    [
        ((768, 1536, 1024), (128, 8), (128, 128, 1024)),  # 768 = 3 x 256: 1024 does not divide
        ((40, 48, 7), (4, 4), (4, 16, 1)),  # gcd(40, 16) = 8, yet 4 is the largest group dividing
        ((12, 0), (2, 3, 4), (12, 24)),  # 0: every group size divides it
    ],
    ids=["gpt3-mesh", "square-mesh", "odd-mesh"],
)
def test_canonical_shape(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], expected: tuple[int, ...]
) -> None:
    assert canonical_shape(shape, Mesh(mesh_shape)) == expected


@pytest.mark.parametrize("mesh_shape", [(4, 4), (128, 8), (2, 3, 4)], ids=str)
def test_canonical_shape_divides_like_the_shape(mesh_shape: tuple[int, ...]) -> None:
    # The chain search asks only whether products of mesh dim sizes divide a dim.
    groups = {math.prod(c) for r in range(4) for c in itertools.combinations(mesh_shape, r)}
    for n in range(1, 3000):
        (canonical,) = canonical_shape((n,), Mesh(mesh_shape))
        assert all((n % g == 0) == (canonical % g == 0) for g in groups), (n, canonical)


def test_edge_tables_shared_across_edges_and_micro_batches_equal_fresh_prices() -> None:
    # One pricer serves both micro-batch sizes (8 and 4 sequences divide alike on 2x2: chains
    # reused) and every edge carrying the same tensor between the same layouts (tables reused).
    prices = ClusterPrices(Cluster(load_profile("dgx-a100"), nodes=1))
    model, inputs = build_model(
        "gpt", device="meta", layers=1, hidden=64, heads=4, seq=16, vocab=128, batch=8
    )
    graphs = micro_batch_graphs(model, inputs, (1, 2), name="gpt")
    shared = BoxingPricer(prices, MESH)
    fresh: dict[tuple[NdSbp, NdSbp, TensorMeta], float] = {}
    checked = 0
    for graph in graphs.values():
        priced = price_graph(graph, MESH, prices, pricer=shared)
        for u, v in graph.graph.edges:
            both, forward = priced.edge_prices(u, v)
            uses = graph.uses(u, v)
            producer, consumer = priced.strategies[u], priced.strategies[v]
            expected_both, expected_forward = np.zeros(both.shape), np.zeros(both.shape)
            for out_idx, in_idx in uses:
                meta = graph.node(u).outputs[out_idx]
                for (i, p), (j, c) in itertools.product(
                    enumerate(producer.candidates), enumerate(consumer.candidates)
                ):
                    src, dst = p.outputs[out_idx], c.inputs[in_idx]
                    pairs = ((src, dst), (dual_nd_sbp(dst), dual_nd_sbp(src)))
                    for a, b in pairs:
                        if (a, b, meta) not in fresh:
                            fresh[a, b, meta] = fresh_time_s(prices, a, b, meta)
                    there, back = (fresh[(*pair, meta)] for pair in pairs)
                    expected_forward[i, j] += there
                    expected_both[i, j] += there + back
            # an overlapped twin's rows are its reduction beside its chunks (test_tp_overlap_price)
            rows = [i for i in range(len(producer.candidates)) if not producer.chunks_of(i)]
            np.testing.assert_allclose(
                forward[rows], expected_forward[rows], rtol=1e-12, err_msg=f"{u}->{v}"
            )
            np.testing.assert_allclose(
                both[rows], expected_both[rows], rtol=1e-12, err_msg=f"{u}->{v}"
            )
            checked += 1
    assert checked > 50


def test_pricer_time_s_equals_fresh_prices_for_any_dtype() -> None:
    # The price cache is keyed by shape and dtype: the same layouts in bf16 cost less.
    prices = ClusterPrices(Cluster(load_profile("dgx-a100"), nodes=1))
    pricer = BoxingPricer(prices, MESH)
    for dtype in (torch.float32, torch.bfloat16):
        meta = TensorMeta((8, 16), dtype)
        for src, dst in [((P, B), (B, B)), ((S(0), S(1)), (B, S(0)))]:
            assert pricer.time_s(src, dst, meta) == pytest.approx(
                fresh_time_s(prices, src, dst, meta), rel=1e-12
            )
    assert pricer.time_s((P, B), (B, B), TensorMeta((8, 16), torch.bfloat16)) < pricer.time_s(
        (P, B), (B, B), TensorMeta((8, 16), torch.float32)
    )


@pytest.mark.parametrize("profile", ["cpu-gloo", "dgx-a100"])
def test_gradients_of_one_bucket_cost_one_collective_of_the_bucket(profile: str) -> None:
    """Tensors that fill a bucket together pay, summed, the all-reduce of the whole bucket (a
    tensor bigger than the bucket pays its own); on cpu-gloo that is far less than each tensor
    as its own all-reduce (collectives cost far from linearly in their size there)."""
    mesh = Mesh((2,))
    prices = ClusterPrices(Cluster(load_profile(profile), nodes=1))
    pricer = BoxingPricer(prices, mesh)
    metas = [TensorMeta((128, 512), torch.float32)] * 8 + [TensorMeta((128,), torch.float32)] * 8
    bucket = sum(m.nbytes for m in metas)
    shares = sum(pricer.bucketed_time_s((P,), (B,), m, bucket) for m in metas)
    whole = prices.collective_time_s("all_reduce", bucket, 2, "intra_node")
    assert shares == pytest.approx(whole, rel=1e-6)
    alone = sum(pricer.time_s((P,), (B,), m) for m in metas)
    assert shares < alone
    big = TensorMeta((1024, 1024), torch.float32)
    own = prices.collective_time_s("all_reduce", big.nbytes, 2, "intra_node")
    assert pricer.bucketed_time_s((P,), (B,), big, bucket) == pytest.approx(own, rel=1e-6)


@pytest.mark.parametrize(("sole", "converted"), [(s, c) for s in (0, 1) for c in (0, 1)])
def test_pair_bytes_equal_use_bytes_pair_by_pair(sole: int, converted: int) -> None:
    # `pair_bytes` builds each use's table from per-layout bytes and a cached view mask; the
    # oracle is `use_bytes` called for every pair. Two meshes share no mask entry wrongly:
    # the view mask reads layouts only, the bytes read the mesh.
    from autosbp.planner.memory.device_bytes import pair_bytes, use_bytes
    from autosbp.planner.memory.kept import KeptUse

    layouts = [(a, b) for a in (B, P, S(0), S(1)) for b in (B, P, S(0), S(1))]
    meta = TensorMeta((8, 12), torch.bfloat16)
    use = KeptUse(0, 0, sole=bool(sole), converted=bool(converted))
    for mesh_shape in ((2, 2), (4, 2)):
        got = pair_bytes(
            [(s,) for s in layouts], [(d,) for d in layouts], [use], [meta], mesh_shape
        )
        expected = [
            [use_bytes(s, d, meta, mesh_shape, use.sole, use.converted) for d in layouts]
            for s in layouts
        ]
        assert np.array_equal(got, np.array(expected))


def test_one_pricer_keeps_dtypes_and_shapes_of_one_chain_key_apart() -> None:
    # The pricer keys its pair times by (shape, dtype) and its chains by the canonical shape:
    # bf16 and fp32 of one shape, and two shapes that divide alike (8 and 4 rows on 2x2), share
    # layouts and chains but never a price. Asked in turn, each equals its fresh price.
    prices = ClusterPrices(Cluster(load_profile("dgx-a100"), nodes=1))
    pricer = BoxingPricer(prices, MESH)
    layouts = [(a, b) for a in (B, P, S(0), S(1)) for b in (B, S(0), S(1))]
    ids = tuple(pricer.layout_id(layout) for layout in layouts)
    metas = [
        TensorMeta(shape, dtype)
        for shape in ((8, 16), (4, 16))
        for dtype in (torch.bfloat16, torch.float32)
    ]
    tables = [pricer.tables(ids, ids, meta)[0] for meta in metas]
    for meta, table in zip(metas, tables, strict=True):
        for (i, src), (j, dst) in itertools.product(enumerate(layouts), repeat=2):
            assert table[i, j] == pytest.approx(fresh_time_s(prices, src, dst, meta), rel=1e-12)
            assert pricer.time_s(src, dst, meta) == table[i, j]
    assert not np.array_equal(tables[0], tables[1]) and not np.array_equal(tables[0], tables[2])


def test_tables_of_one_chain_key_equal_pair_prices_bit_for_bit() -> None:
    # A table prices its pairs' distinct steps once per tensor and sums them per pair
    # (`_TableSteps`): shapes of one chain key (6 and 10 rows, then 14: planned for the first),
    # forward and backward, equal each pair's own price exactly; a pair without a chain
    # (out of P(max)) is inf, a pair of one layout 0.
    prices = ClusterPrices(Cluster(load_profile("dgx-a100"), nodes=1))
    pricer = BoxingPricer(prices, MESH)
    layouts = [(a, b) for a in (B, P, P("max"), S(0), S(1)) for b in (B, P, S(0), S(1))]
    srcs = tuple(pricer.layout_id(layout) for layout in layouts)
    dsts = tuple(pricer.layout_id(layout) for layout in layouts[::-1])
    for rows in (6, 10, 14):
        meta = TensorMeta((rows, 8), torch.float32)
        forward, backward = pricer.tables(srcs, dsts, meta)
        for (i, src), (j, dst) in itertools.product(enumerate(layouts), enumerate(layouts[::-1])):
            assert forward[i, j] == pricer.time_s(src, dst, meta), (rows, src, dst)
            back = pricer.time_s(dual_nd_sbp(dst), dual_nd_sbp(src), meta)
            assert backward[i, j] == back, (rows, src, dst)
        assert math.isinf(forward[layouts.index((P("max"), B)), 0])
        assert forward[layouts.index((S(1), S(1))), 0] == 0.0
