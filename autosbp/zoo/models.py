"""The zoo's dense models: `mlp`, `gpt`, `widedeep`, `resnet`, each a module and its builder.

Lives here: the modules and `build_<name>(generator, **kwargs) -> (model, make_inputs)`, the
builders `autosbp.zoo.build_model` calls under the seed and device it was given. Lives
elsewhere: the mixture-of-experts GPT (`zoo.moe`), building, loading and naming models
(`autosbp.zoo`). Reference: nanoGPT (model.py) for `gpt`; Cheng et al. 2016 (Wide & Deep) for
`widedeep`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from autosbp.errors import CaptureError


# ----------------------------------------------------------------------------------------- mlp
class MlpBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))


class Mlp(nn.Module):
    """in -> Linear -> [Linear + GELU] x layers -> Linear -> MSE against `target`."""

    def __init__(self, features: int, hidden: int, layers: int, outputs: int) -> None:
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.blocks = nn.ModuleList(MlpBlock(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, outputs)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return F.mse_loss(self.head(h), target)


def build_mlp(
    g: torch.Generator,
    *,
    layers: int = 3,
    hidden: int = 64,
    features: int = 32,
    outputs: int = 8,
    batch: int = 8,
) -> tuple[nn.Module, Callable[[], tuple[torch.Tensor, ...]]]:
    model = Mlp(features, hidden, layers, outputs)
    return model, lambda: (
        torch.randn(batch, features, generator=g),
        torch.randn(batch, outputs, generator=g),
    )


# ----------------------------------------------------------------------------------------- gpt
class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class GptMlp(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class GptBlock(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = GptMlp(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Gpt(nn.Module):
    """nanoGPT without dropout: token + position embeddings, blocks, final LN, LM head, CE."""

    def __init__(
        self, layers: int, hidden: int, heads: int, vocab: int, seq: int, tied: bool
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(GptBlock(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def build_gpt(
    g: torch.Generator,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    vocab: int = 128,
    seq: int = 16,
    batch: int = 4,
    tied: bool = False,
) -> tuple[nn.Module, Callable[[], tuple[torch.Tensor, ...]]]:
    if hidden % heads:
        raise CaptureError(f"gpt: hidden={hidden} must be divisible by heads={heads}.")
    model = Gpt(layers, hidden, heads, vocab, seq, tied)
    return model, lambda: (
        torch.randint(0, vocab, (batch, seq), generator=g),
        torch.randint(0, vocab, (batch, seq), generator=g),
    )


# ------------------------------------------------------------------------------------ widedeep
class WideDeep(nn.Module):
    """Wide (linear on dense features) + deep (MLP on dense + one embedding per table), BCE."""

    def __init__(
        self, tables: int, rows: int, dim: int, dense: int, hidden: int, layers: int
    ) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(rows, dim) for _ in range(tables))
        self.wide = nn.Linear(dense, 1)
        widths = [dense + tables * dim] + [hidden] * layers
        self.deep = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))
        self.out = nn.Linear(hidden, 1)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        embedded = [table(ids[:, i]) for i, table in enumerate(self.tables)]
        h = torch.cat([dense, *embedded], dim=1)
        for layer in self.deep:
            h = F.relu(layer(h))
        logit = self.wide(dense) + self.out(h)
        return F.binary_cross_entropy_with_logits(logit, label)


def build_widedeep(
    g: torch.Generator,
    *,
    tables: int = 4,
    rows: int = 1000,
    dim: int = 16,
    dense: int = 13,
    hidden: int = 64,
    layers: int = 2,
    batch: int = 8,
) -> tuple[nn.Module, Callable[[], tuple[torch.Tensor, ...]]]:
    model = WideDeep(tables, rows, dim, dense, hidden, layers)
    return model, lambda: (
        torch.randn(batch, dense, generator=g),
        torch.randint(0, rows, (batch, tables), generator=g),
        torch.randint(0, 2, (batch, 1), generator=g).float(),
    )


# -------------------------------------------------------------------------------------- resnet
class ResBlock(nn.Module):
    """relu(x + bn(conv(relu(bn(conv(x))))))."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(h)))


class ResNet(nn.Module):
    """Stem conv + BN + ReLU, residual blocks, global average pool, Linear, cross-entropy."""

    def __init__(self, channels: int, blocks: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.blocks = nn.ModuleList(ResBlock(channels) for _ in range(blocks))
        self.fc = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.stem(images)))
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.fc(h.mean(dim=(2, 3))), labels)


def build_resnet(
    g: torch.Generator,
    *,
    channels: int = 8,
    blocks: int = 2,
    classes: int = 10,
    image: int = 8,
    batch: int = 4,
) -> tuple[nn.Module, Callable[[], tuple[torch.Tensor, ...]]]:
    model = ResNet(channels, blocks, classes)
    return model, lambda: (
        torch.randn(batch, 3, image, image, generator=g),
        torch.randint(0, classes, (batch,), generator=g),
    )
