"""A small Hugging Face Llama that learns Python's own source code, byte by byte.

`model()` returns what `autosbp train` and `auto_parallelize` take: a module whose forward
returns the training loss, and one example batch (token ids and labels: the ids themselves,
which the model shifts, as Hugging Face causal LMs do). The README trains it:

    autosbp train examples/llama_text.py:model --nproc 2 --data stdlib_text ...

Lives here: the model's config (a vocabulary of 256 byte values) and the wrapper that returns
`.loss`. Lives elsewhere: the text (`runtime.data.stdlib_text`), the training job.
"""

from __future__ import annotations

import torch
from torch import nn


class CausalLoss(nn.Module):
    """A Hugging Face causal LM as a module whose forward(ids, labels) returns its loss."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=labels).loss


def model(
    seq: int = 64, batch: int = 8, layers: int = 2, hidden: int = 64, seed: int = 0
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The Llama (seeded weights) and an example batch of `batch` windows of `seq` bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=seq, attention_dropout=0.0, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lm = LlamaForCausalLM(config)
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return CausalLoss(lm.train()), (ids, ids.clone())
