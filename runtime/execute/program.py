"""One rank's program of its stage: the captured graph rewritten into prebuilt closures.

Lives here: `build_program` (what the stage runs: its nodes, inputs, received and sent values,
recomputed runs and scheduled parameter gathers, built once) and `Program` (`run`: the forward
of one micro-batch on this rank's local tensors). Lives elsewhere: reading the plan's
signatures (`runtime.execute.signatures`), emitting slots and instructions
(`runtime.execute.builder`), recomputed runs (`runtime.execute.recompute_runs`), which values
cross stages (`runtime.parallel.pipeline`), the parameters' local shards
(`runtime.state.shards`), gradient sync and the optimizer (`runtime.engine`), the collectives
(`runtime.execute.collectives`), the single-device reference interpreter
(`autosbp.capturing.run_graph`, of which this is the distributed sibling).

Invariants:
- Every node's local kernel and every boxing chain is built here, once; `Program.run` only reads
  and writes a list of slots, so the per-step Python cost is one closure call per node and per
  boxing.
- Nodes run in `graph.order` on every rank, and each boxing runs right before its first consumer:
  collectives meet in the same order on every rank of a group.
- A slot is cleared after its last reader, so a step holds no more activations than autograd
  saves; the loss, the sent values and the template's tensors are kept.
- What is recomputed is the plan's (`recomputed`), never re-derived here.
Reference: docs/architecture.md ("The plan"); OneFlow paper section 3 (boxing inserted between
mismatched SBPs).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autosbp.boxing.steps import local_box
from autosbp.capturing.graph import OpGraph, Role, TensorMeta
from autosbp.errors import PlanError
from autosbp.rules import NdSignature
from autosbp.sbp import Mesh, NdSbp, Partial, format_nd_sbp, local_shape
from runtime.execute.builder import ProgramBuilder, last_uses
from runtime.execute.instructions import Boxer, Instruction, Values, take_instruction
from runtime.execute.op_comm import GroupComm
from runtime.execute.recompute_runs import checkpointed, recompute_runs
from runtime.parallel.gathers import plan_gathers
from runtime.parallel.prefetch import GatherSchedule, GatherSetup
from runtime.parallel.regather import Regathers

__all__ = ["InputLoader", "Pieces", "Program", "Value", "build_program"]


@dataclass(frozen=True, slots=True)
class InputLoader:
    """Cuts this rank's piece of user input number `position` into `slot`."""

    position: int
    slot: int
    meta: TensorMeta
    index: tuple[slice, ...] | None  # None: the whole tensor (B on every mesh dim)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """This rank's piece's shape."""
        if self.index is None:
            return self.meta.shape
        return tuple(
            len(range(*s.indices(n))) for s, n in zip(self.index, self.meta.shape, strict=True)
        )


class Pieces(tuple):  # type: ignore[type-arg]
    """One micro-batch's inputs already cut to this rank's pieces (`runtime.data`'s RankBatch
    entries; None where the rank reads none), as opposed to the whole micro-batch."""

    __slots__ = ()


def _described(dtype: torch.dtype, shape: Sequence[int]) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


Value = tuple[str, int]  # (producer node, output index)


@dataclass(frozen=True, slots=True)
class Program:
    """One stage's forward of one micro-batch: fill the inputs and the values received from
    earlier stages, run the instructions, return the local loss (None on stages without it) and
    the values later stages need.

    `template` holds the persistent tensors (parameters, buffers, constants) at their slots;
    `steps[k]` runs, then the slots in `frees[k]` are cleared. The loss sits at `loss_slot` in
    layout `loss_layout`; `imports[k]` is the slot of the k-th received value, `exports[k]` of
    the k-th sent one (`runtime.parallel.pipeline.stage_boundaries` orders both). `gathers`
    runs the parameter gathers the program takes from it (`micro_batch` names the forward
    they belong to); after each micro-batch's backward, call
    `gathers.finish_backward(micro_batch)`.
    """

    template: tuple[Any, ...]
    inputs: tuple[InputLoader, ...]
    steps: tuple[Instruction, ...]
    frees: tuple[tuple[int, ...], ...]
    loss_slot: int | None
    loss_layout: NdSbp | None
    model_name: str
    num_inputs: int = 0  # the model's user inputs (a stage may read only some)
    imports: tuple[int, ...] = ()
    exports: tuple[int, ...] = ()
    gathers: GatherSchedule | None = None  # parameter gathers run ahead (runtime.parallel.prefetch)
    regathers: Regathers | None = None  # activations re-gathered in backward (parallel.regather)
    op_comm: GroupComm | None = None  # collectives inside ops: spans go to its `span_hook`
    # Per mean cross-entropy over class indices: the slot of its kept-target count and its
    # target's size (`ProgramBuilder.count_kept`)
    counts: tuple[tuple[int, int], ...] = ()

    def run(
        self,
        batch: Sequence[torch.Tensor | None],
        received: Sequence[torch.Tensor] = (),
        micro_batch: int = 0,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor], tuple[tuple[torch.Tensor, int], ...]]:
        """This micro-batch's forward: the local loss (None off its stage), the values later
        stages need, and each mean cross-entropy's kept-target count with its target's size."""
        values: Values = list(self.template)
        self._load(values, batch)
        for slot, value in zip(self.imports, received, strict=True):
            values[slot] = value
        scope = self.gathers.forward(micro_batch) if self.gathers else contextlib.nullcontext()
        again = self.regathers.forward(self.gathers) if self.regathers else contextlib.nullcontext()
        with scope, again:
            for step, frees in zip(self.steps, self.frees, strict=True):
                step(values)
                for slot in frees:
                    values[slot] = None
        loss = values[self.loss_slot] if self.loss_slot is not None else None
        counted = tuple((values[slot], size) for slot, size in self.counts)
        return loss, [values[slot] for slot in self.exports], counted

    def _load(self, values: Values, batch: Sequence[torch.Tensor | None]) -> None:
        if len(batch) != self.num_inputs:
            raise PlanError(
                f"step() got {len(batch)} input tensors but model `{self.model_name}` takes "
                f"{self.num_inputs}; pass them in forward's order, like the example inputs."
            )
        local = isinstance(batch, Pieces)
        for loader in self.inputs:
            x = batch[loader.position]
            want = loader.local_shape if local else loader.meta.shape
            if x is None or tuple(x.shape) != want or x.dtype != loader.meta.dtype:
                got = "nothing" if x is None else _described(x.dtype, x.shape)
                raise PlanError(
                    f"{'this rank' + chr(39) + 's piece of ' if local else ''}input "
                    f"#{loader.position} of model `{self.model_name}` is {got} but the plan was "
                    f"made for {_described(loader.meta.dtype, want)}; keep the batch shapes of "
                    "the example inputs (or make a plan for the new shapes)."
                )
            values[loader.slot] = x if local or loader.index is None else x[loader.index]


def build_program(
    graph: OpGraph,
    signatures: Mapping[str, NdSignature],
    state: Mapping[str, torch.Tensor],
    coords: tuple[int, ...],
    boxer: Boxer,
    *,
    stage_of: Mapping[str, int] | None = None,
    stage: int = 0,
    received: Sequence[Value] = (),
    sent: Sequence[Value] = (),
    recomputed: frozenset[str] = frozenset(),
    gathering: GatherSetup | None = None,
    param_grad_dtype: torch.dtype | None = None,
    regathered: Mapping[str, frozenset[int]] | None = None,
    overlapped: Mapping[str, int] | None = None,
) -> Program:
    """This rank's program for `stage` (every node when `stage_of` is None). `state` maps every
    parameter/buffer/constant name of the stage to this rank's local tensor in its plan layout.
    `received` and `sent` are the values the stage imports from earlier stages and exports to
    later ones, in exchange order (`runtime.parallel.pipeline.stage_values`).
    `recomputed` (the nodes the plan recomputes: `autosbp.plan.recomputed_nodes`) wraps each
    run of their steps in activation checkpointing. With `gathering`, parameter gathers run
    through a `GatherSchedule` (`runtime.parallel.prefetch`). `param_grad_dtype`: the dtype a
    parameter boxing's backward sums its gradient in (a mixed recipe's reduce dtype).
    `regathered` (per node, `NodePlan.regathered`): the inputs whose copies backward converts
    again instead of keeping (`runtime.parallel.regather`). `overlapped` (per node,
    `NodePlan.overlap_chunks`): the ops run in chunks beside their output's reduction
    (`runtime.parallel.tp_overlap`)."""
    device = next(iter(state.values())).device if state else torch.device("cpu")
    comm = GroupComm(boxer.mesh, coords, boxer.groups)
    here = _stage_nodes(graph, stage_of, stage)
    regathered = {n: i for n, i in (regathered or {}).items() if i and n in here}
    builder = ProgramBuilder(
        graph, signatures, boxer.mesh, coords, boxer, device, comm, param_grad_dtype,
        regathered=regathered, regathers=Regathers(boxer.groups) if regathered else None,
        overlapped={n: k for n, k in (overlapped or {}).items() if k > 1 and n in here},
    )  # fmt: skip
    imports = [builder.slots.setdefault(value, builder.new_slot()) for value in received]
    inputs = _load_inputs(builder, here)
    loss = _emit_nodes(builder, here, state)
    exports = [builder.slots[value] for value in sent]
    keep = {*exports, *builder.persistent_slots(), *(slot for slot, _ in builder.counts)}
    keep |= {loss[0]} if loss else set()
    frees = last_uses(builder.reads, builder.writes, keep)
    runs = recompute_runs(builder, recomputed)
    gathers = _schedule_gathers(builder, runs, set(exports), state, gathering)
    steps, frees = checkpointed(builder, frees, keep, runs)
    return Program(
        template=tuple(builder.template),
        inputs=tuple(inputs),
        steps=steps,
        frees=frees,
        loss_slot=loss[0] if loss else None,
        loss_layout=loss[1] if loss else None,
        model_name=graph.model_name,
        num_inputs=sum(1 for _ in graph.nodes(Role.INPUT)),
        imports=tuple(imports),
        exports=tuple(exports),
        gathers=gathers,
        regathers=builder.regathers,
        op_comm=comm,
        counts=tuple(builder.counts),
    )


def _load_inputs(builder: ProgramBuilder, here: set[str]) -> list[InputLoader]:
    """A slot and a loader for each user input the stage reads (its piece cut on load)."""
    inputs: list[InputLoader] = []
    for position, (name, attrs) in enumerate(builder.graph.nodes(Role.INPUT)):
        if name in here:
            slot = builder.new_slot()
            builder.slots[(name, 0)] = slot
            meta, layout = attrs.outputs[0], builder.layout(name, 0)
            index = _input_index(meta, layout, builder.mesh, builder.coords)
            inputs.append(InputLoader(position, slot, meta, index))
    return inputs


def _emit_nodes(
    builder: ProgramBuilder, here: set[str], state: Mapping[str, torch.Tensor]
) -> tuple[int, NdSbp] | None:
    """The stage's nodes in graph order: parameters and buffers into the template, each
    compute node's instructions; returns the loss's slot and layout (None off its stage)."""
    graph = builder.graph
    loss: tuple[int, NdSbp] | None = None
    for name, attrs in graph.nodes():
        role = attrs.role
        if name not in here or role is Role.INPUT:
            continue
        if role in (Role.PARAMETER, Role.BUFFER):
            builder.slots[(name, 0)] = builder.new_slot(state[attrs.name])
        elif role is Role.OUTPUT:
            node, out = graph.producers(name)[0]  # type: ignore[misc]
            loss = (builder.slots[(node, out)], builder.layout(node, out))
        else:
            builder.add_compute(name, attrs)
    return loss


def _schedule_gathers(
    builder: ProgramBuilder,
    runs: Sequence[tuple[int, int]],
    exported: set[int],
    state: Mapping[str, torch.Tensor],
    gathering: GatherSetup | None,
) -> GatherSchedule | None:
    """Hand the parameter gathers outside recomputed runs to a `GatherSchedule`: their steps
    become takes from it (reading no slot)."""
    if gathering is None:
        return None
    inside = {k for start, end in runs for k in range(start, end)}
    boxes = [box for box in builder.param_boxes if box.step not in inside]
    if not boxes:
        return None
    taken = {box.step for box in boxes}
    read_directly = exported | {
        slot for k, reads in enumerate(builder.reads) if k not in taken for slot in reads
    }
    gathers = plan_gathers(boxes, read_directly, gathering.policy)
    schedule = gathering.schedule(gathers, {box.name: state[box.name] for box in boxes})
    for box, gather in zip(boxes, gathers, strict=True):
        builder.steps[box.step] = take_instruction(
            functools.partial(schedule.take, gather), box.dst
        )
        builder.reads[box.step] = ()
    return schedule


def _stage_nodes(graph: OpGraph, stage_of: Mapping[str, int] | None, stage: int) -> set[str]:
    """The nodes `stage` runs, and the user inputs it reads."""
    if stage_of is None:
        return set(graph.order)
    here = {name for name in graph.order if stage_of[name] == stage}
    for name, _ in graph.nodes(Role.INPUT):
        if any(stage_of[v] == stage for v in graph.graph.successors(name)):
            here.add(name)
        else:
            here.discard(name)
    return here


def _input_index(
    meta: TensorMeta, layout: NdSbp, mesh: Mesh, coords: tuple[int, ...]
) -> tuple[slice, ...] | None:
    if any(isinstance(sbp, Partial) for sbp in layout):
        raise PlanError(
            f"the plan gives a user input the layout {format_nd_sbp(layout)}; inputs are never P."
        )
    if local_shape(meta.shape, layout, mesh.shape) == meta.shape:
        return None
    return tuple(slice(start, stop) for start, stop in local_box(meta.shape, layout, mesh, coords))
