"""Why no plan exists: what a search saw of the configurations it could not use, as one message.

Lives here: `Refusals` (what a search records while it runs: configurations refused outright,
nodes without a candidate, and the configuration whose memory came closest to fitting) and its
message. Lives elsewhere: the search that records them (`search`), the error class
(`errors.NoFitError`).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from autosbp.capturing.graph import OpGraph
from autosbp.plan import format_bytes
from autosbp.planner.ilp.solvers import MEMORY_SLACK
from autosbp.planner.ilp.solving import least_memory_share
from autosbp.planner.problem.build import MeshProblem


@dataclass
class Refusals:
    """What the search could not use, recorded as it goes (kept small: one problem at most)."""

    refused: list[str] = field(default_factory=list)  # whole stage counts or micro-batch counts
    stuck: dict[str, str] = field(default_factory=dict)  # node label -> its shape
    least_bytes: float = math.inf  # over built problems, the least floor of their tightest stage
    least: MeshProblem | None = None  # the problem with that floor
    built: int = 0  # problems built

    def refuse(self, why: str) -> None:
        if why not in self.refused:
            self.refused.append(why)

    def no_candidates(self, graph: OpGraph, names: list[str]) -> None:
        """Nodes that could take no signature in some configuration (the first three)."""
        for name in names:
            if len(self.stuck) < 3:
                shape = graph.node(name).outputs[0].shape
                self.stuck.setdefault(_label(graph, name), "x".join(map(str, shape)))

    def overflows(self, mp: MeshProblem) -> bool:
        """Does some stage of `mp` overflow with each node at its fewest bytes? Remembers the
        problem that comes closest to fitting."""
        self.built += 1
        floors = [_floor_bytes(mem) for mem in mp.problem.memory]
        if not floors:
            return False
        need = max(floors)
        if need < self.least_bytes:
            self.least_bytes, self.least = need, mp
        return any(f > mem.limit_bytes for f, mem in zip(floors, mp.problem.memory, strict=True))

    def message(self, limit: float | None, gathers: bool = True, chunks: int = 1) -> str:
        """Why nothing fits: the least memory any plan could need, and what takes it; without
        `gathers` (a space that forbids parameter gathers: `space.strategy.Space.may_gather`), that
        a weight some op cannot read in its stored layout may be the cause. `chunks`: model
        chunks per device (interleaved, vp), which share its `limit` (`problem.build.
        memory_constraints`): the message says so."""
        if not self.built and not self.stuck and self.refused:
            return "; ".join(self.refused)
        stuck = ", ".join(f"{label} (shape {shape})" for label, shape in self.stuck.items())
        mp = self.least
        if limit is not None and mp is not None and self.least_bytes <= limit:
            # the floor fits; the closest configuration's LP says whether memory still binds
            share = least_memory_share(mp.problem, time_limit_s=30.0)
            if share is not None and math.isfinite(share) and share > 1 - MEMORY_SLACK:
                return _memory_message(mp, limit, chunks, share * limit, "every")
        if limit is None or mp is None or self.least_bytes <= limit:  # memory is not the cause
            return (
                "no plan exists for this model on these devices: "
                + (
                    f"{stuck} can take no signature on the meshes tried"
                    if stuck
                    else "no consistent choice of signatures, though the memory fits"
                )
                + " (a batch, or another dim, that the devices do not divide evenly?). Use a "
                "batch the data-parallel degree divides, other degrees, or another device count."
                + (f" Also: {'; '.join(self.refused)}." if self.refused else "")
                + ("" if gathers else NO_GATHERS)
            )
        return _memory_message(mp, limit, chunks)


NO_GATHERS = (
    " This space gathers no parameter (a Megatron layout computes on its stored pieces, and "
    "the runtime gathers none beside interleaving or zero bubble): a weight that some op "
    "cannot read in the layout it is stored in has no plan here. Try auto (which may gather), "
    "or vp=1 and schedule 1f1b."
)


def _memory_message(
    mp: MeshProblem,
    limit: float,
    chunks: int,
    need_bytes: float | None = None,
    which: str = "even the most sharded",
) -> str:
    """Nothing fits `limit` (a device's): `need_bytes` (default the tightest device's floor,
    each node at its fewest bytes; else what the LP proves) is the least `which` plan of `mp`'s
    configuration needs."""
    tightest = max(mp.problem.memory, key=_floor_bytes)
    per_node = {v: float(np.min(b)) for v, b in tightest.bytes_per_candidate.items() if len(b)}
    top = sorted(per_node.items(), key=lambda kv: -kv[1])[:5]
    tied = Counter(mp.representative.values())
    consumers = ", ".join(
        f"{_label(mp.graph, v)}{f' (and {tied[v] - 1} tied copies)' if tied[v] > 1 else ''} "
        f"{format_bytes(b)}"
        for v, b in top
        if b > 0
    )
    need = format_bytes(_floor_bytes(tightest) if need_bytes is None else need_bytes)
    budget, stages = f"{format_bytes(limit)} per device", "stage(s)"
    if chunks > 1:  # interleaved: a device's chunks share its memory
        budget += f" (the {chunks} model chunks it interleaves together, vp={chunks})"
        stages = f"virtual stage(s), {chunks} per device"
    return (
        f"no plan fits in {budget}: {which} plan (mesh "
        f"{'x'.join(map(str, mp.mesh.shape))}, {mp.split.num_stages} {stages}, "
        f"{mp.micro_batches} micro-batch(es), recompute {mp.recompute}) needs at least "
        f"{need} per device ({tightest.name}). The biggest consumers there: {consumers}. Raise "
        "--memory-gib, use more devices, a smaller batch, or an optimizer with fewer states "
        "(sgd)."
    )


def _floor_bytes(mem) -> float:
    """The least bytes of a memory constraint: each node at its fewest, plus its constant."""
    least = sum(float(np.min(b)) for b in mem.bytes_per_candidate.values() if len(b))
    return least + mem.constant_bytes


def _label(graph: OpGraph | None, node: str) -> str:
    if graph is None:
        return node
    attrs = graph.node(node)
    return attrs.name or attrs.module_path or node
