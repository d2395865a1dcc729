"""Keep or re-gather an activation for backward: each consumer's choice, priced as the runtime runs it.

Lives here: `regather_twins` (which of a consumer's candidates come once more per kept activation
they may read gathered, as the twin that re-gathers it) and `regather_terms` (per pair of an
edge's endpoints, what the twins keep of the edge's kept uses and the conversions they run
again, and which pairs a twin may not take). Lives elsewhere: which inputs a consumer keeps as it reads
them (`memory.kept.Kept.regather_inputs`), the sums per stage (`problem.stage_terms`), the
parameters' own keep or re-gather (FSDP's, `timing.candidates`), what the runtime runs
(`runtime.parallel.regather`), the plan's statement (`NodePlan.regathered`).

Model (Korthikanti et al. 2022, section 4.2.2: sequence parallelism keeps the shard of the
input of a column-parallel linear and all-gathers it again in backward): where a consumer keeps
an input it read through a conversion that exchanges data (an all-gather S -> B, above all), the
converted copy stays until its backward, per micro-batch in flight (`memory.device_bytes.
use_bytes`). Its re-gathering twin keeps instead what the value was as produced (the shard: its
bytes where the use is its value's only holder, else nothing beyond what its holders keep) and,
in its backward, runs the use's forward conversion once more: exposed (the runtime waits for it
before the op's backward), but a linear's activation, gathered beside the linear's input-gradient
matmul (`overlap.hidden_regather_s`, as `runtime.parallel.regather` runs it). A twin
re-gathers one input: a pair of its edge where that input's conversion exchanges nothing (a view,
a slice: nothing to re-gather) is forbidden, as is every pair of that edge where its consumer is
recomputed (the run converts again anyway) or keeps nothing of it in the configuration's
recomputation; so a twin is chosen only where it re-gathers, and never stands for its base's
plan (a consumer re-gathering two inputs at once is not in the space).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from autosbp.capturing.flops import op_family
from autosbp.capturing.graph import OpNode, TensorMeta
from autosbp.overlap import hidden_regather_s
from autosbp.planner.memory.device_bytes import distinct_layouts, pair_bytes
from autosbp.planner.memory.kept import KeptUse
from autosbp.planner.timing.boxing_prices import BoxingPricer
from autosbp.rules import NdSignature
from autosbp.sbp import Broadcast, NdSbp

__all__ = ["REGATHERED_FAMILIES", "regather_terms", "regather_twins"]


# The ops whose kept inputs may be re-gathered: contractions (a linear's input, attention's
# queries, keys and values), whose gathered inputs are the large copies sequence parallelism
# re-gathers; an elementwise op reading a gathered input computes replicated, which the search
# rarely picks, and twins there would enlarge every block's problem for nothing.
REGATHERED_FAMILIES = frozenset({"matmul", "attention", "conv"})


def regather_twins(
    attrs: OpNode,
    candidates: Sequence[NdSignature],
    inputs: frozenset[int],
    mesh_shape: tuple[int, ...],
) -> list[tuple[int, int]]:
    """(candidate, input) for each twin to add to op `attrs` (of `REGATHERED_FAMILIES`): per input
    of `inputs` (its kept activations, `Kept.regather_inputs`), each candidate that reads it whole
    on a mesh dim of more than one device that some dim of the tensor divides (a split there can
    be gathered into it). Elsewhere no conversion into the candidate's layout makes a copy larger
    than its source, and a twin would only enlarge the problem."""
    if op_family(attrs.op) not in REGATHERED_FAMILIES:
        return []
    return [
        (j, i)
        for i in sorted(inputs)
        for j, sig in enumerate(candidates)
        if _gatherable(sig.inputs[i], attrs.inputs[i], mesh_shape)
    ]


def _gatherable(layout: NdSbp, meta: TensorMeta, mesh_shape: tuple[int, ...]) -> bool:
    return any(
        isinstance(sbp, Broadcast) and size > 1 and any(n % size == 0 and n >= size
                                                        for n in meta.shape)
        for sbp, size in zip(layout, mesh_shape, strict=True)
    )  # fmt: skip


def regather_terms(
    producer: Sequence[NdSignature],
    consumer: Sequence[NdSignature],
    twins: np.ndarray,
    carried: frozenset[int],
    uses: Sequence[KeptUse],
    metas: Sequence[TensorMeta],
    kept_bytes: np.ndarray,
    pricer: BoxingPricer,
    recomputed: bool,
    forced: bool = False,
    beside_s: Callable[[int], np.ndarray | None] = lambda index: None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Per pair (producer candidate i, consumer candidate j) of an edge carrying the consumer's
    inputs `carried`, where `twins[j]` is the input candidate j re-gathers (-1: none): what the
    twins add to the pair's time (the conversion run again, less what the consumer's compute
    `beside_s(input)` hides of it, per consumer candidate, where the runtime gathers that input
    beside its input-gradient matmul (`overlap.hidden_regather_s`; None: exposed); inf: the pair
    is forbidden, the module header) and the bytes every pair keeps with one micro-batch in
    flight (`kept_bytes`, the kept `uses`' as read, with a twin's re-gathered use kept as
    produced). `forced` (sequence parallelism, `megatron:...,sp=1`): a candidate that has a twin
    may not keep what the twin would re-gather (those pairs forbidden). None where no twin
    re-gathers an input this edge carries (its pairs price as their base's)."""
    shape = (len(producer), len(consumer))
    families = [i for i in sorted(set(twins.tolist()) - {-1}) if i in carried]
    if not families:
        return None
    again, held, forbid = np.zeros(shape), kept_bytes.copy(), np.zeros(shape, dtype=bool)
    layouts = ([sig.outputs for sig in producer], [sig.inputs for sig in consumer])
    for i in families:
        columns = twins == i
        bases = None  # forced: the candidates that keep every copy but have a twin for input i
        if forced:
            gathered = {consumer[int(j)].inputs[i] for j in np.flatnonzero(columns)}
            bases = np.array(
                [
                    t == -1 and sig.inputs[i] in gathered
                    for sig, t in zip(consumer, twins, strict=True)
                ]
            )
        kept = [(use, meta) for use, meta in zip(uses, metas, strict=True) if use.in_idx == i]
        exchanged_any = np.zeros(shape, dtype=bool)
        beside = beside_s(i)
        for use, meta in [] if recomputed else kept:
            srcs, src_of = distinct_layouts([sig.outputs[use.out_idx] for sig in producer])
            dsts, dst_of = distinct_layouts([sig.inputs[use.in_idx] for sig in consumer])
            ids = tuple(map(pricer.layout_id, srcs)), tuple(map(pricer.layout_id, dsts))
            pick = np.ix_(src_of, dst_of)
            every = pricer.collectives(*ids, meta)[pick]
            if bases is not None:
                forbid |= every & bases[None, :]
            exchanged = every & columns[None, :]
            forward = pricer.tables(*ids, meta)[0][pick]
            as_read = pair_bytes(*layouts, (use,), (meta,), pricer.mesh.shape)
            produced = pair_bytes(
                *layouts, (replace(use, converted=False),), (meta,), pricer.mesh.shape
            )
            held += np.where(exchanged, produced - as_read, 0.0)
            if beside is not None:
                efficiency = pricer.prices.overlap_efficiency
                forward = forward - hidden_regather_s(forward, beside[None, :], efficiency)
            again += np.where(exchanged, forward, 0.0)
            exchanged_any |= exchanged
        forbid |= columns[None, :] & ~exchanged_any
    again[forbid] = np.inf
    return again, held
