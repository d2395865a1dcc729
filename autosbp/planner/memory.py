"""Per-device memory of a strategy: model states by their layout, saved activations by theirs.

Lives here: bytes per parameter element for each optimizer and dtype, which ops keep their
output for backward, and the per-candidate bytes the ILP's memory constraint sums.
Lives elsewhere: time prices (`costs`), the constraint itself (`ilp.MemoryConstraint`).

Model (Rajbhandari et al. 2020, ZeRO, section 3.1, for model states; Korthikanti et al. 2022
section 4 for activations):
- a parameter element costs its value and its gradient in the training dtype, plus optimizer
  states in fp32 (Adam: 2, SGD with momentum: 1, SGD: 0) and an fp32 master copy when training
  in bf16/fp16: 16 bytes per element for Adam in either precision;
- every compute op that is not a view keeps its output until backward (an upper bound of what
  autograd saves), times the micro-batches in flight on its stage;
- all of it divided by the layout: a device holds its local shard only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from autosbp.capturing.flops import op_family
from autosbp.capturing.graph import Role
from autosbp.rules import NdSignature
from autosbp.sbp import local_shape

OPTIMIZER_STATES = {"adam": 2, "sgd_momentum": 1, "sgd": 0}


def parameter_bytes_per_element(dtype: torch.dtype, optimizer: str) -> int:
    """Value + gradient in `dtype`, optimizer states (and an fp32 master copy) in fp32."""
    itemsize = dtype.itemsize
    master = 0 if dtype == torch.float32 else 4
    return 2 * itemsize + master + 4 * OPTIMIZER_STATES[optimizer]


def candidate_bytes(
    attrs: Mapping[str, Any],
    signature: NdSignature,
    mesh_shape: tuple[int, ...],
    *,
    optimizer: str,
    in_flight: int,
) -> float:
    """Bytes one device keeps for this node under `signature` (see the module header)."""
    role = attrs["role"]
    if role is Role.PARAMETER:
        meta = attrs["outputs"][0]
        local = math.prod(local_shape(meta.shape, signature.outputs[0], mesh_shape))
        return float(local * parameter_bytes_per_element(meta.dtype, optimizer))
    if role is Role.BUFFER or role is Role.INPUT:
        meta = attrs["outputs"][0]
        return float(
            math.prod(local_shape(meta.shape, signature.outputs[0], mesh_shape))
            * meta.dtype.itemsize
        )
    if role is not Role.COMPUTE or op_family(attrs["op"]) == "view":  # views alias their input
        return 0.0
    saved = sum(
        math.prod(local_shape(meta.shape, nd, mesh_shape)) * meta.dtype.itemsize
        for meta, nd in zip(attrs["outputs"], signature.outputs, strict=True)
    )
    return float(saved * in_flight)
