"""Models whose training forward holds the `if`s libraries write (issue #29): Hugging Face's
LayerDrop (OPT, BART, Whisper, Wav2Vec2: `if torch.rand([]) < self.layerdrop`) and
Wav2Vec2-for-CTC's argument check (`if labels.max() >= vocab_size: raise ValueError`), in
tiny configs with random weights, and two small modules of our own reproducing those lines for
machines without transformers. Each builder returns `(model, example_inputs)`, the model's
forward the training loss.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.support.real_models import VOCAB, LossOf, ModelAndInputs, _causal_lm, _seeded

TINY = {"d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
        "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
        "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0}  # fmt: skip


def opt(layerdrop: float = 0.0, seed: int = 0) -> ModelAndInputs:
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(
        vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=16, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
        layerdrop=layerdrop,
    )  # fmt: skip
    return _causal_lm(lambda: OPTForCausalLM(config), vocab=VOCAB, batch=4, seq=16, seed=seed)


def bart(layerdrop: float = 0.0, seed: int = 0) -> ModelAndInputs:
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=VOCAB, max_position_embeddings=16, encoder_layerdrop=layerdrop,
        decoder_layerdrop=layerdrop, **TINY,
    )  # fmt: skip
    with _seeded(seed) as g:
        model = BartForConditionalGeneration(config).train()
        ids = torch.randint(3, VOCAB, (4, 16), generator=g)
        labels = torch.randint(3, VOCAB, (4, 8), generator=g)
    return LossOf(model, ("input_ids", "labels")), _here(ids, labels)


def whisper(layerdrop: float = 0.0, seed: int = 0) -> ModelAndInputs:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, max_source_positions=8, max_target_positions=16,
        encoder_layerdrop=layerdrop, decoder_layerdrop=layerdrop, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, **TINY,
    )  # fmt: skip
    with _seeded(seed) as g:
        model = WhisperForConditionalGeneration(config).train()
        features = torch.randn(4, 8, 16, generator=g)  # [batch, mel bins, 2 x source positions]
        labels = torch.randint(3, VOCAB, (4, 8), generator=g)
    return LossOf(model, ("input_features", "labels")), _here(features, labels)


def wav2vec2(layerdrop: float = 0.0, seed: int = 0) -> ModelAndInputs:
    """Audio: a convolutional feature encoder, then a transformer encoder with LayerDrop, as a
    sequence classifier (Wav2Vec2ForCTC's loss, `_ctc_loss.Tensor`, has an output whose shape
    depends on the lengths' values, which capture cannot trace; its label check is `own`'s)."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    config = Wav2Vec2Config(
        vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, layerdrop=layerdrop,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
        final_dropout=0.0, mask_time_prob=0.0, do_stable_layer_norm=True, num_labels=4,
        classifier_proj_size=16,
    )  # fmt: skip
    with _seeded(seed) as g:
        model = Wav2Vec2ForSequenceClassification(config).train()
        audio = torch.randn(4, 400, generator=g)
        labels = torch.randint(0, 4, (4,), generator=g)
    return LossOf(model, ("input_values", "labels")), _here(audio, labels)


class LayerDropNet(nn.Module):
    """HF's LayerDrop and CTC's label check, written as they are there."""

    def __init__(self, layerdrop: float, vocab: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, vocab)
        self.layerdrop, self.vocab = layerdrop, vocab

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if labels.max() >= self.vocab:
            raise ValueError(f"Label values must be <= vocab_size: {self.vocab}")
        assert labels.min() >= 0, "labels must not be negative"
        for layer in self.layers:
            dropout_probability = torch.rand([])
            if self.training and dropout_probability < self.layerdrop:
                continue
            x = torch.tanh(layer(x))
        return nn.functional.cross_entropy(self.head(x), labels)


class PlainNet(LayerDropNet):
    """LayerDropNet without its check and its LayerDrop: the graph capture should find."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return nn.functional.cross_entropy(self.head(x), labels)


class DecidingNet(LayerDropNet):
    """A decision on a value that is neither LayerDrop nor a check: still refused."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            x = x * 2
        return super().forward(x, labels)


def own(
    layerdrop: float = 0.0, label: int = 3, seed: int = 0, kind: str = "layerdrop"
) -> ModelAndInputs:
    """`kind`: layerdrop (LayerDropNet), plain (PlainNet) or deciding (DecidingNet)."""
    net = {"layerdrop": LayerDropNet, "plain": PlainNet, "deciding": DecidingNet}[kind]
    with _seeded(seed) as g:
        model = net(layerdrop)
        x = torch.randn(8, 8, generator=g)
        labels = torch.full((8,), label)
    return model, _here(x, labels)


def _here(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    device = torch.get_default_device()
    return tuple(t.to(device) for t in tensors)


BUILDERS: dict[str, Any] = {"opt": opt, "bart": bart, "whisper": whisper, "wav2vec2": wav2vec2}
