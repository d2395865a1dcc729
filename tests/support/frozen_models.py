"""Models with frozen parameters (issue #29): a frozen first layer (`part`), LoRA-style
adapters on a frozen base (`lora`), everything frozen (`all`), none frozen (`none`); `build`
for `autosbp train tests/support/frozen_models.py:build --model-args kind=...`."""

import torch
from torch import nn


class LoRALinear(nn.Module):
    """A frozen base linear plus a trainable low-rank update (B starts at 0, as LoRA's does;
    here at small random values so that A's gradient is not 0)."""

    def __init__(self, d_in: int, d_out: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, d_in) * 0.1)
        self.b = nn.Parameter(torch.randn(d_out, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


class Net(nn.Module):
    def __init__(self, kind: str, width: int) -> None:
        super().__init__()
        if kind == "lora":
            self.l1, self.l2 = LoRALinear(8, width, 2), LoRALinear(width, 4, 2)
        else:
            self.l1, self.l2 = nn.Linear(8, width), nn.Linear(width, 4)
        if kind == "part":
            self.l1.requires_grad_(False)
        if kind == "all":
            self.requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.l2(torch.tanh(self.l1(x))) - y).pow(2).mean()


def build(kind: str = "part", width: int = 16) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return Net(kind, width), (torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g))
