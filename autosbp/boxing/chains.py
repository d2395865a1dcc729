"""Boxing chains: plan the conversion of a tensor from one nD SBP to another as a chain of steps.

Lives here: `plan_boxing` (input checks, then the cheapest chain by total bytes: a shortest-path
search over nD SBPs, the "middle nodes" of OneFlow, on meshes of any rank; across two disjoint
meshes, hops on the source mesh, one send/recv, hops on the destination mesh); `price_boxing`,
the same chain on one mesh as the numbers that price it.
Lives elsewhere: the steps, their table, bytes and duals (`boxing.steps`); what a step does to
tensors in pure torch (`boxing.simulate`: `simulate_boxing`, the oracle of the runtime) and with
torch.distributed (`runtime.execute.collectives`); what a step costs in seconds (`costmodel`).

Invariants: steps chain (`steps[k].dst == steps[k + 1].src`), start at the source and end at the
destination; the chain's summed `total_bytes` is minimal over chains of supported hops (ties: fewest
steps, then a fixed order). For 1D meshes the sum equals the OneFlow table (reference/oneflow.md
1.1): same placement S(i)->S(j) (p-1)/p |T|, S->B and P->S (p-1)|T|, P->B 2(p-1)|T|, local
conversions 0; disjoint placements S->S |T|, S->B p2|T|, P->S p1|T|, P->B (p1+p2-1)|T| (reduce-
scatter, then send pieces: when no dim of the tensor splits over the source mesh, P->B takes the
cheapest chain the step kinds allow instead, e.g. p1*p2|T| for a scalar).
Every pair of P (sum) / B / S nD SBPs that fit the shape is reachable (through all-B at worst);
P(max)/P(min) and partially overlapping meshes are refused with `SbpError`.
Reference: OneFlow `boxing_collector.cpp` (middle nodes), `sbp_infer_util.cpp` (costs).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator, Sequence
from functools import lru_cache

import torch

from autosbp.boxing.steps import (
    CODE_B,
    CODE_P,
    BoxingStep,
    StepKind,
    code_sbp,
    cross_step,
    cross_transfers,
    hop_bytes,
    hop_kind,
    hop_pieces,
    hop_size,
    later_split_dims,
    make_hop,
    sbp_code,
)
from autosbp.errors import SbpError
from autosbp.sbp import (
    Mesh,
    NdSbp,
    Partial,
    Sbp,
    as_nd_sbp,
    check_nd_sbp,
    divisibility_shape,
    format_nd_sbp,
)


def plan_boxing(
    src: Sbp | Sequence[Sbp] | str,
    dst: Sbp | Sequence[Sbp] | str,
    shape: Sequence[int],
    mesh: Mesh | Sequence[int] | int,
    dst_mesh: Mesh | Sequence[int] | int | None = None,
    dtype: torch.dtype = torch.float32,
) -> list[BoxingStep]:
    """The cheapest chain of steps (by total bytes, then fewest steps) from `src` to `dst`.

    `dst_mesh`, when given and different from `mesh`, must hold other devices: the chain then
    crosses between the two meshes with one SEND_RECV step. An empty list means nothing to do.
    """
    src_nd, dst_nd = as_nd_sbp(src), as_nd_sbp(dst)
    src_mesh = Mesh.of(mesh)
    end_mesh = src_mesh if dst_mesh is None else Mesh.of(dst_mesh)
    shape = tuple(int(n) for n in shape)
    check_nd_sbp(src_nd, shape, src_mesh.shape, what="boxing source")
    check_nd_sbp(dst_nd, shape, end_mesh.shape, what="boxing destination")
    same = _same_devices(src_mesh, end_mesh)
    if same and src_nd == dst_nd:
        return []
    _check_partial_ops(src_nd, dst_nd)
    src_codes, dst_codes = _encode(src_nd), _encode(dst_nd)
    if same:
        hops = _chain_same(src_codes, dst_codes, canonical_shape(shape, src_mesh), src_mesh.shape)
        return _make_hops(hops, shape, src_mesh, dtype)
    before, (x, y), after = _chain_cross(
        src_codes,
        dst_codes,
        canonical_shape(shape, src_mesh, end_mesh),
        src_mesh.shape,
        end_mesh.shape,
    )
    cross_src, cross_dst = _decode(x), _decode(y)
    transfers = cross_transfers(cross_src, cross_dst, shape, src_mesh, end_mesh)
    return [
        *_make_hops(before, shape, src_mesh, dtype),
        cross_step(cross_src, cross_dst, shape, src_mesh, end_mesh, dtype, transfers),
        *_make_hops(after, shape, end_mesh, dtype),
    ]


StepPrice = tuple[StepKind, int, int, str | None]  # (kind, message bytes, group size, link class)


def price_boxing(
    nd_src: NdSbp, nd_dst: NdSbp, shape: tuple[int, ...], mesh: Mesh, dtype: torch.dtype
) -> tuple[StepPrice, ...]:
    """`plan_boxing(nd_src, nd_dst, shape, mesh, dtype=dtype)` on one mesh, each step as what
    prices it, without building the steps (the planner prices thousands of chains): the same
    checks and errors, the same chain."""
    check_nd_sbp(nd_src, shape, mesh.shape, what="boxing source")
    check_nd_sbp(nd_dst, shape, mesh.shape, what="boxing destination")
    if nd_src == nd_dst:
        return ()
    _check_partial_ops(nd_src, nd_dst)
    hops = _chain_same(_encode(nd_src), _encode(nd_dst), canonical_shape(shape, mesh), mesh.shape)
    nbytes = math.prod(shape) * dtype.itemsize
    return tuple(
        (
            kind,
            0 if kind is StepKind.LOCAL else nbytes // pieces // per,
            group,
            mesh.link_classes[d],
        )
        for kind, pieces, per, group, d in _hop_sizes(hops, mesh.shape)
    )


@lru_cache(maxsize=16384)
def _hop_sizes(hops: tuple[Hop, ...], mesh_shape: tuple[int, ...]) -> tuple[tuple, ...]:
    """Per hop, what `hop_size` reads of it besides the tensor's bytes: (kind, the pieces other
    mesh dims cut the tensor into, the divisor of a group's bytes that is the message: p for
    an all-to-all, else 1, the group size, the mesh dim); its message is
    nbytes // pieces // divisor (0 for a LOCAL step), as `hop_size` computes it."""
    sized = []
    for src, dst, mesh_dim in hops:
        found = hop_size(src, dst[mesh_dim], mesh_dim, mesh_shape, 0)
        assert found is not None, f"the search used a hop that hop_size refuses: {src} -> {dst}"
        kind, p = found[0], mesh_shape[mesh_dim]
        pieces = hop_pieces(src, mesh_dim, mesh_shape)
        sized.append((kind, pieces, p if kind is StepKind.ALL_TO_ALL else 1, p, mesh_dim))
    return tuple(sized)


# ---------------------------------------------------------------------------------------------
# Validation


def _same_devices(mesh: Mesh, dst_mesh: Mesh) -> bool:
    if mesh.device_ids == dst_mesh.device_ids and mesh.shape == dst_mesh.shape:
        return True
    shared = sorted(set(mesh.device_ids) & set(dst_mesh.device_ids))
    if shared:
        raise SbpError(
            f"boxing from {mesh} to {dst_mesh}: the meshes share devices {shared} but are not the "
            "same mesh; boxing supports one mesh, or two disjoint meshes (pipeline stages). "
            "Use the same mesh on both sides, or meshes of different devices."
        )
    return False


def _check_partial_ops(src: NdSbp, dst: NdSbp) -> None:
    for nd_sbp, side in ((src, "source"), (dst, "destination")):
        for sbp in nd_sbp:
            if isinstance(sbp, Partial) and sbp.op != "sum":
                raise SbpError(
                    f"boxing {format_nd_sbp(src)} -> {format_nd_sbp(dst)}: the {side} holds "
                    f"{sbp!r}; boxing converts only P (sum) partials, because the backward of a "
                    f"max/min reduction is not a layout conversion. Reduce the {sbp!r} tensor "
                    "inside the op that made it (its rule), or keep it unchanged."
                )


# ---------------------------------------------------------------------------------------------
# The search. It runs on SBP codes (`sbp_code`: S(k) -> k, B -> -1, P -> -2), which hash fast, and
# on a canonical shape: every hop's bytes are |T| times a factor of the SBPs, so the best chain
# depends on the shape only through which splits divide it, and one search serves all shapes with
# the same divisibility (the planner asks for many).

Code = tuple[int, ...]  # the codes of an nD SBP: a state of the search
Hop = tuple[Code, Code, int]  # (src state, dst state, the mesh dim that changes)


def _encode(nd_sbp: NdSbp) -> Code:
    return tuple(sbp_code(sbp) for sbp in nd_sbp)


def _decode(codes: Code) -> NdSbp:
    return tuple(code_sbp(code) for code in codes)


def canonical_shape(shape: tuple[int, ...], *meshes: Mesh) -> tuple[int, ...]:
    """A shape whose dims are divisible by the same products of mesh dim sizes as `shape`'s (the
    only divisors the search asks about; `sbp.divisibility_shape` over every mesh's dims). On a
    128x8 mesh, dims of 768 and 1536 both become 128, so one search serves both."""
    return divisibility_shape(tuple(shape), tuple(n for mesh in meshes for n in mesh.shape))


def _make_hops(
    hops: Sequence[Hop], shape: tuple[int, ...], mesh: Mesh, dtype: torch.dtype
) -> list[BoxingStep]:
    steps = []
    for src, dst, mesh_dim in hops:
        step = make_hop(_decode(src), _decode(dst), mesh_dim, shape, mesh, dtype)
        assert step is not None, f"the search used a hop that make_hop refuses: {src} -> {dst}"
        steps.append(step)
    return steps


def _neighbours(
    state: Code, shape: tuple[int, ...], mesh_shape: tuple[int, ...], reverse: bool
) -> Iterator[tuple[Code, int, int]]:
    """(other state, mesh dim, bytes) for the states one hop from `state` (into `state` when
    `reverse`) that fit the shape; `make_hop`'s rules (`hop_kind`, `hop_bytes`), no steps built."""
    factors: dict[int, int] = {}
    for code, n in zip(state, mesh_shape, strict=True):
        if code >= 0:
            factors[code] = factors.get(code, 1) * n
    tensor_bytes, all_pieces = math.prod(shape), math.prod(factors.values())
    size = math.prod(mesh_shape)
    for mesh_dim, p in enumerate(mesh_shape):
        current = state[mesh_dim]
        later = later_split_dims(state, mesh_shape, mesh_dim)
        group_bytes = tensor_bytes // (all_pieces // (p if current >= 0 else 1))
        for code in (CODE_B, CODE_P, *range(len(shape))):
            if code == current or (code >= 0 and shape[code] % (factors.get(code, 1) * p)):
                continue
            kind = (
                hop_kind(code, current, p, later) if reverse else hop_kind(current, code, p, later)
            )
            if kind is not None:
                other = (*state[:mesh_dim], code, *state[mesh_dim + 1 :])
                yield other, mesh_dim, hop_bytes(kind, group_bytes, p, size // p)


# state -> ((bytes, hops) of the best path, the state before it on that path (forward search) or
# after it (reverse search), the mesh dim that changes between the two)
Paths = dict[Code, tuple[tuple[int, int], Code | None, int]]


def _shortest_paths(
    start: Code,
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    reverse: bool,
    target: Code | None = None,
) -> Paths:
    """Dijkstra over nD SBPs from `start` (towards `start` when `reverse`), ties to fewer hops,
    then to the first found; stops once `target` is settled."""
    best: Paths = {start: ((0, 0), None, -1)}
    order = itertools.count()
    frontier = [((0, 0), next(order), start)]
    while frontier:
        key, _, state = heapq.heappop(frontier)
        if state == target:
            break
        if key > best[state][0]:
            continue
        for other, mesh_dim, cost in _neighbours(state, shape, mesh_shape, reverse):
            new_key = (key[0] + cost, key[1] + 1)
            if other not in best or new_key < best[other][0]:
                best[other] = (new_key, state, mesh_dim)
                heapq.heappush(frontier, (new_key, next(order), other))
    return best


def _hops_along(paths: Paths, state: Code, reverse: bool) -> tuple[Hop, ...]:
    """The hops of the best path to `state` (from `state` when `reverse`), in execution order."""
    hops = []
    _, link, mesh_dim = paths[state]
    while link is not None:
        hops.append((state, link, mesh_dim) if reverse else (link, state, mesh_dim))
        state = link
        _, link, mesh_dim = paths[state]
    return tuple(hops) if reverse else tuple(hops[::-1])


@lru_cache(maxsize=16384)
def _chain_same(
    src: Code, dst: Code, shape: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> tuple[Hop, ...]:
    paths = _paths_from(src, shape, mesh_shape)
    assert dst in paths, f"no chain {src} -> {dst}: every state reaches all-B and back"
    return _hops_along(paths, dst, reverse=False)


@lru_cache(maxsize=4096)
def _paths_from(src: Code, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> Paths:
    """Every best path from `src` (one search serves every destination: a settled state's
    path is the same whether the search stops there or runs on)."""
    return _shortest_paths(src, shape, mesh_shape, reverse=False)


# ---------------------------------------------------------------------------------------------
# Between disjoint meshes: hops on the source mesh, one SEND_RECV, hops on the destination mesh


def _ratio(codes: Code, mesh_shape: tuple[int, ...], code: int) -> int:
    """Product of the sizes of the mesh dims whose SBP code is `code` (B or P)."""
    return math.prod(n for c, n in zip(codes, mesh_shape, strict=True) if c == code)


@lru_cache(maxsize=4096)
def _chain_cross(
    src: Code,
    dst: Code,
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    dst_mesh_shape: tuple[int, ...],
) -> tuple[tuple[Hop, ...], tuple[Code, Code], tuple[Hop, ...]]:
    """Hops to x on the source mesh, the crossing (x, y), hops from y on the destination mesh.

    Each receiving device gets its region once per addend of x, so the send costs |T| * (product
    of the P dims of x) * (product of the B dims of y): only those two products matter. Keep the
    cheapest state per product on each side, then choose the cheapest pair."""
    before = _shortest_paths(src, shape, mesh_shape, reverse=False)
    after = _shortest_paths(dst, shape, dst_mesh_shape, reverse=True)
    by_partial = _cheapest_by_ratio(before, mesh_shape, CODE_P)
    by_broadcast = _cheapest_by_ratio(after, dst_mesh_shape, CODE_B)
    tensor_bytes = math.prod(shape)
    choices = [
        ((k1[0] + k2[0] + tensor_bytes * r1 * r2, k1[1] + k2[1]), x, y)
        for r1, (k1, x) in by_partial.items()
        for r2, (k2, y) in by_broadcast.items()
    ]
    _, x, y = min(choices, key=lambda choice: choice[0])
    return _hops_along(before, x, reverse=False), (x, y), _hops_along(after, y, reverse=True)


def _cheapest_by_ratio(
    paths: Paths, mesh_shape: tuple[int, ...], code: int
) -> dict[int, tuple[tuple[int, int], Code]]:
    out: dict[int, tuple[tuple[int, int], Code]] = {}
    for state, (key, _, _) in paths.items():
        ratio = _ratio(state, mesh_shape, code)
        if ratio not in out or key < out[ratio][0]:
            out[ratio] = (key, state)
    return out
