"""Activations re-gathered in backward: sequence parallelism's memory, as the plan priced it.

Lives here: `Regathers` (one program's re-gathered inputs: each boxing the plan re-gathers
registers the copy it makes, and while a forward runs, every tensor autograd saves that lies in
such a copy is packed as a handle holding the producer's piece; unpacking converts the piece
again) and `RegatherCounts`. Lives elsewhere: which inputs the plan re-gathers
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
- Copies are told apart by their storage (held by a weak reference while the forward runs, so
  its address cannot be another storage's), never by address alone.
- A recomputed run never re-gathers (the plan's checks refuse it: the run converts again
  anyway), nor does a backward split in two (zero bubble: its weight pass would gather again).
Reference: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.2.2 (the all-gather of the input of a column-parallel linear, re-run in
backward rather than kept); torch.autograd.graph.saved_tensors_hooks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from autosbp.boxing.steps import BoxingStep
from runtime.execute.collectives import execute_boxing
from runtime.execute.groups import ProcessGroups
from runtime.parallel.prefetch import GatherSchedule, unpack_saved

__all__ = ["RegatherCounts", "Regathers"]

TensorFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class RegatherCounts:
    """What a program's re-gathers did since it was built (for tests and reports): saved
    tensors packed as handles, and conversions run again in backward."""

    packed: int = 0
    regathered: int = 0


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

    def unpack(self, size: torch.Size, stride: tuple[int, ...], offset: int) -> torch.Tensor:
        if self.again is None:
            with torch.no_grad():
                copy = execute_boxing(self.piece, self.steps, self.owner.groups)
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

    def _pack(self, tensor: torch.Tensor) -> Any:
        found = self._copies.get(tensor.untyped_storage()._cdata)
        if found is None or found[0].expired():
            return tensor if self._outer is None else self._outer.pack_saved(tensor)
        source = found[1]
        source.handles += 1
        self.counts.packed += 1
        return _Handle(source, tensor.size(), tensor.stride(), int(tensor.storage_offset()))


def _unpack(packed: Any) -> Any:
    if isinstance(packed, _Handle):
        return packed.source.unpack(packed.size, packed.stride, packed.offset)
    return unpack_saved(packed)
