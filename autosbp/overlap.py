"""What compute hides of communication in a pipelined step: gradient sync behind the last
backward, parameter conversions behind the blocks' compute.

Lives here: the bucket, in-place gather and prefetch constants the plan states for the runtime, and
the hidden times the planner prices (`hidden_gather_s`, `hidden_sync_s`, `sync_buckets`,
`hidden_regather_s`). Lives
elsewhere: the actors and their firing rules (`schedule`), the ILP's linearization
(`planner.timing.objective`).

Rules:
- Gradient sync is fused: gradients that need the same collective are synced together in flat
  buckets of at most GRAD_BUCKET_BYTES (as DDP does), so a parameter pays its share (its bytes
  over the bucket's) of its bucket's collective. A bucket is launched as soon as the last
  micro-batch's backward has finished its gradients, so the sync overlaps that backward
  (`hidden_sync_s`).
- Parameter communication overlaps the blocks' compute (FSDP's prefetch): a stage of identical
  blocks converts the parameters of the next PREFETCH_BLOCKS block(s) while it computes one, in
  forward (their gathers) and in backward (the re-gathers of the blocks before it and the
  reduce-scatters of the gradients of the blocks after it). Per micro-batch, each of its blocks
  but one hides that much (`hidden_gather_s`); activations' boxing runs in line, but a linear's
  activation re-gathered in backward, which travels beside its input-gradient matmul
  (`hidden_regather_s`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

GRAD_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb (25 MB), torch docs
# A weight piece of at least this many bytes is gathered in place, in a collective of its
# own (`runtime.parallel.weight_gather`; priced so by `memory.gather_buffers.shares_gather_bucket`):
# from that size the bytes outweigh a collective's latency on the links priced, and a bucket
# would add copies into and out of its buffer (1.5x the piece) and the buffer's fresh pages.
# Measured on 2 gloo ranks: four 4 MiB pieces 7.9 ms in place vs 11.5 ms through a bucket,
# four 16 MiB 31 vs 85 ms; thirty 64 KiB pieces 5.2 ms in place vs 2.2 ms through a bucket.
GATHER_IN_PLACE_BYTES = 4 * 2**20
# Blocks whose parameters are converted ahead of the one computing: FSDP2's default (one
# block, `fully_shard`'s implicit prefetching), which the plan states for the runtime.
PREFETCH_BLOCKS = 1


# Ops whose activation input, re-gathered in backward (sequence parallelism: `runtime.parallel.
# regather`), is gathered beside their input-gradient matmul, which does not read it (Megatron-LM's
# column-parallel linear under sequence parallelism): the gather starts as the op's backward
# begins and is waited for just before the weight-gradient matmul (`hidden_regather_s`).
REGATHERED_BESIDE_INPUT_GRADIENT = frozenset({"aten.linear.default"})


def regathers_beside_input_gradient(op: str, index: int) -> bool:
    """Is input `index` of `op`, re-gathered in backward, gathered beside the op's input-gradient
    matmul? A linear's activation (input 0), not its weight."""
    return op in REGATHERED_BESIDE_INPUT_GRADIENT and index == 0


def hidden_regather_s(gather_s: np.ndarray, input_gradient_s: np.ndarray, overlap: float) -> Any:
    """The part of an activation's re-gather (`gather_s`) that its consumer's input-gradient
    matmul (`input_gradient_s`, started with it) hides: overlap x min(gather_s,
    input_gradient_s), elementwise, `overlap` the profile's fraction of communication that
    running beside compute hides (as `hidden_sync_s` with the whole gather in one piece)."""
    return overlap * np.minimum(gather_s, input_gradient_s)


def hidden_gather_s(comm_s: float, compute_s: float, slots: int, overlap: float) -> float:
    """The parameter communication of a stage's blocks that their compute hides, per
    micro-batch and direction: overlap x slots x min(comm_s, compute_s), where `comm_s` and
    `compute_s` are one block's (identical blocks), `slots` the blocks that have a block's
    compute to hide behind (all but one: the first block's forward gathers, and in backward the
    first re-gather and the last reduce-scatter, have none), and `overlap` the profile's
    fraction of communication that running beside compute hides.

    With prefetch, block j + 1's conversions run on the communication stream while block j
    computes, so a block takes the larger of its compute and its communication (with perfect
    overlap): the exposed communication of b blocks is b comm - (b - 1) min(comm, compute),
    whatever the depth (identical blocks: a deeper prefetch cannot beat the slower of the two
    streams). Linear in each argument where they do not cross, so the ILP prices it exactly
    as the larger of two linear parts (`timing.objective`).
    """
    return overlap * max(slots, 0) * min(comm_s, compute_s)


def hidden_sync_s(sync_s: float, backward_s: float, buckets: int, overlap: float) -> float:
    """The part of a stage's gradient sync (`sync_s`, in `buckets` buckets) that its last
    micro-batch's backward (`backward_s`) hides: overlap x (1 - 1/buckets) x min(sync_s,
    backward_s), where `overlap` (the profile's, in [0, 1]) is the fraction of communication
    time that running beside compute hides on this hardware.

    With k equal buckets ready at even intervals of backward, the first starts after 1/k of it
    and the last only when it ends, so with perfect overlap the exposed sync is max(sync / k,
    sync - (1 - 1/k) x backward) = sync - hidden. One bucket hides nothing. Linear in each
    argument where sync and backward do not cross, so the planner's ILP prices it exactly as a
    max of two linear parts.
    """
    return overlap * (1.0 - 1.0 / max(buckets, 1)) * min(sync_s, backward_s)


def sync_buckets(param_bytes: int) -> int:
    """How many buckets the gradients of `param_bytes` of parameters fill, at least one."""
    return max(1, math.ceil(param_bytes / GRAD_BUCKET_BYTES))
