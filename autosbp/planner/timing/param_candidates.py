"""A parameter's own choices beside its layout, and the per-element prices of its update.

Lives here: `zero_state_layout` (the distributed optimizer's layout of a parameter's optimizer
states: ZeRO-1), `with_zero_states` (a parameter's candidates, each once more with its states
sharded where it has any), and the per-step update and gradient-accumulation times of a local shard
(`optimizer_s`, `accumulate_s`). Lives elsewhere: pricing the candidates' syncs and the
`NodeStrategies` they fill (`timing.candidates`), their bytes
(`memory.device_bytes.parameter_bytes_per_element`, `memory.gather_buffers`), what the runtime runs
(`runtime.parallel.sharded_update`).

Invariants:
- A state layout differs from its parameter's layout only on mesh dims where the parameter is
  B on more than one device, and splits there: the states of a replicated weight are held
  1/n per device (Rajbhandari et al. 2020, ZeRO, section 5.1: P_os), the weight stays whole.
- Splits are even (the search prices even pieces only); a parameter no dim of which divides
  keeps its states like its value (None).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from autosbp.boxing.steps import dual_nd_sbp
from autosbp.capturing.graph import TensorMeta
from autosbp.planner.memory.gather_buffers import shares_gather_bucket
from autosbp.planner.timing.recipe import PLAIN, Recipe
from autosbp.rules import NdSignature
from autosbp.sbp import Broadcast, NdSbp, Split, local_shape, split_factors

__all__ = [
    "OPTIMIZER_BYTES_PER_ELEMENT", "OPTIMIZER_FLOPS_PER_ELEMENT", "ParameterPrices",
    "accumulate_s", "optimizer_s", "parameter_prices", "with_zero_states", "zero_state_layout",
]  # fmt: skip

# Adam on an fp32 master copy reads param, grad, m, v and writes param, m, v: 7 x 4 bytes per
# element (derived); about 12 flops per element (derived from the update formula).
OPTIMIZER_BYTES_PER_ELEMENT = 28
OPTIMIZER_FLOPS_PER_ELEMENT = 12


class _OpPrices(Protocol):
    """The part of `timing.boxing_prices.Prices` these prices read."""

    def op_time_s(
        self, flops: float, nbytes: float, dtype: torch.dtype, transcendentals: float = 0.0
    ) -> float: ...


def zero_state_layout(
    layout: NdSbp, shape: Sequence[int], mesh_shape: Sequence[int]
) -> NdSbp | None:
    """ZeRO-1's layout of the optimizer states of a parameter stored in `layout`: every mesh dim
    where it is B on more than one device split instead, on the first tensor dim that stays
    evenly divisible (dims `layout` does not split already first, so each conversion stays one
    collective); None where nothing changes."""
    out = list(layout)
    for d, (sbp, size) in enumerate(zip(layout, mesh_shape, strict=True)):
        if not isinstance(sbp, Broadcast) or size == 1:
            continue
        taken = {x.dim for x in out if isinstance(x, Split)}
        for k in sorted(range(len(shape)), key=lambda k: (k in taken, k)):
            trial = [*out[:d], Split(k), *out[d + 1 :]]
            parts = split_factors(trial, mesh_shape)[k]
            if shape[k] % parts == 0 and shape[k] >= parts:
                out = trial
                break
    found = tuple(out)
    return found if found != tuple(layout) else None


def with_zero_states(
    candidates: tuple[NdSignature, ...],
    regather: Sequence[bool],
    shape: Sequence[int],
    mesh_shape: Sequence[int],
) -> tuple[tuple[NdSignature, ...], list[bool], list[NdSbp | None], list[NdSbp | None]]:
    """`timing.candidates` (with their `regather` flags), then each whose layout has a ZeRO state
    layout q twice more: with its states in q (ZeRO-1), and with its states and gradient in q
    (ZeRO-2). Returns (candidates, regather flags, state layout per candidate, gradient layout
    per candidate; None: the parameter's own)."""
    twins = [
        (i, zero_state_layout(sig.outputs[0], shape, mesh_shape))
        for i, sig in enumerate(candidates)
    ]
    twins = [(i, q) for i, q in twins if q is not None]
    both = [*twins, *twins]
    return (
        (*candidates, *(candidates[i] for i, _ in both)),
        [*regather, *(regather[i] for i, _ in both)],
        [*([None] * len(candidates)), *(q for _, q in both)],
        [*([None] * (len(candidates) + len(twins))), *(q for _, q in twins)],
    )


# (src, dst, tensor, bucket bytes) -> seconds: `timing.boxing_prices.BoxingPricer.bucketed_time_s`
SyncPrice = Callable[[NdSbp, NdSbp, TensorMeta, int], float]


@dataclass(frozen=True, slots=True)
class ParameterPrices:
    """Per candidate of one parameter (`parameter_prices`): `sync_s` the per-step sync backward
    may hide, `update_s` the rest of the step's update, `accumulate_s` one micro-batch's
    gradient add (every micro-batch's but the first), `scatter_s` what every micro-batch's
    backward adds in line (ZeRO-2's reduce-scatter; 0 elsewhere)."""

    sync_s: list[float]
    update_s: list[float]
    accumulate_s: list[float]
    scatter_s: list[float]


def parameter_prices(
    meta: TensorMeta,
    candidates: Sequence[NdSignature],
    states: Sequence[NdSbp | None],
    gradients: Sequence[NdSbp | None],
    sync_price: SyncPrice,
    prices: _OpPrices,
    mesh_shape: tuple[int, ...],
    bucket_bytes: int,
    recipe: Recipe = PLAIN,
) -> ParameterPrices:
    """Per candidate (its layout p, its `states` layout q or None, its `gradients` layout: q or
    None), as `runtime.parallel.sharded_update` runs them: without q, the sync dual(p) -> p inside a
    bucket of `bucket_bytes` and the optimizer on p's shard; ZeRO-1, the same bucketed sync
    (backward may hide it, as DDP's; the shard's gradient is then a slice of the synced one), after
    backward the all-gather q -> p (nothing hidden; inside a bucket of `bucket_bytes` where
    `shares_gather_bucket`, else one collective per parameter) and the optimizer on q's shard;
    ZeRO-2, the reduce-scatter dual(p) -> q in every micro-batch's backward, in line (unbucketed:
    one collective per parameter as its gradient is made, nothing hidden), the adds on q's shard,
    after the step's backward the all-gather and the optimizer on q's. `recipe`: the gradient
    the syncs carry (fp32 under a mixed recipe, or its reduce dtype), what one accumulation
    moves, and what the update adds (the compute copy's cast, clipping: `timing.recipe`, on
    the tensor the optimizer steps). ZeRO gathers the shards into the weights in the weights'
    dtype (a mixed recipe's compute copies: its masters are the shards)."""
    found = ParameterPrices([], [], [], [])
    wire = recipe.wire(meta)
    master = TensorMeta(meta.shape, Recipe.gradient_dtype(meta.dtype))
    for sig, q, g in zip(candidates, states, gradients, strict=True):
        p = sig.outputs[0]
        bucketed = sync_price(dual_nd_sbp(p), p, wire, bucket_bytes)
        found.sync_s.append(bucketed if g is None else 0.0)
        extra = _update_extra_s(meta, p if q is None else q, prices, mesh_shape, recipe)
        if q is None:
            found.update_s.append(optimizer_s(meta, p, prices, mesh_shape) + extra)
        else:
            bucketed_gather = shares_gather_bucket(meta, p, q, mesh_shape)
            gather = sync_price(q, p, meta, bucket_bytes if bucketed_gather else 1)
            found.update_s.append(gather + optimizer_s(meta, q, prices, mesh_shape) + extra)
        scatter = sync_price(dual_nd_sbp(p), g, master, 1) if g is not None else 0.0
        found.scatter_s.append(scatter)
        found.accumulate_s.append(
            accumulate_s(meta, g if g is not None else p, prices, mesh_shape, recipe)
        )
    return found


def _update_extra_s(
    meta: TensorMeta, layout: NdSbp, prices: _OpPrices, mesh_shape: tuple[int, ...], recipe: Recipe
) -> float:
    """What the update runs beside the optimizer on the local shard (`Recipe.update_bytes`)."""
    per_element = recipe.update_bytes(meta.dtype)
    if not per_element:
        return 0.0
    local = math.prod(local_shape(meta.shape, layout, mesh_shape))
    return prices.op_time_s(local, local * per_element, torch.float32)


def optimizer_s(
    meta: TensorMeta, layout: NdSbp, prices: _OpPrices, mesh_shape: tuple[int, ...]
) -> float:
    """The optimizer's update of the local shard of `meta` in `layout` (memory-bound)."""
    local = math.prod(local_shape(meta.shape, layout, mesh_shape))
    return prices.op_time_s(
        local * OPTIMIZER_FLOPS_PER_ELEMENT, local * OPTIMIZER_BYTES_PER_ELEMENT, torch.float32
    )


def accumulate_s(
    meta: TensorMeta,
    layout: NdSbp,
    prices: _OpPrices,
    mesh_shape: tuple[int, ...],
    recipe: Recipe = PLAIN,
) -> float:
    """grad += new on the local shard: one add, reading two gradients and writing one (under a
    mixed recipe the new one in the compute dtype, the others fp32: `Recipe.accumulate_bytes`)."""
    local = math.prod(local_shape(meta.shape, layout, mesh_shape))
    return prices.op_time_s(local, local * recipe.accumulate_bytes(meta.dtype), meta.dtype)
