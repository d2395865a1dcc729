"""The price of the runtime's non-finite check, part of every step's update.

Lives here: `gradient_check_s` (one parameter's share: the max-norm of its local gradient) and
`check_reduce_s` (the one all-reduce of one integer over the world). Lives elsewhere: the check
itself (`runtime.verify.finite.first_non_finite`, run after the gradient sync and before the
optimizer, inside the runtime's "optimizer" span), where these are added (`candidates`, per
parameter candidate into its update; `stage_terms.StageTerms.add_check`, once per stage).

Model: `torch._foreach_norm(ord=inf)` reads each local gradient once and writes a scalar: a
memory-bound read of the gradient's local bytes, one comparison per element (the profile's
`op_time_s`); the all-reduce carries 8 bytes, so it costs the profile's latency of an
all-reduce over every device of the job: across stages where there are several (the link
between them), else across the stage mesh's outermost dim (its devices farthest apart).
"""

from __future__ import annotations

import math

from autosbp.capturing.graph import TensorMeta
from autosbp.planner.boxing_prices import Prices
from autosbp.sbp import Mesh, NdSbp, local_shape

__all__ = ["CHECK_BYTES", "check_reduce_s", "gradient_check_s"]

CHECK_BYTES = 8  # the all-reduced int64 (`runtime.verify.finite`)


def gradient_check_s(
    meta: TensorMeta, layout: NdSbp, prices: Prices, mesh_shape: tuple[int, ...]
) -> float:
    """The max-norm of the local gradient of `meta` in `layout` (the parameter's own: ZeRO-1's
    shards are checked as the parameter's gradient)."""
    local = math.prod(local_shape(meta.shape, layout, mesh_shape))
    return prices.op_time_s(local, local * meta.dtype.itemsize, meta.dtype)


def check_reduce_s(prices: Prices, mesh: Mesh, num_stages: int, stage_link: str) -> float:
    """The check's all-reduce over every device of `num_stages` stages on meshes like `mesh`
    (0 on one device: no collective runs)."""
    world = mesh.size * num_stages
    if world == 1:
        return 0.0
    link = stage_link if num_stages > 1 else mesh.link_classes[0]
    return prices.collective_time_s("all_reduce", CHECK_BYTES, world, link)
