"""A builder that moves its model as training scripts do (issue #29): `.to("cpu")`,
`.to(torch.device("cpu"))`, `.cuda()`, `.to(torch.float64)`, or no move (`none`)."""

import torch
from torch import nn


class WithLoss(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.body(x) - y).pow(2).mean()


def build(how: str = "none") -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model: nn.Module = WithLoss(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    x, y = torch.randn(4, 4), torch.randn(4, 1)
    if how == "cpu":
        model, x, y = model.to("cpu"), x.to("cpu"), y.to("cpu")
    elif how == "device":
        model = model.to(torch.device("cpu"))
    elif how == "cuda":
        model, x, y = model.cuda(), x.cuda(), y.cuda()
    elif how == "double":
        model, x, y = model.to(torch.float64), x.double(), y.to("cpu", torch.float64)
    return model, (x, y)
