"""The model zoo: every model returns a deterministic scalar loss; loading and --model-args errors.

Oracle: eager torch (the same model built twice with one seed gives bit-identical losses).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autosbp.errors import CaptureError
from autosbp.zoo import ZOO_MODELS, build_model, load_model, parse_model_args


@pytest.mark.parametrize("name", ZOO_MODELS)
def test_zoo_model_returns_deterministic_scalar_loss(name: str) -> None:
    rng_before = torch.random.get_rng_state()
    model, inputs = build_model(name, seed=3)
    again, inputs_again = build_model(name, seed=3)
    other, other_inputs = build_model(name, seed=4)
    loss = model(*inputs)
    assert loss.shape == () and loss.dtype == torch.float32 and torch.isfinite(loss)
    assert torch.equal(loss, again(*inputs_again))
    assert not torch.equal(loss, other(*other_inputs))
    assert torch.equal(torch.random.get_rng_state(), rng_before), "build_model moved global RNG"
    assert model.training


@pytest.mark.parametrize("name", ZOO_MODELS)
def test_zoo_model_on_meta_allocates_nothing(name: str) -> None:
    model, inputs = build_model(name, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert all(t.is_meta for t in inputs)
    assert model(*inputs).shape == ()


@pytest.mark.parametrize(
    ("name", "kwargs", "attr", "expected"),
    [
        ("gpt", {"layers": 3}, "blocks", 3),
        ("mlp", {"layers": 5}, "blocks", 5),
        ("resnet", {"blocks": 4}, "blocks", 4),
        ("widedeep", {"tables": 6}, "tables", 6),
    ],
    ids=["gpt-layers", "mlp-layers", "resnet-blocks", "widedeep-tables"],
)
def test_zoo_kwargs_size_the_model(name: str, kwargs: dict, attr: str, expected: int) -> None:
    model, inputs = build_model(name, **kwargs)
    assert len(getattr(model, attr)) == expected
    assert model(*inputs).shape == ()


def test_gpt_tied_head_shares_the_embedding() -> None:
    model, _ = build_model("gpt", tied=True)
    assert model.head.weight is model.wte.weight


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("bert", {}, "Unknown zoo model 'bert'"),
        ("gpt", {"depth": 2}, "no argument 'depth'"),
        ("gpt", {"hidden": 10, "heads": 4}, "divisible by heads"),
    ],
    ids=["unknown-name", "unknown-kwarg", "bad-heads"],
)
def test_build_model_errors(name: str, kwargs: dict, message: str) -> None:
    with pytest.raises(CaptureError, match=message):
        build_model(name, **kwargs)


# ------------------------------------------------------------------------------ load_model
GOOD_FILE = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, 1)

    def forward(self, x):
        return self.fc(x).pow(2).mean()

def make(width=4):
    return Net(width), (torch.ones(2, width),)

def not_a_pair():
    return Net(4)

def bad_inputs():
    return Net(4), (1, 2)
"""


def test_load_model_from_file(tmp_path: Path) -> None:
    path = tmp_path / "net.py"
    path.write_text(GOOD_FILE)
    model, inputs = load_model(f"{path}:make", {"width": 3})
    assert inputs[0].shape == (2, 3) and model(*inputs).shape == ()
    meta_model, meta_inputs = load_model(f"{path}:make", {}, device="meta")
    assert meta_model.fc.weight.is_meta and meta_inputs[0].is_meta


def test_load_model_zoo_name() -> None:
    model, inputs = load_model("gpt", {"layers": 1})
    assert len(model.blocks) == 1 and model(*inputs).shape == ()


@pytest.mark.parametrize(
    ("spec", "args", "message"),
    [
        ("{dir}/missing.py:make", {}, "does not exist"),
        ("{dir}/net.py:nope", {}, "has no function 'nope'.*make"),
        ("{dir}/net.py:not_a_pair", {}, "returned a Net; it must return a pair"),
        ("{dir}/net.py:bad_inputs", {}, r"returned a tuple of 2 \(Net, tuple\)"),
        ("{dir}/net.py:make", {"depth": 1}, "Check --model-args"),
        ("{dir}/broken.py:make", {}, "Importing model file .* failed with ZeroDivisionError"),
        ("{dir}/net.py", {}, "Unknown model .*path/to/file.py:function"),
        ("resnet50", {}, "Unknown model 'resnet50'"),
    ],
    ids=[
        "missing-file",
        "missing-function",
        "not-a-pair",
        "non-tensor-inputs",
        "bad-kwarg",
        "import-error",
        "no-function-part",
        "unknown-zoo-name",
    ],
)
def test_load_model_errors(tmp_path: Path, spec: str, args: dict, message: str) -> None:
    (tmp_path / "net.py").write_text(GOOD_FILE)
    (tmp_path / "broken.py").write_text("x = 1 / 0\n")
    with pytest.raises(CaptureError, match=message):
        load_model(spec.format(dir=tmp_path), args)


# ------------------------------------------------------------------------- parse_model_args
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", {}),
        ("layers=2", {"layers": 2}),
        ("lr=0.5, tied=true,name=tiny", {"lr": 0.5, "tied": True, "name": "tiny"}),
        ("flag=False,big=1e3", {"flag": False, "big": 1000.0}),
    ],
    ids=["empty", "int", "float-bool-str", "false-exponent"],
)
def test_parse_model_args(text: str, expected: dict) -> None:
    parsed = parse_model_args(text)
    assert parsed == expected
    assert [type(v) for v in parsed.values()] == [type(v) for v in expected.values()]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("layers", "Bad --model-args item 'layers'"),
        ("=3", "Bad --model-args item '=3'"),
        ("layers=", "Bad --model-args item 'layers='"),
        ("2x=1", "Bad --model-args item '2x=1'"),
        ("a=1,a=2", "gives 'a' twice"),
    ],
    ids=["no-equals", "no-key", "no-value", "bad-key", "duplicate"],
)
def test_parse_model_args_errors(text: str, message: str) -> None:
    with pytest.raises(CaptureError, match=message):
        parse_model_args(text)
