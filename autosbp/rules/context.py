"""Context parallelism: attention with the sequence split, keys and values all-gathered inside.

Lives here: the sequence-split signature of SDPA (`cp_signatures`), what it exchanges
(`cp_exchanges`, priced by `autosbp.planner.timing.op_exchanges`) and its kernel (`build_cp_attention`).
Lives elsewhere: SDPA's other rows (`attention`), the row's second kernel, keys and values
passed around a ring (`ring`), the collectives on real groups (`runtime.execute.op_comm`), the
vocabulary of communication inside an op (`comm`).

The row, for one mesh dim of n devices (Llama 3's choice, paper section 3.3.2):
  query, key, value S(-2) -> S(-2) (attn_mask, where given, split on its rows or B where it
  broadcasts over them), no dropout, self-attention (query and key of one length L). Each device holds chunk c of the sequence; inside the op it
  all-gathers keys and values (one collective: K and V concatenated on their last dim) and
  attends its queries to them. Backward: autograd through the all-gather, whose adjoint is the
  reduce-scatter of dK and dV. GQA (fewer key/value heads) gathers the fewer heads.
  Causal: the mask is built from the global row index, and the work is balanced: chunk c of
  every device is cut in two halves (2c, 2c+1 of 2n); device c keeps half 2c and swaps half
  2c+1 with the mirrored device n-1-c's half 2(n-1-c)+1, so every device attends two halves
  whose causal work sums to the same (2c + 2(n-1-c) + 2 = 2n half-rows of keys), computes,
  and swaps the output back. A swap is a send/recv pair; its adjoint is the same swap. This
  keeps the layout a plain S(-2) everywhere outside the op (the mirrored layout of Megatron's
  data loader would need a layout of its own) at the price of moving half a query chunk and
  half an output chunk each way, declared as exchanges. The row needs L divisible by 2n.
  An explicit mask (Hugging Face's causal mask tensor) is data: each device attends its rows
  under its rows of the mask to every key, unbalanced work being what the mask asks (a math
  SDPA computes every score whatever the mask).
Several mesh dims may split the sequence (their chunks nest, outer dim first): the kernel
gathers along the innermost first (so the gathered pieces stay in sequence order) and swaps
along each (the mirrored device of the combined index N-1-c is mirrored on every dim).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from autosbp.capturing.graph import InputRef
from autosbp.rules.comm import Exchange, OpComm, OpContext
from autosbp.rules.core import (
    LocalOp,
    NdSignature,
    Node,
    Shape,
    Signature,
    arg_shape,
    bound_args,
    make_signature,
    slot_of,
)
from autosbp.rules.pointwise import aligned_sbp
from autosbp.sbp import B, S, Sbp, local_shape


def cp_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    """The sequence-split row, where it applies (module header)."""
    args = bound_args(node)
    q, k = node.inputs[0].shape, node.inputs[1].shape
    if args["dropout_p"] or len(q) < 3 or q[-2] != k[-2]:
        return []
    if args["is_causal"] and q[-2] % (2 * mesh_dim_size):
        return []
    seq = S(len(q) - 2)
    scores = (*node.outputs[0].shape[:-1], k[-2])
    mask = (
        aligned_sbp(arg_shape(node, "attn_mask"), scores, len(q) - 2)
        if args["attn_mask"] is not None
        else B
    )
    by_name: dict[str, Sbp] = {"query": seq, "key": seq, "value": seq, "attn_mask": mask}
    return [make_signature(node, by_name, (seq,))]


def seq_mesh_dims(node: Node, sig: NdSignature, mesh_shape: Shape) -> tuple[int, ...]:
    """The mesh dims (of more than one device) on which `sig` is the sequence-split row."""
    q, k = slot_of(node, "query"), slot_of(node, "key")
    if q is None or k is None:
        return ()
    seq = len(node.inputs[q].shape) - 2
    return tuple(
        m
        for m, size in enumerate(mesh_shape)
        if size > 1 and sig.inputs[q][m] == S(seq) and sig.inputs[k][m] == S(seq)
    )


def cp_computed(node: Node, sig: NdSignature, mesh_shape: Shape) -> float:
    """The fraction of its even share of the dense scores the kernel computes: causal on N
    chunks, each half reads the keys up to its last row, (2c+1 + 2(N-1-c)+2) halves of keys of
    the 4N a dense share reads: (2N+1)/4N; 1 otherwise (every key, or not the row)."""
    dims = seq_mesh_dims(node, sig, mesh_shape)
    if not dims or not bound_args(node)["is_causal"]:
        return 1.0
    chunks = math.prod(mesh_shape[m] for m in dims)
    return (2 * chunks + 1) / (4 * chunks)


def cp_exchanges(node: Node, sig: NdSignature, mesh_shape: Shape) -> tuple[Exchange, ...]:
    """Per seq-split mesh dim: the all-gather of K and V (forward; it holds the gathered copy
    until backward) and its adjoint reduce-scatter (backward); causal, the swaps of half a
    query chunk and half an output chunk (forward) and of their gradients (backward)."""
    dims = seq_mesh_dims(node, sig, mesh_shape)
    if not dims:
        return ()
    q, k, v = (slot_of(node, name) for name in ("query", "key", "value"))
    assert q is not None and k is not None and v is not None

    def local_bytes(slot: int) -> float:
        meta = node.inputs[slot]
        shape = local_shape(meta.shape, sig.inputs[slot], mesh_shape)
        return float(math.prod(shape) * meta.dtype.itemsize)

    kv = local_bytes(k) + local_bytes(v)
    out: list[Exchange] = []
    gathered = kv
    for m in reversed(dims):  # innermost first: the pieces stay in sequence order
        gathered *= mesh_shape[m]
        held = gathered - kv if m == dims[0] else 0.0  # the whole gathered copy, counted once
        out.append(Exchange("all_gather", m, gathered, held_bytes=held))
        out.append(Exchange("reduce_scatter", m, gathered, backward=True))
    if bound_args(node)["is_causal"]:
        out_meta = node.outputs[0]
        out_shape = local_shape(out_meta.shape, sig.outputs[0], mesh_shape)
        half_out = math.prod(out_shape) * out_meta.dtype.itemsize / 2
        for m in dims:
            for nbytes in (local_bytes(q) / 2, half_out):
                out.append(Exchange("send_recv", m, nbytes))
                out.append(Exchange("send_recv", m, nbytes, backward=True))
    return tuple(out)


def build_cp_attention(node: Node, sig: NdSignature, ctx: OpContext) -> LocalOp:
    """The kernel of the sequence-split row on the device at `ctx.coords`."""
    assert ctx.comm is not None
    dims = seq_mesh_dims(node, sig, ctx.mesh_shape)
    args = bound_args(node)
    chunk, chunks = 0, 1
    for m in dims:  # the combined index of this device's chunk, outer dim first
        chunk, chunks = chunk * ctx.mesh_shape[m] + ctx.coords[m], chunks * ctx.mesh_shape[m]
    attend = functools.partial(
        _attend, scale=args["scale"], enable_gqa=bool(args.get("enable_gqa") or False)
    )
    fn = functools.partial(
        _cp_attention, comm=ctx.comm, mesh_dims=dims, chunk=chunk, chunks=chunks,
        causal=bool(args["is_causal"]), mirrors=tuple(
            ctx.mesh_shape[m] - 1 - ctx.coords[m] for m in dims
        ), attend=attend,
    )  # fmt: skip
    names = ("query", "key", "value", "attn_mask")
    refs = tuple(
        InputRef(slot) for slot in map(functools.partial(slot_of, node), names) if slot is not None
    )
    return LocalOp(fn, refs, {}, len(node.outputs))


def _cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    comm: OpComm,
    mesh_dims: tuple[int, ...],
    chunk: int,
    chunks: int,
    causal: bool,
    mirrors: tuple[int, ...],
    attend: functools.partial[torch.Tensor],
) -> torch.Tensor:
    """This device's queries (chunk `chunk` of `chunks`) against every key and value."""
    kv = torch.cat([k, v], dim=-1)
    for m in reversed(mesh_dims):  # innermost first: the pieces stay in sequence order
        kv = comm.all_gather(kv, dim=-2, mesh_dim=m)
    keys, values = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
    if not causal:  # every row against every key, under the given mask's rows (or none)
        return attend(q, keys, values, first_row=None, mask=mask)
    half = q.shape[-2] // 2
    mine, theirs = q.split([half, half], dim=-2)
    for m, peer in zip(mesh_dims, mirrors, strict=True):
        theirs = comm.swap(theirs, mesh_dim=m, peer=peer)
    out_mine = attend(mine, keys, values, first_row=2 * chunk * half)
    out_theirs = attend(theirs, keys, values, first_row=(2 * (chunks - 1 - chunk) + 1) * half)
    for m, peer in zip(reversed(mesh_dims), reversed(mirrors), strict=True):
        out_theirs = comm.swap(out_theirs, mesh_dim=m, peer=peer)
    return torch.cat([out_mine, out_theirs], dim=-2)


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    first_row: int | None,
    scale: float | None,
    enable_gqa: bool,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA of query rows starting at global row `first_row` (causal; None: not causal) against
    the whole sequence's keys: only the keys up to the last row are read, under the causal mask
    of those global rows, lower-right aligned (`causal_lower_right`: a flash kernel skips its
    masked blocks where torch dispatches to one; the math kernel, on CPU, materializes it)."""
    if first_row is None:
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
    end = first_row + q.shape[-2]
    return F.scaled_dot_product_attention(
        q, keys[..., :end, :], values[..., :end, :], attn_mask=causal_lower_right(q.shape[-2], end),
        scale=scale, enable_gqa=enable_gqa,
    )  # fmt: skip
