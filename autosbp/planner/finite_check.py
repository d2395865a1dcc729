"""The price of the runtime's non-finite check, part of every step's update.

Lives here: `gradient_check_s` (one parameter's share: the max-norm's read of its local
gradient) and `check_step_s` (the fused op's floor, and the one all-reduce of one integer over
the world). Lives elsewhere: the check
itself (`runtime.verify.finite.first_non_finite`, run after the gradient sync and before the
optimizer, inside the runtime's "optimizer" span), where these are added (`candidates`, per
parameter candidate into its update; `stage_terms.StageTerms.add_check`, once per stage).

Model: `torch._foreach_norm(ord=inf)` is one fused op over every local gradient: it reads
each once and writes a scalar. Per parameter, its gradient's local bytes at the profile's
memory rate (`op_time_s` of a read far above any per-op floor, divided out: the rate of a
streaming read); per stage, the op's floor once (`op_time_s` of nothing) and the all-reduce,
which carries 8 bytes, so it costs the profile's price of a tiny all-reduce over every device
of the job: across stages where there are several (the link between them), else across the
stage mesh's outermost dim (its devices farthest apart).
"""

from __future__ import annotations

import math

import torch

from autosbp.capturing.graph import TensorMeta
from autosbp.planner.boxing_prices import Prices
from autosbp.sbp import Mesh, NdSbp, local_shape

__all__ = ["CHECK_BYTES", "check_step_s", "gradient_check_s"]

CHECK_BYTES = 8  # the all-reduced int64 (`runtime.verify.finite`)
RATE_ELEMENTS = 1 << 28  # a read this long (1 GiB of fp32) prices the memory rate, not a floor


def gradient_check_s(
    meta: TensorMeta, layout: NdSbp, prices: Prices, mesh_shape: tuple[int, ...]
) -> float:
    """The max-norm's read of the local gradient of `meta` in `layout` (the parameter's own:
    ZeRO-1's shards are checked as the parameter's gradient), inside the one fused op."""
    local = math.prod(local_shape(meta.shape, layout, mesh_shape))
    n = RATE_ELEMENTS
    per_element_s = prices.op_time_s(n, n * meta.dtype.itemsize, meta.dtype) / n
    return local * per_element_s


def check_step_s(prices: Prices, mesh: Mesh, num_stages: int, stage_link: str) -> float:
    """Once per step and stage: the fused norm's floor, and the all-reduce over every device of
    `num_stages` stages on meshes like `mesh` (none on one device)."""
    floor_s = prices.op_time_s(0.0, 0.0, torch.float32)
    world = mesh.size * num_stages
    if world == 1:
        return floor_s
    link = stage_link if num_stages > 1 else mesh.link_classes[0]
    return floor_s + prices.collective_time_s("all_reduce", CHECK_BYTES, world, link)
