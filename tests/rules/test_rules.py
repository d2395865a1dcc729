"""Every signature of every rule, executed on simulated devices, equals the op on whole tensors.

Oracle: `autosbp.rules.oracle.simulate` (shard the global inputs per the signature, P inputs as
random addends; run the local kernel per device; assemble, summing P) against the op on one
device. Meshes: 2, 4 and 2x2. Plus the registry's contracts: the all-B signature first, the
divisibility filter, P only on floating tensors, placeholders and output, unknown ops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autosbp.capturing.graph import OpNode, Role, TensorMeta
from autosbp.rules import (
    NdSignature,
    Signature,
    UnknownOpWarning,
    has_rule,
    local_call,
    mutated_inputs,
    nd_signatures,
    signatures_1d,
    warn_unknown_ops,
)
from autosbp.rules.core import default_local_op
from autosbp.rules.oracle import node_from_call, run_global, simulate
from autosbp.rules.registry import RULES
from autosbp.sbp import B, Broadcast, P, Partial, S, split_factors
from tests.support.rules_helpers import CASES, CASES_BY_ID, UNDEFINED_VALUES, Case, build_case

MESHES = [(2,), (4,), (2, 2)]
aten = torch.ops.aten


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{what}: {got.shape} vs {want.shape}"
    )
    if want.is_floating_point():
        tol = 1e-9 if want.dtype == torch.float64 else 1e-5
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(got, want), what


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_signature_reproduces_the_op(case: Case) -> None:
    with _defined_memory(case):
        _reproduces(case)


@contextlib.contextmanager
def _defined_memory(case: Case) -> Iterator[None]:
    """For torch.empty and its kin, torch's deterministic mode, which fills new memory (nan,
    or the largest integer), so every device's B copy holds the same values."""
    if case.id not in UNDEFINED_VALUES:
        yield
        return
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def _reproduces(case: Case) -> None:
    node, inputs = build_case(case)
    want = run_global(node, inputs)
    for mesh in MESHES:
        sigs = nd_signatures(node, mesh)
        assert sigs[0] == NdSignature.from_1d([signatures_1d(node, 2)[0]] * len(mesh)), (
            "all-B first"
        )
        assert all(s == B for nd in (*sigs[0].inputs, *sigs[0].outputs) for s in nd)
        for sig in sigs:
            got = simulate(node, sig, mesh, inputs)
            for k, (g, w) in enumerate(zip(got.outputs, want, strict=True)):
                if case.id in UNDEFINED_VALUES:  # torch.empty's values are whatever memory held
                    assert (g.shape, g.dtype) == (w.shape, w.dtype), f"{case.id} {sig}"
                    continue
                assert_same(g, w, f"{case.id} mesh {mesh} {sig} output {k}")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_signature_lists_keep_and_forbid_rows(case: Case) -> None:
    node, _ = build_case(case)
    listed = {repr(s) for s in signatures_1d(node, 2)}
    assert set(case.expect) <= listed, (
        f"missing {set(case.expect) - listed}; listed {sorted(listed)}"
    )
    assert not set(case.forbid) & listed, f"forbidden rows listed: {set(case.forbid) & listed}"


def test_every_registered_op_has_a_case() -> None:
    covered = {str(case.target) for case in CASES}
    missing = sorted(set(RULES) - covered - {"placeholder", "output"})
    assert not missing, f"rules without an execution case: {missing}"


def test_batch_norm_running_stats_update_exactly_under_channel_split() -> None:
    node, inputs = build_case(CASES_BY_ID["batch_norm-train"])
    after = [t.clone() for t in inputs]
    default_local_op(node)(after)  # the op on whole tensors, updating `after` in place
    for sig in nd_signatures(node, (2, 2)):
        got = simulate(node, sig, (2, 2), inputs)
        for name, k in (("running_mean", 3), ("running_var", 4)):
            assert_same(got.inputs[k], after[k], f"{sig} {name}")


@pytest.mark.parametrize(
    ("case_id", "mutated"),
    [
        ("batch_norm-train", (3, 4)),
        ("batch_norm-eval", ()),
        ("add_-inplace", (0,)),
        ("add-alpha", ()),
    ],
)
def test_mutated_inputs_include_hidden_running_stat_updates(
    case_id: str, mutated: tuple[int, ...]
) -> None:
    node, _ = build_case(CASES_BY_ID[case_id])
    assert mutated_inputs(node) == mutated


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_cross_entropy_mean_divides_by_the_global_count_of_kept_targets(mesh: tuple) -> None:
    """Device 0 of a batch split holds only ignored targets: its share must be 0, and the
    others' must divide by the batch's kept targets, not their own (the shards sum to torch's
    mean). Holds for every split of the logits (the case table runs all of them)."""
    logits, target = torch.randn(8, 12, dtype=torch.float64), torch.randint(0, 12, (8,))
    target[:4] = -100
    node, inputs = node_from_call(aten.cross_entropy_loss.default, (logits, target))
    split = NdSignature(((S(0),) * len(mesh), (B,) * len(mesh)), ((P,) * len(mesh),))
    assert split in nd_signatures(node, mesh)
    got = simulate(node, split, mesh, inputs).outputs[0]
    want = torch.nn.functional.cross_entropy(logits, target)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    first = local_call(
        node, split, mesh, (0,) * len(mesh), [logits[: 8 // math.prod(mesh)], target]
    )
    assert float(first[0]) == 0.0


def test_vocab_parallel_embedding_masks_rows_of_other_devices() -> None:
    weight, idx = torch.randn(8, 4, dtype=torch.float64), torch.tensor([[0, 3, 4, 7]])
    node, _ = node_from_call(aten.embedding.default, (weight, idx))
    sig = NdSignature(((S(0),), (B,)), ((P,),))
    second_half = local_call(node, sig, (2,), (1,), [weight[4:], idx])[0]
    assert torch.equal(second_half[0, :2], torch.zeros(2, 4, dtype=torch.float64))
    assert torch.equal(second_half[0, 2:], weight[[4, 7]])


# ---------------------------------------------------------------------------------------------
# Registry contracts


def test_non_divisible_dims_are_never_split() -> None:
    node, _ = node_from_call(aten.linear.default, (torch.randn(3, 8), torch.randn(6, 8)))
    for mesh in [(2,), (4,), (2, 2)]:
        for sig in nd_signatures(node, mesh):
            for meta, nd in zip(
                (*node.inputs, *node.outputs), (*sig.inputs, *sig.outputs), strict=True
            ):
                for dim, parts in split_factors(nd, mesh).items():
                    assert meta.shape[dim] % parts == 0, f"{mesh} {sig}"
    assert not any(s.inputs[0] == S(0) for s in signatures_1d(node, 2))  # 3 rows on 2 devices
    assert any(s.inputs[1] == S(0) for s in signatures_1d(node, 2))  # 6 rows split fine
    assert not any(nd.inputs[1] == (S(0), S(0)) for nd in nd_signatures(node, (2, 2)))  # 6 % 4


def test_partial_never_on_integer_or_bool_tensors() -> None:
    node, _ = node_from_call(aten.clone.default, (torch.arange(8),))
    assert [repr(s) for s in signatures_1d(node, 2)] == ["(B -> B)", "(S(0) -> S(0))"]


@st.composite
def reshapes(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """A shape and another factorization of its element count, with some size-1 dims."""
    shape = draw(st.lists(st.sampled_from([1, 2, 3, 4, 6, 8]), min_size=1, max_size=4))
    left, out = math.prod(shape), []
    while left > 1:
        factor = draw(st.sampled_from([d for d in range(2, left + 1) if left % d == 0]))
        out.append(factor)
        left //= factor
    for _ in range(draw(st.integers(0, 2))):
        out.insert(draw(st.integers(0, len(out))), 1)
    return shape, out or [1]


@given(pair=reshapes())
@settings(max_examples=25, deadline=None)
def test_reshape_to_random_factorizations(pair: tuple[list[int], list[int]]) -> None:
    shape, out = pair
    x = torch.randn(*shape, dtype=torch.float64)
    node, inputs = node_from_call(aten.view.default, (x, out))
    want = run_global(node, inputs)
    for mesh in [(2,), (3,), (2, 2)]:
        for sig in nd_signatures(node, mesh):
            assert_same(
                simulate(node, sig, mesh, inputs).outputs[0], want[0], f"{shape}->{out} {sig}"
            )


@given(
    a=st.lists(st.sampled_from([1, 2, 4, 6]), min_size=1, max_size=3),
    b=st.lists(st.sampled_from([1, 2, 4, 6]), min_size=1, max_size=3),
)
@settings(max_examples=20, deadline=None)
def test_broadcasting_add_on_random_shapes(a: list[int], b: list[int]) -> None:
    x, y = torch.randn(*a, dtype=torch.float64), torch.randn(*b, dtype=torch.float64)
    try:
        torch.broadcast_shapes(x.shape, y.shape)
    except RuntimeError:
        return
    node, inputs = node_from_call(aten.add.Tensor, (x, y))
    want = run_global(node, inputs)
    for mesh in [(2,), (2, 2)]:
        for sig in nd_signatures(node, mesh):
            assert_same(simulate(node, sig, mesh, inputs).outputs[0], want[0], f"{a}+{b} {sig}")


def _placeholder(shape: tuple[int, ...], role: Role = Role.PARAMETER) -> OpNode:
    return OpNode("placeholder", role, outputs=(TensorMeta(shape, torch.float32),), name="w")


@pytest.mark.parametrize("role", [Role.PARAMETER, Role.BUFFER, Role.INPUT], ids=lambda r: r.value)
def test_placeholders_choose_any_divisible_split_or_b_never_p(role: Role) -> None:
    node = _placeholder((6, 8), role)
    assert [repr(s) for s in signatures_1d(node, 2)] == ["( -> B)", "( -> S(0))", "( -> S(1))"]
    assert [repr(s) for s in signatures_1d(node, 4)] == ["( -> B)", "( -> S(1))"]
    nd = {repr(s) for s in nd_signatures(node, (2, 2))}
    assert "( -> S(1)S(1))" in nd and "( -> S(0)S(1))" in nd and "( -> S(0)S(0))" not in nd
    assert not any(
        isinstance(s, Partial) for sig in nd_signatures(node, (2, 2)) for s in sig.outputs[0]
    )


def test_output_accepts_b_or_p() -> None:
    node = OpNode("output", Role.OUTPUT, inputs=(TensorMeta((), torch.float32),))
    assert signatures_1d(node, 2) == [Signature((B,), ()), Signature((P,), ())]
    assert len(nd_signatures(node, (2, 2))) == 4


def test_unknown_op_gets_all_b_and_one_warning_listing_it(caplog: pytest.LogCaptureFixture) -> None:
    x = torch.randn(4, 8)
    node, _ = node_from_call(aten.relu.default, (x,))
    node = dataclasses.replace(node, op="aten.foo.default")
    assert not has_rule("aten.foo.default")
    # derived (rules/derived.py): relu's splits reproduce it, its P row does not (nonlinear)
    assert [repr(s) for s in signatures_1d(node, 2)] == [
        "(B -> B)",
        "(S(0) -> S(0))",
        "(S(1) -> S(1))",
    ]
    sig = next(s for s in nd_signatures(node, (2,)) if repr(s) == "(S(1) -> S(1))")
    half = local_call(node, sig, (2,), (1,), (x[:, 4:],))[0]
    assert torch.equal(half, x[:, 4:].relu())
    whole, _ = node_from_call(aten.prod.default, (x,))  # no split of a product is exact
    assert signatures_1d(dataclasses.replace(whole, op="aten.bar.default"), 2) == [
        Signature((B,), (B,))
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unknown = warn_unknown_ops(
            ["aten.foo.default", "aten.relu.default", "aten.bar.default", "aten.foo.default"]
        )
    assert unknown == ("aten.bar.default", "aten.foo.default")
    assert len(caught) == 1 and issubclass(caught[0].category, UnknownOpWarning)
    assert "aten.bar.default, aten.foo.default" in str(caught[0].message)
    with warnings.catch_warnings(record=True) as none:
        warnings.simplefilter("always")
        assert warn_unknown_ops(["aten.relu.default"]) == ()
    assert not none


def test_registry_names_real_aten_overloads() -> None:
    for op in set(RULES) - {"placeholder", "output"}:
        namespace, name, overload = op.split(".")
        packet = getattr(getattr(torch.ops, namespace), name)
        assert str(getattr(packet, overload)) == op


def test_nd_signature_stacks_and_splits_mesh_dims() -> None:
    one, two = Signature((S(0), B), (S(0),)), Signature((P, B), (P,))
    nd = NdSignature.from_1d([one, two])
    assert nd.inputs == ((S(0), P), (B, B)) and nd.outputs == ((S(0), P),)
    assert nd.mesh_dim(0) == one and nd.mesh_dim(1) == two
    assert repr(nd) == "(S(0)P, BB -> S(0)P)" and repr(one) == "(S(0), B -> S(0))"
    assert isinstance(nd.inputs[1][0], Broadcast)
