"""A model whose work is in good part an op without an SBP rule that no split reproduces
(`torch.prod` of a whole tensor: a product of partial products is no sum, and a split's local
products differ), for the replicated-FLOPs statement of issue #29."""

import torch
from torch import nn


class Unruled(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        for _ in range(8):  # a share of the FLOPs that no device can split
            h = h * torch.prod(h).tanh()
        return h.mean()


def build(width: int = 16) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return Unruled(width), (torch.randn(8, width),)
