"""Third-party models as a user brings them: Hugging Face transformers, tiny configs, random weights.

Lives here: one builder per model, each returning `(model, example_inputs)` where
`model(*example_inputs)` is the training loss (the HF model's own `.loss`, labels among the
inputs), usable wherever autosbp takes a model: `autosbp plan tests/support/real_models.py:gpt2 ...`,
`autosbp train tests/support/real_models.py:llama --nproc 2 --check`, `auto_parallelize(*gpt2())`.
Lives elsewhere: what the suite does with them (tests/models/test_real_models.py), the zoo's own
models (`autosbp.zoo`).

Invariants: no download (every model is built from a `Config` object, never `from_pretrained`);
the same arguments give bit-identical weights and inputs (seeded, global RNG left untouched);
built under `torch.device("meta")` (the CLI's `--meta`, the fingerprint check) they hold no
memory and trace the same graph; dropout probabilities are 0 (the check compares exact
training); sizes are tiny (2 layers, hidden 32) and divide by 2 and 4 where heads and batch
must. Causal LMs get labels with ignored (-100) positions, as HF's own padding gives them.

torchvision and timm are absent on purpose: their wheels on PyPI are built against the CUDA
torch and do not import beside the CPU torch 2.13 pin ("operator torchvision::nms does not
exist"); timm imports torchvision. The constructs they bring (in-place ReLU and hardswish,
depthwise convolutions with BatchNorm) are covered by transformers' ResNet and ConvNeXt and by
`inplace_cnn`, a small torchvision- and timm-style network written here, and MobileNetV2
outside the CI suite (`SUITE`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

ModelAndInputs = tuple[nn.Module, tuple[torch.Tensor, ...]]
IGNORE_INDEX = -100  # HF's (and torch's) default ignore_index of cross-entropy


class LossOf(nn.Module):
    """`model(**{name: input})` -> its `.loss`: a HF model as a module whose forward returns the
    training loss, inputs passed positionally in `names` order."""

    def __init__(self, model: nn.Module, names: tuple[str, ...]) -> None:
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.names, inputs, strict=True))).loss


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[torch.Generator]:
    """Weights from torch's global RNG seeded with `seed` (restored after); inputs from the
    returned CPU generator, so they do not depend on the device the model is built on."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield torch.Generator().manual_seed(seed)


def _on_default_device(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Inputs drawn on the CPU, moved where the model is built (meta under `--meta`)."""
    device = torch.get_default_device()
    return tuple(t.to(device) for t in tensors)


def _tokens_and_labels(
    g: torch.Generator, batch: int, seq: int, vocab: int, ignored: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels = the ids with the last `ignored` positions of every row set to
    IGNORE_INDEX (right padding, as a data collator pads labels)."""
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = ids.clone()
    if ignored:
        labels[:, seq - ignored :] = IGNORE_INDEX
    return ids, labels


def _causal_lm(
    make: Callable[[], nn.Module], *, vocab: int, batch: int, seq: int, seed: int
) -> ModelAndInputs:
    with _seeded(seed) as g:
        model = make()
        ids, labels = _tokens_and_labels(g, batch, seq, vocab, ignored=seq // 4)
    model.train()
    return LossOf(model, ("input_ids", "labels")), _on_default_device(ids, labels)


VOCAB = 128
TEXT = {"batch": 4, "seq": 16}


def gpt2(batch: int = TEXT["batch"], seq: int = TEXT["seq"], seed: int = 0) -> ModelAndInputs:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=seq, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return _causal_lm(lambda: GPT2LMHeadModel(config), vocab=VOCAB, batch=batch, seq=seq, seed=seed)


def _llama_like(config_class: Any, model_class: Any, **extra: Any) -> Callable[..., ModelAndInputs]:
    def build(
        batch: int = TEXT["batch"],
        seq: int = TEXT["seq"],
        seed: int = 0,
        layers: int = 2,
        hidden: int = 32,
    ) -> ModelAndInputs:
        config = config_class(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
            attention_dropout=0.0, **extra,
        )  # fmt: skip
        return _causal_lm(lambda: model_class(config), vocab=VOCAB, batch=batch, seq=seq, seed=seed)

    return build


def llama(
    batch: int = TEXT["batch"],
    seq: int = TEXT["seq"],
    seed: int = 0,
    layers: int = 2,
    hidden: int = 32,
) -> ModelAndInputs:
    from transformers import LlamaConfig, LlamaForCausalLM

    return _llama_like(LlamaConfig, LlamaForCausalLM)(batch, seq, seed, layers, hidden)


def mistral(batch: int = TEXT["batch"], seq: int = TEXT["seq"], seed: int = 0) -> ModelAndInputs:
    from transformers import MistralConfig, MistralForCausalLM

    return _llama_like(MistralConfig, MistralForCausalLM, sliding_window=seq // 2)(batch, seq, seed)


def qwen2(batch: int = TEXT["batch"], seq: int = TEXT["seq"], seed: int = 0) -> ModelAndInputs:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _llama_like(Qwen2Config, Qwen2ForCausalLM)(batch, seq, seed)


def mixtral(batch: int = TEXT["batch"], seq: int = TEXT["seq"], seed: int = 0) -> ModelAndInputs:
    from transformers import MixtralConfig, MixtralForCausalLM

    build = _llama_like(
        MixtralConfig, MixtralForCausalLM, num_local_experts=4, num_experts_per_tok=2,
        router_jitter_noise=0.0,
    )  # fmt: skip
    return build(batch, seq, seed)


def bert(batch: int = TEXT["batch"], seq: int = TEXT["seq"], seed: int = 0) -> ModelAndInputs:
    """Masked LM: labels hold the token at a quarter of the positions, -100 elsewhere."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=seq, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    with _seeded(seed) as g:
        model = BertForMaskedLM(config)
        ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
        masked = torch.rand(batch, seq, generator=g) < 0.25
        masked[:, 0] = True  # every row predicts at least one token
        labels = torch.where(masked, ids, IGNORE_INDEX)
    model.train()
    return LossOf(model, ("input_ids", "labels")), _on_default_device(ids, labels)


def t5(batch: int = TEXT["batch"], seq: int = TEXT["seq"], seed: int = 0) -> ModelAndInputs:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    with _seeded(seed) as g:
        model = T5ForConditionalGeneration(config)
        ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
        _, labels = _tokens_and_labels(g, batch, seq // 2, VOCAB, ignored=seq // 8)
    model.train()
    return LossOf(model, ("input_ids", "labels")), _on_default_device(ids, labels)


def _image_classifier(
    make: Callable[[], nn.Module], *, batch: int, image: int, classes: int, seed: int
) -> ModelAndInputs:
    with _seeded(seed) as g:
        model = make()
        pixels = torch.randn(batch, 3, image, image, generator=g)
        labels = torch.randint(0, classes, (batch,), generator=g)
    model.train()
    return LossOf(model, ("pixel_values", "labels")), _on_default_device(pixels, labels)


IMAGES = {"batch": 4, "image": 16, "classes": 8}


def vit_like(config_name: str, model_name: str) -> Callable[..., ModelAndInputs]:
    """An image-classifier builder of the ViT family: transformers' `config_name` and
    `model_name` at the suite's tiny ViT shape."""

    def build(batch: int = IMAGES["batch"], seed: int = 0) -> ModelAndInputs:
        import transformers

        config = getattr(transformers, config_name)(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            image_size=IMAGES["image"], patch_size=4, num_labels=IMAGES["classes"],
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        return _image_classifier(
            lambda: getattr(transformers, model_name)(config), batch=batch,
            image=IMAGES["image"], classes=IMAGES["classes"], seed=seed,
        )  # fmt: skip

    return build


vit = vit_like("ViTConfig", "ViTForImageClassification")


RESNET_IMAGE = 8  # the last stage is 1x1: its BatchNorm needs 2 samples (MicroBatchError at 1)


def resnet(batch: int = IMAGES["batch"], seed: int = 0) -> ModelAndInputs:
    """HF ResNet: conv + BatchNorm + ReLU stem, basic blocks with BatchNorm and shortcuts; on 8x8
    images its last BatchNorm sees one value per channel and sample, so micro-batches of one
    sample cannot train it (the planner must skip them)."""
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
        num_labels=IMAGES["classes"],
    )  # fmt: skip
    return _image_classifier(
        lambda: ResNetForImageClassification(config), batch=batch, image=RESNET_IMAGE,
        classes=IMAGES["classes"], seed=seed,
    )  # fmt: skip


def convnext(batch: int = IMAGES["batch"], seed: int = 0) -> ModelAndInputs:
    """HF ConvNeXt: depthwise 7x7 convolutions, channels-last LayerNorm, layer scale."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(
        num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], patch_size=2,
        num_labels=IMAGES["classes"], layer_scale_init_value=1.0,
    )  # fmt: skip
    return _image_classifier(
        lambda: ConvNextForImageClassification(config), batch=batch, image=IMAGES["image"],
        classes=IMAGES["classes"], seed=seed,
    )  # fmt: skip


def mobilenet_v2(batch: int = IMAGES["batch"], seed: int = 0) -> ModelAndInputs:
    """HF MobileNetV2: depthwise convolutions, BatchNorm, ReLU6, in-place dropout (p = 0) on a
    view. Its 17 blocks are fixed (578 ops at any width): it plans in about a minute per mesh,
    so the CI suite leaves it out (`SUITE`); bench/real_models.py runs it."""
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    config = MobileNetV2Config(
        depth_multiplier=0.25, finegrained_output=False, image_size=IMAGES["image"],
        num_labels=IMAGES["classes"], classifier_dropout_prob=0.0,
    )  # fmt: skip
    return _image_classifier(
        lambda: MobileNetV2ForImageClassification(config), batch=batch, image=IMAGES["image"],
        classes=IMAGES["classes"], seed=seed,
    )  # fmt: skip


class _InplaceBlock(nn.Module):
    """torchvision's BasicBlock shape: conv-BN-ReLU(inplace)-conv-BN, += shortcut, ReLU(inplace);
    and a depthwise conv with hardswish(inplace), as timm's MobileNetV3 blocks have."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.depthwise = nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.act = nn.Hardswish(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.act(self.bn2(self.depthwise(out)))
        out += x
        return self.relu(out)


class InplaceCnn(nn.Module):
    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(inplace=True),
        )
        self.blocks = nn.Sequential(_InplaceBlock(channels), _InplaceBlock(channels))
        self.head = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(images))
        logits = self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(h, 1), 1))
        return nn.functional.cross_entropy(logits, labels)


def inplace_cnn(batch: int = IMAGES["batch"], seed: int = 0) -> ModelAndInputs:
    """A torchvision/timm-style CNN (BatchNorm, in-place ReLU and hardswish, depthwise conv)."""
    with _seeded(seed) as g:
        model = InplaceCnn(8, IMAGES["classes"])
        pixels = torch.randn(batch, 3, IMAGES["image"], IMAGES["image"], generator=g)
        labels = torch.randint(0, IMAGES["classes"], (batch,), generator=g)
    return model.train(), _on_default_device(pixels, labels)


BUILDERS: dict[str, Callable[..., ModelAndInputs]] = {
    "gpt2": gpt2,
    "llama": llama,
    "bert": bert,
    "t5": t5,
    "vit": vit,
    "mixtral": mixtral,
    "qwen2": qwen2,
    "mistral": mistral,
    "resnet": resnet,
    "convnext": convnext,
    "mobilenet_v2": mobilenet_v2,
    "inplace_cnn": inplace_cnn,
}
# The models of the CI suite (tests/models/test_real_models.py): all but MobileNetV2 (see its builder).
SUITE: tuple[str, ...] = tuple(name for name in BUILDERS if name != "mobilenet_v2")
