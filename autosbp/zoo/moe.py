"""The zoo's mixture-of-experts GPT (`moe`): GShard / Switch top-k routing with a capacity.

Lives here: `MoeMlp`, `MoeBlock`, `MoeGpt`, `expert_capacity`, `build_moe` and the defaults
from the literature (`CAPACITY_FACTOR`, `BALANCE_WEIGHT`). Lives elsewhere: the dense GPT it
extends (`zoo.models`), the routing ops' rules (`autosbp.rules.routing`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from autosbp.errors import CaptureError
from autosbp.zoo.models import CausalSelfAttention, Gpt

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
# runtime/verify/step_check.py states the limit.
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


def build_moe(
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
