"""`autosbp zoo`: every zoo model with every argument `--model-args` accepts and its default."""

from __future__ import annotations

import pytest

from autosbp import cli
from autosbp.zoo import ZOO_MODELS, build_model, model_arguments


def _out(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert cli.main(argv) == 0
    return " ".join(capsys.readouterr().out.split())


def test_zoo_lists_every_model_with_its_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    out = _out(capsys, ["zoo"])
    for name in ZOO_MODELS:
        assert f" {name} " in out
        for key, default in model_arguments(name).items():
            assert f"{key}={default}" in out, (name, key)


@pytest.mark.parametrize("name", ZOO_MODELS)
def test_naming_one_model_lists_only_it(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = _out(capsys, ["zoo", name])
    others = [other for other in ZOO_MODELS if other != name]
    assert f" {name} " in out and not any(f" {other} " in out for other in others)
    model, _ = build_model(name, device="meta")
    assert f"{sum(p.numel() for p in model.parameters()):,}" in out


def test_the_listed_defaults_are_what_build_model_uses() -> None:
    # The listing reads the builders' signatures: passing the listed defaults explicitly
    # builds the same model as passing nothing.
    for name in ZOO_MODELS:
        default, _ = build_model(name, device="meta")
        explicit, _ = build_model(name, device="meta", **model_arguments(name))
        assert [p.shape for p in default.parameters()] == [p.shape for p in explicit.parameters()]


def test_an_unknown_model_is_refused_with_the_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["zoo", "bogus"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "Unknown zoo model 'bogus'" in err and all(name in err for name in ZOO_MODELS)
