"""The memos of `rules.nd_signatures` (exact node, 1D lists, and the product shared across
micro-batch sizes by divisibility) return exactly what computing every node afresh returns.

Oracle: brute force, each node's signatures computed with every memo empty. Graphs: the zoo's
GPT at several micro-batch counts (rebatched graphs: only batch-dependent sizes differ), on 1D
and 2D meshes.
"""

from __future__ import annotations

import pytest

from autosbp import rules
from autosbp.capturing.rebatch import micro_batch_graphs
from autosbp.rules import nd_signatures
from autosbp.zoo import build_model

MESHES = [(2,), (4,), (2, 2), (2, 4), (8, 16)]


def empty_memos() -> None:
    for memo in (rules._ND_MEMO, rules._1D_MEMO, rules._PRODUCT_MEMO):
        memo.clear()


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_shared_signatures_equal_fresh_ones_across_micro_batch_counts(
    mesh_shape: tuple[int, ...],
) -> None:
    model, inputs = build_model(
        "gpt", device="meta", layers=2, hidden=64, heads=4, seq=16, vocab=128, batch=48
    )
    graphs = micro_batch_graphs(model, inputs, (1, 2, 3, 4, 6, 12), name="gpt")
    empty_memos()
    shared = {
        (count, name): nd_signatures(attrs, mesh_shape)
        for count, graph in graphs.items()
        for name, attrs in graph.nodes()
    }
    # micro-batches of 48, 24, 16, 12, 8, 4 sequences: some divide alike, and share products
    assert len(rules._PRODUCT_MEMO) < len(rules._ND_MEMO)
    for (count, name), found in shared.items():
        empty_memos()
        fresh = nd_signatures(graphs[count].node(name), mesh_shape)
        assert found == fresh, (count, name, mesh_shape)
        assert [s.kernel for s in found] == [s.kernel for s in fresh]
