"""Cutting a batch into micro-batches: the one rule capture and the runtime share.

Lives here: `split_micro_batches`. The planner captures the graph of one micro-batch
(`capturing.export.capture_micro_batch`, `capturing.rebatch`) and the runtime runs that graph
once per piece (`runtime.engine`); both cut the batch here, so the graph a plan was made for is
the graph each micro-batch runs. Lives elsewhere: when each micro-batch runs (`schedule`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from autosbp.errors import SbpError


def split_micro_batches(
    inputs: Sequence[torch.Tensor], micro_batches: int
) -> list[tuple[torch.Tensor, ...]]:
    """Cut every input along dim 0 (the batch) into `micro_batches` equal, consecutive pieces.

    Training on the pieces one after another, each loss scaled by 1/micro_batches, gives the
    gradients of the whole batch when the loss is a mean over the batch (torch's default
    reductions); a loss summed over the batch would need no scaling.
    """
    if micro_batches < 1:
        raise SbpError(f"micro_batches must be at least 1, got {micro_batches}.")
    if micro_batches == 1:
        return [tuple(inputs)]
    for position, x in enumerate(inputs):
        if x.dim() == 0 or x.shape[0] % micro_batches:
            raise SbpError(
                f"input #{position} of shape {tuple(x.shape)} cannot be cut into {micro_batches} "
                "micro-batches along dim 0 (the batch); use a batch divisible by the micro-batch count."
            )
    pieces = [x.chunk(micro_batches, dim=0) for x in inputs]
    return [tuple(p[k] for p in pieces) for k in range(micro_batches)]
