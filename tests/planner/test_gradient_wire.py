"""The gathered gradient a weight's reduce-scatter holds, as the planner prices it.

`memory.device_bytes.wire_pair_bytes` against the runtime's own wire
(`runtime.parallel.prefetch.GatherSchedule.reduce`: `grad.to(reduce_dtype).contiguous()`, held
by the started reduce-scatter until the next unit's): the gathered piece in the dtype the recipe
reduces it in (`timing.recipe.Recipe.wire`), where a collective gathers the weight; 0 where the
conversion is a view (no reduce-scatter). In a step of one micro-batch, less the shard's
gradient the parameter is given only when that reduce-scatter is waited for (its master's
dtype). Lives elsewhere: the measured peaks this pricing serves (tests/runtime/test_memory.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from autosbp.capturing.graph import TensorMeta
from autosbp.plan.values import master_dtype
from autosbp.planner.memory.device_bytes import wire_pair_bytes
from autosbp.planner.timing.recipe import Recipe
from autosbp.sbp import Broadcast, NdSbp, Split, local_shape

SHAPE, MESH = (128, 64), (4,)
GATHERED: NdSbp = (Broadcast(),)
SHARDED: NdSbp = (Split(0),)

# (weight dtype, reduce dtype): the mixed recipes, their bf16 reduce, and fp32 training
RECIPES = [
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.bfloat16),
    (torch.float32, torch.float32),
]


def _runtime_bytes(
    dtype: torch.dtype, reduce: torch.dtype, src: NdSbp, dst: NdSbp, less_gradient: bool
) -> int:
    """The wire the runtime holds for a weight gathered from `src` to `dst` (a slice, or no
    conversion, has no reduce-scatter), less the shard's gradient made after it."""
    if math.prod(local_shape(SHAPE, dst, MESH)) <= math.prod(local_shape(SHAPE, src, MESH)):
        return 0
    grad = torch.zeros(local_shape(SHAPE, dst, MESH), dtype=dtype)
    wire = grad.to(Recipe(reduce).wire(TensorMeta(SHAPE, dtype)).dtype).contiguous()
    shard = torch.zeros(local_shape(SHAPE, src, MESH), dtype=master_dtype(dtype))
    return max(wire.nbytes - shard.nbytes, 0) if less_gradient else wire.nbytes


@pytest.mark.parametrize("less_gradient", [False, True], ids=["micro-batches", "one"])
@pytest.mark.parametrize(("dtype", "reduce"), RECIPES, ids=lambda d: str(d).split(".")[-1])
def test_wire_bytes_are_the_runtimes_wire(
    dtype: torch.dtype, reduce: torch.dtype, less_gradient: bool
) -> None:
    meta = TensorMeta(SHAPE, dtype)
    layouts = [SHARDED, GATHERED]
    matrix = wire_pair_bytes(
        [(p,) for p in layouts], [(q,) for q in layouts], [(0, 0)], [meta],
        [Recipe(reduce).wire(meta).dtype], MESH, less_gradient=less_gradient,
    )  # fmt: skip
    expected = [
        [_runtime_bytes(dtype, reduce, p, q, less_gradient) for q in layouts] for p in layouts
    ]
    assert matrix.tolist() == expected
