"""Where a parameter's gather runs in a shared bucket, and the staging bytes that bucket holds.

Lives here: `gathers_in_bucket` (does a parameter gather in place in the fused bucket, the
runtime's own rule), `shares_gather_bucket` (and is its weight piece small enough to share
it) and `gather_staging_bytes` (the bucket's staging buffer, held only while it gathers).
Lives elsewhere: the gather's time (`timing.param_candidates.parameter_prices`), the bucket the
runtime runs (`runtime.parallel.weight_gather`), the constraint these bytes enter
(`problem.build.gather_constraints`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from autosbp.capturing.graph import TensorMeta
from autosbp.overlap import GATHER_IN_PLACE_BYTES
from autosbp.rules import NdSignature
from autosbp.sbp import NdSbp, Split, local_shape


def gathers_in_bucket(
    layout: NdSbp, state_layout: NdSbp, shape: Sequence[int], mesh_shape: Sequence[int]
) -> bool:
    """Whether the runtime gathers a parameter's updated shard (in `state_layout`) back into
    its weight (in `layout`) inside a bucket (`runtime.parallel.weight_gather`): where the
    layouts differ on one mesh dim d only, splitting tensor dim k there, and every member's
    shard is a contiguous slot of its weight piece. Inside: no later mesh dim of more than one
    device splits k in `layout` (pieces are cut in mesh-dim order, so a later cut would cut
    across d's). Contiguous: every dim of the piece before k holds one element."""
    differ = [d for d, (a, b) in enumerate(zip(layout, state_layout, strict=True)) if a != b]
    split = state_layout[differ[0]] if len(differ) == 1 else None
    if not isinstance(split, Split):
        return False
    d, k = differ[0], split.dim
    for e in range(d + 1, len(layout)):
        sbp = layout[e]
        if isinstance(sbp, Split) and sbp.dim == k and mesh_shape[e] > 1:
            return False
    piece = local_shape(tuple(shape), layout, tuple(mesh_shape))
    return all(n == 1 for n in piece[:k])


def shares_gather_bucket(
    meta: TensorMeta, layout: NdSbp, state_layout: NdSbp, mesh_shape: Sequence[int]
) -> bool:
    """Whether the gather of the parameter `meta` shares a bucket's buffer with others
    (`gathers_in_bucket` and its weight piece under `GATHER_IN_PLACE_BYTES`); else it is a
    collective of its own, in place where `gathers_in_bucket`."""
    if not gathers_in_bucket(layout, state_layout, meta.shape, mesh_shape):
        return False
    piece = math.prod(local_shape(meta.shape, layout, tuple(mesh_shape)))
    return piece * meta.dtype.itemsize < GATHER_IN_PLACE_BYTES


def gather_staging_bytes(
    meta: TensorMeta,
    candidates: Sequence[NdSignature],
    states: Sequence[NdSbp | None],
    mesh_shape: Sequence[int],
) -> np.ndarray:
    """Per candidate, what the parameter takes of a weight-gather bucket's buffer
    (`runtime.parallel.weight_gather`: its weight piece, every member's slot, in the weight's
    dtype: the compute copy's under a mixed recipe) where `shares_gather_bucket`, else 0: held
    only while the bucket gathers, after the optimizer's step."""
    itemsize = meta.dtype.itemsize
    out = np.zeros(len(candidates))
    for i, (sig, q) in enumerate(zip(candidates, states, strict=True)):
        p = sig.outputs[0]
        if q is not None and shares_gather_bucket(meta, p, q, mesh_shape):
            out[i] = math.prod(local_shape(meta.shape, p, tuple(mesh_shape))) * itemsize
    return out
