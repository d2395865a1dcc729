"""Ops without a rule get the signatures that reproduce them, checked against the op itself
(issue #29, `rules/derived.py`). The oracle: `rules.oracle.simulate`, on other meshes and other
random values than the derivation's (P inputs as random addends), must give the op's result
for every derived signature; and what no split reproduces stays all-B."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autosbp.rules import has_rule, nd_signatures, signatures_1d
from autosbp.rules.oracle import node_from_call, run_global, simulate

aten = torch.ops.aten
F64 = torch.float64


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(shape, dtype=F64)


# (id, op, args, rows it must derive, rows it must not)
CASES = [
    ("erfcx", aten.special_erfcx.default, lambda: (_x(4, 8),), ["(S(0) -> S(0))", "(S(1) -> S(1))"],
     ["(P -> P)"]),
    ("prod", aten.prod.default, lambda: (_x(4, 8),), [], ["(P -> P)", "(S(0) -> S(0))"]),
    ("logcumsumexp", aten.logcumsumexp.default, lambda: (_x(4, 8, 6), 2),
     ["(S(0) -> S(0))", "(S(1) -> S(1))"], ["(S(2) -> S(2))", "(P -> P)"]),
    ("repeat", aten.repeat.default, lambda: (_x(4, 2), [1, 3]), ["(S(0) -> S(0))"], []),
    ("trace", aten.trace.default, lambda: (_x(4, 4),), ["(P -> P)"], []),
    # complex inputs (FNet's DFT matmuls): the derivation's draw was a crash (issue #48)
    ("sgn-complex", aten.sgn.default, lambda: (torch.randn(4, 8, dtype=torch.complex128),),
     ["(S(0) -> S(0))", "(S(1) -> S(1))"], ["(P -> P)"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case_id", "op", "make", "must", "never"), CASES, ids=[c[0] for c in CASES]
)
def test_derived_signatures_reproduce_the_op(case_id: str, op, make, must, never) -> None:  # type: ignore[no-untyped-def]
    assert not has_rule(str(op)), f"{op} has a rule now: pick another op for this test"
    torch.manual_seed(7)  # not the derivation's draw
    node, inputs = node_from_call(op, make())
    listed = [repr(s) for s in signatures_1d(node, 2)]
    assert listed[0].startswith("(B") and set(must) <= set(listed), listed
    assert not set(never) & set(listed), listed
    want = run_global(node, inputs)
    for mesh in [(2,), (4,), (2, 2)]:
        for sig in nd_signatures(node, mesh):
            got = simulate(node, sig, mesh, inputs).outputs
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9, msg=f"{case_id} {sig}")


def test_a_random_op_is_not_derived() -> None:
    node, _ = node_from_call(aten.rand_like.default, (_x(4, 8),))
    assert [repr(s) for s in signatures_1d(dataclasses.replace(node, op="aten.x.default"), 2)] == [
        "(B -> B)"
    ]
