"""Boxing time between two layouts of a tensor on a mesh, cached: the edges' prices.

Lives here: `Prices` (what the planner needs from a hardware profile; costmodel's `Cluster`
provides it) and `BoxingPricer` (a chain's time from the profile's collective prices, cached
by layout, shape and dtype; a gradient's share of a fused bucket). Lives elsewhere: the chains
(`autosbp.boxing`), the node and edge prices built on these (`timing.candidates`), communication
inside an op (`timing.op_exchanges`), the hardware numbers (`costmodel.prices`).

Invariants: a price depends only on its key (the pricer's mesh and prices are fixed); a
conversion with no chain is forbidden (an infinite price); a LOCAL step is free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np
import torch

from autosbp.boxing import StepPrice, canonical_shape, price_boxing
from autosbp.boxing.steps import BoxingStep, StepKind, dual_nd_sbp
from autosbp.capturing.graph import TensorMeta
from autosbp.errors import SbpError
from autosbp.sbp import Mesh, NdSbp

__all__ = ["BoxingPricer", "Prices"]


class Prices(Protocol):
    """What the planner needs from a hardware profile (costmodel's cluster provides it)."""

    def op_time_s(
        self, flops: float, nbytes: float, dtype: torch.dtype, transcendentals: float = 0.0
    ) -> float: ...

    def collective_time_s(
        self, kind: str, message_bytes: float, group_size: int, link_class: str
    ) -> float: ...

    def p2p_time_s(self, nbytes: float, link_class: str) -> float: ...

    @property
    def overlap_efficiency(self) -> float:
        """The fraction of communication time that running beside compute hides, in [0, 1]."""
        ...

    @property
    def causal_skip(self) -> float:
        """The fraction of a causal attention's masked scores the kernel skips, in [0, 1]."""
        ...


class BoxingPricer:
    """Boxing time between two layouts of one tensor on a mesh, cached: a GPT-3 search asks for
    ~440k prices and only ~55k differ (profiled; edges repeat tensors between the same layouts).

    Caches, each keyed by all its value depends on besides the pricer's fixed mesh and prices:
    - layouts interned as small ints (`layout_id`, with each one's dual), so keys hash fast;
    - per (src, dst, canonical shape, dtype), the chain: one plan per divisibility pattern, its
      step bytes scaled to each tensor's (exact: they are the tensor's bytes over an integer);
    - per (src, dst, shape, dtype), the price (`time_s`); per `StepPrice`, a step's;
    - per (distinct src layouts, distinct dst layouts, shape, dtype), an edge use's forward and
      backward tables (`tables`), shared by every edge that carries such a tensor;
    - per (distinct src layouts, distinct dst layouts, direction, chain key), a table's chains
      as its distinct steps (`_TableSteps`): a tensor of another micro-batch size with the same
      divisibility prices each distinct step once at its bytes and sums them per pair, in
      chain order (the sum `_steps_time_s` makes, so the same floats).
    """

    def __init__(self, prices: Prices, mesh: Mesh) -> None:
        self.prices = prices
        self.mesh = mesh
        self._ids: dict[NdSbp, int] = {}
        self._layouts: list[NdSbp] = []  # by id
        self._duals: list[int | None] = []  # by id: the id of the dual layout, once asked
        # per chain key (`_chain_key`), then per (src, dst): a tensor's pairs hash two ints
        self._chains: dict[tuple, dict[tuple[int, int], tuple[tuple[StepPrice, ...], int] | None]]
        self._chains = {}
        self._times: dict[tuple[tuple[int, ...], torch.dtype], dict[tuple[int, int], float]] = {}
        self._step_times: dict[StepPrice, float] = {}
        self._tables: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._table_steps: dict[tuple, _TableSteps] = {}

    def time_s(self, src: NdSbp, dst: NdSbp, meta: TensorMeta) -> float:
        return self._pair_time_s(self.layout_id(src), self.layout_id(dst), meta.shape, meta.dtype)

    def layout_id(self, nd_sbp: NdSbp) -> int:
        """A small int standing for `nd_sbp` in this pricer's caches."""
        found = self._ids.get(nd_sbp)
        if found is None:
            found = self._ids[nd_sbp] = len(self._layouts)
            self._layouts.append(nd_sbp)
            self._duals.append(None)
        return found

    def tables(
        self, src_ids: tuple[int, ...], dst_ids: tuple[int, ...], meta: TensorMeta
    ) -> tuple[np.ndarray, np.ndarray]:
        """Read-only [i, j] boxing times of the tensor `meta` from layout src_ids[i] to
        dst_ids[j] (forward), and from dual(dst_ids[j]) to dual(src_ids[i]) (its backward)."""
        key = (src_ids, dst_ids, meta.shape, meta.dtype)
        found = self._tables.get(key)
        if found is None:
            found = self._tables[key] = (
                self._table(src_ids, dst_ids, meta, backward=False),
                self._table(src_ids, dst_ids, meta, backward=True),
            )
        return found

    def collectives(
        self, src_ids: tuple[int, ...], dst_ids: tuple[int, ...], meta: TensorMeta
    ) -> np.ndarray:
        """[i, j]: does the chain of `meta` from layout src_ids[i] to dst_ids[j] exchange data
        between devices (`boxing.params.has_collective`: the runtime's test of a gather)? A
        pair without a chain is False here (its price is infinite already)."""
        plan = _TablePlan.of(meta.shape, meta.dtype, self.mesh)

        def collective(src: int, dst: int) -> bool:
            found = None if src == dst else self._planned(src, dst, *plan.planning)
            return found is not None and any(step[0] is not StepKind.LOCAL for step in found[0])

        return np.array([[collective(s, d) for d in dst_ids] for s in src_ids], dtype=bool)

    def _table(
        self, src_ids: tuple[int, ...], dst_ids: tuple[int, ...], meta: TensorMeta, backward: bool
    ) -> np.ndarray:
        plan = _TablePlan.of(meta.shape, meta.dtype, self.mesh)
        key = (src_ids, dst_ids, backward, plan.chain_key)
        steps = self._table_steps.get(key)
        if steps is None:
            steps = self._table_steps[key] = self._steps_of(src_ids, dst_ids, backward, plan)
        scale = 1.0  # a whole tensor: each step at its own bytes (`_steps_time_s`)
        times = [
            self._step_time_s((kind, round(message * plan.nbytes // max(planned, 1) * scale),
                               group, link))
            for kind, message, planned, group, link in steps.steps
        ]  # fmt: skip
        times.append(0.0)  # the padding step: chains shorter than the longest add nothing
        step_times = np.array(times, dtype=float)
        total = np.zeros(len(src_ids) * len(dst_ids))
        for column in steps.at:  # in chain order, as `_steps_time_s` sums (0 + t1) + t2 ...
            total += step_times[column]
        total = total / scale
        total[steps.forbidden] = math.inf
        table = total.reshape(len(src_ids), len(dst_ids))
        table.flags.writeable = False  # shared by every edge use with this key
        return table

    def _steps_of(
        self, src_ids: tuple[int, ...], dst_ids: tuple[int, ...], backward: bool, plan: _TablePlan
    ) -> _TableSteps:
        """The chains of a table's pairs (`_planned` at `plan`'s chain key), as distinct steps
        and, per position in a chain, each pair's step there (`_TableSteps`)."""
        if backward:
            pairs = [(self._dual_id(d), self._dual_id(s)) for s in src_ids for d in dst_ids]
        else:
            pairs = [(s, d) for s in src_ids for d in dst_ids]
        distinct: dict[tuple, int] = {}
        chains: list[list[int]] = []
        forbidden = []
        known = self._chains.get(plan.chain_key, {})  # `_planned`'s own, read without a call
        for k, (src, dst) in enumerate(pairs):
            found = ((), 0) if src == dst else known.get((src, dst), _UNPLANNED)
            if found is _UNPLANNED:
                found = self._planned(src, dst, *plan.planning)
                known = self._chains[plan.chain_key]
            if found is None:
                forbidden.append(k)
                found = ((), 0)
            chain_steps, planned_bytes = cast(tuple[tuple[StepPrice, ...], int], found)
            chains.append(
                [distinct.setdefault((kind, message, planned_bytes, group, link), len(distinct))
                 for kind, message, group, link in chain_steps]
            )  # fmt: skip
        longest = max(map(len, chains), default=0)
        at = np.full((longest, len(pairs)), len(distinct), dtype=int)  # the padding step
        for k, chain in enumerate(chains):
            at[: len(chain), k] = chain
        return _TableSteps(tuple(distinct), at, np.array(forbidden, dtype=int))

    def _dual_id(self, layout: int) -> int:
        dual = self._duals[layout]
        if dual is None:
            dual = self._duals[layout] = self.layout_id(dual_nd_sbp(self._layouts[layout]))
        return dual

    def _pair_time_s(self, src: int, dst: int, shape: tuple[int, ...], dtype: torch.dtype) -> float:
        known = self._times.setdefault((shape, dtype), {})
        found = known.get((src, dst))
        if found is None:
            found = known[(src, dst)] = self._price_pair(src, dst, shape, dtype)
        return found

    def _price_pair(
        self, src: int, dst: int, shape: tuple[int, ...], dtype: torch.dtype, scale: float = 1.0
    ) -> float:
        """The chain src -> dst of this tensor; with `scale`, each step priced at `scale` times
        its bytes and the tensor paying 1 / scale of it (its share of a fused bucket)."""
        if src == dst:
            return 0.0
        planned = self._chain(src, dst, shape, dtype)
        if planned is None:
            return math.inf
        return self._steps_time_s(planned, math.prod(shape) * dtype.itemsize, scale)

    def _steps_time_s(
        self, planned: tuple[tuple[StepPrice, ...], int], nbytes: int, scale: float
    ) -> float:
        """A planned chain's time for a tensor of `nbytes` (steps at `scale` times its share)."""
        steps, planned_bytes = planned
        return (
            sum(
                self._step_time_s(
                    (kind, round(message * nbytes // max(planned_bytes, 1) * scale), group, link)
                )
                for kind, message, group, link in steps
            )
            / scale
        )

    def _chain(
        self, src: int, dst: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[tuple[StepPrice, ...], int] | None:
        """The chain src -> dst planned for the first tensor of `shape`'s divisibility pattern,
        and that tensor's bytes; None where no chain exists (e.g. out of P(max)): forbidden.
        An empty tensor (a dim of 0: HF's empty KV-cache constants) is planned apart: its steps
        move 0 bytes and scale to no other tensor's (0 divides like any size)."""
        return self._planned(src, dst, shape, dtype, _chain_key(shape, dtype, self.mesh))

    def _planned(
        self, src: int, dst: int, shape: tuple[int, ...], dtype: torch.dtype, chain_key: tuple
    ) -> tuple[tuple[StepPrice, ...], int] | None:
        """`_chain`, its key's shape part (`_chain_key`) given."""
        planned = self._chains.setdefault(chain_key, {})
        found = planned.get((src, dst), _UNPLANNED)
        if found is _UNPLANNED:
            try:
                steps = price_boxing(
                    self._layouts[src], self._layouts[dst], shape, self.mesh, dtype
                )
            except SbpError:
                found = planned[(src, dst)] = None
            else:
                found = planned[(src, dst)] = (steps, math.prod(shape) * dtype.itemsize)
        return found  # type: ignore[return-value]

    def bucketed_time_s(self, src: NdSbp, dst: NdSbp, meta: TensorMeta, bucket_bytes: int) -> float:
        """Like `time_s`, for a gradient synced inside a fused bucket of `bucket_bytes`
        (`sync_bucket_bytes`; the tensor alone where it is bigger): each collective is priced
        at the bucket's size, and the tensor pays its share of it (its bytes over the
        bucket's). Collectives cost far from linearly in their size (on cpu-gloo 64 KiB took
        two thirds of 1 MiB's time), so pricing each tensor as its own collective, less a
        latency, had put a 2.7 MB bucket of 40 tensors at 18 ms where it took 4.5 ms."""
        if meta.nbytes == 0:
            return 0.0
        scale = max(bucket_bytes, meta.nbytes) / meta.nbytes
        src_id, dst_id = self.layout_id(src), self.layout_id(dst)
        return self._price_pair(src_id, dst_id, meta.shape, meta.dtype, scale)

    def step_time_s(self, step: BoxingStep) -> float:
        return self._step_time_s((step.kind, step.message_bytes, step.group_size, step.link_class))

    def _step_time_s(self, step: StepPrice) -> float:
        found = self._step_times.get(step)
        if found is None:
            kind, message_bytes, group_size, link_class = step
            if kind is StepKind.LOCAL:
                found = 0.0  # a slice or a zero fill: negligible beside the ops around it
            elif kind is StepKind.SEND_RECV:
                found = self.prices.p2p_time_s(message_bytes, "inter_node")
            else:
                assert link_class is not None
                found = self.prices.collective_time_s(
                    kind.value, message_bytes, group_size, link_class
                )
            self._step_times[step] = found
        return found


_UNPLANNED = object()  # a chain not planned yet (None is planned and forbidden)


def _chain_key(shape: tuple[int, ...], dtype: torch.dtype, mesh: Mesh) -> tuple:
    """What a chain of a tensor of `shape` depends on besides its layouts (`_chain`)."""
    return (canonical_shape(shape, mesh), dtype, 0 in shape)


@dataclass(frozen=True, slots=True)
class _TablePlan:
    """One tensor's share of its table's pairs: its shape, dtype, bytes and chain key."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    chain_key: tuple

    @classmethod
    def of(cls, shape: tuple[int, ...], dtype: torch.dtype, mesh: Mesh) -> _TablePlan:
        nbytes = math.prod(shape) * dtype.itemsize
        return cls(shape, dtype, nbytes, _chain_key(shape, dtype, mesh))

    @property
    def planning(self) -> tuple[tuple[int, ...], torch.dtype, tuple]:
        """`BoxingPricer._planned`'s arguments after the pair."""
        return self.shape, self.dtype, self.chain_key


@dataclass(frozen=True, slots=True)
class _TableSteps:
    """A table's chains, for every tensor of one chain key: the distinct steps (kind, message
    bytes, the bytes of the tensor the chain was planned for, group size, link class), and
    `at[k, pair]`, the step at position k of that pair's chain (len(steps): none, it is
    shorter); `forbidden`, the pairs without a chain (flat indices)."""

    steps: tuple[tuple[StepKind, int, int, int, str | None], ...]
    at: np.ndarray
    forbidden: np.ndarray
