"""One rank's program of a single-stage plan: the captured graph rewritten into prebuilt closures.

Lives here: `read_signatures` (the plan's per-node SBP strings parsed and checked against the
graph and the rules), `build_program` (slots, instructions and frees, built once) and `Program`
(`run`: the forward of one step on this rank's local tensors). Lives elsewhere: the parameters'
local shards, gradient sync and the optimizer (`runtime.engine`), the collectives
(`runtime.boxing`), the local kernels (`autosbp.rules.local_op`), the single-device reference
interpreter (`autosbp.capturing.run_graph`, of which this is the distributed sibling).

Invariants:
- Every node's local kernel and every boxing chain is built here, once; `Program.run` only reads
  and writes a list of slots, so the per-step Python cost is one closure call per node and per
  boxing.
- Nodes run in `graph.order` on every rank, and each boxing runs right before its first consumer:
  collectives meet in the same order on every rank of a group.
- A producer output boxed to one layout is boxed once per step, whatever the number of consumers
  that need that layout (autograd sums their gradients before the backward collective).
- A slot is cleared after its last reader, so a step holds no more activations than autograd saves.
- An op that writes into a buffer input (batch norm's running stats, `add_` on a counter) that was
  boxed for it writes into a copy of its own; right after the op the copy is boxed back and
  copied into the buffer (no grad), so buffers evolve exactly as in eager. Boxing into any
  other in-place write (`autosbp.rules.pinned_inputs`: the written input and the views leading
  to it) is refused at build time; the planner never plans it.
- The graph's RUN_DEVICE (factory ops, `.to(device)`) is this rank's device.
Reference: design.md 3.7; OneFlow paper section 3 (boxing inserted between mismatched SBPs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autosbp.boxing.steps import local_box
from autosbp.capturing.graph import OpGraph, Role, TensorMeta, run_device
from autosbp.errors import PlanError
from autosbp.plan import Plan
from autosbp.planner.pipeline import recompute_runs
from autosbp.rules import NdSignature, local_op, mutated_inputs, nd_signatures, pinned_inputs
from autosbp.sbp import Mesh, NdSbp, Partial, format_nd_sbp, local_shape, parse_nd_sbp
from runtime.closures import (
    Boxer,
    Instruction,
    Values,
    box_instruction,
    checkpoint_instruction,
    clone_instruction,
    compute_instruction,
    take_instruction,
    write_back_instruction,
)
from runtime.gathers import ParamBox, has_collective, plan_gathers
from runtime.prefetch import GatherSchedule, GatherSetup

__all__ = ["Program", "build_program", "read_signatures"]


@dataclass(frozen=True, slots=True)
class InputLoader:
    """Cuts this rank's piece of user input number `position` into `slot`."""

    position: int
    slot: int
    meta: TensorMeta
    index: tuple[slice, ...] | None  # None: the whole tensor (B on every mesh dim)


Value = tuple[str, int]  # (producer node, output index)


@dataclass(frozen=True, slots=True)
class Program:
    """One stage's forward of one micro-batch: fill the inputs and the values received from
    earlier stages, run the instructions, return the local loss (None on stages without it) and
    the values later stages need.

    `template` holds the persistent tensors (parameters, buffers, constants) at their slots;
    `steps[k]` runs, then the slots in `frees[k]` are cleared. The loss sits at `loss_slot` in
    layout `loss_layout`; `imports[k]` is the slot of the k-th received value, `exports[k]` of
    the k-th sent one (`stage_boundaries` orders both). `gathers` runs the parameter gathers
    the program takes from it (`micro_batch` names the forward they belong to); after each
    micro-batch's backward, call `gathers.finish_backward(micro_batch)`.
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
    gathers: GatherSchedule | None = None  # parameter gathers run ahead (runtime.prefetch)

    def run(
        self,
        batch: Sequence[torch.Tensor],
        received: Sequence[torch.Tensor] = (),
        micro_batch: int = 0,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        values: Values = list(self.template)
        self._load(values, batch)
        for slot, value in zip(self.imports, received, strict=True):
            values[slot] = value
        scope = self.gathers.forward(micro_batch) if self.gathers else contextlib.nullcontext()
        with scope:
            for step, frees in zip(self.steps, self.frees, strict=True):
                step(values)
                for slot in frees:
                    values[slot] = None
        loss = values[self.loss_slot] if self.loss_slot is not None else None
        return loss, [values[slot] for slot in self.exports]

    def _load(self, values: Values, batch: Sequence[torch.Tensor]) -> None:
        if len(batch) != self.num_inputs:
            raise PlanError(
                f"step() got {len(batch)} input tensors but model `{self.model_name}` takes "
                f"{self.num_inputs}; pass them in forward's order, like the example inputs."
            )
        for loader in self.inputs:
            x = batch[loader.position]
            if tuple(x.shape) != loader.meta.shape or x.dtype != loader.meta.dtype:
                raise PlanError(
                    f"input #{loader.position} of model `{self.model_name}` is "
                    f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)} but the plan was "
                    f"made for {loader.meta!r}; keep the batch shapes of the example inputs "
                    "(or make a plan for the new shapes)."
                )
            values[loader.slot] = x if loader.index is None else x[loader.index]


# ------------------------------------------------------------------------------ signatures
def read_signatures(
    graph: OpGraph, plan: Plan, mesh_shape: tuple[int, ...]
) -> dict[str, NdSignature]:
    """Every node's nd-signature from the plan, checked: same ops, and a signature the rules
    offer for the node on this mesh (a plan edited by hand cannot run something wrong)."""
    missing = [name for name in graph.order if name not in plan.nodes]
    if missing:
        raise PlanError(
            f"the plan has no signature for {len(missing)} node(s) of `{graph.model_name}` "
            f"({', '.join(missing[:5])}); it was made for another model: make a new plan."
        )
    out: dict[str, NdSignature] = {}
    for name, attrs in graph.nodes():
        node_plan = plan.nodes[name]
        sig = NdSignature(
            tuple(parse_nd_sbp(s) for s in node_plan.inputs),
            tuple(parse_nd_sbp(s) for s in node_plan.outputs),
        )
        if node_plan.op != attrs["op"] or sig not in nd_signatures(attrs, mesh_shape):
            raise PlanError(
                f"the plan gives node {name!r} ({attrs['op']}, module "
                f"`{attrs['module_path'] or '<top>'}`) the signature {sig!r} for op "
                f"{node_plan.op}, which its rule does not offer on mesh {mesh_shape}; the plan "
                "was edited or made by another autosbp version: make it again."
            )
        out[name] = sig
    return out


# ------------------------------------------------------------------------------ building
@dataclass
class _Builder:
    """Assigns slots and emits instructions in program order."""

    graph: OpGraph
    signatures: Mapping[str, NdSignature]
    mesh: Mesh
    coords: tuple[int, ...]
    boxer: Boxer
    device: torch.device
    slots: dict[tuple[str, int], int] = dataclasses.field(default_factory=dict)
    boxed: dict[tuple[str, int, NdSbp], int] = dataclasses.field(default_factory=dict)
    steps: list[Instruction] = dataclasses.field(default_factory=list)
    reads: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    writes: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    owners: list[str] = dataclasses.field(default_factory=list)  # the node each step serves
    template: list[Any] = dataclasses.field(default_factory=list)
    param_boxes: list[ParamBox] = dataclasses.field(default_factory=list)
    current: str = ""

    def new_slot(self, value: Any = None) -> int:
        self.template.append(value)
        return len(self.template) - 1

    def layout(self, node: str, index: int) -> NdSbp:
        return self.signatures[node].outputs[index]

    def source(self, consumer: str, index: int, want: NdSbp, pinned: frozenset[int]) -> int:
        """The slot holding input `index` of `consumer` in layout `want` (boxing it if needed;
        refused for a `pinned` input: the planner never boxes one, a hand-edited plan may)."""
        found = self.graph.producers(consumer)[index]
        assert found is not None, f"{consumer}: input {index} has no producer"
        node, out = found
        have = self.layout(node, out)
        if have == want:
            return self.slots[(node, out)]
        if index in pinned:
            raise PlanError(
                f"the plan boxes input {index} of node {consumer!r} "
                f"({self.graph.graph.nodes[consumer]['op']}) from {format_nd_sbp(have)} to "
                f"{format_nd_sbp(want)}, but that input leads to an in-place write: a boxed copy "
                "would take the write away from the tensor read afterwards. The planner never "
                "does this; the plan was edited or made by another autosbp version: make it again."
            )
        key = (node, out, want)
        if key not in self.boxed:
            attrs = self.graph.graph.nodes[node]
            meta = attrs["outputs"][out]
            box = self.boxer.chain(have, want, meta.shape, meta.dtype)
            src, dst = self.slots[(node, out)], self.new_slot()
            steps = self.boxer.steps(have, want, meta.shape, meta.dtype)
            if attrs["role"] is Role.PARAMETER and has_collective(steps):
                block = self.graph.graph.nodes[consumer]["block"]
                self.param_boxes.append(
                    ParamBox(len(self.steps), attrs["name"], src, dst, block, steps)
                )
            self.emit(box_instruction(box, src, dst), (src,), (dst,))
            self.boxed[key] = dst
        return self.boxed[key]

    def emit(self, step: Instruction, reads: tuple[int, ...], writes: tuple[int, ...]) -> None:
        self.owners.append(self.current)
        self.steps.append(step)
        self.reads.append(reads)
        self.writes.append(writes)

    def add_compute(self, name: str, attrs: Mapping[str, Any]) -> None:
        self.current = name
        sig = self.signatures[name]
        pinned = pinned_inputs(self.graph, name)
        ins = tuple(self.source(name, i, want, pinned) for i, want in enumerate(sig.inputs))
        ins = tuple(
            self.own_copy(slot)
            if i in mutated_inputs(attrs) and self.is_boxed(name, i, slot)
            else slot
            for i, slot in enumerate(ins)
        )
        outs = tuple(self.new_slot() for _ in attrs["outputs"])
        for index, slot in enumerate(outs):
            self.slots[(name, index)] = slot
        op = local_op(attrs, sig, self.mesh.shape, self.coords)
        op = dataclasses.replace(  # the graph's RUN_DEVICE (factory ops, `.to(device)`) is ours
            op,
            args=run_device(op.args, self.device),
            kwargs=run_device(dict(op.kwargs), self.device),
        )
        self.emit(compute_instruction(op, ins, outs), ins, outs)
        for index in mutated_inputs(attrs):
            self.write_back(name, index, ins[index])

    def is_boxed(self, consumer: str, index: int, slot: int) -> bool:
        node, out = self.graph.producers(consumer)[index]  # type: ignore[misc]
        return slot != self.slots[(node, out)]

    def own_copy(self, slot: int) -> int:
        """A fresh copy of a boxed buffer for an op to write into: the boxing may return a view
        of the buffer (a slice), and the write-back's copy into the buffer would then change a
        tensor autograd saved (batch norm saves its running statistics)."""
        dst = self.new_slot()
        self.emit(clone_instruction(slot, dst), (slot,), (dst,))
        return dst

    def write_back(self, consumer: str, index: int, copy: int) -> None:
        """After `consumer` wrote into input `index`: if that input was a boxed copy of a buffer,
        box the copy back to the buffer's layout and copy it into the buffer."""
        node, out = self.graph.producers(consumer)[index]  # type: ignore[misc]
        target = self.slots[(node, out)]
        if copy == target:
            return  # the op wrote into the buffer itself
        attrs = self.graph.graph.nodes[node]
        assert attrs["role"] is Role.BUFFER, (
            f"{consumer}: a boxed write into {node} (pinned_inputs)"
        )
        meta = attrs["outputs"][0]
        want = self.signatures[consumer].inputs[index]
        box = self.boxer.chain(want, self.layout(node, out), meta.shape, meta.dtype)
        self.emit(write_back_instruction(box, copy, target), (copy,), ())


def stage_boundaries(
    graph: OpGraph, stage_of: Mapping[str, int] | None
) -> dict[tuple[int, int], list[Value]]:
    """(sending stage, receiving stage) -> the values it carries, in graph order: every output
    of a non-input node read on a later stage (user inputs are read by each stage itself)."""
    out: dict[tuple[int, int], list[Value]] = {}
    if stage_of is None:
        return out
    for name in graph.order:
        if graph.graph.nodes[name]["role"] is Role.INPUT:
            continue
        readers: dict[tuple[int, int], None] = {}
        for v in graph.graph.successors(name):
            if stage_of[v] != stage_of[name]:
                for out_idx, _ in graph.graph.edges[name, v]["uses"]:
                    readers[(stage_of[v], out_idx)] = None
        for reader, out_idx in sorted(readers):
            out.setdefault((stage_of[name], reader), []).append((name, out_idx))
    return out


def build_program(
    graph: OpGraph,
    signatures: Mapping[str, NdSignature],
    state: Mapping[str, torch.Tensor],
    coords: tuple[int, ...],
    boxer: Boxer,
    *,
    stage_of: Mapping[str, int] | None = None,
    stage: int = 0,
    recompute: str = "none",
    gathering: GatherSetup | None = None,
) -> Program:
    """This rank's program for `stage` (every node when `stage_of` is None). `state` maps every
    parameter/buffer/constant name of the stage to this rank's local tensor in its plan layout.
    `recompute` (a plan's mode) wraps each run of recomputed steps in activation checkpointing.
    With `gathering`, parameter gathers run through a `GatherSchedule` (`runtime.prefetch`)."""
    device = next(iter(state.values())).device if state else torch.device("cpu")
    mesh = boxer.mesh
    builder = _Builder(graph, signatures, mesh, coords, boxer, device)
    here = _stage_nodes(graph, stage_of, stage)
    boundaries = stage_boundaries(graph, stage_of)
    imports = [
        builder.slots.setdefault(value, builder.new_slot())
        for (src, dst), values in sorted(boundaries.items())
        if dst == stage
        for value in values
    ]
    inputs: list[InputLoader] = []
    loss: tuple[int, NdSbp] | None = None
    for position, (name, attrs) in enumerate(graph.nodes(Role.INPUT)):
        if name in here:
            slot = builder.new_slot()
            builder.slots[(name, 0)] = slot
            meta, layout = attrs["outputs"][0], builder.layout(name, 0)
            inputs.append(
                InputLoader(position, slot, meta, _input_index(meta, layout, mesh, coords))
            )
    for name, attrs in graph.nodes():
        role = attrs["role"]
        if name not in here or role is Role.INPUT:
            continue
        if role in (Role.PARAMETER, Role.BUFFER):
            builder.slots[(name, 0)] = builder.new_slot(state[attrs["name"]])
        elif role is Role.OUTPUT:
            node, out = graph.producers(name)[0]  # type: ignore[misc]
            loss = (builder.slots[(node, out)], builder.layout(node, out))
        else:
            builder.add_compute(name, attrs)
    exports = [
        builder.slots[value]
        for (src, dst), values in sorted(boundaries.items())
        if src == stage
        for value in values
    ]
    keep = {*exports, *_persistent(builder.template)} | ({loss[0]} if loss else set())
    frees = _last_uses(builder.reads, builder.writes, keep)
    runs = _recompute_runs(builder, recompute)
    gathers = _schedule_gathers(builder, runs, set(exports), state, gathering)
    steps, frees = _checkpointed(builder, frees, keep, runs)
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
    )


def _schedule_gathers(
    builder: _Builder,
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


def _recompute_runs(builder: _Builder, recompute: str) -> list[tuple[int, int]]:
    """The runs [start, end) of steps that serve one run of recomputed nodes
    (`planner.pipeline.recompute_runs`: what the planner prices is what is checkpointed)."""
    owned = recompute_runs(builder.graph, recompute)

    def group(k: int) -> int | None:
        return owned.get(builder.owners[k]) if builder.owners[k] else None

    runs = []
    k, n = 0, len(builder.steps)
    while k < n:
        run = group(k)
        end = k + 1
        while run is not None and end < n and group(end) == run:
            end += 1
        if run is not None:
            runs.append((k, end))
        k = end
    return runs


def _checkpointed(
    builder: _Builder,
    frees: tuple[tuple[int, ...], ...],
    keep: set[int],
    runs: Sequence[tuple[int, int]],
) -> tuple[tuple[Instruction, ...], tuple[tuple[int, ...], ...]]:
    """The steps with each of the `runs` replaced by one checkpointed step: its inputs are
    saved, what it computes is dropped after forward and recomputed in backward."""
    starts = dict(runs)
    steps: list[Instruction] = []
    out_frees: list[tuple[int, ...]] = []
    k, n = 0, len(builder.steps)
    while k < n:
        if k not in starts:
            steps.append(builder.steps[k])
            out_frees.append(frees[k])
            k += 1
            continue
        end = starts[k]
        written = {s for j in range(k, end) for s in builder.writes[j]}
        read = {s for j in range(k, end) for s in builder.reads[j]}
        persistent = _persistent(builder.template)
        ins = tuple(sorted(read - written - persistent))
        later = {s for j in range(end, n) for s in builder.reads[j]} | keep
        outs = tuple(sorted(written & later))
        inner = tuple(tuple(s for s in frees[j] if s not in outs) for j in range(k, end))
        steps.append(
            checkpoint_instruction(
                builder.steps[k:end], inner, ins, outs, builder.template, persistent
            )
        )
        out_frees.append(tuple(s for j in range(k, end) for s in frees[j] if s in set(ins)))
        k = end
    return tuple(steps), tuple(out_frees)


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


def _persistent(template: Sequence[Any]) -> set[int]:
    return {slot for slot, value in enumerate(template) if value is not None}


def _last_uses(
    reads: Sequence[tuple[int, ...]], writes: Sequence[tuple[int, ...]], keep: set[int]
) -> tuple[tuple[int, ...], ...]:
    """frees[k]: the slots (not in `keep`) last used by instruction k; a slot nothing reads is
    freed right after the instruction that writes it."""
    last: dict[int, int] = {}
    for k, (read, written) in enumerate(zip(reads, writes, strict=True)):
        for slot in (*read, *written):
            last[slot] = k
    frees: list[list[int]] = [[] for _ in reads]
    for slot, k in last.items():
        if slot not in keep:
            frees[k].append(slot)
    return tuple(tuple(f) for f in frees)
