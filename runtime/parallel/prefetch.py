"""Parameter gathers as FSDP runs them: ahead of their use, freed after forward, again in backward.

Lives here: `GatherSchedule` (per rank: starts the gathers of the next blocks while this block
computes, hands each gathered weight to autograd, frees the ones the plan re-gathers and
gathers them again, ahead, in backward, and reduce-scatters gradients while backward goes on),
`GatherSetup` (what a program needs to build one; `gather_setup` builds it where the plan
gathers a parameter) and `GatherCounts`. Lives elsewhere: the policy and which boxings are
parameter gathers, in which units (`runtime.parallel.gathers`), where the program waits for
them (`runtime.execute.program`), the collectives (`runtime.execute.collectives`, whose
`StartedChain` runs a gather or reduce-scatter asynchronously), the sync of
what the reduce-scatter leaves summed (`runtime.parallel.grad_sync`), the firing loop that
calls `finish_backward` after each backward (`runtime.parallel.pipeline`).

Invariants:
- A unit is a run of parameter gathers whose consumers lie in one repeated block (or a run
  outside blocks), in program order. With depth d, the first take of a gather of unit u
  waits for all of unit u's gathers (started first if they were not), then starts every unit
  up to u + d not started yet, in unit order; in backward, the first unpack of a re-gathered
  weight of unit u waits for unit u's re-gathers likewise, then starts every re-gathered unit
  down to u - d, in descending order. So a unit's collective buffers (gloo stages a gather's
  whole output beside it) are gone before the next units' are made: FSDP2's order, and the
  (1 + d) blocks' copies `autosbp.planner.problem.stage_terms` prices. Forward and backward run the same program in the same order on every rank of a
  stage, so every group meets the same collectives in the same order. Gathers run on process
  groups of their own, gradient reduce-scatters on others: neither waits behind the boxing of
  activations, nor behind each other.
- Keep (the default): the gathered weight is an autograd input like any other, saved by the
  ops that need it until their backward. Re-gather (`GatherPolicy.regather`): a saved tensor
  whose storage is a re-gathered weight (the weight itself or a view of it, e.g. the
  transpose `linear` saves) is packed as a handle (`torch.autograd.graph.saved_tensors_hooks`),
  so the weight dies after its last forward reader; unpacking gathers it again (once per
  micro-batch, shared by every handle) and views it as the saved tensor was.
- The backward of a gather is its dual chain (an all-gather's is a reduce-scatter), run on
  the gradient given up to it (on gloo, all-reduced in place: no copy of it). Where
  every read of a parameter goes through scheduled gathers, its reduce-scatters run
  asynchronously: started in backward, finished (and added into the parameter's gradient)
  when backward starts the next unit's, and all at the end of the micro-batch's backward
  (`finish_backward`); at most one unit's gradients wait in flight (FSDP2's order). Other
  parameters' gathers reduce-scatter synchronously, as autograd accumulates their gradient.
- Gathers inside a recomputed (checkpointed) run are not scheduled: recomputation runs them
  again in backward anyway.
- Every wait is bounded by the world's timeout.
Reference: Zhao et al. 2023, "PyTorch FSDP" (sections 3.3, 4: prefetching, resharding after
forward, reduce-scatter overlapped with backward); torch/distributed/fsdp/_fully_shard
(`reshard_after_forward`, explicit prefetching); torch.autograd.graph.saved_tensors_hooks.
"""

from __future__ import annotations

import contextlib
import datetime
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from autosbp.boxing.params import gathers_parameters
from autosbp.boxing.steps import dual_step
from autosbp.capturing.graph import OpGraph
from autosbp.rules import NdSignature
from autosbp.sbp import Mesh
from autosbp.timeline import SpanHook
from runtime.execute.collectives import StartedChain
from runtime.execute.groups import ProcessGroups, build_groups
from runtime.execute.instructions import Boxer
from runtime.parallel.gathers import GatherPolicy, ParamGather

__all__ = ["GatherCounts", "GatherSchedule", "GatherSetup", "gather_setup", "unpack_saved"]


@dataclass(frozen=True, slots=True)
class GatherSetup:
    """What a program needs to schedule its gathers: the policy, the process groups of
    gathers and of gradients (`runtime.execute.groups.build_groups` of every mesh, built apart from
    the boxing's), and the world's timeout."""

    policy: GatherPolicy
    gather_groups: ProcessGroups
    grad_groups: ProcessGroups
    timeout: datetime.timedelta

    def schedule(
        self, gathers: Sequence[ParamGather], shards: Mapping[str, torch.Tensor]
    ) -> GatherSchedule:
        return GatherSchedule(
            gathers, shards, depth=self.policy.prefetch_blocks,
            gather_groups=self.gather_groups, grad_groups=self.grad_groups,
            timeout=self.timeout,
        )  # fmt: skip


def gather_setup(
    graph: OpGraph,
    signatures: Mapping[str, NdSignature],
    boxer: Boxer,
    meshes: Sequence[Mesh],
    policy: GatherPolicy,
    timeout: datetime.timedelta,
) -> GatherSetup | None:
    """Process groups of the parameter gathers' own (a collective: every rank decides alike,
    from the whole graph), or None where the plan gathers no parameter."""
    if not gathers_parameters(graph, signatures.__getitem__, boxer.mesh):
        return None
    return GatherSetup(policy, build_groups(meshes), build_groups(meshes), timeout)


@dataclass(eq=False, slots=True)
class _Handle:
    """A saved tensor of a re-gathered weight, as packed: which gather, and the view."""

    owner: _Pass
    gather: ParamGather
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


@dataclass(eq=False)
class _Pass:
    """One micro-batch's forward and backward of the schedule's gathers."""

    schedule: GatherSchedule
    micro_batch: int
    next_unit: int = 0  # forward: units before it are started
    started: dict[int, StartedChain] = field(default_factory=dict)  # gather index -> in flight
    spans: dict[int, Any] = field(default_factory=dict)  # unit -> its open span
    left: dict[int, int] = field(default_factory=dict)  # unit -> gathers not yet taken
    gathered: dict[int, tuple[weakref.ref[torch.Tensor], ParamGather]] = field(
        default_factory=dict
    )  # id(weight) -> the re-gathered weight it is (weakly) and its gather
    handles: dict[int, int] = field(default_factory=dict)  # gather index -> handles packed
    backward_started: set[int] = field(default_factory=set)  # units
    regathered: dict[int, torch.Tensor] = field(default_factory=dict)

    # ---- forward
    def take(self, gather: ParamGather, shard: torch.Tensor) -> torch.Tensor:
        """The gathered weight for `gather` (differentiable w.r.t. `shard`), after starting the
        units the policy runs ahead."""
        schedule = self.schedule
        if self.next_unit <= gather.unit:  # the unit's first take: its gathers, then ahead
            self.start_through(gather.unit)
            self.wait_unit(gather.unit)
            self.start_through(gather.unit + schedule.depth)
        schedule.counts.ahead_units = max(
            schedule.counts.ahead_units, self.next_unit - 1 - gather.unit
        )
        chain = self.started.pop(gather.index)
        weight = _GatheredParam.apply(shard, schedule, gather, chain)
        self.left[gather.unit] -= 1
        if not self.left[gather.unit]:
            schedule.close_span(self.spans.pop(gather.unit))
        if gather.regather:
            self.gathered[id(weight)] = (weakref.ref(weight), gather)
        return weight

    def start_through(self, unit: int) -> None:
        schedule = self.schedule
        while self.next_unit <= min(unit, schedule.last_unit):
            u = self.next_unit
            self.spans[u] = schedule.open_span("param_gather", self.micro_batch)
            for gather in schedule.units[u]:
                shard = schedule.shards[gather.name].detach()
                self.started[gather.index] = StartedChain(
                    shard, gather.steps, schedule.gather_groups
                )
            self.left[u] = len(schedule.units[u])
            self.next_unit += 1

    def wait_unit(self, unit: int) -> None:
        """Wait for `unit`'s gathers in flight (before starting the ones ahead: so this unit's
        collective buffers are gone before theirs are made)."""
        for gather in self.schedule.units[unit]:
            if gather.index in self.started:
                self.started[gather.index].wait(self.schedule.timeout)

    def pack(self, tensor: torch.Tensor) -> Any:
        base = tensor._base if tensor._base is not None else tensor
        found = self.gathered.get(id(base))
        if found is None or found[0]() is not base:
            return tensor
        gather = found[1]
        self.handles[gather.index] = self.handles.get(gather.index, 0) + 1
        offset = int(tensor.storage_offset())
        return _Handle(self, gather, tensor.size(), tensor.stride(), offset)

    def end_forward(self) -> None:
        assert not self.started, f"gathers started but never taken: {sorted(self.started)}"
        self.gathered.clear()

    # ---- backward
    def unpack(self, handle: _Handle) -> torch.Tensor:
        gather = handle.gather
        weight = self.regathered.get(gather.index)
        if weight is None:
            if gather.unit not in self.backward_started:  # its re-gathers, then ahead
                self.start_backward_through(gather.unit)
                self.wait_unit(gather.unit)
            self.start_backward_through(gather.unit - self.schedule.depth)
            counts = self.schedule.counts
            counts.regathers += 1
            ahead = gather.unit - min(self.backward_started)
            counts.ahead_units_backward = max(counts.ahead_units_backward, ahead)
            chain = self.started.pop(gather.index)
            weight = chain.result(self.schedule.timeout)
            self.regathered[gather.index] = weight
            self.left[gather.unit] -= 1
            if not self.left[gather.unit]:
                self.schedule.close_span(self.spans.pop(gather.unit))
        self.handles[gather.index] -= 1
        if not self.handles[gather.index]:
            del self.regathered[gather.index]  # every handle has its copy: free with them
        return weight.as_strided(handle.size, handle.stride, handle.offset)

    def start_backward_through(self, unit: int) -> None:
        """Start the re-gathers of every packed unit from the last down to `unit` not started
        yet (descending: the order backward needs them)."""
        schedule = self.schedule
        packed = sorted({g.unit for g in schedule.gathers if self.handles.get(g.index)})
        for u in reversed(packed):
            if u < unit or u in self.backward_started:
                continue
            self.backward_started.add(u)
            self.spans[u] = schedule.open_span("param_regather", self.micro_batch)
            chosen = [g for g in schedule.units[u] if self.handles.get(g.index)]
            for gather in chosen:
                shard = schedule.shards[gather.name].detach()
                self.started[gather.index] = StartedChain(
                    shard, gather.steps, schedule.gather_groups
                )
            self.left[u] = len(chosen)

    def close(self) -> None:
        """After backward: finish re-gathers started but never unpacked (a weight whose saving
        op's backward did not run)."""
        for chain in self.started.values():
            chain.result(self.schedule.timeout)
        self.started.clear()
        for span in self.spans.values():
            self.schedule.close_span(span)
        self.spans.clear()
        self.regathered.clear()


def _unpack(packed: Any) -> Any:
    return packed.owner.unpack(packed) if isinstance(packed, _Handle) else packed


unpack_saved = _unpack  # what `GatherSchedule.pack_saved` packed, as a saved tensor again


class _GatheredParam(torch.autograd.Function):
    """A started gather's weight, differentiable w.r.t. the shard: backward is the dual chain
    (reduce-scatter), synchronous or deferred (`GatherSchedule.reduce`)."""

    @staticmethod
    def forward(
        ctx: Any,
        shard: torch.Tensor,
        schedule: GatherSchedule,
        gather: ParamGather,
        chain: StartedChain,
    ) -> torch.Tensor:
        ctx.schedule, ctx.gather = schedule, gather
        weight = chain.result(schedule.timeout)
        return weight if weight._base is None else weight.clone()  # its own storage

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        return ctx.schedule.reduce(ctx.gather, grad), None, None, None


@dataclass(slots=True)
class GatherCounts:
    """What a schedule did since it was built (for tests and reports): re-gathers run in
    backward, gradients reduce-scattered asynchronously, and how many units ahead of the one
    taken the most were started (forward) or started in backward below the one unpacked."""

    regathers: int = 0
    deferred_reduces: int = 0
    ahead_units: int = 0
    ahead_units_backward: int = 0


@dataclass(eq=False, slots=True)
class _Reduce:
    gather: ParamGather
    chain: StartedChain
    span: Any


class GatherSchedule:
    """The parameter gathers of one rank's program (`gathers`, in program order) over the
    parameters' local shards (`shards`, by name). Gathers (and re-gathers) run on
    `gather_groups`, gradients on `grad_groups`; `timeout` bounds every wait."""

    def __init__(
        self,
        gathers: Sequence[ParamGather],
        shards: Mapping[str, torch.Tensor],
        *,
        depth: int,
        gather_groups: ProcessGroups,
        grad_groups: ProcessGroups,
        timeout: datetime.timedelta,
    ) -> None:
        self.gathers = tuple(gathers)
        self.shards = shards
        self.depth = depth
        self.gather_groups, self.grad_groups, self.timeout = gather_groups, grad_groups, timeout
        self.units: dict[int, list[ParamGather]] = {}
        for gather in self.gathers:
            self.units.setdefault(gather.unit, []).append(gather)
        assert list(self.units) == list(range(len(self.units))), "units numbered in order"
        self.last_unit = len(self.units) - 1
        self.regathers = any(g.regather for g in self.gathers)
        self.counts = GatherCounts()
        self.span_hook: SpanHook | None = None
        self.on_gradient: Callable[[torch.Tensor], None] | None = None  # gradient final
        # A mixed recipe (`runtime.parallel.precision`): the shards are compute copies, their
        # gradients reduced in `reduce_dtype` and added into their masters (`grad_targets`).
        self.reduce_dtype: torch.dtype | None = None
        self.grad_targets: Mapping[str, torch.Tensor] = {}
        self._passes: dict[int, _Pass] = {}
        self._current: _Pass | None = None
        self._reducing: list[_Reduce] = []
        self._reduced: dict[str, None] = {}  # parameters with a deferred gradient this backward

    @property
    def deferred(self) -> frozenset[str]:
        """Parameters whose gradient this schedule adds in (none reaches autograd's hooks)."""
        return frozenset(g.name for g in self.gathers if g.deferred_grad)

    # ---- forward
    @contextlib.contextmanager
    def forward(self, micro_batch: int) -> Iterator[None]:
        """The scope of one micro-batch's forward: gathers taken inside it belong to it."""
        assert self._current is None, "a forward inside another forward"
        current = self._passes[micro_batch] = _Pass(self, micro_batch)
        self._current = current
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(current.pack, _unpack)
            if self.regathers
            else contextlib.nullcontext()
        )
        try:
            with hooks:
                yield
            current.end_forward()
        finally:
            self._current = None

    def pack_saved(self, tensor: torch.Tensor) -> Any:
        """What the current forward's hook packs for `tensor` (a handle where it lies in a
        re-gathered weight, else the tensor): for hooks nested inside this schedule's
        (`runtime.parallel.regather`), which replace its own while they are installed."""
        if self._current is None or not self.regathers:
            return tensor
        return self._current.pack(tensor)

    def take(self, gather: ParamGather) -> torch.Tensor:
        assert self._current is not None, "a parameter gather outside GatherSchedule.forward"
        return self._current.take(gather, self.shards[gather.name])

    # ---- backward
    def reduce(self, gather: ParamGather, grad: torch.Tensor) -> torch.Tensor | None:
        """The backward of `gather`: its gradient's dual chain, now (returned to autograd) or,
        for a deferred parameter, started now and added into the gradient later (None)."""
        dual = tuple(dual_step(step) for step in reversed(gather.steps))
        wire = grad.to(self.reduce_dtype or grad.dtype).contiguous()  # FSDP2's reduce_dtype
        if not gather.deferred_grad:
            summed = StartedChain(wire, dual, self.grad_groups, donate=True)
            return summed.result(self.timeout).to(grad.dtype)
        # The unit backward left (FSDP2 waits here), held by no name: its buffers go first.
        self._finish_reduces([r for r in self._reducing if r.gather.unit != gather.unit])
        self.counts.deferred_reduces += 1
        span = self.open_span("grad_reduce", None)
        self._reducing.append(
            _Reduce(gather, StartedChain(wire, dual, self.grad_groups, donate=True), span)
        )
        return None

    def finish_backward(self, micro_batch: int) -> None:
        """After one micro-batch's backward: finish its deferred reduce-scatters (gradients
        added in), its re-gathers, and tell `on_gradient` which gradients are final here."""
        self._finish_reduces(list(self._reducing))
        self._passes.pop(micro_batch).close()
        if self.on_gradient is not None:
            for name in self._reduced:
                self.on_gradient(self._target(name))
        self._reduced.clear()

    def _finish_reduces(self, reduces: list[_Reduce]) -> None:
        for item in reduces:
            self._reducing.remove(item)
            piece = item.chain.result(self.timeout)
            self.close_span(item.span)
            param = self._target(item.gather.name)
            with torch.no_grad():
                if param.grad is None:
                    param.grad = piece.to(param.dtype)
                else:
                    param.grad.add_(piece)
            self._reduced[item.gather.name] = None

    def _target(self, name: str) -> torch.Tensor:
        """The tensor a deferred gradient is added into: the shard's master (its fp32 master
        under a mixed recipe: `grad_targets`), else the shard itself."""
        return self.grad_targets.get(name, self.shards[name])

    # ---- spans
    def open_span(self, kind: str, micro_batch: int | None) -> Any:
        if self.span_hook is None:
            return None
        span = self.span_hook.span(kind, micro_batch)
        span.__enter__()
        return span

    def close_span(self, span: Any) -> None:
        if span is not None:
            span.__exit__(None, None, None)
