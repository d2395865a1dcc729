"""A model whose evaluation differs from its training: dropout (a module and attention's
dropout_p) and batch norm with running statistics away from their initial values, so
`Engine.evaluate` shows whether it runs them in eval mode (tests/runtime/test_job_parts.py)."""

import torch
from torch import nn
from torch.nn import functional as F


class DropsAndNorms(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.5)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, 1)
        with torch.no_grad():  # running statistics no batch of the data would give
            self.norm.running_mean.uniform_(-1.0, 1.0)
            self.norm.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.norm(self.inp(x).transpose(1, 2)).transpose(1, 2)))
        q, k, v = self.qkv(h).unsqueeze(1).chunk(3, dim=-1)
        p = 0.3 if self.training else 0.0
        h = h + F.scaled_dot_product_attention(q, k, v, dropout_p=p).squeeze(1)
        return (self.out(h) - y).pow(2).mean()


def build(
    width: int = 8, batch: int = 8, seq: int = 4
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = DropsAndNorms(width)
    return model, (3.0 * torch.randn(batch, seq, width) + 2.0, torch.randn(batch, seq, 1))
