"""Frozen parameters stay frozen (issue #29): a parameter with `requires_grad=False` is captured
as state the step reads (no gradient, no optimizer state, no sync), priced so, and `--check`
compares every step with torch on one device, where it is frozen too, and holds it unchanged.
A model with nothing to train is refused, naming why.

Oracles: single-device torch (`--check`: loss and gradients in float64, the trainable updates
against the same Adam, the frozen tensors equal to their values before the step); Adam's
states for the memory (gradient + two moments, 12 bytes per fp32 element, that a frozen
weight does not have).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from autosbp.capturing.export import capture
from autosbp.capturing.graph import Role
from autosbp.cli import main
from autosbp.planner.api import auto_parallelize
from autosbp.planner.memory.kept import kept_for_backward
from autosbp.planner.space.ties import tie_graph
from tests.support.frozen_models import build

MODELS = Path(__file__).resolve().parents[1] / "support" / "frozen_models.py"
ADAM_STATE_BYTES = 12  # per fp32 element: its gradient and Adam's two moments


def _train(kind: str, plan: str) -> int:
    return main(["train", f"{MODELS}:build", "--model-args", f"kind={kind}", "--nproc", "2",
                 "--plan", plan, "--steps", "3", "--check"])  # fmt: skip


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("kind", "plan"),
    [("part", "dp"), ("part", "fsdp"), ("lora", "auto"), ("lora", "megatron:tp=2,pp=1,dp=1")],
    ids=["part-dp", "part-fsdp", "lora-auto", "lora-tp2"],
)
def test_frozen_parameters_train_like_one_device(
    kind: str, plan: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _train(kind, plan) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "passed" in out or "Compared at every step" in out, out


def test_a_model_with_everything_frozen_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", f"{MODELS}:build", "--model-args", "kind=all", "--nproc", "2",
                 "--plan", "dp", "--steps", "1"]) != 0  # fmt: skip
    err = capsys.readouterr().err
    assert "every parameter of model" in err and "is frozen (requires_grad=False" in err, err
    assert "Traceback" not in err


def test_frozen_weights_are_state_without_gradients() -> None:
    model, inputs = build("part")
    graph = capture(model, inputs)
    roles = {a.name: a.role for _, a in graph.nodes() if a.role in (Role.PARAMETER, Role.BUFFER)}
    assert roles == {
        "l1.weight": Role.BUFFER, "l1.bias": Role.BUFFER,
        "l2.weight": Role.PARAMETER, "l2.bias": Role.PARAMETER,
    }  # fmt: skip
    # autograd runs no backward for the frozen layer (nothing it reads requires grad)
    share = kept_for_backward(graph, tie_graph(graph).representative, "none").backward_share
    linear = {a.module_path: n for n, a in graph.nodes(Role.COMPUTE) if "linear" in a.op}
    assert share[linear["l1"]] == 0.0 and 0.0 < share[linear["l2"]] < 1.0


def test_a_frozen_layer_is_priced_without_its_states_and_weight_gradient() -> None:
    width = 512  # the frozen layer's weights dominate: 8 x 512 + 512 elements
    plans = {
        kind: auto_parallelize(*build(kind, width), devices=2, strategy="dp", time_limit_s=10)
        for kind in ("none", "part")
    }
    assert set(plans["part"].params) == {"l2.weight", "l2.bias"}
    frozen_elements = 8 * width + width
    saved = plans["none"].stages[0].peak_memory_bytes - plans["part"].stages[0].peak_memory_bytes
    assert saved >= ADAM_STATE_BYTES * frozen_elements  # activations kept only shrink besides
    part, none = plans["part"].stages[0], plans["none"].stages[0]
    assert part.backward_s < none.backward_s and part.update_s < none.update_s
