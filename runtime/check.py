"""The single-device check of a training job: a reference trained beside the plan, compared.

Lives here: `Reference` (the model trained on one device with the same optimizer, beside a
float64 copy that tells which elements have vanishing exact gradients) and its comparison with
the plan's full state. Lives elsewhere: the job that runs it on rank 0 (`runtime.train`), the
verdict printed by `autosbp train --check` (`autosbp.commands.train`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]

# fp32 cannot resolve a gradient below about this fraction of its tensor's largest one (its
# rounding noise is larger). Adam divides each gradient by its own running size, so once an
# element's exact gradient falls below that (an attention key bias: softmax ignores a constant
# per row, so its exact gradient is 0), its fp32 steps are driven by noise and no two summation
# orders agree. The exact gradients come from a float64 copy of the reference; the check leaves
# such elements out from the first step their exact gradient vanished, and reports how many.
VANISHING_GRAD_FRACTION = 1e-6


class Reference:
    """The same model trained on one device with the same optimizer (the oracle), beside a
    float64 copy that tells which elements have vanishing exact gradients."""

    def __init__(self, model: torch.nn.Module, optimizer: OptimizerFactory) -> None:
        import copy

        self.model = copy.deepcopy(model)
        self.exact = copy.deepcopy(model).double()
        self.optimizers = [optimizer(m.parameters()) for m in (self.model, self.exact)]
        self.vanishing = {
            name: torch.zeros_like(p, dtype=torch.bool) for name, p in self.model.named_parameters()
        }

    def step(self, inputs: Any) -> float:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss = self.model(*inputs)
        loss.backward()
        self.exact(*(x.double() if x.is_floating_point() else x for x in inputs)).backward()
        for name, p in self.exact.named_parameters():
            grad = p.grad.abs() if p.grad is not None else torch.zeros_like(p)
            self.vanishing[name] |= grad <= VANISHING_GRAD_FRACTION * grad.max()
        for optimizer in self.optimizers:
            optimizer.step()
        return float(loss.detach())

    def max_rel_diff(self, full: dict[str, torch.Tensor]) -> float:
        """Largest ||p - q|| / ||q|| over parameters (q: the fp32 reference), on the elements
        whose exact gradient never vanished (see VANISHING_GRAD_FRACTION)."""
        worst = 0.0
        for name, ref in self.model.named_parameters():
            keep = ~self.vanishing[name]
            if keep.any():
                got, want = full[name][keep], ref.detach()[keep]
                worst = max(worst, float((got - want).norm() / want.norm().clamp_min(1e-30)))
        return worst

    def excluded_elements(self) -> int:
        return int(sum(int(mask.sum()) for mask in self.vanishing.values()))
