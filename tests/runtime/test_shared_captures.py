"""The runtime tests' shared captures (tests/support/shared_captures.py) are keyed soundly:
whatever capture reads changes the key (a model's values, flags, code, dtype, inputs' shapes
and dtypes, the name), and a served graph is the graph a capture gives, a new object per
caller.

Oracle: the key of an unchanged model (built again) is equal, and each change is unequal; a
served graph against `autosbp.capturing.export.capture` itself (fingerprint, nodes, order).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from autosbp.capturing import export
from autosbp.capturing.export import capture_micro_batch, capturing_in
from autosbp.zoo import build_model, load_model
from tests.support.shared_captures import capture_key, shared_captures

GPT = {"layers": 2, "hidden": 16, "heads": 2, "vocab": 32, "seq": 4, "batch": 4}
Built = tuple[nn.Module, tuple[torch.Tensor, ...]]


def _gpt() -> Built:
    model, inputs = build_model("gpt", **GPT)
    return model, tuple(inputs)


def _value(built: Built) -> Built:
    with torch.no_grad():
        next(built[0].parameters())[0, 0] += 1
    return built


def _eval(built: Built) -> Built:
    built[0].eval()
    return built


def _frozen(built: Built) -> Built:
    next(built[0].parameters()).requires_grad_(False)
    return built


def _shape(built: Built) -> Built:
    return built[0], tuple(x[: x.shape[0] // 2] for x in built[1])


def _input_dtype(built: Built) -> Built:
    return built[0], tuple(x.to(torch.int32) for x in built[1])


def _other_model(built: Built) -> Built:
    model, inputs = build_model("gpt", **{**GPT, "hidden": 32})
    return model, tuple(inputs)


CHANGES: dict[str, Callable[[Built], Built]] = {
    "a-parameter-value": _value,
    "eval-mode": _eval,
    "a-frozen-parameter": _frozen,
    "input-shape": _shape,
    "input-dtype": _input_dtype,
    "another-config": _other_model,
}


def test_the_same_model_built_again_has_the_same_key() -> None:
    assert capture_key(*_gpt(), None, None) == capture_key(*_gpt(), None, None) is not None


@pytest.mark.parametrize("change", list(CHANGES.values()), ids=list(CHANGES))
def test_every_change_capture_reads_changes_the_key(change: Callable[[Built], Built]) -> None:
    assert capture_key(*change(_gpt()), None, None) != capture_key(*_gpt(), None, None)


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(4, 4), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc(x)).pow(2).mean()


def test_dropout_turned_off_changes_the_key() -> None:
    torch.manual_seed(0)
    model, inputs = Dropped(), (torch.ones(2, 4),)
    before = capture_key(model, inputs, None, None)
    model.drop.p = 0.0  # as `--check` disables dropout (runtime.verify.one_device)
    assert capture_key(model, inputs, None, None) != before


def test_the_dtype_and_the_name_are_in_the_key() -> None:
    model, inputs = _gpt()
    plain = capture_key(model, inputs, None, None)
    bf16 = capture_key(model, inputs, None, torch.bfloat16)
    with capturing_in(torch.bfloat16):  # as the planner casts: the same capture as dtype=
        assert capture_key(model, inputs, None, None) == bf16
    assert len({plain, bf16, capture_key(model, inputs, "other", None)}) == 3


def _write_builder(path: Path, scale: float) -> str:
    path.write_text(
        "import torch\nfrom torch import nn\n\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.fc = nn.Linear(4, 4)\n\n"
        f"    def forward(self, x):\n        return (self.fc(x) * {scale}).pow(2).mean()\n\n\n"
        "def build():\n    torch.manual_seed(0)\n    return Net(), (torch.ones(2, 4),)\n"
    )
    return f"{path}:build"


def test_a_model_file_rewritten_changes_the_key(tmp_path: Path) -> None:
    path = tmp_path / "net.py"
    before = capture_key(*load_model(_write_builder(path, 1.0)), None, None)
    after = capture_key(*load_model(_write_builder(path, 2.0)), None, None)  # same size, names
    assert before is not None and after is not None and before != after


def test_a_model_that_does_not_pickle_by_name_has_no_key() -> None:
    class Local(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum()

    assert capture_key(Local(), (torch.ones(2),), None, None) is None


@pytest.mark.slow
def test_a_served_graph_is_the_captured_graph_and_each_caller_gets_its_own() -> None:
    model, inputs = _gpt()
    with shared_captures():
        served: list[Any] = [capture_micro_batch(model, inputs, 2) for _ in range(2)]
        fresh = export.capture.__wrapped__(model, [x[:2] for x in inputs])  # type: ignore[attr-defined]
    assert served[0] is not served[1]
    for graph in served:
        assert graph.fingerprint() == fresh.fingerprint()
        assert graph.order == fresh.order and graph.model_name == fresh.model_name
        assert all(graph.node(n) == fresh.node(n) for n in fresh.order)


def test_autosbp_s_own_code_is_in_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    # a folder a dead session left keeps graphs of the code it ran: another code, another key
    from tests.support import shared_captures as module

    model, inputs = _gpt()
    before = capture_key(model, inputs, None, None)
    monkeypatch.setattr(module, "_autosbp_code", lambda: "another autosbp")
    assert capture_key(model, inputs, None, None) != before
