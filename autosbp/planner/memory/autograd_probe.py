"""What autograd keeps for backward: per op, read from autograd itself, never guessed.

Lives here: `Saved` (which tensor inputs and outputs of one op its backward keeps, the bytes of
what else it keeps, and which outputs require grad), `saved_by` (autograd asked: the op run on
fake tensors of the node's shapes under `torch.autograd.graph.saved_tensors_hooks`, cached) and
`requires_grad_of` (which values of a graph require grad, from the parameters forward). Lives
elsewhere: what a graph keeps per micro-batch and layout (`memory`), the op's signatures
(`rules`).

How. Under a `FakeTensorMode` (no memory: GPT-3's shapes cost nothing) the op runs with each
floating input a fresh tensor that requires grad exactly where the graph's value does, on the
CPU (so SDPA takes the fused kernel that saves q, k, v, the output and the logsumexp, as
FlashAttention does on GPUs; on the meta device it decomposes into the math path), as the graph
runs it (`graph.kernel_of`: rms_norm keeps the fused kernel's input, weight and rstd). Every tensor
autograd packs is matched to the inputs and outputs by storage (a saved `weight.t()` is the
weight); the rest are intermediates (a norm's mean and rstd, a dropout mask, cross-entropy's
log-softmax), counted once per storage in `extra_bytes`. What autograd keeps depends on which
inputs require grad (`linear` keeps its weight only when its input requires grad: the first
layer on user data does not), so the probe takes the graph's flags.

Where autograd cannot be asked (the op needs real data, or a probe fails), `Saved` says
everything: every input and output kept, no intermediates known (an upper bound of the
inputs and outputs; `known` is False).

Measured on torch 2.13 CPU: linear keeps input and weight; gelu its input; add nothing;
softmax its output; SDPA q, k, v, output and logsumexp; layer_norm input, weight, bias, mean
and rstd; rms_norm input, weight and rstd; cross_entropy_loss the target and log-softmax (tests/planner/test_saved.py holds the probe to
each op's `grad_fn._saved_*` attributes on real tensors).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.graph import saved_tensors_hooks

from autosbp.capturing.graph import (
    InputRef,
    OpGraph,
    OpNode,
    Role,
    TensorMeta,
    kernel_of,
    run_device,
)

__all__ = ["Saved", "requires_grad_of", "saved_by"]

_LOG = logging.getLogger(__name__)
PROBE_DEVICE = torch.device("cpu")  # whose kernels the probe asks (the module header)


@dataclass(frozen=True, slots=True)
class Saved:
    """What one op's backward keeps: tensor inputs and outputs by index, the bytes of the
    intermediates it keeps beside them (whole tensors), and per output whether it requires
    grad. `known` is False where autograd could not be asked (then everything is kept)."""

    inputs: frozenset[int]
    outputs: frozenset[int]
    extra_bytes: int
    requires_grad: tuple[bool, ...]
    known: bool = True


def saved_by(attrs: OpNode, requires_grad: tuple[bool, ...]) -> Saved:
    """What autograd keeps for the compute node `attrs` when its inputs require grad as
    `requires_grad` says (one flag per tensor input)."""
    key = (
        attrs.op, repr(attrs.args), repr(attrs.kwargs), tuple(attrs.inputs),
        requires_grad,
    )  # fmt: skip
    found = _CACHE.get(key)
    if found is None:
        found = _CACHE[key] = _probe(attrs, requires_grad)
    return found


_CACHE: dict[tuple, Saved] = {}  # per op, arguments, input tensors and flags (shape-exact)


def _probe(attrs: OpNode, requires_grad: tuple[bool, ...]) -> Saved:
    metas: tuple[TensorMeta, ...] = tuple(attrs.inputs)
    assert attrs.target is not None, f"{attrs.op}: a compute node without a target"
    kernel = kernel_of(attrs.target)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            inputs = [_fake(meta, flag) for meta, flag in zip(metas, requires_grad, strict=True)]
            args = run_device(_resolve(attrs.args, inputs), PROBE_DEVICE)
            kwargs = run_device(_resolve(attrs.kwargs, inputs), PROBE_DEVICE)
            packed: list[torch.Tensor] = []

            def pack(t: torch.Tensor) -> torch.Tensor:
                packed.append(t)
                return t

            with saved_tensors_hooks(pack, lambda t: t):
                result = kernel(*args, **kwargs)
            outputs = _tensors(result)
            return _matched(packed, inputs, outputs)
    except Exception as exc:  # the op needs real data, or fake tensors cannot run it: assume
        # the most (an upper bound), and say so
        _LOG.info(
            "%s: autograd's saves not probed (%s); counting every input and output",
            attrs.op,
            exc,
        )
        return _everything(attrs, requires_grad)


def _matched(
    packed: list[torch.Tensor], inputs: list[torch.Tensor], outputs: list[torch.Tensor]
) -> Saved:
    """The packed tensors as input and output indices (by storage) and intermediates' bytes."""
    of_input = {_storage(t): i for i, t in enumerate(inputs)}
    of_output = {_storage(t): i for i, t in enumerate(outputs)}
    kept_inputs, kept_outputs, extras = set(), set(), {}
    for t in packed:
        storage = _storage(t)
        if storage in of_input:
            kept_inputs.add(of_input[storage])
        elif storage in of_output:
            kept_outputs.add(of_output[storage])
        else:
            extras[storage] = t.untyped_storage().nbytes()
    flags = tuple(bool(t.requires_grad) for t in outputs)
    return Saved(frozenset(kept_inputs), frozenset(kept_outputs), sum(extras.values()), flags)


def _everything(attrs: OpNode, requires_grad: tuple[bool, ...]) -> Saved:
    flag = any(requires_grad)
    outputs: tuple[TensorMeta, ...] = tuple(attrs.outputs)
    return Saved(
        frozenset(range(len(attrs.inputs))), frozenset(range(len(outputs))), 0,
        tuple(flag and _differentiable(meta.dtype) for meta in outputs), known=False,
    )  # fmt: skip


def _fake(meta: TensorMeta, requires_grad: bool) -> torch.Tensor:
    """A fresh tensor of `meta` (a non-leaf where it requires grad, so in-place ops may write
    into it as they do into activations)."""
    t = torch.empty(meta.shape, dtype=meta.dtype, device=PROBE_DEVICE)
    if requires_grad and _differentiable(meta.dtype):
        return t.requires_grad_().clone()
    return t


def _differentiable(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _tensors(result: Any) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, list | tuple):
        return [t for item in result for t in _tensors(item)]
    return []


def _resolve(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, InputRef):
        return tensors[value.index]
    if isinstance(value, list | tuple):
        return type(value)(_resolve(v, tensors) for v in value)
    if isinstance(value, dict):
        return {k: _resolve(v, tensors) for k, v in value.items()}
    return value


def requires_grad_of(graph: OpGraph) -> dict[tuple[str, int], bool]:
    """Per value (producer, output index): does it require grad? Floating parameters do, user
    inputs, buffers and constants do not, and an op's outputs as autograd says (`saved_by`)."""
    flags: dict[tuple[str, int], bool] = {}
    for name in graph.order:
        attrs = graph.node(name)
        role = attrs.role
        if role is Role.PARAMETER:
            flags[(name, 0)] = _differentiable(attrs.outputs[0].dtype)
        elif role in (Role.INPUT, Role.BUFFER):
            flags[(name, 0)] = False
        elif role is Role.COMPUTE:
            ins = tuple(flags[p] if p is not None else False for p in graph.producers(name))
            found = saved_by(attrs, ins)
            for index, flag in enumerate(found.requires_grad):
                flags[(name, index)] = flag
    return flags
