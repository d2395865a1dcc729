"""The real-model suite's sweep over more Hugging Face families (issue #29, models not seen
before): decoders with their own attention variants (GPT-NeoX: partial rotary; Falcon:
multi-query, fused QKV; Phi: partial rotary, parallel block; BLOOM: ALiBi; Gemma: scaled
embeddings, GeGLU; OPT; GPT-J; StableLM; Qwen3: QK norm), encoders (DistilBERT, RoBERTa,
ALBERT: shared layers, ELECTRA), vision (DeiT) and speech encoder-decoder (Whisper).

Lives here: one builder per model, `(model, example_inputs)` with `model(*inputs)` the training
loss, under the invariants of tests/support/real_models.py (no download, seeded, tiny, dropout
0, meta-buildable). Lives elsewhere: the suite (tests/models/test_real_models.py), the older
builders (tests/support/real_models.py, tests/support/real_model_families.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tests.support.real_models import (
    IGNORE_INDEX,
    TEXT,
    VOCAB,
    LossOf,
    ModelAndInputs,
    _causal_lm,
    _llama_like,
    _on_default_device,
    _seeded,
    vit_like,
)


def _decoder(config_name: str, model_name: str, **config: Any) -> Callable[..., ModelAndInputs]:
    """A causal-LM builder from transformers' `config_name(**config)` and `model_name`; the
    builder's keyword arguments beyond batch, seq and seed replace config entries (layers)."""

    def build(
        batch: int = TEXT["batch"], seq: int = TEXT["seq"], seed: int = 0, **changed: Any
    ) -> ModelAndInputs:
        import transformers

        made = getattr(transformers, config_name)(vocab_size=VOCAB, **{**config, **changed})
        model_class = getattr(transformers, model_name)
        return _causal_lm(lambda: model_class(made), vocab=VOCAB, batch=batch, seq=seq, seed=seed)

    return build


gpt_neox = _decoder(
    "GPTNeoXConfig", "GPTNeoXForCausalLM", hidden_size=32, num_hidden_layers=2,
    num_attention_heads=4, intermediate_size=64, max_position_embeddings=TEXT["seq"],
    rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0,
)  # fmt: skip
falcon = _decoder(
    "FalconConfig", "FalconForCausalLM", hidden_size=32, num_hidden_layers=2,
    num_attention_heads=4, multi_query=True, parallel_attn=True, alibi=False,
    hidden_dropout=0.0, attention_dropout=0.0,
)  # fmt: skip
phi = _decoder(
    "PhiConfig", "PhiForCausalLM", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, max_position_embeddings=TEXT["seq"], partial_rotary_factor=0.5,
    resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
)  # fmt: skip
bloom = _decoder(
    "BloomConfig", "BloomForCausalLM", hidden_size=32, n_layer=2, n_head=4,
    hidden_dropout=0.0, attention_dropout=0.0,
)  # fmt: skip
opt = _decoder(
    "OPTConfig", "OPTForCausalLM", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=TEXT["seq"], dropout=0.0,
    attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
)  # fmt: skip
gptj = _decoder(
    "GPTJConfig", "GPTJForCausalLM", n_embd=32, n_layer=2, n_head=4, n_positions=TEXT["seq"],
    rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
    eos_token_id=2,
)  # fmt: skip
stablelm = _decoder(
    "StableLmConfig", "StableLmForCausalLM", hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=TEXT["seq"], partial_rotary_factor=0.25, hidden_dropout=0.0,
    attention_dropout=0.0,
)  # fmt: skip


def gemma(batch: int = TEXT["batch"], seq: int = TEXT["seq"], seed: int = 0) -> ModelAndInputs:
    from transformers import GemmaConfig, GemmaForCausalLM

    return _llama_like(GemmaConfig, GemmaForCausalLM, head_dim=8)(batch, seq, seed)


def qwen3(batch: int = TEXT["batch"], seq: int = TEXT["seq"], seed: int = 0) -> ModelAndInputs:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _llama_like(Qwen3Config, Qwen3ForCausalLM, head_dim=8)(batch, seq, seed)


def _masked_lm(config_name: str, model_name: str, **config: Any) -> Callable[..., ModelAndInputs]:
    """A masked-LM builder: labels hold the token at a quarter of the positions, -100 elsewhere;
    the builder's keyword arguments beyond batch, seq and seed replace config entries."""

    def build(
        batch: int = TEXT["batch"], seq: int = TEXT["seq"], seed: int = 0, **changed: Any
    ) -> ModelAndInputs:
        import transformers

        made = getattr(transformers, config_name)(vocab_size=VOCAB, **{**config, **changed})
        with _seeded(seed) as g:
            model = getattr(transformers, model_name)(made)
            ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
            masked = torch.rand(batch, seq, generator=g) < 0.25
            masked[:, 0] = True  # every row predicts at least one token
            labels = torch.where(masked, ids, IGNORE_INDEX)
        model.train()
        return LossOf(model, ("input_ids", "labels")), _on_default_device(ids, labels)

    return build


_ENCODER = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "intermediate_size": 64, "max_position_embeddings": TEXT["seq"] + 2,
    "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
}  # fmt: skip
distilbert = _masked_lm(
    "DistilBertConfig", "DistilBertForMaskedLM", dim=32, n_layers=2, n_heads=4, hidden_dim=64,
    max_position_embeddings=TEXT["seq"], dropout=0.0, attention_dropout=0.0,
)  # fmt: skip
roberta = _masked_lm("RobertaConfig", "RobertaForMaskedLM", pad_token_id=1, **_ENCODER)
albert = _masked_lm("AlbertConfig", "AlbertForMaskedLM", embedding_size=16, **_ENCODER)
electra = _masked_lm("ElectraConfig", "ElectraForMaskedLM", embedding_size=16, **_ENCODER)


deit = vit_like("DeiTConfig", "DeiTForImageClassification")  # a distillation token beside CLS


WHISPER_MELS = 8
WHISPER_FRAMES = 16  # the encoder's two convolutions halve it: max_source_positions = 8


def whisper(batch: int = TEXT["batch"], seed: int = 0) -> ModelAndInputs:
    """Whisper: a convolutional front end on log-mel frames, encoder, decoder on text labels."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=WHISPER_MELS, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, d_model=32, max_source_positions=WHISPER_FRAMES // 2,
        max_target_positions=TEXT["seq"], pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        encoder_layerdrop=0.0, decoder_layerdrop=0.0, mask_time_prob=0.0,
        suppress_tokens=None, begin_suppress_tokens=None,
    )  # fmt: skip
    with _seeded(seed) as g:
        model = WhisperForConditionalGeneration(config).train()
        features = torch.randn(batch, WHISPER_MELS, WHISPER_FRAMES, generator=g)
        labels = torch.randint(3, VOCAB, (batch, TEXT["seq"] // 2), generator=g)
        labels[:, -2:] = IGNORE_INDEX
    return LossOf(model, ("input_features", "labels")), _on_default_device(features, labels)


SWEEP: dict[str, Callable[..., ModelAndInputs]] = {
    "gpt_neox": gpt_neox,
    "falcon": falcon,
    "phi": phi,
    "bloom": bloom,
    "opt": opt,
    "gptj": gptj,
    "stablelm": stablelm,
    "gemma": gemma,
    "qwen3": qwen3,
    "distilbert": distilbert,
    "roberta": roberta,
    "albert": albert,
    "electra": electra,
    "deit": deit,
    "whisper": whisper,
}
