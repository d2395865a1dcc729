"""Pure-torch reproductions of what third-party models do at capture (issue #17), shared by the
capture, planner and runtime tests of those behaviours.

Lives here: small modules, each `model(*inputs)` returning a loss, and `build(case, device)`
(seeded weights, inputs drawn on the CPU and moved to `device`). Each reproduces one construct
of Hugging Face, torchvision or timm models in a few lines: attention's
`transpose().contiguous()`, `x.to(device)` and `arange(device=...)`, T5's indexing assignments
with a Python scalar, HF's empty KV-cache constant and non-persistent buffers, in-place
activations and residual adds, a `torch.no_grad()` region (HF's rotary embeddings),
RMSNorm's `type_as` and a loop over a `set` (Gemma3's rotary tables, issue #48). Lives elsewhere: the tests
(tests/capturing/test_capture_canonical.py, tests/rules/test_inplace_plans.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

BATCH, SEQ, HIDDEN, HEADS = 4, 8, 16, 2


class Attention(nn.Module):
    """HF's attention tail: SDPA, transpose, contiguous, view (view needs the copy on meta)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in self.qkv(x).split(c, 2))
        h = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).contiguous().view(b, t, c)
        return F.mse_loss(self.out(h), y)


class DeviceMoves(nn.Module):
    """`x.to(device)`, `arange(device=...)` and `new_zeros`, as HF's masks and positions do."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device).to(x.device, torch.float32)
        h = self.fc(x.to(self.fc.weight.device)) + positions[None, :, None]
        return F.mse_loss(h + x.new_zeros(()), y)


class ShiftRight(nn.Module):
    """T5's `_shift_right`: assignments into a fresh tensor through views, one of a scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, HIDDEN)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        shifted = ids.new_zeros(ids.shape)
        shifted[..., 1:] = ids[..., :-1].clone()
        shifted[..., 0] = 3
        shifted.masked_fill_(shifted == 5, 0)
        return F.mse_loss(self.embed(shifted), y)


class PositionBuffer(nn.Module):
    """HF's non-persistent buffers (`position_ids`, rotary `inv_freq`): no state_dict entry,
    export lifts them as constants."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, HIDDEN), persistent=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.fc(x) * self.scale, y)


class EmptyCache(nn.Module):
    """HF's empty KV cache: an empty constant concatenated with the keys (item 1's 0 bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        cache = torch.tensor([], device=x.device)
        keys = torch.cat([cache, self.fc(x).flatten()]).view(x.shape)
        return F.mse_loss(keys, y)


class InplaceCnn(nn.Module):
    """torchvision's and timm's in-place activations and residual add."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.act = nn.Hardswish(inplace=True)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.relu(self.bn(self.conv(x)))
        out = self.act(self.conv2(h))
        out += h
        out = self.relu(out)
        return F.mse_loss(out.mean(dim=(2, 3)), y)


class NoGradScale(nn.Module):
    """A `torch.no_grad()` region (HF's rotary embeddings): its result carries no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)
        self.gate = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = torch.sigmoid(self.gate(x))
        return F.mse_loss(self.fc(x) * scale, y)


class KeyedTables(nn.Module):
    """Gemma3's and ModernBERT's rotary tables: one table per layer type, built in
    `for key in set(self.kinds)` (Python's per-process hash order; `order` fixes another), each
    layer reading its type's table. Buffers registered in sorted order, as theirs are."""

    KINDS = ("sliding", "full", "sliding", "chunked")

    def __init__(self, order: tuple[str, ...] | None = None) -> None:
        super().__init__()
        self.order = order
        for k, kind in enumerate(sorted(set(self.KINDS))):
            self.register_buffer(f"{kind}_freq", torch.arange(HIDDEN) / (k + 1.0), persistent=False)
        self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in self.KINDS)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        tables = {}
        for kind in self.order or set(self.KINDS):
            angles = x.mean(-1, keepdim=True) * getattr(self, f"{kind}_freq")
            tables[kind] = angles.cos() + angles.sin()
        for layer, kind in zip(self.layers, self.KINDS, strict=True):
            x = layer(x) * tables[kind]
        return F.mse_loss(x, y)


class TypeAs(nn.Module):
    """Gemma's and Llama's RMSNorm tail, `output.type_as(x)`: once to x's own dtype (float32,
    a no-op) and once to a float64 tensor's (a cast), then back. Its statistics are a sum over
    the width divided by it, not `mean`: no rms_norm that capture would fuse
    (`capturing.fused_norms`, whose backward rounds otherwise), so the casts stay."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)
        self.norm = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        normed = (h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) / HIDDEN + 1e-6)).type_as(x)
        wide = (normed * (1.0 + self.norm)).type_as(torch.zeros((), dtype=torch.float64))
        return F.mse_loss(wide.pow(2).sum(-1).type_as(y), y.sum(-1))


def _floats() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, SEQ, HIDDEN, generator=g), torch.randn(
        BATCH, SEQ, HIDDEN, generator=g
    )


def _ids() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 32, (BATCH, SEQ), generator=g), torch.randn(
        BATCH, SEQ, HIDDEN, generator=g
    )


def _images() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, 3, 4, 4, generator=g), torch.randn(BATCH, 4, generator=g)


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[torch.Tensor, ...]]]] = {
    "attention-contiguous": (Attention, _floats),
    "device-moves": (DeviceMoves, _floats),
    "shift-right": (ShiftRight, _ids),
    "empty-cache": (EmptyCache, _floats),
    "position-buffer": (PositionBuffer, _floats),
    "inplace-cnn": (InplaceCnn, _images),
    "no-grad": (NoGradScale, _floats),
    "type-as": (TypeAs, _floats),
    "set-loop": (KeyedTables, _floats),
}


def build(case: str, device: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model of `case` (weights from seed 0) built on `device`, and its inputs there."""
    make_model, make_inputs = CASES[case]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with torch.device(device):
            model = make_model()
    return model, tuple(t.to(device) for t in make_inputs())
