"""The closures a rank's program runs every step: op kernels, boxings, buffer write-backs.

Lives here: `Boxer` (plans a boxing chain once and returns the closure that runs it, dropping
relabels), the instruction makers (`compute_instruction`, `box_instruction`,
`take_instruction`, `clone_instruction`, `write_back_instruction`, `checkpoint_instruction`)
that read and write a step's slot list, and `evaluating` (the mode in which a kernel with a
training flag runs its `autosbp.rules.in_eval_mode` form: `by_mode`). Lives elsewhere: which closures a program holds and in
what order (`runtime.execute.program`, `runtime.execute.builder`), the collectives
(`runtime.execute.collectives`), parameter gathers run ahead (`runtime.parallel.prefetch`), the
local kernels (`autosbp.rules.local_op`).

Invariants:
- Everything that does not depend on the step's tensors is computed when a closure is made:
  the chain of steps, the argument template of an op and the slots its tensors come from.
- A step on a mesh dim of one device (a relabel: its piece is the whole tensor before and after)
  is dropped; a chain of only relabels is the identity. So a one-process plan runs no boxing.
- A kernel gives the same results as `LocalOp.__call__`; the fast path only precomputes where
  the tensor arguments go (ops with tensors inside lists or keywords keep `LocalOp.__call__`).
- The mode is read when an instruction runs (programs run on the caller's thread): training
  unless inside `evaluating()`.
Reference: docs/architecture.md ("Contracts between the parts": boxing steps as autograd-aware
collectives).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

from autosbp.boxing import plan_boxing
from autosbp.boxing.steps import BoxingStep, StepKind
from autosbp.capturing.graph import InputRef
from autosbp.rules import LocalOp
from autosbp.rules.core import as_tuple
from autosbp.sbp import Mesh, NdSbp
from runtime.execute.collectives import execute_boxing, execute_boxing_summed_in, run_step
from runtime.execute.groups import ProcessGroups

__all__ = [
    "Boxer",
    "Instruction",
    "TensorFn",
    "Values",
    "box_instruction",
    "by_mode",
    "checkpoint_instruction",
    "clone_instruction",
    "compute_instruction",
    "evaluating",
    "take_instruction",
    "write_back_instruction",
]

Values = list[Any]  # slot -> local tensor (None once dead)
Instruction = Callable[[Values], None]
TensorFn = Callable[[torch.Tensor], torch.Tensor]

_EVALUATING: ContextVar[bool] = ContextVar("evaluating", default=False)


@contextmanager
def evaluating() -> Iterator[None]:
    """Programs run inside run as under `nn.Module.eval()` (`by_mode`)."""
    token = _EVALUATING.set(True)
    try:
        yield
    finally:
        _EVALUATING.reset(token)


def by_mode(training: Instruction, evaluation: Instruction) -> Instruction:
    """`evaluation` inside `evaluating()`, else `training`."""

    def run(values: Values) -> None:
        (evaluation if _EVALUATING.get() else training)(values)

    return run


@dataclass(frozen=True, slots=True)
class Boxer:
    """Boxing on one mesh through its process groups (autograd-aware; run under no_grad for
    gradient and state syncs)."""

    mesh: Mesh
    groups: ProcessGroups

    def chain(
        self,
        src: NdSbp,
        dst: NdSbp,
        shape: tuple[int, ...],
        dtype: torch.dtype = torch.float32,
        *,
        donate: bool = False,
        grad_dtype: torch.dtype | None = None,
    ) -> TensorFn:
        """The closure taking this rank's piece in layout `src` to its piece in `dst`. With
        `donate` it runs without autograd and may reuse its input's memory (the caller must not
        read the input afterwards): for buffers made to be synced, like gradient buckets. With
        `grad_dtype` its backward sums in that dtype (a mixed recipe's weight gathers)."""
        steps = self.steps(src, dst, shape, dtype)
        if not steps:
            return _identity
        groups = self.groups
        if donate:
            return lambda x: _run_donated(x, steps, groups)
        if grad_dtype is not None and grad_dtype != dtype:
            return lambda x: execute_boxing_summed_in(x, steps, groups, grad_dtype)
        return lambda x: execute_boxing(x, steps, groups)

    def steps(
        self, src: NdSbp, dst: NdSbp, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
    ) -> tuple[BoxingStep, ...]:
        """The steps of the conversion src -> dst on this mesh, relabels dropped."""
        return tuple(
            step
            for step in plan_boxing(src, dst, shape, self.mesh, dtype=dtype)
            if not _is_relabel(step)
        )


def _run_donated(
    x: torch.Tensor, steps: tuple[BoxingStep, ...], groups: ProcessGroups
) -> torch.Tensor:
    with torch.no_grad():
        for step in steps:
            x = run_step(x, step, groups, donate=True)
    return x


def _is_relabel(step: BoxingStep) -> bool:
    return step.kind is StepKind.LOCAL and step.group_size == 1


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def box_instruction(box: TensorFn, src: int, dst: int) -> Instruction:
    def run(values: Values) -> None:
        values[dst] = box(values[src])

    return run


def take_instruction(take: Callable[[], torch.Tensor], dst: int) -> Instruction:
    """Store a parameter's gathered weight, as the gather schedule hands it over, at `dst`."""

    def run(values: Values) -> None:
        values[dst] = take()

    return run


def clone_instruction(src: int, dst: int) -> Instruction:
    """A copy of the tensor at `src` (no grad: buffers only) into `dst`."""

    def run(values: Values) -> None:
        with torch.no_grad():
            values[dst] = values[src].clone()

    return run


def write_back_instruction(box: TensorFn, copy: int, target: int) -> Instruction:
    """Box the written copy back to the buffer's layout and copy it into the buffer."""

    def run(values: Values) -> None:
        with torch.no_grad():
            values[target].copy_(box(values[copy]))

    return run


def compute_instruction(op: LocalOp, ins: tuple[int, ...], outs: tuple[int, ...]) -> Instruction:
    """Run `op` on the tensors at slots `ins` (InputRef order); store its outputs at `outs`."""
    refs = [(pos, arg.index) for pos, arg in enumerate(op.args) if isinstance(arg, InputRef)]
    others = [arg for arg in op.args if not isinstance(arg, InputRef)]
    if op.scale is not None or _holds_ref(others) or _holds_ref(list(op.kwargs.values())):
        return _general_instruction(op, ins, outs)
    fn, template, kwargs = op.fn, list(op.args), dict(op.kwargs)
    binds = [(pos, ins[index]) for pos, index in refs]

    def run(values: Values) -> None:
        args = template.copy()
        for pos, slot in binds:
            args[pos] = values[slot]
        results = as_tuple(fn(*args, **kwargs))
        for slot, result in zip(outs, results, strict=True):
            values[slot] = result

    return run


def _general_instruction(op: LocalOp, ins: tuple[int, ...], outs: tuple[int, ...]) -> Instruction:
    def run(values: Values) -> None:
        results = op([values[slot] for slot in ins])
        for slot, result in zip(outs, results, strict=True):
            values[slot] = result

    return run


def checkpoint_instruction(
    steps: Sequence[Instruction],
    frees: Sequence[tuple[int, ...]],
    ins: tuple[int, ...],
    outs: tuple[int, ...],
    template: Sequence[Any],
    persistent: set[int],
) -> Instruction:
    """`steps` as one activation-checkpointed step (torch.utils.checkpoint, non-reentrant):
    it reads slots `ins` (and persistent ones: parameters, buffers, constants), writes `outs`,
    and in backward runs `steps` again from the saved `ins`. Collectives inside it run again in
    backward too, in the same order on every rank of the stage."""
    size = len(template)
    fixed = [(slot, template[slot]) for slot in sorted(persistent)]

    def segment(*tensors: Any) -> tuple[Any, ...]:
        values: Values = [None] * size
        for slot, value in fixed:
            values[slot] = value
        for slot, value in zip(ins, tensors, strict=True):
            values[slot] = value
        for step, free in zip(steps, frees, strict=True):
            step(values)
            for slot in free:
                values[slot] = None
        return tuple(values[slot] for slot in outs)

    def run(values: Values) -> None:
        results = torch.utils.checkpoint.checkpoint(
            segment, *(values[slot] for slot in ins), use_reentrant=False
        )
        for slot, value in zip(outs, results, strict=True):
            values[slot] = value

    return run


def _holds_ref(values: Sequence[Any]) -> bool:
    for value in values:
        if isinstance(value, InputRef):
            return True
        if isinstance(value, list | tuple | dict):
            items = value.values() if isinstance(value, dict) else value
            if _holds_ref(list(items)):
                return True
    return False
