"""A builder that moves its model (`.to(device)`, `.cuda()`, `.to(dtype)`) captures on meta
(issue #29) into the graph of the same builder run on real weights: the fingerprint is the
oracle (ops, shapes, dtypes, edges). `.cuda()` on a machine without a GPU is compared with the
builder that does not move (a move says where the model runs, which the plan decides)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autosbp.capturing.export import capture
from autosbp.zoo import load_model

BUILDER = f"{Path(__file__).resolve().parents[1] / 'support' / 'moving_models.py'}:build"


def _fingerprint(how: str, device: str | None) -> str:
    model, inputs = load_model(BUILDER, {"how": how}, device=device)
    if device == "meta":
        assert all(p.is_meta for p in model.parameters()) and all(x.is_meta for x in inputs)
    return capture(model, inputs).fingerprint()


@pytest.mark.parametrize(
    ("how", "like"),
    [("cpu", "cpu"), ("device", "device"), ("double", "double"), ("cuda", "none")],
    ids=["to-cpu", "to-device", "to-float64", "cuda"],
)
def test_a_moving_builder_captures_on_meta_as_on_real_weights(how: str, like: str) -> None:
    if like == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    assert _fingerprint(how, "meta") == _fingerprint(like, None)


def test_a_dtype_move_on_meta_changes_the_dtype() -> None:
    model, inputs = load_model(BUILDER, {"how": "double"}, device="meta")
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert {x.dtype for x in inputs} == {torch.float64}
    assert _fingerprint("double", "meta") != _fingerprint("none", "meta")
