"""The price of the runtime's non-finite check, part of every step's update.

Lives here: `gradient_check_s` (one parameter's share: the 2-norm's read of its local
gradient) and `check_step_s` (the fused op's floor, and the one all-reduce of one integer over
the world). Lives elsewhere: the check
itself (`runtime.verify.finite.first_non_finite`, run after the gradient sync and before the
optimizer, inside the runtime's "optimizer" span), where these are added (`timing.candidates`, per
parameter candidate into its update; `problem.stage_terms.StageTerms.add_check`, once per stage).

Model: `torch._foreach_norm(ord=2)` (the runtime's screen; the max-norm only re-reads a
gradient found non-finite) is one fused op over every local gradient: it reads
each once and writes a scalar. Per parameter, its gradient's local bytes at the profile's
memory rate (`op_time_s` of a read far above any per-op floor, divided out: the rate of a
streaming read); per stage, the op's floor once (`op_time_s` of nothing) and the all-reduce,
which carries 8 bytes: latency-bound, so priced as its two hops, a tiny all-reduce over the
stage's mesh (its outermost dim's link: its devices farthest apart) and one over the stages
(the link between them), never as one group larger than a stage or the stage count.
"""

from __future__ import annotations

import math

import torch

from autosbp.capturing.graph import TensorMeta
from autosbp.planner.timing.boxing_prices import Prices
from autosbp.sbp import Mesh, NdSbp, local_shape

__all__ = ["CHECK_BYTES", "check_step_s", "gradient_check_s"]

CHECK_BYTES = 8  # the all-reduced int64 (`runtime.verify.finite`)
RATE_ELEMENTS = 1 << 28  # a read this long (1 GiB of fp32) prices the memory rate, not a floor


def gradient_check_s(
    meta: TensorMeta, layout: NdSbp, prices: Prices, mesh_shape: tuple[int, ...]
) -> float:
    """The 2-norm's read of the local gradient of `meta` in `layout` (the parameter's own:
    ZeRO-1's shards are checked as the parameter's gradient), inside the one fused op."""
    local = math.prod(local_shape(meta.shape, layout, mesh_shape))
    n = RATE_ELEMENTS
    per_element_s = prices.op_time_s(n, n * meta.dtype.itemsize, meta.dtype) / n
    return local * per_element_s


def check_step_s(prices: Prices, mesh: Mesh, num_stages: int, stage_link: str) -> float:
    """Once per step and stage: the fused norm's floor, and the all-reduce over every device of
    `num_stages` stages on meshes like `mesh` (none on one device)."""
    total_s = prices.op_time_s(0.0, 0.0, torch.float32)
    if mesh.size > 1:
        total_s += prices.collective_time_s(
            "all_reduce", CHECK_BYTES, mesh.size, mesh.link_classes[0]
        )
    if num_stages > 1:
        total_s += prices.collective_time_s("all_reduce", CHECK_BYTES, num_stages, stage_link)
    return total_s
