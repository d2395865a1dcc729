"""What a training step runs around each parameter, as the planner prices it: the precision
recipe's gradients and casts, the gradient sync's dtype, clipping.

Lives here: `Recipe` (the sync's dtype and whether the update clips) and the per-element
figures it implies: the gradient a backward accumulates into and the sync carries, the bytes
one micro-batch's accumulation moves, and what the update adds to the optimizer's own pass.
Lives elsewhere: the recipe's record in the plan (`autosbp.plan.Precision`,
`Plan.clips_gradients`), what the runtime runs (`runtime.parallel.precision`: fp32 masters,
compute copies, the bridge; `runtime.parallel.grad_sync`: the reduce dtype;
`runtime.parallel.grad_norm`: the norm and the clip), the per-parameter prices that read it
(`timing.param_candidates`), the bytes held (`memory.device_bytes`: by the parameter's dtype
alone: below fp32 the recipe is always mixed).

Invariants, per parameter element of dtype d (the plan's compute dtype):
- below fp32 the recipe is mixed: the gradient is accumulated in fp32 (4 bytes) from each
  micro-batch's gradient in d, and the sync sums it in `reduce_dtype` (fp32 unless asked for
  bf16); in fp32 the gradient is d itself;
- one micro-batch's accumulation reads its gradient (d) and the accumulated one and writes
  the accumulated one (`accumulate_bytes`);
- the update adds to the optimizer's pass: under a mixed recipe the compute copy written from
  the master (read 4, write d), with clipping one read and one write of the gradient
  (`update_bytes`). The norm's read is the non-finite check's (`timing.finite_check`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autosbp.capturing.graph import TensorMeta
from autosbp.plan.values import master_dtype

__all__ = ["PLAIN", "Recipe"]


@dataclass(frozen=True, slots=True)
class Recipe:
    """The sync's dtype (`reduce_dtype`: fp32, or bf16 to halve it) and clipping."""

    reduce_dtype: torch.dtype = torch.float32
    clips: bool = False

    @staticmethod
    def gradient_dtype(dtype: torch.dtype) -> torch.dtype:
        """The dtype a parameter of `dtype` accumulates its gradient in (its master's)."""
        return master_dtype(dtype)

    def wire(self, meta: TensorMeta) -> TensorMeta:
        """The gradient of `meta` as the sync carries it."""
        grad = self.gradient_dtype(meta.dtype)
        dtype = self.reduce_dtype if self.reduce_dtype.itemsize < grad.itemsize else grad
        return TensorMeta(meta.shape, dtype)

    def accumulate_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one micro-batch's gradient add moves per element."""
        return dtype.itemsize + 2 * self.gradient_dtype(dtype).itemsize

    def update_bytes(self, dtype: torch.dtype) -> int:
        """Bytes the update moves per element beside the optimizer's pass."""
        cast = 4 + dtype.itemsize if dtype.itemsize < 4 else 0
        clip = 2 * self.gradient_dtype(dtype).itemsize if self.clips else 0
        return cast + clip


PLAIN = Recipe()  # fp32 sync, no clipping: the default of every pricing function
