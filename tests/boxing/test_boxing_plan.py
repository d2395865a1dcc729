"""Boxing plans, in one process: bytes against the OneFlow table, the transition table's duality,
minimal chains against brute force, bad inputs, and a property test of the layout algebra on
simulated ranks (1D/2D/3D meshes, disjoint meshes, random shapes and SBP pairs).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autosbp.boxing import (
    TRANSITIONS,
    StepKind,
    dual_nd_sbp,
    dual_step,
    plan_boxing,
    price_boxing,
)
from autosbp.boxing.simulate import simulate_boxing
from autosbp.boxing.steps import make_hop
from autosbp.errors import SbpError
from autosbp.sbp import B, Mesh, P, S, format_nd_sbp, split_factors
from tests.support.dist_helpers import (
    assemble_checked,
    byte_picker,
    draw_case,
    random_values,
    shard_random,
)

T_SHAPE = (12, 12)  # divisible by 1..4 and 6: every split below fits
T_BYTES = 12 * 12 * 4  # float32


def _total(steps) -> int:
    return sum(step.total_bytes for step in steps)


# ---------------------------------------------------------------------------------------------
# Bytes: the OneFlow table (reference/oneflow.md 1.1), |T| = T_BYTES

SAME = {  # (src, dst) -> total bytes of a tensor of t bytes on p devices of one placement
    ("S0", "S0"): lambda t, p: 0,
    ("S0", "S1"): lambda t, p: (p - 1) * t // p,
    ("S0", "B"): lambda t, p: (p - 1) * t,
    ("S0", "P"): lambda t, p: 0,
    ("B", "S0"): lambda t, p: 0,
    ("B", "B"): lambda t, p: 0,
    ("B", "P"): lambda t, p: 0,
    ("P", "S0"): lambda t, p: (p - 1) * t,
    ("P", "B"): lambda t, p: 2 * (p - 1) * t,
    ("P", "P"): lambda t, p: 0,
}
DISJOINT = {  # (src, dst) -> total bytes of a tensor of t bytes from p1 devices to p2 others
    ("S0", "S0"): lambda t, p1, p2: t,
    ("S0", "S1"): lambda t, p1, p2: t,
    ("S0", "B"): lambda t, p1, p2: p2 * t,
    ("S0", "P"): lambda t, p1, p2: t,
    ("B", "S0"): lambda t, p1, p2: t,
    ("B", "B"): lambda t, p1, p2: p2 * t,
    ("B", "P"): lambda t, p1, p2: t,
    ("P", "S0"): lambda t, p1, p2: p1 * t,
    ("P", "B"): lambda t, p1, p2: (p1 + p2 - 1) * t,
    ("P", "P"): lambda t, p1, p2: p1 * t,
}
NAMED = {"S0": S(0), "S1": S(1), "B": B, "P": P}


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize(("src", "dst"), list(SAME), ids=[f"{a}->{b}" for a, b in SAME])
def test_same_placement_bytes_match_oneflow(src: str, dst: str, p: int):
    steps = plan_boxing(NAMED[src], NAMED[dst], T_SHAPE, (p,))
    assert _total(steps) == SAME[src, dst](T_BYTES, p)
    assert len(steps) == (src != dst)


@pytest.mark.parametrize(("p1", "p2"), [(2, 2), (2, 1), (1, 3), (4, 2), (3, 4)])
@pytest.mark.parametrize(("src", "dst"), list(DISJOINT), ids=[f"{a}->{b}" for a, b in DISJOINT])
def test_disjoint_placement_bytes_match_oneflow(src: str, dst: str, p1: int, p2: int):
    mesh, dst_mesh = Mesh((p1,)), Mesh((p2,), device_ids=tuple(range(p1, p1 + p2)))
    steps = plan_boxing(NAMED[src], NAMED[dst], T_SHAPE, mesh, dst_mesh)
    assert _total(steps) == DISJOINT[src, dst](T_BYTES, p1, p2)
    assert [s.kind for s in steps].count(StepKind.SEND_RECV) == 1


@pytest.mark.parametrize(
    ("src", "dst", "expected"),
    [
        # groups x the 1D volume of each group's piece; OneFlow's worked example first
        ((B, S(0)), (B, B), 2 * (4 - 1) * T_BYTES),  # 2 rows gather |T| over 4
        ((S(0), P), (S(0), B), 2 * 2 * (4 - 1) * T_BYTES // 2),  # 2 rows all-reduce |T|/2
        ((P, S(1)), (B, S(1)), 4 * 2 * (2 - 1) * T_BYTES // 4),  # 4 columns all-reduce |T|/4
        ((S(0), B), (S(1), B), 4 * (2 - 1) * T_BYTES // 2),  # 4 columns all-to-all |T|
    ],
    ids=["BS0->BB", "S0P->S0B", "PS1->BS1", "S0B->S1B"],
)
def test_nd_hop_bytes_scale_with_the_parallel_groups(src, dst, expected):
    steps = plan_boxing(src, dst, T_SHAPE, (2, 4))
    assert len(steps) == 1
    assert _total(steps) == expected


def test_step_exposes_what_the_cost_model_prices():
    mesh = Mesh((2, 4), link_classes=("inter_node", "intra_node"))
    (step,) = plan_boxing((B, S(0)), (B, B), T_SHAPE, mesh)
    assert step.kind is StepKind.ALL_GATHER and step.kind.value == "all_gather"
    assert (step.mesh_dim, step.group_size, step.num_groups) == (1, 4, 2)
    assert step.link_class == "intra_node"
    assert step.tensor_dims == (0,)
    assert step.message_bytes == T_BYTES  # nccl-tests size: the gathered output
    assert step.bytes_per_device == 3 * T_BYTES // 4
    (cross,) = plan_boxing(S(0), S(0), T_SHAPE, (2,), Mesh((2,), device_ids=(2, 3)))
    assert cross.mesh_dim is None and cross.link_class is None
    assert cross.message_bytes == T_BYTES // 2


# ---------------------------------------------------------------------------------------------
# The transition table and the search


@pytest.mark.parametrize("key", list(TRANSITIONS), ids=["->".join(k) for k in TRANSITIONS])
def test_transition_table_is_closed_under_duality(key):
    letters = {"S": S(0), "S'": S(1), "B": B, "P": P}
    src, dst = (letters[key[0]],), (letters[key[1]],)
    step = make_hop(src, dst, 0, T_SHAPE, Mesh((4,)), torch.float32)
    dual = dual_step(step)
    assert (dual.src, dual.dst) == (dual_nd_sbp(dst), dual_nd_sbp(src))
    assert dual.total_bytes == step.total_bytes
    assert dual_step(dual) == step


def _fitting_nd_sbps(shape, mesh: Mesh) -> list:
    options = [B, P, *(S(k) for k in range(len(shape)))]
    return [
        nd
        for nd in itertools.product(options, repeat=mesh.ndim)
        if all(shape[dim] % parts == 0 for dim, parts in split_factors(nd, mesh.shape).items())
    ]


def _brute_force_bytes(src, shape, mesh) -> dict:
    """Bellman-Ford over every fitting nD SBP with `make_hop` as the only edge rule."""
    states = _fitting_nd_sbps(shape, mesh)
    best = dict.fromkeys(states, math.inf) | {src: 0}
    for _ in states:
        for a, b in itertools.permutations(states, 2):
            changed = [d for d in range(mesh.ndim) if a[d] != b[d]]
            hop = len(changed) == 1 and make_hop(a, b, changed[0], shape, mesh, torch.float32)
            if hop and best[a] + hop.total_bytes < best[b]:
                best[b] = best[a] + hop.total_bytes
    return best


@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 3)], ids=["2x2", "2x3"])
def test_chains_are_as_cheap_as_brute_force(mesh_shape):
    mesh = Mesh(mesh_shape)
    shape = (12, 6)  # S(1)S(1) does not fit on 2x2: chains must avoid it
    states = _fitting_nd_sbps(shape, mesh)
    for src in states:
        brute = _brute_force_bytes(src, shape, mesh)
        for dst in states:
            steps = plan_boxing(src, dst, shape, mesh)
            assert _total(steps) == brute[dst], (
                f"{format_nd_sbp(src)}->{format_nd_sbp(dst)}: {steps}"
            )


@pytest.mark.parametrize(
    ("mesh_shape", "shape", "dtype"),
    [
        ((2, 2), (12, 6), torch.float32),
        ((2, 3), (12, 6), torch.bfloat16),
        ((2, 2, 2), (8, 4), torch.float32),
    ],
    ids=["2x2", "2x3-bf16", "2x2x2"],
)
def test_price_boxing_prices_the_planned_chain(mesh_shape, shape, dtype):
    mesh = Mesh(mesh_shape, link_classes=tuple(f"link{d}" for d in range(len(mesh_shape))))
    checked = 0
    for src, dst in itertools.product(_fitting_nd_sbps(shape, mesh), repeat=2):
        steps = plan_boxing(src, dst, shape, mesh, dtype=dtype)
        expected = tuple((s.kind, s.message_bytes, s.group_size, s.link_class) for s in steps)
        assert price_boxing(src, dst, shape, mesh, dtype) == expected
        checked += bool(steps)
    assert checked > 50
    with pytest.raises(SbpError, match="boxing destination"):
        price_boxing((B,) * mesh.ndim, (S(0),) * mesh.ndim, (3, 4), mesh, dtype)


def test_same_tensor_dim_split_twice_routes_around_the_strided_group():
    # (S(0), S(0)) -> (B, S(0)): gathering on mesh dim 0 would concatenate strided chunks.
    steps = plan_boxing((S(0), S(0)), (B, S(0)), (8, 8), (2, 2))
    assert all(not (s.mesh_dim == 0 and s.src[1] == S(0)) for s in steps), steps
    assert steps[0].src == (S(0), S(0)) and steps[-1].dst == (B, S(0))


# ---------------------------------------------------------------------------------------------
# Bad inputs


@pytest.mark.parametrize(
    ("src", "dst", "shape", "mesh", "dst_mesh", "match"),
    [
        (S(2), B, (4, 4), (2,), None, r"boxing source.*splits dim 2 .*shape \(4, 4\)"),
        (B, S(0), (3, 4), (2,), None, r"boxing destination.*length 3 into 2 parts"),
        ((S(0), B), B, (4, 4), (4,), None, r"has 2 entries but the mesh \(4,\) has 1 dims"),
        (B, B, (4,), (2, 2), None, r"has 1 entries but the mesh \(2, 2\) has 2 dims"),
        (P("max"), B, (4,), (2,), None, r"P\(max\).*only P \(sum\)"),
        (B, S(0), (4,), Mesh((2,)), Mesh((2,), device_ids=(1, 2)), r"share devices \[1\]"),
        ("S(0)X", B, (4,), (2,), None, r"cannot read SBP text"),
    ],
    ids=[
        "dim-missing",
        "not-divisible",
        "too-many-sbps",
        "too-few-sbps",
        "p-max",
        "overlap",
        "text",
    ],
)
def test_bad_input_raises_sbp_error(src, dst, shape, mesh, dst_mesh, match):
    with pytest.raises(SbpError, match=match):
        plan_boxing(src, dst, shape, mesh, dst_mesh)


# ---------------------------------------------------------------------------------------------
# Property: on simulated ranks, every chain gives the target layout, and its dual chain is the
# adjoint (the true backward).


def _dot(xs, ys) -> float:
    return sum(float((x * y).sum()) for x, y in zip(xs, ys, strict=True))


@pytest.mark.slow
@settings(max_examples=1000, deadline=None)
@given(st.binary(min_size=32, max_size=32), st.integers(0, 2**16))
def test_boxing_simulates_to_the_target_layout_and_back(choices: bytes, seed: int):
    src, dst, shape, mesh, dst_mesh = draw_case(byte_picker(choices), max_devices=12)
    tensor, grad = random_values(shape, seed), random_values(shape, seed + 1)
    steps = plan_boxing(src, dst, shape, mesh, dst_mesh)
    assert all(a.dst == b.src for a, b in itertools.pairwise(steps))
    pieces = shard_random(tensor, src, mesh, seed)
    out = simulate_boxing(pieces, steps)
    assert torch.equal(assemble_checked(out, dst, dst_mesh), tensor)
    upstream = shard_random(grad, dual_nd_sbp(dst), dst_mesh, seed + 2)
    back = simulate_boxing(upstream, [dual_step(s) for s in reversed(steps)])
    assert torch.equal(assemble_checked(back, dual_nd_sbp(src), mesh), grad)
    assert _dot(out, upstream) == _dot(pieces, back)  # <F x, g> = <x, F^T g>: the adjoint
    if mesh.ndim == dst_mesh.ndim == 1 and _table_applies(src[0], dst[0], shape, mesh, dst_mesh):
        assert _total(steps) == _oneflow_bytes(src[0], dst[0], tensor, mesh, dst_mesh)


def _table_applies(src, dst, shape, mesh: Mesh, dst_mesh: Mesh) -> bool:
    """P -> B across meshes costs (p1+p2-1)|T| by reduce-scatter on the source, then sending
    pieces; a tensor that no dim lets split over the source mesh cannot take that path."""
    if mesh != dst_mesh and (src, dst) == (P, B):
        return any(n % mesh.size == 0 for n in shape)
    return True


def _oneflow_bytes(src, dst, tensor: torch.Tensor, mesh: Mesh, dst_mesh: Mesh) -> int:
    """The OneFlow table's bytes for a 1D conversion (S(i) -> S(j) named S0 -> S1)."""
    names = {B: "B", P: "P"}
    other_split = src not in names and dst not in names and src != dst
    key = (names.get(src, "S0"), names.get(dst, "S1" if other_split else "S0"))
    t = tensor.numel() * tensor.element_size()
    if mesh == dst_mesh:
        return SAME[key](t, mesh.size)
    return DISJOINT[key](t, mesh.size, dst_mesh.size)
