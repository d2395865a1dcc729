"""Recomputation as the program runs it: runs of recomputed steps, each one checkpointed step.

Lives here: `recompute_runs` (the maximal runs of steps that serve the plan's recomputed nodes
of one block: their input boxings and kernels) and `checkpointed` (the steps with each run
replaced by one activation-checkpointed step). Lives elsewhere: which nodes are recomputed
(the plan: `autosbp.plan.recomputed_nodes`), the checkpointed instruction
(`runtime.execute.instructions.checkpoint_instruction`), the steps (`runtime.execute.builder`).

Invariants: a run never spans two blocks; a checkpointed step saves its inputs (the slots it
reads that it does not write, parameters and buffers aside), drops what it computes after
forward and computes it again in backward; it hands on only the slots read after it (or kept),
and frees its inputs where the steps it replaces freed them.
Reference: torch.utils.checkpoint; Chen et al. 2016, "Training Deep Nets with Sublinear Memory
Cost".
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.execute.builder import ProgramBuilder
from runtime.execute.instructions import Instruction, checkpoint_instruction

__all__ = ["checkpointed", "recompute_runs"]


def recompute_runs(builder: ProgramBuilder, recomputed: frozenset[str]) -> list[tuple[int, int]]:
    """The maximal runs [start, end) of steps that serve recomputed nodes of one block (the
    plan names the nodes; a node's steps are its input boxings and its kernel)."""

    def group(k: int) -> int | None:
        owner = builder.owners[k]
        return builder.graph.node(owner).block if owner in recomputed else None

    runs = []
    k, n = 0, len(builder.steps)
    while k < n:
        block = group(k)
        end = k + 1
        while block is not None and end < n and group(end) == block:
            end += 1
        if block is not None:
            runs.append((k, end))
        k = end
    return runs


def checkpointed(
    builder: ProgramBuilder,
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
        persistent = builder.persistent_slots()
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
