"""Boxing: converting a tensor between two nD SBPs, as steps the planner prices and the runtime runs.

Lives here, one module per responsibility:
- `steps`: what a step is (`StepKind`, `BoxingStep`, `Transfer`), the one table of 1D
  conversions (`TRANSITIONS`), a step's bytes and its backward (`dual_step`, `dual_nd_sbp`);
- `chains`: choosing the chain of steps for a conversion (`plan_boxing`) and its prices
  (`price_boxing`);
- `simulate`: what the steps do to local tensors in pure torch, one process for all ranks
  (`simulate_boxing`, the oracle the runtime's collectives are tested against).
Lives elsewhere: the same steps on torch.distributed (`runtime.execute.collectives`), a step's time in
seconds (`costmodel`), where boxing is needed and what it costs a plan (`planner.costs`).

The names most callers need are re-exported here: `from autosbp.boxing import plan_boxing`.
"""

from autosbp.boxing.chains import StepPrice, canonical_shape, plan_boxing, price_boxing
from autosbp.boxing.simulate import simulate_boxing
from autosbp.boxing.steps import (
    TRANSITIONS,
    BoxingStep,
    StepKind,
    Transfer,
    dual_nd_sbp,
    dual_step,
    local_box,
)

__all__ = [
    "TRANSITIONS",
    "BoxingStep",
    "StepKind",
    "StepPrice",
    "Transfer",
    "canonical_shape",
    "dual_nd_sbp",
    "dual_step",
    "local_box",
    "plan_boxing",
    "price_boxing",
    "simulate_boxing",
]
