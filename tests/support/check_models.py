"""Small models that tell a sound `--check` from a naive one (tests/runtime/test_check.py, bench/check.py).

Lives here: one builder per case, each returning `(model, example_inputs)` where
`model(*example_inputs)` is the training loss, loadable as `tests/support/check_models.py:NAME`:
- `attention`: separate q, k, v projections with biases; softmax ignores a constant per row,
  so the key bias's exact gradient is 0 (BERT, ViT, Qwen2 have one);
- `conv_bn`: a convolution with a bias feeding BatchNorm, which removes any constant per
  channel, so that bias's exact gradient is 0;
- `dropout`: an MLP with torch.nn.Dropout modules (the check turns them off);
- `functional_dropout`: F.dropout with its own probability (the check must refuse it);
- `grouped`: a grouped matmul (torch's `grouped_mm`), which has no float64 kernel on the CPU
  (Hugging Face Mixtral's experts run on it);
- `float32_only`: a forward that refuses any other dtype in Python (no op to run in fp32);
- `buffers`: a buffer of every dtype the check compares (issue #48): a bool causal mask
  (GPT-BigCode's), an integer permutation, and a complex running spectrum the forward updates
  (equal where exact, within a bound where rounded).
Lives elsewhere: the zoo (`autosbp.zoo`), third-party models (tests/support/real_models.py).

Invariants: the same arguments give bit-identical weights and inputs (seeded; the global RNG is
left as it was); sizes are tiny and divide by 2 and 4 (batch, heads, hidden).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ModelAndInputs = tuple[nn.Module, tuple[torch.Tensor, ...]]


class Attention(nn.Module):
    """Embedding, one self-attention with separate biased q/k/v projections, a head, CE."""

    def __init__(self, vocab: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, hidden)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(hidden, hidden) for _ in range(4)
        )
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        b, t, c = x.shape
        q, k, v = (
            p(x).view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, t, c))
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def attention(
    batch: int = 4, seq: int = 8, vocab: int = 32, hidden: int = 16, heads: int = 2, seed: int = 0
) -> ModelAndInputs:
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Attention(vocab, hidden, heads)
    return model, (
        torch.randint(0, vocab, (batch, seq), generator=g),
        torch.randint(0, vocab, (batch, seq), generator=g),
    )


class ConvBn(nn.Module):
    """conv (with bias) -> BatchNorm -> ReLU -> mean over space -> Linear -> CE."""

    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1, bias=True)
        self.bn = nn.BatchNorm2d(channels)
        self.fc = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(images)))
        return F.cross_entropy(self.fc(h.mean(dim=(2, 3))), labels)


def conv_bn(
    batch: int = 8, channels: int = 8, classes: int = 4, image: int = 6, seed: int = 0
) -> ModelAndInputs:
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = ConvBn(channels, classes)
    return model, (
        torch.randn(batch, 3, image, image, generator=g),
        torch.randint(0, classes, (batch,), generator=g),
    )


class DropoutMlp(nn.Module):
    """Linear -> GELU -> Dropout -> Linear -> MSE; `functional` draws its own mask instead."""

    def __init__(self, features: int, hidden: int, p: float, functional: bool) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(features, hidden), nn.Linear(hidden, 1)
        self.drop = nn.Dropout(p)
        self.p, self.functional = p, functional

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        h = F.dropout(h, self.p, training=True) if self.functional else self.drop(h)
        return F.mse_loss(self.fc2(h), target)


def _dropout_mlp(
    batch: int, features: int, hidden: int, functional: bool, seed: int
) -> ModelAndInputs:
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = DropoutMlp(features, hidden, 0.5, functional)
    return model, (torch.randn(batch, features, generator=g), torch.randn(batch, 1, generator=g))


def dropout(batch: int = 8, features: int = 8, hidden: int = 16, seed: int = 0) -> ModelAndInputs:
    return _dropout_mlp(batch, features, hidden, False, seed)


def functional_dropout(
    batch: int = 8, features: int = 8, hidden: int = 16, seed: int = 0
) -> ModelAndInputs:
    return _dropout_mlp(batch, features, hidden, True, seed)


class Grouped(nn.Module):
    """Tokens grouped by sequence position (so a cut of the batch keeps each token's expert),
    each group through its own expert weight, then MSE. Run eagerly, one grouped matmul
    (`F.grouped_mm`, fp32 and bf16 only); traced, one matmul per expert, as Hugging Face's
    experts do (`transformers.integrations.moe`: grouped_mm, or its fallback under tracing)."""

    def __init__(self, experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, hidden, hidden) / hidden**0.5)
        self.experts = experts

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        tokens = x.transpose(0, 1).flatten(0, 1)  # position-major: groups are positions
        size = tokens.shape[0] // self.experts
        if torch.compiler.is_compiling():
            y = torch.cat([g @ w for g, w in zip(tokens.split(size), self.weight, strict=True)])
        else:
            offsets = torch.arange(1, self.experts + 1, dtype=torch.int32) * size
            y = F.grouped_mm(tokens, self.weight, offs=offsets)
        return F.mse_loss(y, target.transpose(0, 1).flatten(0, 1))


def grouped(
    batch: int = 4, seq: int = 4, hidden: int = 8, experts: int = 2, seed: int = 0
) -> ModelAndInputs:
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Grouped(experts, hidden)
    return model, (
        torch.randn(batch, seq, hidden, generator=g),
        torch.randn(batch, seq, hidden, generator=g),
    )


class Float32Only(nn.Module):
    """A linear layer and MSE, refusing inputs of any dtype but float32 in Python."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.fc = nn.Linear(features, 1)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"float32 inputs only, got {x.dtype}")
        return F.mse_loss(self.fc(x), target)


def float32_only(batch: int = 8, features: int = 4, seed: int = 0) -> ModelAndInputs:
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Float32Only(features)
    return model, (torch.randn(batch, features, generator=g), torch.randn(batch, 1, generator=g))


class Buffers(nn.Module):
    """Attention scores masked by a bool causal buffer, positions read through an int64
    buffer, and a complex64 running spectrum of the hidden state updated in forward (as
    BatchNorm updates its statistics), then MSE."""

    def __init__(self, seq: int, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.mask = nn.Buffer(torch.tril(torch.ones(seq, seq, dtype=torch.bool)), persistent=False)
        self.order = nn.Buffer(torch.arange(seq).flip(0))
        self.spectrum = nn.Buffer(torch.zeros(hidden // 2 + 1, dtype=torch.complex64))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)[:, self.order]
        scores = (h @ h.transpose(1, 2)).masked_fill(~self.mask, float("-inf"))
        h = scores.softmax(-1) @ h
        with torch.no_grad():
            spectrum = torch.fft.rfft(h.mean((0, 1)))
            self.spectrum.mul_(0.9).add_(0.1 * spectrum.to(self.spectrum.dtype))
        return F.mse_loss(h, target)


def buffers(batch: int = 4, seq: int = 8, hidden: int = 8, seed: int = 0) -> ModelAndInputs:
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Buffers(seq, hidden)
    return model, (
        torch.randn(batch, seq, hidden, generator=g),
        torch.randn(batch, seq, hidden, generator=g),
    )
