"""The vocabulary of op rules: signatures, the rule record, the local kernel, node access helpers.

Lives here: `Signature` (one mesh dim) and `NdSignature` (all mesh dims), `OpRule` (how one op
family lists its signatures and builds its local kernel), `LocalOp` (the op bound to one device's
shards, built once per node, signature and device; a signature that communicates inside the op
declares its exchanges and builds its kernel with an `OpContext`: `rules.comm`), and the helpers every family uses to read a
node (`bound_args`, `tensor_slots`, `make_signature`) and to rewrite its arguments
(`local_op_with`). Lives elsewhere: the per-family rules (sibling modules), the registry and the
nD product (`autosbp.rules`), the simulation oracle (`autosbp.rules.oracle`).

Invariants: a Signature has one SBP per tensor input (InputRef order) and one per tensor output;
rules never emit P on a tensor that is not floating point (the registry filters it anyway);
a LocalOp returns exactly one tensor per node output, whatever the op returns.
References: docs/architecture.md ("Contracts": rules); `OpNode` (graph.py) for the node contract;
OneFlow `GetSbp` functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

from autosbp.capturing.graph import InputRef, OpNode, RunDevice
from autosbp.rules.comm import Exchange, OpContext
from autosbp.sbp import B, Broadcast, NdSbp, P, Partial, Sbp, Split, format_nd_sbp, local_shape

Node: TypeAlias = OpNode
Shape: TypeAlias = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Signature:
    """One mesh dim: the SBP of every tensor input (InputRef order) and of every tensor output."""

    inputs: tuple[Sbp, ...]
    outputs: tuple[Sbp, ...]

    def __repr__(self) -> str:
        ins = ", ".join(repr(s) for s in self.inputs)
        outs = ", ".join(repr(s) for s in self.outputs)
        return f"({ins} -> {outs})"


@dataclass(frozen=True, slots=True)
class NdSignature:
    """All mesh dims: the nD SBP of every tensor input and output (what the planner prices).
    `kernel` names another kernel for the same layouts ("" for the rule's own; an op whose rule
    has `variants`, e.g. "ring" for context-parallel attention), told apart in a plan by the
    exchanges it states."""

    inputs: tuple[NdSbp, ...]
    outputs: tuple[NdSbp, ...]
    kernel: str = ""

    @classmethod
    def from_1d(cls, per_mesh_dim: Sequence[Signature]) -> NdSignature:
        """Stack one Signature per mesh dim (outer mesh dim first)."""
        ins = tuple(zip(*(s.inputs for s in per_mesh_dim), strict=True))
        outs = tuple(zip(*(s.outputs for s in per_mesh_dim), strict=True))
        return cls(ins, outs)

    def mesh_dim(self, mesh_dim: int) -> Signature:
        """The 1D signature this one uses on `mesh_dim`."""
        return Signature(
            tuple(nd[mesh_dim] for nd in self.inputs), tuple(nd[mesh_dim] for nd in self.outputs)
        )

    def __repr__(self) -> str:
        ins = ", ".join(format_nd_sbp(s) for s in self.inputs)
        outs = ", ".join(format_nd_sbp(s) for s in self.outputs)
        return f"({ins} -> {outs}" + (f" [{self.kernel}])" if self.kernel else ")")


@dataclass(frozen=True, slots=True)
class LocalOp:
    """An op bound to one device: `fn(*args, **kwargs)` with InputRefs read from the local inputs.

    `scale` multiplies every output (the local kernel of a mean whose reduced dim is split).
    Built once per (node, signature, mesh, coords); calling it is cheap.
    """

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    n_outputs: int
    scale: float | None = None

    def __call__(self, local_inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        args = resolve_refs(self.args, local_inputs)
        kwargs = {k: resolve_refs(v, local_inputs) for k, v in self.kwargs.items()}
        outs = as_tuple(self.fn(*args, **kwargs))
        assert len(outs) == self.n_outputs, (
            f"{self.fn} gave {len(outs)} outputs, not {self.n_outputs}"
        )
        if self.scale is not None:
            outs = tuple(out * self.scale for out in outs)
        return outs


# ---------------------------------------------------------------------------------------------
# Reading a node


def bound_args(node: Node) -> dict[str, Any]:
    """The call's arguments by schema name, defaults filled in (InputRefs left in place)."""
    schema = node.schema
    assert schema is not None, f"{node.op}: arguments by name need an ATen schema"
    args, kwargs = tuple(node.args), dict(node.kwargs)
    out: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            out[arg.name] = args[i]
        elif arg.name in kwargs:
            out[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            out[arg.name] = None
    return out


def tensor_slots(node: Node) -> dict[str, int | tuple[int, ...]]:
    """Schema name -> the InputRef index it holds (a tuple for tensor lists such as cat's)."""
    slots: dict[str, int | tuple[int, ...]] = {}
    for name, value in bound_args(node).items():
        if isinstance(value, InputRef):
            slots[name] = value.index
        elif isinstance(value, list | tuple) and any(isinstance(v, InputRef) for v in value):
            slots[name] = tuple(v.index for v in value if isinstance(v, InputRef))
    return slots


def in_shapes(node: Node) -> list[Shape]:
    return [tuple(meta.shape) for meta in node.inputs]


def out_shapes(node: Node) -> list[Shape]:
    return [tuple(meta.shape) for meta in node.outputs]


def norm_dim(dim: int, rank: int) -> int:
    """A possibly negative dim as 0..rank-1 (a 0-d tensor counts as rank 1, like torch)."""
    return dim % max(rank, 1)


def make_signature(
    node: Node, by_name: Mapping[str, Sbp | Sequence[Sbp]], outputs: Sequence[Sbp]
) -> Signature:
    """A Signature from SBPs given by schema argument name; names absent from the node are skipped.

    A tensor-list argument takes either one SBP (for every member) or a sequence of them.
    """
    inputs: dict[int, Sbp] = {}
    for name, slot in tensor_slots(node).items():
        sbp = by_name[name]
        if isinstance(slot, int):
            assert isinstance(sbp, Split | Broadcast | Partial)
            inputs[slot] = sbp
        else:
            members = [sbp] * len(slot) if isinstance(sbp, Split | Broadcast | Partial) else sbp
            inputs.update(zip(slot, members, strict=True))
    assert len(inputs) == len(node.inputs), f"{node.op}: an input got no SBP"
    return Signature(tuple(inputs[i] for i in range(len(inputs))), tuple(outputs))


def slot_of(node: Node, name: str) -> int | None:
    """The InputRef index of the one-tensor argument `name`; None if it holds no tensor."""
    value = bound_args(node).get(name)
    return value.index if isinstance(value, InputRef) else None


def arg_shape(node: Node, name: str) -> Shape:
    """The global shape of the tensor argument `name` (() if the argument holds no tensor)."""
    slot = slot_of(node, name)
    return () if slot is None else tuple(node.inputs[slot].shape)


# Ops that update inputs in place without saying so in their schema (training-mode batch norm
# updates the running statistics it is given).
HIDDEN_WRITES: dict[str, tuple[str, ...]] = {
    "aten.batch_norm.default": ("running_mean", "running_var"),
    "aten.native_batch_norm.default": ("running_mean", "running_var"),
}


def mutated_inputs(node: Node) -> tuple[int, ...]:
    """InputRef indices of the inputs the op writes in place (schema `(a!)`, or HIDDEN_WRITES)."""
    schema = node.schema
    if schema is None:  # placeholder, output
        return ()
    args = bound_args(node)
    names = {a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write}
    if args.get("training"):
        names |= set(HIDDEN_WRITES.get(node.op, ()))
    return tuple(sorted(v.index for k, v in args.items() if k in names and isinstance(v, InputRef)))


def all_broadcast(node: Node) -> Signature:
    return Signature((B,) * len(node.inputs), (B,) * len(node.outputs))


def uniform(node: Node, sbp: Sbp) -> Signature:
    """Every input and output gets the same SBP (S(i) on all, or P -> P)."""
    return Signature((sbp,) * len(node.inputs), (sbp,) * len(node.outputs))


def one_partial(n_inputs: int, index: int) -> tuple[Sbp, ...]:
    """P at `index`, B elsewhere: the inputs of an op linear in input `index` alone."""
    return tuple(P if i == index else B for i in range(n_inputs))


# ---------------------------------------------------------------------------------------------
# Local kernels


def plain_local_op(node: Node, sig: NdSignature, mesh_shape: Shape, coords: Shape) -> LocalOp:
    """The node's own call on local tensors: right for ops whose arguments carry no global size."""
    return default_local_op(node)


def no_exchanges(node: Node, sig: NdSignature, mesh_shape: Shape) -> tuple[Exchange, ...]:
    """The default: the op's kernel communicates nothing under any signature."""
    return ()


def full_work(node: Node, sig: NdSignature | None, mesh_shape: Shape, causal_skip: float) -> float:
    """The default: the kernel computes its whole share of the op's counted flops."""
    return 1.0


SignatureFn: TypeAlias = Callable[[Node, int], list[Signature]]
LocalOpFn: TypeAlias = Callable[[Node, NdSignature, Shape, Shape], LocalOp]
ExchangesFn: TypeAlias = Callable[[Node, NdSignature, Shape], tuple[Exchange, ...]]
CommLocalFn: TypeAlias = Callable[[Node, NdSignature, OpContext], LocalOp]
WorkFn: TypeAlias = Callable[[Node, NdSignature | None, Shape, float], float]
VariantsFn: TypeAlias = Callable[[Node, NdSignature, Shape], list[NdSignature]]


@dataclass(frozen=True, slots=True)
class OpRule:
    """How one op lists its 1D signatures and builds its local kernel for an nD signature.

    A signature for which `exchanges` lists collectives (`rules.comm.Exchange`) communicates
    inside the op: its kernel is `build_comm(node, sig, OpContext)`, built with this device's
    groups; every other signature's is `build_local(node, sig, mesh_shape, coords)`.
    `work(node, sig, mesh_shape, causal_skip)`: the fraction of its even share of the node's
    counted flops the kernel computes under `sig` (causal attention computes part of the dense
    product; None for `sig`: the least over every signature, for lower bounds).
    `variants(node, sig, mesh_shape)`: other kernels of an admissible nd-signature's layouts
    (`NdSignature.kernel`), offered beside it."""

    signatures: SignatureFn
    build_local: LocalOpFn = plain_local_op
    exchanges: ExchangesFn = no_exchanges
    build_comm: CommLocalFn | None = None
    work: WorkFn = full_work
    variants: VariantsFn | None = None


def default_local_op(
    node: Node, overrides: Mapping[str, Any] | None = None, scale: float | None = None
) -> LocalOp:
    """The node's own target, with schema arguments in `overrides` replaced (e.g. local sizes)."""
    assert node.target is not None, f"{node.op}: no target to call"
    return local_op_with(node, node.target, overrides or {}, scale)


def local_op_with(
    node: Node, fn: Callable[..., Any], overrides: Mapping[str, Any], scale: float | None = None
) -> LocalOp:
    """`fn` called with the node's args, schema arguments in `overrides` replaced."""
    args, kwargs = _overridden(node, node.args, node.kwargs, overrides)
    return LocalOp(fn, args, kwargs, len(node.outputs), scale)


def _overridden(
    node: Node, args: Sequence[Any], kwargs: Mapping[str, Any], overrides: Mapping[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`args` and `kwargs` of a call of the node's op, schema arguments in `overrides` replaced."""
    args, kwargs = list(args), dict(kwargs)
    if overrides:
        assert node.schema is not None, f"{node.op}: overrides by name need an ATen schema"
        names = [a.name for a in node.schema.arguments]
        for name, value in overrides.items():
            pos = names.index(name)
            if pos < len(args) and name not in kwargs:
                args[pos] = value
            else:
                kwargs[name] = value
    return tuple(args), kwargs


def in_eval_mode(node: Node, op: LocalOp) -> LocalOp | None:
    """`op` as the node runs under `nn.Module.eval()`: dropout (aten.dropout, native_dropout,
    attention's dropout_p) passes its input through, batch norm normalizes by its running
    statistics and leaves them unchanged. None where the node runs alike in both modes, or
    where its kernel is not the op itself (a kernel of its own refuses dropout: `context`).
    The graph is captured in training mode; evaluation runs it with these flags flipped."""
    if op.fn is not node.target or node.schema is None:
        return None
    bound = bound_args(node)
    flips: dict[str, Any] = {}
    for name in ("train", "training"):
        if name in bound and bound[name] is not False:
            flips[name] = False
    if "running_mean" in bound and bound["running_mean"] is None:
        flips.pop("training", None)  # no running statistics: the batch's, in eval mode too
    if bound.get("dropout_p", 0.0):
        flips["dropout_p"] = 0.0
    if not flips:
        return None
    args, kwargs = _overridden(node, op.args, op.kwargs, flips)
    return dataclasses.replace(op, args=args, kwargs=kwargs)


def local_out_shape(node: Node, sig: NdSignature, mesh_shape: Shape, index: int = 0) -> list[int]:
    """The local shape of output `index` under `sig` (for size arguments)."""
    return list(local_shape(node.outputs[index].shape, sig.outputs[index], mesh_shape))


def shard_range(length: int, dim: int, nd_sbp: NdSbp, mesh_shape: Shape, coords: Shape) -> range:
    """The global indices of `dim` that the device at `coords` holds (layout.py's convention)."""
    chunk, parts = 0, 1
    for sbp, size, coord in zip(nd_sbp, mesh_shape, coords, strict=True):
        if isinstance(sbp, Split) and sbp.dim == dim:
            chunk, parts = chunk * size + coord, parts * size
    step = length // parts
    return range(chunk * step, (chunk + 1) * step)


def reduced_fraction(global_shape: Shape, local: Shape, dims: Sequence[int]) -> float:
    """Local count / global count of the elements over `dims` (the rescale of a split mean)."""
    num = den = 1
    for d in dims:
        num, den = num * local[d], den * global_shape[d]
    return num / den


def resolve_refs(value: Any, inputs: Sequence[torch.Tensor]) -> Any:
    """`value` with every InputRef (also inside lists) replaced by its tensor from `inputs`, and
    RUN_DEVICE by the inputs' device (the default device for an op without inputs; the runtime
    fills in its own before calling)."""
    if isinstance(value, InputRef):
        return inputs[value.index]
    if isinstance(value, RunDevice):
        return inputs[0].device if inputs else torch.get_default_device()
    if isinstance(value, list | tuple):
        return type(value)(resolve_refs(v, inputs) for v in value)
    return value


def as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    """An op's return value as a tuple of tensors (None -> (), one tensor -> (tensor,))."""
    if out is None:
        return ()
    if isinstance(out, torch.Tensor):
        return (out,)
    return tuple(out)
