"""Ring attention: the sequence-split row of `context` with keys and values passed around a ring.

Lives here: the "ring" kernel of the sequence-split SDPA row (`ring_variants`, offered beside the
all-gather kernel for the same layouts, `NdSignature.kernel`), what it exchanges (`ring_exchanges`,
priced by `autosbp.planner.timing.op_exchanges`) and the kernel (`build_ring_attention`). Lives
elsewhere: the row, its all-gather kernel and the causal balance (`context`), the ring step on real
groups (`runtime.execute.op_comm.GroupComm.shift`).

The kernel, on one mesh dim of n devices (Liu et al. 2023, Ring Attention; the balance as
Megatron-Core's and torchtitan's): device c holds chunk c of q, k and v (plain S(-2)).
Causal, it first swaps the second half of its queries and of its keys and values with the
mirrored device n-1-c (as `context` does for queries): it then holds halves 2c and 2n-1-2c of
both. Then n steps: at step t it holds the keys and values of device (c - t) mod n, starts the
next ring exchange (send its pair to c+1, receive from c-1: `OpComm.shift`), computes its
queries against the pair it holds, and waits for the exchange. Query half a against key half
b: all of it if b < a, the causal square if b = a, nothing if b > a; every step after the
first computes exactly two half x half blocks on every device (balanced), the first one plus two
causal squares. Each block yields its output and its log-sum-exp; the outputs merge by their
log-sum-exps (exact: softmax over the union of the keys). Causal, the output's second half is
swapped back. Backward: autograd through the blocks (plain math, differentiable), the merge and
the exchanges, whose adjoints are the reverse shift and the same swap: exact. The exchanges of
forward overlap the step's compute (`Exchange.overlaps`, `beside` = 1/n: one step's share); those
of backward are waited where autograd reaches them (not overlapped). The blocks are computed by
plain matmuls (every score of a computed block, a causal square's masked half too: nothing is
skipped inside a block, on any device) and keep their scores for backward, as a math SDPA does.
Applies to one sequence-split mesh dim, no explicit mask, no dropout. Chosen only where a plan
asks for it (`megatron:...,cp=C,ring=1`; auto keeps the rules' own kernels, `space.strategy`): the
unfused blocks ran 2.5x slower than the all-gather kernel's SDPA on a CPU (bench/runtime.py),
which a price by flops does not see.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from autosbp.capturing.graph import InputRef
from autosbp.rules.comm import Exchange, OpComm, OpContext
from autosbp.rules.context import seq_mesh_dims
from autosbp.rules.core import LocalOp, NdSignature, Node, Shape, bound_args, slot_of
from autosbp.sbp import local_shape

RING = "ring"


def ring_variants(node: Node, sig: NdSignature, mesh_shape: Shape) -> list[NdSignature]:
    """The ring kernel of a sequence-split signature on exactly one mesh dim, without a mask."""
    if sig.kernel or len(seq_mesh_dims(node, sig, mesh_shape)) != 1:
        return []
    if bound_args(node)["attn_mask"] is not None:
        return []
    return [NdSignature(sig.inputs, sig.outputs, kernel=RING)]


def ring_exchanges(node: Node, sig: NdSignature, mesh_shape: Shape) -> tuple[Exchange, ...]:
    """Causal: the swaps of half the queries, half the keys and values and half the output, and
    their gradients'; then n - 1 ring steps of this device's keys and values, each beside one
    step's compute, holding what it received until backward; backward, n - 1 steps of their
    gradients, waited."""
    (m,) = seq_mesh_dims(node, sig, mesh_shape)
    n = mesh_shape[m]

    def local_bytes(meta_shape: tuple[int, ...], nd: tuple, itemsize: int) -> float:
        return float(math.prod(local_shape(meta_shape, nd, mesh_shape)) * itemsize)

    q, k, v = (slot_of(node, name) for name in ("query", "key", "value"))
    assert q is not None and k is not None and v is not None
    sizes = [
        local_bytes(node.inputs[s].shape, sig.inputs[s], node.inputs[s].dtype.itemsize)
        for s in (q, k, v)
    ]
    kv = sizes[1] + sizes[2]
    out_meta = node.outputs[0]
    out = local_bytes(out_meta.shape, sig.outputs[0], out_meta.dtype.itemsize)
    declared: list[Exchange] = []
    if bound_args(node)["is_causal"]:
        for nbytes in (sizes[0] / 2, kv / 2, out / 2):
            declared.append(Exchange("send_recv", m, nbytes))
            declared.append(Exchange("send_recv", m, nbytes, backward=True))
    for step in range(n - 1):
        held = kv * (n - 1) if step == 0 else 0.0
        declared.append(Exchange("send_recv", m, kv, overlaps=True, held_bytes=held, beside=1 / n))
        declared.append(Exchange("send_recv", m, kv, backward=True))
    return tuple(declared)


def build_ring_attention(node: Node, sig: NdSignature, ctx: OpContext) -> LocalOp:
    """The ring kernel on the device at `ctx.coords`."""
    assert ctx.comm is not None
    (m,) = seq_mesh_dims(node, sig, ctx.mesh_shape)
    args = bound_args(node)
    scale = args["scale"] if args["scale"] is not None else 1 / math.sqrt(node.inputs[0].shape[-1])
    fn = functools.partial(
        _ring_attention, comm=ctx.comm, mesh_dim=m, chunk=ctx.coords[m],
        chunks=ctx.mesh_shape[m], causal=bool(args["is_causal"]), scale=scale,
    )  # fmt: skip
    slots = [slot_of(node, name) for name in ("query", "key", "value")]
    return LocalOp(fn, tuple(InputRef(s) for s in slots if s is not None), {}, 1)


def _ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    comm: OpComm,
    mesh_dim: int,
    chunk: int,
    chunks: int,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """This device's queries against every device's keys and values, a ring step at a time."""
    kv = torch.cat([k, v], dim=-1)
    half = q.shape[-2] // 2
    mirror = chunks - 1 - chunk
    if causal:  # halves 2c and 2n-1-2c of queries, keys and values (module header)
        q = torch.cat([q[..., :half, :], comm.swap(q[..., half:, :], mesh_dim, mirror)], dim=-2)
        kv = torch.cat([kv[..., :half, :], comm.swap(kv[..., half:, :], mesh_dim, mirror)], dim=-2)
    rows = _row_blocks(q, half, chunk, chunks, causal)
    parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in rows]
    for step in range(chunks):
        wait: Callable[[], None] | None = None
        if step < chunks - 1:
            incoming, wait = comm.shift(kv, mesh_dim)
        owner = (chunk - step) % chunks
        keys, values = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
        for (first, q_rows), got in zip(rows, parts, strict=True):
            block = _block(q_rows, keys, values, first, owner, half, chunks, causal, scale)
            if block is not None:
                got.append(block)
        if wait is not None:
            wait()
            kv = incoming
    out = torch.cat([_merge(got) for got in parts], dim=-2)
    if causal:
        out = torch.cat([out[..., :half, :], comm.swap(out[..., half:, :], mesh_dim, mirror)], -2)
    return out


def _row_blocks(
    q: torch.Tensor, half: int, chunk: int, chunks: int, causal: bool
) -> list[tuple[int, torch.Tensor]]:
    """(global half index, rows) of this device's queries; not causal: one block, index -1."""
    if not causal:
        return [(-1, q)]
    return [(2 * chunk, q[..., :half, :]), (2 * chunks - 1 - 2 * chunk, q[..., half:, :])]


def _block(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    first: int,
    owner: int,
    half: int,
    chunks: int,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Query half `first` against the key halves device `owner` holds: the output of the keys
    it sees and their log-sum-exp (None: it sees none)."""
    if not causal:
        return _attend(q, keys, values, None, scale)
    mine = (2 * owner, 2 * chunks - 1 - 2 * owner)  # the global halves of keys held, in order
    seen = [i for i, b in enumerate(mine) if b <= first]
    if not seen:
        return None
    cols = [slice(i * half, (i + 1) * half) for i in seen]
    keys = torch.cat([keys[..., c, :] for c in cols], dim=-2)
    values = torch.cat([values[..., c, :] for c in cols], dim=-2)
    square = torch.ones(half, half, dtype=torch.bool, device=q.device).tril()
    full = torch.ones(half, half, dtype=torch.bool, device=q.device)
    mask = torch.cat([square if mine[i] == first else full for i in seen], dim=-1)
    return _attend(q, keys, values, mask, scale)


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of `q` to these keys (grouped-query: each key head serves its run of
    query heads, as SDPA's enable_gqa) and the rows' log-sum-exp, by plain differentiable math."""
    groups = q.shape[-3] // keys.shape[-3]
    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=-3)
        values = values.repeat_interleave(groups, dim=-3)
    scores = (q @ keys.transpose(-2, -1)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - lse) @ values, lse


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The attention over the union of the blocks' keys: outputs weighted by exp(lse - total)."""
    total = torch.logsumexp(torch.stack([lse for _, lse in parts]), dim=0)
    return torch.stack([out * torch.exp(lse - total) for out, lse in parts]).sum(dim=0)
