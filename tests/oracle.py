"""The single-device oracle of the training tests: eager torch, Adam, the same steps."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def train_single_device(
    module: torch.nn.Module, inputs: Sequence[torch.Tensor], steps: int, lr: float
) -> tuple[list[float], dict[str, np.ndarray]]:
    """Losses of `steps` Adam steps on `inputs`, and the state dict after them (as arrays)."""
    optimizer = torch.optim.Adam(module.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = module(*inputs)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: t.detach().numpy().copy() for name, t in module.state_dict().items()}
