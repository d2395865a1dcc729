"""The model zoo: small, deterministic training models that return their own loss.

Lives here: `build_model(name, **kwargs) -> (model, example_inputs)` for the zoo models (`mlp`,
`gpt`, `widedeep`, `resnet`), `load_model` (a zoo name or a user's `path/to/file.py:function`),
and `parse_model_args` (the CLI's `--model-args k=v,...`). Lives elsewhere: capturing a model
(`capture`), planning it (`planner`).

Invariants: `model(*example_inputs)` returns the scalar training loss; the same (name, kwargs,
seed) gives bit-identical weights and inputs, and leaves the global RNG untouched; no dropout, so
training is deterministic; `device="meta"` builds parameters and inputs without memory. Models
are in train mode and use only the ops of design.md section 6 (linear, layer norm, SDPA, GELU,
embedding, conv2d, batch norm, cross-entropy ...). The GPT head is untied unless `tied=True`.
Reference: nanoGPT (model.py) for `gpt`; Cheng et al. 2016 (Wide & Deep) for `widedeep`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import itertools
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autosbp.errors import CaptureError

__all__ = ["ZOO_MODELS", "build_model", "load_model", "parse_model_args"]

ModelAndInputs = tuple[nn.Module, tuple[torch.Tensor, ...]]


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


def _build_mlp(
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


def _build_gpt(
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


def _build_widedeep(
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


def _build_resnet(
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


# ----------------------------------------------------------------------------------------- moe
# A GPT whose MLPs are top-k routed experts with a fixed capacity, as GShard (Lepikhin et al.
# 2020, section 2.2 and algorithm 1) and Switch (Fedus et al. 2021, section 2.2) train them:
# router -> softmax -> top-k -> one-hot -> a token's position in its expert's buffer by a
# cumulative sum -> tokens past the capacity dropped (their MLP output is 0, the residual carries
# them) -> dispatch to [experts, groups x capacity, hidden] -> per-expert matmuls -> combine
# weighted by the gates. A group is one sequence: capacity and positions are per group, and a
# plan may split groups (the batch) but no rule splits a cumulative sum's dim, so every plan
# routes each token as one device does. Shapes are static: an expert computes its capacity,
# filled or not, so the cost model prices exactly what runs (the capacity factor is the padding
# paid for imbalance; imbalance beyond it drops tokens, it never slows an expert down). A top-k
# near tie (two router probabilities within rounding) may route a token differently in another
# precision or summation order: with random weights and tokens it is vanishingly rare, and
# runtime/check.py states the limit.
CAPACITY_FACTOR = 1.25  # Switch's training value (Fedus et al. 2021, section 2.2: 1.0-1.25)
BALANCE_WEIGHT = 0.01  # Switch's auxiliary load-balancing loss weight (section 2.2, alpha)


def expert_capacity(tokens: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert and group: ceil(capacity_factor x top_k x tokens / experts), the balanced
    share of the group's top_k x tokens assignments times the slack (DeepSpeed-MoE's formula;
    GShard's 2N/E for top-2 is capacity_factor 1)."""
    return math.ceil(capacity_factor * top_k * tokens / experts)


class MoeMlp(nn.Module):
    """Top-k routed experts (no biases, GELU) over groups [G, S, M]; returns the output and
    Switch's balance loss E x sum_e f_e P_e (f_e: the share of first choices that go to e, P_e:
    the mean router probability of e; 1 when balanced), averaged over groups."""

    def __init__(
        self, hidden: int, ffn: int, experts: int, top_k: int, capacity_factor: float
    ) -> None:
        super().__init__()
        self.experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.router = nn.Linear(hidden, experts, bias=False)
        bound_in, bound_out = hidden**-0.5, ffn**-0.5  # nn.Linear's init bounds, per expert
        self.w_in = nn.Parameter(torch.empty(experts, hidden, ffn).uniform_(-bound_in, bound_in))
        self.w_out = nn.Parameter(torch.empty(experts, ffn, hidden).uniform_(-bound_out, bound_out))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        groups, tokens, hidden = x.shape
        experts, k = self.experts, self.top_k
        capacity = expert_capacity(tokens, experts, k, self.capacity_factor)
        probs = self.router(x).softmax(dim=-1)  # [G, S, E]
        gates, chosen = probs.topk(k, dim=-1)  # [G, S, k]
        gates = gates / gates.sum(dim=-1, keepdim=True)
        # choice-major: every token's first choice takes a slot before any second choice
        mask = F.one_hot(chosen.transpose(1, 2), experts).flatten(1, 2)  # [G, k*S, E]
        position = mask.cumsum(dim=1) * mask - 1  # in the expert's buffer; -1: not chosen
        slots = torch.arange(capacity, device=x.device)
        slot = (position.unsqueeze(-1) == slots).view(groups, k, tokens, experts, capacity)
        dispatch = slot.sum(dim=1).to(x.dtype)  # [G, S, E, C]: 0 or 1
        combine = (slot * gates.transpose(1, 2)[..., None, None]).sum(dim=1)  # [G, S, E, C]
        expert_in = dispatch.flatten(2).transpose(1, 2) @ x  # [G, E*C, M]
        expert_in = expert_in.view(groups, experts, capacity, hidden).transpose(0, 1)
        h = F.gelu(expert_in.reshape(experts, groups * capacity, hidden) @ self.w_in)
        expert_out = (h @ self.w_out).view(experts, groups, capacity, hidden).transpose(0, 1)
        y = combine.flatten(2) @ expert_out.reshape(groups, experts * capacity, hidden)
        first_choices = mask[:, :tokens].to(x.dtype).mean(dim=1)  # [G, E]
        balance = experts * (first_choices * probs.mean(dim=1)).sum(dim=-1).mean()
        return y, balance


class MoeBlock(nn.Module):
    """GptBlock with routed experts for its MLP: x + attn(ln(x)), then x + moe(ln(x))."""

    def __init__(self, hidden: int, heads: int, moe: MoeMlp) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln1(x))
        y, balance = self.moe(self.ln2(x))
        return x + y, balance


class MoeGpt(Gpt):
    """Gpt (untied head) with MoeBlocks; the loss adds balance_weight x the blocks' balance
    losses, summed (Switch, section 2.2)."""

    def __init__(
        self, blocks: list[MoeBlock], hidden: int, heads: int, vocab: int, seq: int,
        balance_weight: float,
    ) -> None:  # fmt: skip
        super().__init__(0, hidden, heads, vocab, seq, tied=False)
        self.blocks = nn.ModuleList(blocks)
        self.balance_weight = balance_weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        balances = []
        for block in self.blocks:
            x, balance = block(x)
            balances.append(balance)
        logits = self.head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
        return loss + self.balance_weight * torch.stack(balances).sum()


def _build_moe(
    g: torch.Generator,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    experts: int = 4,
    top_k: int = 2,
    ffn: int = 256,
    capacity_factor: float = CAPACITY_FACTOR,
    balance_weight: float = BALANCE_WEIGHT,
    vocab: int = 128,
    seq: int = 16,
    batch: int = 4,
) -> tuple[nn.Module, Callable[[], tuple[torch.Tensor, ...]]]:
    if hidden % heads:
        raise CaptureError(f"moe: hidden={hidden} must be divisible by heads={heads}.")
    if not 1 <= top_k <= experts or capacity_factor <= 0:
        raise CaptureError(
            f"moe: top_k={top_k} must be between 1 and experts={experts}, and capacity_factor="
            f"{capacity_factor} positive (Switch trains with 1.0-1.25)."
        )
    blocks = [
        MoeBlock(hidden, heads, MoeMlp(hidden, ffn, experts, top_k, capacity_factor))
        for _ in range(layers)
    ]
    model = MoeGpt(blocks, hidden, heads, vocab, seq, balance_weight)
    return model, lambda: (
        torch.randint(0, vocab, (batch, seq), generator=g),
        torch.randint(0, vocab, (batch, seq), generator=g),
    )


# ------------------------------------------------------------------------------------- loading
_BUILDERS: dict[str, Callable[..., tuple[nn.Module, Callable[[], tuple[torch.Tensor, ...]]]]] = {
    "gpt": _build_gpt,
    "mlp": _build_mlp,
    "moe": _build_moe,
    "resnet": _build_resnet,
    "widedeep": _build_widedeep,
}
ZOO_MODELS: tuple[str, ...] = tuple(sorted(_BUILDERS))


def build_model(
    name: str, *, device: str | torch.device = "cpu", seed: int = 0, **kwargs: Any
) -> ModelAndInputs:
    """A zoo model and its example inputs; weights and inputs depend only on (kwargs, seed).

    Parameters are created under `torch.device(device)` ("meta": no memory); inputs are drawn on
    the CPU from a generator seeded with `seed`, then moved to `device`.
    """
    builder = _BUILDERS.get(name)
    if builder is None:
        raise CaptureError(f"Unknown zoo model {name!r}: choose one of {', '.join(ZOO_MODELS)}.")
    _check_kwargs(name, kwargs)
    generator = torch.Generator().manual_seed(seed)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            with torch.device(device):
                model, make_inputs = builder(generator, **kwargs)
        inputs = tuple(t.to(device) for t in make_inputs())
    except (TypeError, ValueError, RuntimeError) as exc:
        given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise CaptureError(
            f"Zoo model {name!r} cannot be built with {given or 'its defaults'}: "
            f"{type(exc).__name__}: {exc}. Check the values of --model-args: sizes are positive "
            "whole numbers."
        ) from exc
    return model, inputs


# GPT-3 175B as trained by Brown et al. 2020 (table 2.1) and Narayanan et al. 2021 (the
# Megatron-LM scaling runs): global batch 1536 sequences of 2048 tokens.
GPT3_175B: dict[str, int] = {
    "layers": 96, "hidden": 12288, "heads": 96, "seq": 2048, "vocab": 51200, "batch": 1536,
}  # fmt: skip


def gpt3_175b(layers: int = GPT3_175B["layers"]) -> ModelAndInputs:
    """GPT-3 175B (or the same width with fewer `layers`) on the meta device, in bf16."""
    model, inputs = build_model("gpt", device="meta", **{**GPT3_175B, "layers": layers})
    return model.to(torch.bfloat16), inputs


def gpt3_megatron(layers: int = GPT3_175B["layers"], devices: int = 1024) -> tuple[str, int]:
    """The Megatron-LM plan for GPT-3 on `devices` DGX A100 GPUs (Narayanan et al. 2021, table
    1: tensor parallel 8 inside a node, 16 pipeline stages, data parallel for the rest, one
    sequence per micro-batch and data-parallel rank, full recomputation): its strategy string
    and micro-batch count. With fewer `layers`, as many stages (at most 16) as divide them."""
    stages = max(p for p in (1, 2, 4, 8, 16) if layers % p == 0 and devices % (8 * p) == 0)
    dp = devices // (8 * stages)
    count = GPT3_175B["batch"] // dp
    return f"megatron:tp=8,pp={stages},dp={dp},mb={count}", count


def model_arguments(name: str) -> dict[str, Any]:
    """The arguments zoo model `name` accepts (`--model-args`), with their defaults; `device`
    and `seed` are accepted by every model besides."""
    builder = _BUILDERS.get(name)
    if builder is None:
        raise CaptureError(f"Unknown zoo model {name!r}: choose one of {', '.join(ZOO_MODELS)}.")
    params = inspect.signature(builder).parameters.values()
    return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _check_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    accepted = model_arguments(name)
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        options = ", ".join(f"{k}={v!r}" for k, v in accepted.items())
        raise CaptureError(
            f"Zoo model {name!r} has no argument {', '.join(map(repr, unknown))}; "
            f"it accepts {options} (plus device and seed). `autosbp zoo` lists every model."
        )


def load_model(
    spec: str, model_args: dict[str, Any] | None = None, *, device: str | None = None
) -> ModelAndInputs:
    """A zoo name or `path/to/file.py:function`, called with `model_args`.

    A file's function must return `(nn.Module, example_inputs)`; with `device` set it runs under
    `torch.device(device)` (so "meta" builds it without parameter memory).
    """
    args = dict(model_args or {})
    if spec in _BUILDERS:
        return build_model(spec, device=device or "cpu", **args)
    path_text, sep, func_name = spec.rpartition(":")
    if not sep or not path_text.endswith(".py") or not func_name:
        raise CaptureError(
            f"Unknown model {spec!r}: give a zoo model ({', '.join(ZOO_MODELS)}) or "
            "`path/to/file.py:function` where the function returns (model, example_inputs)."
        )
    func = _load_function(Path(path_text), func_name)
    try:
        inspect.signature(func).bind(**args)
    except TypeError as exc:
        raise CaptureError(
            f"{func_name}{inspect.signature(func)} in {path_text} cannot take {args!r}: {exc}. "
            "Check --model-args against the function's parameters."
        ) from exc
    try:
        with torch.device(device) if device else contextlib.nullcontext():
            result = func(**args)
    except (Exception, SystemExit) as exc:  # sys.exit in user code: an error, not our exit
        raise CaptureError(
            f"Calling {func_name}({', '.join(f'{k}={v!r}' for k, v in args.items())}) from "
            f"{path_text} failed with {type(exc).__name__}: {exc}. Fix the function (or "
            "--model-args) so that it returns (model, example_inputs)."
        ) from exc
    return _check_model_and_inputs(result, spec)


def _load_function(path: Path, func_name: str) -> Callable[..., Any]:
    if not path.is_file():
        raise CaptureError(
            f"Model file {str(path)!r} (from the MODEL argument) does not exist (looked for "
            f"{path.resolve()}); check the path, or give a zoo model ({', '.join(ZOO_MODELS)})."
        )
    module_name = f"autosbp_user_model_{abs(hash(path.resolve()))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # sys.exit in user code: an error, not our exit
        del sys.modules[module_name]
        raise CaptureError(
            f"Importing model file {str(path)!r} failed with {type(exc).__name__}: {exc}. "
            f"Fix the file so that `python {path}` runs."
        ) from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        found = sorted(
            n
            for n, v in vars(module).items()
            if inspect.isfunction(v) and v.__module__ == module_name
        )
        raise CaptureError(
            f"Model file {str(path)!r} has no function {func_name!r}; its functions are: "
            f"{', '.join(found) or 'none'}. Name one that returns (model, example_inputs)."
        )
    return func


def _check_model_and_inputs(result: object, spec: str) -> ModelAndInputs:
    if isinstance(result, tuple) and len(result) == 2:
        model, inputs = result
        tensors = isinstance(inputs, Sequence) and all(isinstance(t, torch.Tensor) for t in inputs)
        if isinstance(model, nn.Module) and tensors:
            return model, tuple(inputs)
    raise CaptureError(
        f"{spec} returned {_describe(result)}; it must return a pair (model, example_inputs): "
        "an nn.Module whose forward returns the training loss, and a tuple of tensors."
    )


def _describe(value: object) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    name = type(value).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def parse_model_args(text: str | None) -> dict[str, Any]:
    """`"layers=2,hidden=64,tied=true,name=x"` -> {"layers": 2, ...}: int, float, bool or str."""
    if not text:
        return {}
    out: dict[str, Any] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key.isidentifier() or not value:
            raise CaptureError(
                f"Bad --model-args item {item.strip()!r} in {text!r}: write key=value pairs "
                "separated by commas, e.g. --model-args layers=4,hidden=256,tied=true."
            )
        if key in out:
            raise CaptureError(f"--model-args gives {key!r} twice in {text!r}; give it once.")
        out[key] = _parse_value(value)
    return out


def _parse_value(text: str) -> int | float | bool | str:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text
