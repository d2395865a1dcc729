"""The real-model suite's families beyond decoders, BERT, T5, ViT and CNNs (issue #29): an
encoder-decoder with LayerDrop (BART), audio (Wav2Vec2 for CTC), windowed vision attention
(Swin: `roll`), two-tower contrastive (CLIP: `argmax`), state-space (Mamba, transformers'
torch path) and a LoRA fine-tune of a causal LM (Llama frozen, low-rank adapters in plain torch);
and issue #48's (`FAULTS`): causal LMs with a bool causal-mask buffer (GPT-BigCode, GPT-Neo,
ImageGPT), rotary tables built in a loop over a `set` of layer types (Gemma3, ModernBERT, OLMo3,
ModernBERT's decoder), and SigLIP, whose loss holds `eye`; `DEEPER` gives them 4 layers.

Lives here: one builder per model, `(model, example_inputs)` with `model(*inputs)` the training
loss, under the invariants of tests/support/real_models.py (no download, seeded, tiny, dropout 0,
meta-buildable). Lives elsewhere: the suite (tests/models/test_real_models.py), the older
builders (tests/support/real_models.py), LayerDrop's and the raise-only check's own models
(tests/support/training_ifs_models.py, whose BART this reuses).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tests.support import real_models, training_ifs_models
from tests.support.real_model_sweep import SWEEP, _decoder, _masked_lm
from tests.support.real_models import (
    IGNORE_INDEX,
    IMAGES,
    TEXT,
    VOCAB,
    LossOf,
    ModelAndInputs,
    _causal_lm,
    _on_default_device,
    _seeded,
    llama,
)

AUDIO_SAMPLES = 400  # (400 - 10) / 5 + 1 = 79 frames, then (79 - 3) / 2 + 1 = 39
CTC_VOCAB = 16  # Wav2Vec2's character vocabulary: 0 is the CTC blank (pad_token_id)


def bart(seed: int = 0) -> ModelAndInputs:
    """BART, encoder and decoder with LayerDrop in their loops (probability 0 here)."""
    return training_ifs_models.bart(layerdrop=0.0, seed=seed)


def wav2vec2_ctc(batch: int = 4, seed: int = 0) -> ModelAndInputs:
    """Wav2Vec2 for CTC: convolutional feature encoder, positional conv, transformer encoder
    with LayerDrop (0), CTC loss on character labels padded by -100 (rows of 3 to 6 labels)."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    config = Wav2Vec2Config(
        vocab_size=CTC_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, layerdrop=0.0,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
        final_dropout=0.0, mask_time_prob=0.0, pad_token_id=0, ctc_loss_reduction="mean",
    )  # fmt: skip
    with _seeded(seed) as g:
        model = Wav2Vec2ForCTC(config).train()
        audio = torch.randn(batch, AUDIO_SAMPLES, generator=g)
        labels = torch.randint(1, CTC_VOCAB, (batch, 6), generator=g)
        lengths = torch.arange(batch) % 4 + 3
        labels[torch.arange(6) >= lengths[:, None]] = IGNORE_INDEX
    return LossOf(model, ("input_values", "labels")), _on_default_device(audio, labels)


def swin(batch: int = IMAGES["batch"], seed: int = 0) -> ModelAndInputs:
    """Swin: attention in 2x2 windows, every second block shifted by `roll`, patch merging."""
    from transformers import SwinConfig, SwinForImageClassification

    config = SwinConfig(
        image_size=IMAGES["image"], patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
        window_size=2, mlp_ratio=2.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0, num_labels=IMAGES["classes"],
    )  # fmt: skip
    with _seeded(seed) as g:
        model = SwinForImageClassification(config).train()
        pixels = torch.randn(batch, 3, IMAGES["image"], IMAGES["image"], generator=g)
        labels = torch.randint(0, IMAGES["classes"], (batch,), generator=g)
    return LossOf(model, ("pixel_values", "labels")), _on_default_device(pixels, labels)


def clip(batch: int = 4, seed: int = 0) -> ModelAndInputs:
    """CLIP: a text and a vision tower, the contrastive loss over the batch's text-image pairs;
    the text tower pools at each row's end token by `argmax` (eos_token_id 2: the largest id)."""
    from transformers import CLIPConfig, CLIPModel

    text = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 16,
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "attention_dropout": 0.0}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "image_size": IMAGES["image"], "patch_size": 4,
              "attention_dropout": 0.0}  # fmt: skip
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    with _seeded(seed) as g:
        model = CLIPModel(config).train()
        ids = torch.randint(3, VOCAB - 1, (batch, 16), generator=g)
        ids[:, -4:] = VOCAB - 1  # every row's largest id last: the end token argmax finds
        pixels = torch.randn(batch, 3, IMAGES["image"], IMAGES["image"], generator=g)
    return _ContrastiveLoss(model), _on_default_device(ids, pixels)


class _ContrastiveLoss(nn.Module):
    """CLIP's forward computes its loss only when asked (`return_loss=True`)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, pixel_values=pixel_values, return_loss=True).loss


MAMBA_SEQ = 8  # the scan is a loop over time, a few nodes per step: half the text length


def mamba(batch: int = TEXT["batch"], seq: int = MAMBA_SEQ, seed: int = 0) -> ModelAndInputs:
    """Mamba, transformers' torch path (no CUDA kernels): selective scan as a loop over time."""
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2,
        conv_kernel=4, time_step_rank=4, use_mambapy=False,
    )  # fmt: skip
    return _causal_lm(
        lambda: MambaForCausalLM(config), vocab=VOCAB, batch=batch, seq=seq, seed=seed
    )


LORA_RANK = 4


class LoraLinear(nn.Module):
    """`base(x) + scale * x @ a.T @ b.T`: a frozen linear layer with a trainable low-rank
    update, as LoRA writes it (b starts small, not zero, so the first step moves a too)."""

    def __init__(self, base: nn.Linear, rank: int = LORA_RANK, alpha: float = 8.0) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, base.in_features) / base.in_features**0.5)
        self.b = nn.Parameter(torch.randn(base.out_features, rank) * 0.01)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * (x @ self.a.T @ self.b.T)


def lora_llama(seed: int = 0) -> ModelAndInputs:
    """Llama with every weight frozen and LoRA adapters on each attention's q and v."""
    model, inputs = llama(seed=seed)
    model.requires_grad_(False)
    with _seeded(seed + 1):
        for layer in model.model.model.layers:
            attention = layer.self_attn
            attention.q_proj = LoraLinear(attention.q_proj)
            attention.v_proj = LoraLinear(attention.v_proj)
    return model, inputs


# ------------------------------------------------------------------ issue #48's families
# Written from transformers 5.17's Config classes: a bool causal-mask buffer (GPT-BigCode,
# GPT-Neo, ImageGPT: `--check` compares it by equality), rotary tables built per layer type in
# `for layer_type in set(config.layer_types)` (Gemma3, ModernBERT, OLMo3, ModernBERT's decoder:
# Python's per-process set order, made canonical by capture) and `eye` in the loss (SigLIP).
_LAYER_TYPES = ["sliding_attention", "full_attention"]  # one layer of each: both tables read
# No KV cache in training (HF's default makes one): a sliding layer's cache runs other ops than
# a full one's, so the layers would not be alike blocks, and no pipeline could cut them.

gpt_bigcode = _decoder(
    "GPTBigCodeConfig", "GPTBigCodeForCausalLM", n_positions=TEXT["seq"], n_embd=32, n_layer=2,
    n_head=4, n_inner=64, multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip
gpt_neo = _decoder(
    "GPTNeoConfig", "GPTNeoForCausalLM", max_position_embeddings=TEXT["seq"], hidden_size=32,
    num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]], window_size=8,
    intermediate_size=64, embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip
gemma3 = _decoder(
    "Gemma3TextConfig", "Gemma3ForCausalLM", hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    max_position_embeddings=TEXT["seq"], sliding_window=8, layer_types=_LAYER_TYPES,
    attention_dropout=0.0, use_cache=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip
olmo3 = _decoder(
    "Olmo3Config", "Olmo3ForCausalLM", hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=TEXT["seq"], sliding_window=8, layer_types=_LAYER_TYPES,
    attention_dropout=0.0, use_cache=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip
modernbert_decoder = _decoder(
    "ModernBertDecoderConfig", "ModernBertDecoderForCausalLM", hidden_size=32,
    intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=TEXT["seq"], local_attention=8, layer_types=_LAYER_TYPES,
    embedding_dropout=0.0, mlp_dropout=0.0, attention_dropout=0.0, use_cache=False, bos_token_id=1,
    eos_token_id=2, pad_token_id=0, cls_token_id=1, sep_token_id=2,
)  # fmt: skip
modernbert = _masked_lm(
    "ModernBertConfig", "ModernBertForMaskedLM", hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=TEXT["seq"],
    local_attention=8, layer_types=_LAYER_TYPES, embedding_dropout=0.0, mlp_dropout=0.0,
    attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
    sep_token_id=2,
)  # fmt: skip


def imagegpt(batch: int = TEXT["batch"], seq: int = TEXT["seq"], seed: int = 0) -> ModelAndInputs:
    """ImageGPT: GPT-2 over colour-cluster tokens; its head predicts all but the start token."""
    from transformers import ImageGPTConfig, ImageGPTForCausalImageModeling

    config = ImageGPTConfig(
        vocab_size=VOCAB + 1, n_positions=seq, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return _causal_lm(
        lambda: ImageGPTForCausalImageModeling(config), vocab=VOCAB, batch=batch, seq=seq,
        seed=seed,
    )  # fmt: skip


def _siglip(config_name: str, model_name: str) -> Callable[..., ModelAndInputs]:
    """A SigLIP-style two-tower model whose loss, a sigmoid per text-image pair, labels the
    pairs by `2 * eye(batch) - 1`."""

    def build(batch: int = 4, seed: int = 0) -> ModelAndInputs:
        import transformers

        text = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
                "num_hidden_layers": 2, "num_attention_heads": 4,
                "max_position_embeddings": TEXT["seq"], "attention_dropout": 0.0}  # fmt: skip
        vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "image_size": IMAGES["image"], "patch_size": 4,
                  "attention_dropout": 0.0}  # fmt: skip
        config = getattr(transformers, config_name)(text_config=text, vision_config=vision)
        with _seeded(seed) as g:
            model = getattr(transformers, model_name)(config).train()
            ids = torch.randint(0, VOCAB, (batch, TEXT["seq"]), generator=g)
            pixels = torch.randn(batch, 3, IMAGES["image"], IMAGES["image"], generator=g)
        return _ContrastiveLoss(model), _on_default_device(ids, pixels)

    return build


siglip = _siglip("SiglipConfig", "SiglipModel")


FAMILIES: dict[str, Callable[..., ModelAndInputs]] = {
    "bart": bart,
    "wav2vec2_ctc": wav2vec2_ctc,
    "swin": swin,
    "clip": clip,
    "mamba": mamba,
    "lora_llama": lora_llama,
}
# Issue #48's: a bool buffer, a set-ordered rotary model, eye in the loss.
FAULTS: dict[str, Callable[..., ModelAndInputs]] = {
    "gpt_bigcode": gpt_bigcode,
    "gpt_neo": gpt_neo,
    "imagegpt": imagegpt,
    "gemma3": gemma3,
    "modernbert": modernbert,
    "olmo3": olmo3,
    "modernbert_decoder": modernbert_decoder,
    "siglip": siglip,
}
# The builder arguments that give 4 layers (what an interleaved pipeline of 2 stages of 2
# chunks cuts), for the families that take them and pipeline: ModernBERT's and its decoder's
# first layer has no attention norm (nn.Identity), so their layers are not alike blocks.
DEEPER: dict[str, dict[str, Any]] = {
    "gpt_bigcode": {"n_layer": 4},
    "gpt_neo": {"num_layers": 4, "attention_types": [[["global", "local"], 2]]},
    "gemma3": {"num_hidden_layers": 4, "layer_types": _LAYER_TYPES * 2},
    "olmo3": {"num_hidden_layers": 4, "layer_types": _LAYER_TYPES * 2},
}
# Every model of the real-model suite, the older ones first (what `build` and the bench read).
BUILDERS: dict[str, Callable[..., ModelAndInputs]] = (
    real_models.BUILDERS | FAMILIES | SWEEP | FAULTS
)
