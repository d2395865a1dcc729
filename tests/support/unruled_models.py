"""A model whose work is mostly an op without an SBP rule (`torch.special.erfcx`, rare enough
that no rule covers it), for the replicated-FLOPs statement of issue #29."""

import torch
from torch import nn


class Unruled(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.special.erfcx(self.fc(x))
        for _ in range(8):  # most of the FLOPs: elementwise ops after the one without a rule
            h = torch.special.erfcx(h * 0.5)
        return h.mean()


def build(width: int = 16) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return Unruled(width), (torch.randn(8, width),)
