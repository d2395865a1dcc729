"""Signatures of an op without a rule, derived by checking candidates against the op itself.

Lives here: `derived_signatures(node, mesh_dim_size)`: for a node whose op has no rule, the 1D
signatures that reproduce the op exactly when each device runs the op unchanged on its shards,
found by trying candidates on random tensors of the node's own shapes. Lives elsewhere: the
registered rules (their families), the queries that fall back to this (`autosbp.rules`), the
oracle the registered rules are proven with (`rules.oracle`, which works the same way).

Candidates, for one mesh dim: all-B; for every output dim d, each input split on its dim
aligned with d (from the right, as broadcasting aligns, and from the left, as a reduction keeps
its leading dims), B where it has no such dim of the same size, every output of that size at d
split there; and P on every floating input and output (a linear op). A candidate is kept when the
assembled result equals the op on whole tensors (within float rounding) and every B output is
the same on every device; P inputs are random addends, so a nonlinear op fails its P row.

Invariants: only deterministic, functional ops with a schema are tried (no random op, no
in-place write); only where its tensors are small enough to make here (DERIVE_MAX_ELEMENTS; a
larger node keeps all-B, as an op without a rule always did); results are memoized per (op,
arguments, tensor metas, mesh dim size), so the planner and the runtime derive the same list.
The local kernel of a derived signature is the op with its arguments unchanged: exactly what was
checked. A check on one draw is evidence, not proof: an op exact on these values but not on
others (a data-dependent branch inside the kernel) would pass; the registered rules are proven
by reasoning, these by test.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from autosbp.capturing.graph import TensorMeta
from autosbp.rules.core import Node, Signature, all_broadcast, default_local_op
from autosbp.sbp import B, Broadcast, P, Partial, S, Sbp, Split

__all__ = ["DERIVE_MAX_ELEMENTS", "derived_signatures"]

DERIVE_MAX_ELEMENTS = 1 << 18  # input and output elements a derivation may make here (a few MB)


def derived_signatures(node: Node, mesh_dim_size: int, key: Hashable | None) -> list[Signature]:
    """The checked signatures of `node` on `mesh_dim_size` devices (all-B first; all-B alone
    when the op cannot be tried). `key`: what the node's signatures depend on (None: not
    hashable, derive afresh)."""
    if key is None:
        return _derive(node, mesh_dim_size)
    return list(_memo(key, mesh_dim_size, _Boxed(node)))


class _Boxed:
    """A node carried through the memo without taking part in its key."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def __hash__(self) -> int:
        return 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Boxed)


@functools.lru_cache(maxsize=4096)
def _memo(key: Hashable, mesh_dim_size: int, boxed: _Boxed) -> tuple[Signature, ...]:
    return tuple(_derive(boxed.node, mesh_dim_size))


def _derive(node: Node, size: int) -> list[Signature]:
    base = all_broadcast(node)
    if not _triable(node):
        return [base]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        inputs = tuple(_sample(meta) for meta in node.inputs)
        try:
            want = default_local_op(node)([t.clone() for t in inputs])
        except Exception:
            return [base]
        found = [base]
        for sig in _candidates(node):
            if sig not in found and _reproduces(node, sig, size, inputs, want):
                found.append(sig)
    return found


def _triable(node: Node) -> bool:
    target, schema = node.target, node.schema
    if not isinstance(target, torch._ops.OpOverload) or schema is None or not node.outputs:
        return False
    if schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    elements = sum(m.numel for m in (*node.inputs, *node.outputs))
    return bool(node.inputs) and elements <= DERIVE_MAX_ELEMENTS


def _sample(meta: TensorMeta) -> torch.Tensor:
    """Random values of `meta` on the CPU (whatever default device a capture runs under)."""
    cpu = torch.device("cpu")
    if meta.dtype.is_floating_point or meta.dtype.is_complex:  # complex: FNet's DFT matmuls
        wide = torch.complex128 if meta.dtype.is_complex else torch.float64
        return torch.randn(meta.shape, dtype=wide, device=cpu).to(meta.dtype)
    if meta.dtype is torch.bool:
        return torch.rand(meta.shape, device=cpu) < 0.5
    return torch.randint(0, 2, meta.shape, dtype=meta.dtype, device=cpu)


def _candidates(node: Node) -> list[Signature]:
    out_shape = node.outputs[0].shape
    sigs: list[Signature] = []
    for d in range(len(out_shape)):
        outs = tuple(S(d) if _size(m.shape, d) == out_shape[d] else B for m in node.outputs)
        for align in (_from_right, _from_left):
            ins = tuple(align(m.shape, out_shape, d) for m in node.inputs)
            if any(isinstance(s, Split) for s in ins):
                sigs.append(Signature(ins, outs))
    if all(m.dtype.is_floating_point for m in (*node.inputs, *node.outputs)):
        sigs.append(Signature((P,) * len(node.inputs), (P,) * len(node.outputs)))
    return sigs


def _size(shape: Sequence[int], dim: int) -> int | None:
    return shape[dim] if dim < len(shape) else None


def _from_right(shape: Sequence[int], out_shape: Sequence[int], d: int) -> Sbp:
    dim = d - (len(out_shape) - len(shape))
    return S(dim) if 0 <= dim < len(shape) and shape[dim] == out_shape[d] > 1 else B


def _from_left(shape: Sequence[int], out_shape: Sequence[int], d: int) -> Sbp:
    return S(d) if d < len(shape) and shape[d] == out_shape[d] > 1 else B


def _reproduces(
    node: Node,
    sig: Signature,
    size: int,
    inputs: Sequence[torch.Tensor],
    want: Sequence[torch.Tensor],
) -> bool:
    """Does `sig` on `size` simulated devices give the op's result?"""
    for meta, sbp in zip((*node.inputs, *node.outputs), (*sig.inputs, *sig.outputs), strict=True):
        if isinstance(sbp, Split) and meta.shape[sbp.dim] % size:
            return False
    pieces = [_cut(t, sbp, size) for t, sbp in zip(inputs, sig.inputs, strict=True)]
    kernel = default_local_op(node)
    try:
        per_device = [kernel([p[k] for p in pieces]) for k in range(size)]
    except Exception:
        return False
    for k, (sbp, whole) in enumerate(zip(sig.outputs, want, strict=True)):
        got = [outs[k] for outs in per_device]
        if isinstance(sbp, Broadcast) and not all(_close(g, got[0]) for g in got):
            return False
        if not _close(_assemble(got, sbp), whole):
            return False
    return True


def _cut(t: torch.Tensor, sbp: Sbp, size: int) -> list[torch.Tensor]:
    if isinstance(sbp, Split):
        return [c.contiguous() for c in t.chunk(size, dim=sbp.dim)]
    if isinstance(sbp, Partial):
        addends = [torch.randn_like(t) for _ in range(size - 1)]
        return [t - sum(addends, torch.zeros_like(t)), *addends]
    return [t.clone() for _ in range(size)]


def _assemble(pieces: Sequence[torch.Tensor], sbp: Sbp) -> torch.Tensor:
    if isinstance(sbp, Split):
        return torch.cat(list(pieces), dim=sbp.dim)
    if isinstance(sbp, Partial):
        return sum(pieces[1:], pieces[0].clone())
    return pieces[0]


def _close(got: Any, want: torch.Tensor) -> bool:
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return False
    if want.is_floating_point():
        tol = 1e-9 if want.dtype == torch.float64 else 1e-4 if want.dtype == torch.float32 else 1e-2
        scale = float(want.abs().nan_to_num(posinf=0.0).max()) if want.numel() else 0.0
        # relative to the result's size: an absolute bar would pass any op whose values are tiny
        return torch.allclose(got, want, rtol=tol, atol=tol * scale, equal_nan=True)
    return torch.equal(got, want)
