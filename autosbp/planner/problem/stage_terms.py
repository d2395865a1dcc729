"""The sums one configuration's costs and memory are made of, per pipeline stage.

Lives here: `StageTerms` (per stage: busy and forward time per micro-batch, transfers, the
update and its sync, memory per node candidate and edge pair, and one block's parameter
communication and compute, which prefetching overlaps), filled from the tied counts of a graph
cut into stages; tied nodes and edges are added once per group, times its count. Lives
elsewhere: the prices it sums (`problem.priced.Priced`, `timing.candidates`, `memory`), the
objective made of the sums (`timing.objective`), the problem (`problem.build.build_problem`).

Memory per stage (k = the micro-batches in flight, `memory.in_flight.in_flight`): model states once;
what backward keeps (`memory.kept`) k times: outputs and intermediates on nodes, kept uses on edges
(the producer's tensor or a converted copy, `memory.device_bytes.pair_bytes`; where an op's twin
re-gathers an activation, the value as produced and the conversion again in backward:
`timing.regather`). A parameter candidate
that re-gathers keeps no copy across: its copies are alive only while their block runs, with the
next PREFETCH_BLOCKS blocks' prefetched beside them ((1 + PREFETCH_BLOCKS) blocks' worth of copies
at once), and its consumer's edge pays the forward conversion again per micro-batch in backward. A
recomputed block holds, one block at a time, what its ops save while recomputing. "One block's
worth" sums the copies of a block's edges over the stage's blocks divided by their number, exact
where the blocks are identical; where they are not, every block's (an upper bound).

Two more moments per stage, each a constraint of its own: at the weight gather, after the step
(what is held but activations, and the gather's buffer: `memory.gather_buffers`); and while a
unit's gathered weights' gradients are reduce-scattered, held until the next unit's are
(`runtime.parallel.prefetch.GatherSchedule.reduce`, FSDP2's order): what is held but activations
and the parameters' gathered copies, where one unit's copies (one block's worth, and every copy
outside blocks) are replaced by their gradients in the dtype they are reduced in
(`memory.device_bytes.wire_pair_bytes`: fp32 under a mixed recipe, twice the bf16 copy it
replaces), less the gradient each becomes in a step of one micro-batch. A constraint only where
some gradient outweighs its copy; else the stage's own implies it.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from autosbp.capturing.graph import OpNode, Role
from autosbp.overlap import GRAD_BUCKET_BYTES, PREFETCH_BLOCKS, sync_buckets
from autosbp.planner.ilp.formulation import Costs, MemoryConstraint
from autosbp.planner.memory.gather_buffers import gather_staging_bytes
from autosbp.planner.memory.in_flight import in_flight
from autosbp.planner.space.recomputation import recomputed
from autosbp.planner.timing.candidates import NodeStrategies, Prices
from autosbp.planner.timing.objective import StageCosts
from autosbp.sbp import Mesh, local_shape

__all__ = ["P2P", "StageTerms"]


class StageTerms:
    """Per stage, the sums of a configuration (see `StageCosts`). `blocks[s]` is the number of
    repeated blocks of stage s; `identical`: the graph's blocks are all alike (tied)."""

    def __init__(
        self, blocks: tuple[int, ...], identical: bool, kept: tuple[int, ...] | None = None
    ) -> None:
        self.num_stages = len(blocks)
        # Micro-batches in flight per stage: 1F1B's, or the schedule's (`kept`, interleaved).
        self.in_flight = kept or tuple(in_flight(s, self.num_stages) for s in range(len(blocks)))
        self.blocks, self.identical = blocks, identical
        self.busy, self.forward, self.send, self.update, self.sync = (
            [_Acc() for _ in blocks] for _ in range(5)
        )
        self.memory = [_Acc(sparse=True) for _ in blocks]
        # At the weight gather, after the step: what is held but activations, and the
        # gather's buffer (`memory.gather_buffers.gather_staging_bytes`, at most one bucket's)
        self.update_memory, self.staging = [_Acc() for _ in blocks], [_Acc() for _ in blocks]
        # At a gathered weight's reduce-scatter, after its unit's backward: what is held but
        # activations, with the unit's copy replaced by its gradient (the module docstring);
        # `wired`: where some gradient outweighs its copy (elsewhere `memory` implies it)
        self.reducing = [_Acc(sparse=True) for _ in blocks]
        self.wired = [False] * self.num_stages
        self.gather_forward, self.compute_forward, self.gather_backward, self.compute_backward = (
            [_Acc() for _ in blocks] for _ in range(4)
        )
        self.param_bytes = [0] * self.num_stages
        # Per stage, what its time costs are made of: equal for stages whose costs are equal.
        self.kinds: list[Counter[tuple]] = [Counter() for _ in blocks]

    def per_block(self, attrs: OpNode, s: int) -> float:
        """The weight that turns a copy of a node of a block on stage s into one block's worth
        (the module docstring): 1 / blocks where they are identical, 1 otherwise."""
        if attrs.block is None or not self.identical or not self.blocks[s]:
            return 1.0
        return 1.0 / self.blocks[s]

    def add_nodes(
        self, tied, priced, optimizer: str, micro_batches: int, recompute: str, modes=None
    ) -> None:
        """Every node's time and memory. `modes` (`space.ties.ModeTies`, under `full:K`): the
        counts split by the mode each copy runs (its own, its readers'), else every copy's is
        `recompute`."""
        entries = (
            ((r, s, outside, recompute, recompute), n) for (r, s, outside), n in tied.nodes.items()
        )
        freed = self._freed_nodes(modes, priced, optimizer) if modes else {}
        for (r, s, read_outside, own, readers), n in modes.nodes.items() if modes else entries:
            attrs, found = priced.graph.node(r), priced.strategies[r]
            k = self.in_flight[s]
            self.kinds[s][("node", r, read_outside, own, readers)] += n
            if attrs.role is Role.PARAMETER:
                self._add_parameter(r, s, n, found, micro_batches)
                self.param_bytes[s] += n * attrs.outputs[0].nbytes
            elif attrs.role is Role.COMPUTE:
                fwd = found.forward_part_s()
                again = fwd if recomputed(priced.graph, r, own) else 0.0
                self.busy[s].node(r, n * (found.compute_s + again))
                self.forward[s].node(r, n * fwd)
                if attrs.block is not None and self.identical:
                    w = n * self.per_block(attrs, s)
                    self.compute_forward[s].node(r, w * fwd)
                    self.compute_backward[s].node(r, w * (found.compute_s - fwd + again))
            if attrs.role is Role.COMPUTE:
                held = priced.kept_bytes(r, optimizer, own, readers)
                self.memory[s].node(r, n * k * held)
                if recomputed(priced.graph, r, own):  # one run rematerialized at a time
                    again = priced.rematerialized_bytes(r, own)
                    if (r, s) in freed:  # less what the blocks kept whole have freed by then
                        again = np.maximum(again - freed[(r, s)], 0.0)
                    self.memory[s].transient(r, again)
            else:
                held = n * priced.kept_bytes(r, optimizer, own)
                self.memory[s].node(r, held)
                self.update_memory[s].node(r, held)
                if attrs.role is Role.PARAMETER:
                    meta, mesh_shape = attrs.outputs[0], priced.mesh.shape
                    states = found.state or (None,) * len(found.candidates)
                    staging = gather_staging_bytes(meta, found.candidates, states, mesh_shape)
                    self.staging[s].node(r, n * staging)

    @staticmethod
    def _freed_nodes(modes, priced, optimizer: str) -> dict[tuple[str, int], np.ndarray]:
        """Under `full:K`, per representative compute node and stage, what its copies in the
        blocks kept whole (run under none) keep of one micro-batch: by the time a stage
        recomputes one of its first K blocks for a micro-batch, backward has passed that
        micro-batch's later blocks, kept whole, and freed it (the module docstring)."""
        freed: dict[tuple[str, int], np.ndarray] = {}
        for (r, s, _, own, readers), n in modes.nodes.items():
            if own == "none" and priced.graph.node(r).role is Role.COMPUTE:
                held = n * priced.kept_bytes(r, optimizer, own, readers)
                freed[(r, s)] = freed[(r, s)] + held if (r, s) in freed else held
        return freed

    def _add_parameter(
        self, r: str, s: int, n: int, found: NodeStrategies, micro_batches: int
    ) -> None:
        self.update[s].node(r, n * found.compute_s)
        assert found.sync_s is not None, f"{r}: a parameter priced without its sync"
        self.sync[s].node(r, n * found.sync_s)
        if micro_batches > 1 or found.scatter_s is not None:  # accumulation, ZeRO-2's scatter
            self.busy[s].node(r, n * found.per_micro_batch_s(micro_batches))

    def add_check(self, reduce_s: float, devices_stages: int) -> None:
        """The non-finite check's all-reduce, once per step on each of the `devices_stages`
        pipeline devices' updates (`timing.finite_check.check_step_s`; a device holds virtual stages
        d, d + P, ... of an interleaved plan): added to every candidate of the first parameter
        of the device's first chunk that has one, a constant every choice pays (a device
        without parameters skips no check, but has no update to hold it: left out)."""
        for d in range(devices_stages):
            held = [acc for acc in self.update[d::devices_stages] if acc.nodes]
            if held:
                held[0].node(next(iter(held[0].nodes)), reduce_s)

    def add_edges(
        self, tied, priced, recompute: str, micro_batches: int, p2p: P2P, modes=None
    ) -> None:
        """Boxing on every edge (time, and the copies kept for backward), and each tensor sent
        to a later stage (time and memory); `modes` as `add_nodes` (an edge's is its
        consumer's)."""
        rep, graph = priced.representative, priced.graph
        entries = ((((u, v), sv, recompute), n) for ((u, v), sv), n in tied.edges.items())
        freed_edges: dict[tuple, np.ndarray] = {}  # ((rep u, rep v), stage) -> bytes per pair
        for ((u, v), sv, mode), n in modes.edges.items() if modes else ():
            kept, regather = priced.edge_kept(u, v, mode), priced.strategies[rep[u]].regather
            gathers = graph.node(u).role is Role.PARAMETER and regather is not None
            plain = kept.twin_bytes is None and not (gathers and regather.any())
            if mode == "none" and plain:  # as `_freed_nodes`: one micro-batch's copies
                key = ((rep[u], rep[v]), sv)
                freed_edges[key] = freed_edges.get(key, 0.0) + n * kept.bytes
        for ((u, v), sv, mode), n in modes.edges.items() if modes else entries:
            self.kinds[sv][("edge", u, v, mode)] += n
            key, consumer = (rep[u], rep[v]), graph.node(rep[v])
            both, fwd_only = priced.edge_prices(u, v)
            again = recomputed(priced.graph, rep[v], mode)  # tied nodes are recomputed alike
            self.busy[sv].edge(key, n * (both + fwd_only) if again else n * both)
            self.forward[sv].edge(key, n * fwd_only)
            kept = priced.edge_kept(u, v, mode)
            w = n * self.per_block(consumer, sv)
            if again and modes and self.identical:  # one block's worth of the recomputed ones
                w = n / modes.recomputing[sv]
            regather = priced.strategies[rep[u]].regather
            if graph.node(u).role is not Role.PARAMETER:
                regather = None  # an op's twins re-gather what they read (`timing.regather`)
            if kept.twin_s is not None:  # an op's twins re-gather, or may not take a pair
                self.busy[sv].edge(key, n * kept.twin_s)
            extra = np.zeros_like(both)
            if again:  # kept while its block recomputes, one block at a time
                held = w * kept.recomputed_bytes
                if modes and (key, sv) in freed_edges:  # less what blocks kept whole freed
                    held = np.maximum(held - freed_edges[(key, sv)], 0.0)
            elif kept.twin_bytes is not None:
                held = n * self.in_flight[sv] * kept.twin_bytes
            elif regather is not None and regather.any():
                rows = regather[:, None]
                extra = np.where(rows, kept.forward_s, 0.0)  # converted again before backward
                self.busy[sv].edge(key, n * extra)
                k = self.in_flight[sv]
                held = n * k * np.where(rows, 0.0, kept.bytes)
                held = held + w * (1 + PREFETCH_BLOCKS) * np.where(rows, kept.bytes, 0.0)
            else:
                held = n * self.in_flight[sv] * kept.bytes
            self.memory[sv].edge(key, held)
            if graph.node(u).role is Role.PARAMETER and priced.gathers:  # a unit's gradients
                unit = n * self.per_block(consumer, sv)
                grad = priced.wire_bytes(u, v, less_gradient=micro_batches == 1)
                wire = np.maximum(unit * (grad - kept.bytes), 0.0)
                self.reducing[sv].edge(key, held + wire)
                self.wired[sv] = self.wired[sv] or bool(wire.any())
            in_block = consumer.block is not None and self.identical
            if graph.node(u).role is Role.PARAMETER and in_block:
                # a forbidden pair (a gather where none runs) is forbidden by `busy`, and hides
                # nothing here (inf - inf would be nan)
                allowed = np.isfinite(both)
                forward = np.where(allowed, fwd_only, 0.0)
                self.gather_forward[sv].edge(key, w * forward)
                backward = np.where(allowed, both, 0.0) - forward + extra
                self.gather_backward[sv].edge(key, w * backward)
        for u, out_idx, sv in tied.sends:
            self.kinds[sv - 1][("send", rep[u], out_idx, graph.node(u).outputs[out_idx])] += 1
            local = p2p.local_bytes(priced.strategies[u], out_idx, graph.node(u).outputs[out_idx])
            self.send[sv - 1].node(rep[u], p2p.time_s(local))
            self.memory[sv].node(rep[u], local * self.in_flight[sv])

    def stage_costs(
        self, sizes: dict[str, int], overlap: float, memory_limit_bytes: float | None
    ) -> StageCosts:
        limit = memory_limit_bytes if memory_limit_bytes is not None else math.inf
        kinds = tuple(frozenset(kind.items()) for kind in self.kinds)
        first = {kind: s for s, kind in reversed(list(enumerate(kinds)))}

        def costs(sums: list[_Acc]) -> tuple[Costs, ...]:  # stages of one kind share theirs
            built = {s: sums[s].costs(sizes) for s in set(first.values())}
            return tuple(built[first[kind]] for kind in kinds)

        slots = tuple(b - 1 if self.identical and b > 1 else 0 for b in self.blocks)
        return StageCosts(
            costs(self.busy), costs(self.forward), costs(self.send), costs(self.update),
            costs(self.sync), tuple(sync_buckets(b) for b in self.param_bytes), overlap,
            tuple(
                MemoryConstraint(
                    a.memory_bytes(sizes), limit, name=f"stage {s}", bytes_per_pair=a.edges
                )
                for s, a in enumerate(self.memory)
            ),
            kinds, costs(self.gather_forward), costs(self.compute_forward),
            costs(self.gather_backward), costs(self.compute_backward), slots,
            tuple(self._update_memory(s, sizes, limit) for s in range(self.num_stages)),
            costs(self.staging),
            tuple(
                self._reduce_memory(s, sizes, limit) if self.wired[s] else None
                for s in range(self.num_stages)
            ),
        )  # fmt: skip

    def _update_memory(self, s: int, sizes: dict[str, int], limit: float) -> MemoryConstraint:
        """Stage s's bytes at its weight gather: what is held but activations, and the gather's
        buffer, which is the chosen bucketed parameters' pieces up to one bucket
        (`overlap.GRAD_BUCKET_BYTES`). Where all of them fit in one bucket, each candidate's
        piece (exact); else one bucket's bytes, whatever the choice (a constant: the ILP stays
        linear, and it is at most a bucket too many)."""
        held, staged = (
            self.update_memory[s].memory_bytes(sizes),
            self.staging[s].memory_bytes(sizes),
        )
        most = sum(float(np.max(b)) for b in staged.values() if len(b))
        name = f"stage {s} update"
        if most <= GRAD_BUCKET_BYTES:
            exact = {r: held[r] + staged[r] for r in sizes}
            return MemoryConstraint(exact, limit, name=name)
        return MemoryConstraint(held, limit, constant_bytes=float(GRAD_BUCKET_BYTES), name=name)

    def _reduce_memory(self, s: int, sizes: dict[str, int], limit: float) -> MemoryConstraint:
        """Stage s's bytes at a gathered weight's reduce-scatter (the module docstring): what is
        held but activations, the parameters' copies, and one unit's gradients in place of
        theirs."""
        held = self.update_memory[s].memory_bytes(sizes)
        return MemoryConstraint(
            held, limit, name=f"stage {s} reduce", bytes_per_pair=self.reducing[s].edges
        )

    def least_bytes(self, sizes: dict[str, int], virtual_stages: int = 1) -> float:
        """The fewest bytes of the tightest device, from its nodes alone (interleaved, a
        device's v chunks together: `build.memory_constraints`)."""
        stages = [
            sum(float(np.min(b)) for b in a.memory_bytes(sizes).values() if len(b))
            for a in self.memory
        ]
        p = len(stages) // virtual_stages
        return max(
            (sum(stages[c * p + d] for c in range(virtual_stages)) for d in range(p)),
            default=0.0,
        )


class _Acc:
    """Sums node arrays and edge matrices per representative (tied copies add up); an edge
    between two copies of one node (same position in two blocks) lands on the node's diagonal.
    `transient` keeps the largest single copy (one block rematerialized at a time). `sparse`:
    an edge whose matrices are all 0 is left out (memory; time keeps every edge, whose pairs
    tie its endpoints' choices in the ILP)."""

    def __init__(self, sparse: bool = False) -> None:
        self.sparse = sparse
        self.nodes: dict[str, np.ndarray] = {}
        self.edges: dict[tuple[str, str], np.ndarray] = {}
        self.peaks: dict[str, np.ndarray] = {}

    def node(self, key: str, values: np.ndarray | float) -> None:
        if key in self.nodes:
            self.nodes[key] = self.nodes[key] + values
        else:
            self.nodes[key] = np.asarray(values, dtype=float) + 0.0

    def edge(self, key: tuple[str, str], matrix: np.ndarray) -> None:
        if self.sparse and key not in self.edges and not matrix.any():
            return
        if key[0] == key[1]:
            self.node(key[0], np.diag(matrix))
        elif key in self.edges:
            self.edges[key] = self.edges[key] + matrix
        else:
            self.edges[key] = matrix

    def transient(self, key: str, values: np.ndarray) -> None:
        self.peaks[key] = np.maximum(self.peaks[key], values) if key in self.peaks else values

    def costs(self, sizes: dict[str, int]) -> Costs:
        return Costs(
            {r: _per_candidate(self.nodes.get(r), n) for r, n in sizes.items()}, self.edges
        )

    def memory_bytes(self, sizes: dict[str, int]) -> dict[str, np.ndarray]:
        out = {}
        for r, n in sizes.items():
            total = _per_candidate(self.nodes.get(r), n)
            out[r] = total + self.peaks[r] if r in self.peaks else total
        return out


def _per_candidate(values: np.ndarray | None, n: int) -> np.ndarray:
    """`values` as one number per candidate (a scalar is every candidate's; None is 0)."""
    if values is None:
        return np.zeros(n)
    return values if values.shape == (n,) else np.full(n, float(values))


class P2P:
    """Cross-stage transfer: device i of one stage sends its local piece to device i of the
    next (every stage has the same mesh shape, and a tensor keeps its layout across)."""

    def __init__(self, prices: Prices, mesh: Mesh, link: str) -> None:
        self.prices, self.mesh, self.link = prices, mesh, link

    def local_bytes(self, found: NodeStrategies, out_idx: int, meta) -> np.ndarray:
        return np.array(
            [
                math.prod(local_shape(meta.shape, sig.outputs[out_idx], self.mesh.shape))
                * meta.dtype.itemsize
                for sig in found.candidates
            ],
            dtype=float,
        )

    def time_s(self, nbytes: np.ndarray) -> np.ndarray:
        return np.array([self.prices.p2p_time_s(float(b), self.link) for b in nbytes])
