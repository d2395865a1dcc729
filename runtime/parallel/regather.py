"""Activations re-gathered in backward: sequence parallelism's memory, as the plan priced it.

Lives here: `Regathers` (one program's re-gathered inputs: each boxing the plan re-gathers
registers the copy it makes, and while a forward runs, every tensor autograd saves that lies in
such a copy is packed as a handle holding the producer's piece; unpacking converts the piece
again; a linear reading such a copy gathers it beside its input-gradient matmul:
`_RegatheredLinear`) and `RegatherCounts`. Lives elsewhere: which inputs the plan re-gathers
(`NodePlan.regathered`, chosen and priced by `autosbp.planner.timing.regather`), where the
boxings are emitted (`runtime.execute.builder`), the collectives (`runtime.execute.collectives`),
parameters' re-gathers (FSDP's, `runtime.parallel.prefetch`, whose hooks these nest inside).

Invariants:
- The forward runs as without re-gathers: the boxing makes the copy, the op reads it. Only what
  autograd saves changes: a saved tensor whose storage is a registered copy (the copy itself, or
  a view of it: a reshape, a transpose `linear` saves) is packed as a handle (`saved_tensors_
  hooks`), so nothing keeps the copy after its last forward reader, and the handle keeps the
  producer's piece (a tensor the producer made anyway). The op's forward never runs again.
- Unpacking converts the piece again through the same steps, without autograd, on the boxing's
  process groups: backward runs in the same order on every rank of a stage, so the groups meet
  the same collectives in the same order. The copy is made once per micro-batch and boxing,
  shared by every handle into it, and let go with the last of them; it has the first copy's
  shape, strides and offset, so each handle's view of it is the tensor that was saved.
- A linear whose activation is a re-gathered copy (`beside_input_gradient`, as the planner
  prices it: `autosbp.overlap.hidden_regather_s`) keeps the handle itself, and its backward
  starts the conversion (its last step in flight), computes the input's gradient, which does
  not read the activation, then waits for the copy (with the world's timeout) and computes the
  weight's gradient from it: the gather travels beside the input-gradient matmul.
- Copies are told apart by their storage (held by a weak reference while the forward runs, so
  its address cannot be another storage's), never by address alone.
- A recomputed run never re-gathers (the plan's checks refuse it: the run converts again
  anyway), nor does a backward split in two (zero bubble: its weight pass would gather again).
Reference: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.2.2 (the all-gather of the input of a column-parallel linear, re-run in
backward rather than kept, overlapped with the input-gradient GEMM); Megatron-LM's
LinearWithGradAccumulationAndAsyncCommunication; torch.autograd.graph.saved_tensors_hooks.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from autosbp.boxing.steps import BoxingStep
from autosbp.capturing.graph import InputRef
from autosbp.errors import PlanError
from autosbp.rules import LocalOp
from runtime.execute.collectives import Started, execute_boxing, start_step
from runtime.execute.groups import ProcessGroups, world_timeout
from runtime.parallel.prefetch import GatherSchedule, unpack_saved

__all__ = ["RegatherCounts", "Regathers"]

TensorFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class RegatherCounts:
    """What a program's re-gathers did since it was built (for tests and reports): saved
    tensors packed as handles, conversions run again in backward, and of those, the ones a
    linear started beside its input-gradient matmul (`_RegatheredLinear`)."""

    packed: int = 0
    regathered: int = 0
    beside: int = 0


@dataclass(eq=False, slots=True)
class _Source:
    """One copy a re-gathered boxing made in one forward: the producer's piece and the steps
    that convert it, the copy's layout, and (in backward) the copy made again while handles
    into it are left."""

    owner: Regathers
    piece: torch.Tensor
    steps: tuple[BoxingStep, ...]
    layout: tuple[torch.Size, tuple[int, ...], int, int]  # size, stride, offset, storage bytes
    handles: int = 0
    again: torch.Tensor | None = None
    started: Started | None = None  # the last step in flight (`start`)

    def start(self) -> bool:
        """Begin converting the piece again, unless it is or is being (False): the steps before
        the last run here, the last is left in flight (`unpack` waits for it)."""
        if self.again is not None or self.started is not None:
            return False
        with torch.no_grad():
            x = execute_boxing(self.piece, self.steps[:-1], self.owner.groups)
            self.started = start_step(x, self.steps[-1], self.owner.groups)
        return True

    def unpack(self, size: torch.Size, stride: tuple[int, ...], offset: int) -> torch.Tensor:
        if self.again is None:
            self.start()
            assert self.started is not None
            copy, self.started = self.started.result(world_timeout()), None
            assert _layout(copy) == self.layout, (_layout(copy), self.layout)
            self.again = copy
            self.owner.counts.regathered += 1
        copy = self.again
        self.handles -= 1
        if not self.handles:  # the last handle: the copy goes with it
            self.again = None
        return copy.as_strided(size, stride, offset)


@dataclass(eq=False, slots=True)
class _Handle:
    """A saved tensor that lies in a re-gathered copy, as packed: its source and its view."""

    source: _Source
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def _layout(tensor: torch.Tensor) -> tuple[torch.Size, tuple[int, ...], int, int]:
    return (
        tensor.size(), tensor.stride(), int(tensor.storage_offset()),
        tensor.untyped_storage().nbytes(),
    )  # fmt: skip


@dataclass(eq=False)
class Regathers:
    """The re-gathered boxings of one rank's program, converting on `groups` (the boxing's)."""

    groups: ProcessGroups
    counts: RegatherCounts = field(default_factory=RegatherCounts)
    # while a forward runs: storage -> (its weak reference, the copy's source)
    _copies: dict[int, tuple[StorageWeakRef, _Source]] = field(default_factory=dict)
    _outer: GatherSchedule | None = None

    def boxing(self, box: TensorFn, steps: Sequence[BoxingStep]) -> TensorFn:
        """`box` (the conversion of `steps`), its copy registered for re-gathering."""
        chain = tuple(steps)

        def run(piece: torch.Tensor) -> torch.Tensor:
            copy = box(piece)
            storage = copy.untyped_storage()
            source = _Source(self, piece.detach(), chain, _layout(copy))
            self._copies[storage._cdata] = (StorageWeakRef(storage), source)
            return copy

        return run

    @contextlib.contextmanager
    def forward(self, outer: GatherSchedule | None = None) -> Iterator[None]:
        """The scope of one micro-batch's forward: saved tensors in its copies become handles;
        the others go to `outer`'s packing (parameters FSDP re-gathers), if any."""
        self._outer = outer
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                yield
        finally:
            self._copies.clear()
            self._outer = None

    def beside_input_gradient(self, op: LocalOp) -> LocalOp:
        """A linear `op` whose activation (input 0) is a re-gathered copy, run so that its
        backward gathers the activation again beside the input-gradient matmul
        (`_RegatheredLinear`), as the planner prices it (`overlap.hidden_regather_s`)."""
        plain = op.fn is torch.ops.aten.linear.default and op.scale is None and not op.kwargs
        if not plain or not op.args or op.args[0] != InputRef(0):
            raise PlanError(
                f"the plan re-gathers the activation of {op.fn} beside its input-gradient "
                "matmul, but its local op is not a plain linear of that input; the planner never "
                "does this: the plan was edited or made by another autosbp version: make it again."
            )

        def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Any:
            if not torch.is_grad_enabled():  # evaluation: no backward, nothing kept
                return torch.nn.functional.linear(x, weight, bias)
            return _RegatheredLinear.apply(x, weight, bias, self._handle(x))

        return dataclasses.replace(op, fn=linear)

    def _handle(self, tensor: torch.Tensor) -> _Handle | None:
        """`tensor` as a handle into the re-gathered copy it lies in (counted), or None."""
        found = self._copies.get(tensor.untyped_storage()._cdata)
        if found is None or found[0].expired():
            return None
        source = found[1]
        source.handles += 1
        self.counts.packed += 1
        return _Handle(source, tensor.size(), tensor.stride(), int(tensor.storage_offset()))

    def _pack(self, tensor: torch.Tensor) -> Any:
        handle = self._handle(tensor)
        if handle is not None:
            return handle
        return tensor if self._outer is None else self._outer.pack_saved(tensor)


class _RegatheredLinear(torch.autograd.Function):
    """linear(x, weight, bias) keeping of x only its handle: in backward the copy is gathered
    again while the input's gradient (grad @ weight, which does not read x) is computed, and
    waited for just before the weight's (Megatron-LM's column-parallel linear under sequence
    parallelism). Without a handle (an x in no registered copy, which `beside_input_gradient`'s
    builder never passes) x is kept as autograd would keep it."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        handle: _Handle | None,
    ) -> torch.Tensor:
        ctx.handle, ctx.has_bias = handle, bias is not None
        ctx.save_for_backward(weight, *(() if handle is not None else (x,)))
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        weight, *kept = ctx.saved_tensors
        handle: _Handle | None = ctx.handle
        if handle is not None and handle.source.start():  # travels beside grad_input's matmul
            handle.source.owner.counts.beside += 1
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        x = kept[0] if handle is None else _unpack(handle)
        ctx.handle = None
        rows = grad.reshape(-1, grad.shape[-1])
        grad_weight = rows.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_bias = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias, None


def _unpack(packed: Any) -> Any:
    if isinstance(packed, _Handle):
        return packed.source.unpack(packed.size, packed.stride, packed.offset)
    return unpack_saved(packed)
