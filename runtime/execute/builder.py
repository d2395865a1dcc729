"""Building a program: slots, instructions and frees, emitted in graph order.

Lives here: `ProgramBuilder` (assigns each value a slot, emits each node's input boxings, local
kernel and buffer write-backs as instructions, and remembers which slots each reads and writes
and which parameter boxings hold a collective) and `last_uses` (when each slot can be freed).
Lives elsewhere: what to build and the `Program` built (`runtime.execute.program`), the
instructions themselves (`runtime.execute.instructions`), recomputed runs
(`runtime.execute.recompute_runs`), the local kernels (`autosbp.rules.local_op`; a kernel that
communicates inside the op gets this rank's `runtime.execute.op_comm.GroupComm`).

Invariants:
- Each boxing is emitted right before its first consumer, and a producer output boxed to one
  layout is boxed once, whatever the number of consumers that need that layout; except for an
  input the plan re-gathers in backward (`NodePlan.regathered`), whose copy is its consumer's
  own (`runtime.parallel.regather` registers it), as the planner prices it: one conversion per
  edge, kept or re-gathered by its consumer alone; a linear re-gathers its activation beside
  its input-gradient matmul (`Regathers.beside_input_gradient`).
- An op that writes into a buffer input that was boxed for it writes into a copy of its own,
  boxed back and copied into the buffer right after the op. Boxing into any other in-place
  write (`autosbp.rules.pinned_inputs`) is refused: the planner never plans it.
- The graph's RUN_DEVICE (factory ops, `.to(device)`) is this rank's device.
- A node with a training flag (dropout, batch norm) runs its eval-mode form inside
  `runtime.execute.instructions.evaluating()` (`autosbp.rules.in_eval_mode`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autosbp.boxing.params import has_collective
from autosbp.boxing.steps import BoxingStep
from autosbp.capturing.graph import OpGraph, OpNode, Role, run_device
from autosbp.errors import PlanError
from autosbp.overlap import regathers_beside_input_gradient
from autosbp.rules import (
    LocalOp,
    MeanOverTargets,
    NdSignature,
    in_eval_mode,
    kept_targets,
    local_op,
    mean_over_targets,
    mutated_inputs,
    pinned_inputs,
)
from autosbp.sbp import Mesh, NdSbp, format_nd_sbp
from autosbp.tp_overlap import chunk_plan, fits, reduce_step
from runtime.execute.instructions import (
    Boxer,
    Instruction,
    TensorFn,
    Values,
    box_instruction,
    by_mode,
    clone_instruction,
    compute_instruction,
    write_back_instruction,
)
from runtime.execute.op_comm import GroupComm
from runtime.parallel.gathers import ParamBox
from runtime.parallel.regather import Regathers
from runtime.parallel.tp_overlap import overlapped_instruction

__all__ = ["ProgramBuilder", "last_uses"]


@dataclass
class ProgramBuilder:
    """Assigns slots and emits instructions in program order."""

    graph: OpGraph
    signatures: Mapping[str, NdSignature]
    mesh: Mesh
    coords: tuple[int, ...]
    boxer: Boxer
    device: torch.device
    comm: GroupComm | None = None  # collectives inside ops (`autosbp.rules.comm`)
    # A mixed recipe's gradient sum dtype for parameter boxings (None: the weights' own)
    param_grad_dtype: torch.dtype | None = None
    slots: dict[tuple[str, int], int] = dataclasses.field(default_factory=dict)
    # (producer, output, layout, consumer: its own copy where it re-gathers it, else "")
    boxed: dict[tuple[str, int, NdSbp, str], int] = dataclasses.field(default_factory=dict)
    steps: list[Instruction] = dataclasses.field(default_factory=list)
    reads: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    writes: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    owners: list[str] = dataclasses.field(default_factory=list)  # the node each step serves
    template: list[Any] = dataclasses.field(default_factory=list)
    param_boxes: list[ParamBox] = dataclasses.field(default_factory=list)
    # Per mean cross-entropy over class indices: the slot of its micro-batch's kept-target
    # count, and its target's size (the count when nothing is ignored)
    counts: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    current: str = ""
    # The inputs the plan re-gathers in backward, per consumer (`NodePlan.regathered`), and
    # what registers their copies (`runtime.parallel.regather`; None where there are none)
    regathered: Mapping[str, frozenset[int]] = dataclasses.field(default_factory=dict)
    regathers: Regathers | None = None
    # The ops the plan overlaps with the reduction of their output, and their chunks
    # (`NodePlan.overlap_chunks`, `runtime.parallel.tp_overlap`)
    overlapped: Mapping[str, int] = dataclasses.field(default_factory=dict)

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
                f"({self.graph.node(consumer).op}) from {format_nd_sbp(have)} to "
                f"{format_nd_sbp(want)}, but that input leads to an in-place write: a boxed copy "
                "would take the write away from the tensor read afterwards. The planner never "
                "does this; the plan was edited or made by another autosbp version: make it again."
            )
        again = index in self.regathered.get(consumer, ())
        key = (node, out, want, consumer if again else "")  # a re-gathered copy is its own
        if key not in self.boxed:
            attrs = self.graph.node(node)
            meta = attrs.outputs[out]
            grad_dtype = self.param_grad_dtype if attrs.role is Role.PARAMETER else None
            box = self.boxer.chain(have, want, meta.shape, meta.dtype, grad_dtype=grad_dtype)
            src, dst = self.slots[(node, out)], self.new_slot()
            steps = self.boxer.steps(have, want, meta.shape, meta.dtype)
            if again:
                box = self._regathered(consumer, index, attrs, box, steps)
            if attrs.role is Role.PARAMETER and has_collective(steps):
                block = self.graph.node(consumer).block
                self.param_boxes.append(
                    ParamBox(len(self.steps), attrs.name, src, dst, block, steps)
                )
            self.emit(box_instruction(box, src, dst), (src,), (dst,))
            self.boxed[key] = dst
        return self.boxed[key]

    def _regathered(
        self,
        consumer: str,
        index: int,
        producer: OpNode,
        box: TensorFn,
        steps: tuple[BoxingStep, ...],
    ) -> TensorFn:
        """`box`, its copy registered to be converted again in backward (refused where the plan
        states a re-gather that has nothing to convert again: the planner never does)."""
        if producer.role is not Role.COMPUTE or not has_collective(steps):
            raise PlanError(
                f"the plan re-gathers input {index} of node {consumer!r} in backward, but that "
                "input is not an activation reached through a collective; the planner never "
                "does this: the plan was edited or made by another autosbp version: make it again."
            )
        assert self.regathers is not None, "re-gathered inputs without their registry"
        return self.regathers.boxing(box, steps)

    def emit(self, step: Instruction, reads: tuple[int, ...], writes: tuple[int, ...]) -> None:
        self.owners.append(self.current)
        self.steps.append(step)
        self.reads.append(reads)
        self.writes.append(writes)

    def add_compute(self, name: str, attrs: OpNode) -> None:
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
        outs = tuple(self.new_slot() for _ in attrs.outputs)
        for index, slot in enumerate(outs):
            self.slots[(name, index)] = slot
        op = local_op(attrs, sig, self.mesh.shape, self.coords, self.comm)
        op = dataclasses.replace(  # the graph's RUN_DEVICE (factory ops, `.to(device)`) is ours
            op,
            args=run_device(op.args, self.device),
            kwargs=run_device(dict(op.kwargs), self.device),
        )
        if name in self.overlapped:
            self.emit_overlapped(name, attrs, op, ins, outs)
            return
        if any(regathers_beside_input_gradient(attrs.op, i) for i in self.regathered.get(name, ())):
            assert self.regathers is not None, "re-gathered inputs without their registry"
            op = self.regathers.beside_input_gradient(op)
        run = compute_instruction(op, ins, outs)
        evaluated = in_eval_mode(attrs, op)
        if evaluated is not None:
            run = by_mode(run, compute_instruction(evaluated, ins, outs))
        self.emit(run, ins, outs)
        for index in mutated_inputs(attrs):
            self.write_back(name, index, ins[index])
        mean = mean_over_targets(attrs)
        if mean is not None:
            self.count_kept(mean, ins, attrs.inputs[mean.target].numel)

    def emit_overlapped(
        self, name: str, attrs: OpNode, op: LocalOp, ins: tuple[int, ...], outs: tuple[int, ...]
    ) -> None:
        """`name` in chunks with its output's one conversion overlapped (`runtime.parallel.
        tp_overlap`): the converted copy is the boxing its reader finds (refused where the plan
        states an overlap the runtime cannot run: the planner never does)."""
        readers = [(v, i) for v in self.graph.readers(name) for _, i in self.graph.uses(name, v)]
        chunks = self.overlapped[name]
        want = self.signatures[readers[0][0]].inputs[readers[0][1]] if len(readers) == 1 else None
        meta = attrs.outputs[0]
        have = self.layout(name, 0)
        step = None if want is None else reduce_step(self.boxer.steps(have, want, meta.shape))
        cut = chunk_plan(attrs, self.signatures[name], self.mesh.shape, chunks)
        if step is None or cut is None or not fits(cut, step) or self.comm is None:
            raise PlanError(
                f"the plan overlaps node {name!r} ({attrs.op}) with its output's reduction in "
                f"{chunks} chunks, but that output is not one matmul's partial sums read once "
                "through one all-reduce or reduce-scatter, cut along a dim it does not split; the "
                "planner never does this: the plan was edited or made by another autosbp "
                "version: make it again."
            )
        assert want is not None, "a reduction without its layout"
        dst = self.new_slot()
        self.emit(overlapped_instruction(op, cut, step, self.comm, ins, dst), ins, (*outs, dst))
        self.boxed[(name, 0, want, "")] = dst

    def count_kept(self, mean: MeanOverTargets, ins: tuple[int, ...], size: int) -> None:
        """The kept targets of a mean cross-entropy's micro-batch into a slot of their own (its
        target is whole on every device: `autosbp.rules.loss`), for the loss weights."""
        target, weight = ins[mean.target], None if mean.weight is None else ins[mean.weight]
        slot = self.new_slot()

        def count(values: Values) -> None:
            classes = None if weight is None else values[weight]
            with torch.no_grad():
                values[slot] = kept_targets(values[target], classes, mean.ignore_index)

        reads = (target,) if weight is None else (target, weight)
        self.emit(count, reads, (slot,))
        self.counts.append((slot, size))

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
        attrs = self.graph.node(node)
        assert attrs.role is Role.BUFFER, f"{consumer}: a boxed write into {node} (pinned_inputs)"
        meta = attrs.outputs[0]
        want = self.signatures[consumer].inputs[index]
        box = self.boxer.chain(want, self.layout(node, out), meta.shape, meta.dtype)
        self.emit(write_back_instruction(box, copy, target), (copy,), ())

    def persistent_slots(self) -> set[int]:
        """The slots the template fills (parameters, buffers, constants): never freed."""
        return {slot for slot, value in enumerate(self.template) if value is not None}


def last_uses(
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
