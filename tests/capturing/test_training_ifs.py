"""Capture absorbs the `if`s libraries put in training forwards (issue #29): LayerDrop's draw
compared with a probability of 0 (the branch never runs) and checks whose branch only raises
(assumed, checked on the example inputs, reported). The oracle for the graph: the same model
without those lines captures to the same fingerprint; for training, `--check` (one device).
Anything else still refused, with the user's line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autosbp.capturing.export import capture
from autosbp.cli import main
from autosbp.errors import CaptureError
from tests.support.training_ifs_models import BUILDERS, own

MODELS = Path(__file__).resolve().parents[1] / "support" / "training_ifs_models.py"


def test_layerdrop_at_zero_and_a_check_capture_as_the_plain_model() -> None:
    graph = capture(*own())
    assert graph.fingerprint() == capture(*own(kind="plain")).fingerprint()
    assert not any("rand" in a.op for _, a in graph.nodes())
    said = "\n".join(graph.meta["absorbed"])
    assert "training_ifs_models.py:" in said and "dropout_probability < self.layerdrop" in said
    assert "`if labels.max() >= self.vocab:`: assumed not taken" in said
    assert "checked on the example inputs" in said and "assert labels.min() >= 0" in said


def test_on_meta_the_assumption_is_reported_unchecked() -> None:
    with torch.device("meta"):
        graph = capture(*own())
    assert graph.fingerprint() == capture(*own()).fingerprint()
    assert "unchecked on meta" in "\n".join(graph.meta["absorbed"])


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ({"layerdrop": 0.1}, "compares a random draw with 0.1: whether the branch runs is decided"),
        ({"layerdrop": 0.1}, "Fix: set `LayerDropNet.layerdrop` to 0.0 (it holds 0.1)"),
        ({"label": 9}, "raises on its example inputs (ValueError: Label values must be <="),
        ({"kind": "deciding"}, "if x.sum() > 0:"),
    ],
    ids=["layerdrop-0.1", "layerdrop-says-what-to-set", "check-fails-on-inputs", "other-decision"],
)
def test_what_cannot_be_absorbed_is_refused_with_the_line(args: dict, says: str) -> None:
    with pytest.raises(CaptureError) as info:
        capture(*own(**args))
    assert says in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("name", "setting"),
    [
        ("bart", "`encoder_layerdrop=0.0` and `decoder_layerdrop=0.0` in the model's `BartConfig`"),
        ("wav2vec2", "`layerdrop=0.0` in the model's `Wav2Vec2Config`"),
    ],
)
def test_layerdrop_inside_0_1_is_refused_naming_the_config_fields(name: str, setting: str) -> None:
    """A probability in (0, 1) decides per step whether a layer runs: one graph cannot hold it
    (not supported), and the refusal says which of the config's fields to set to 0."""
    pytest.importorskip("transformers")
    with pytest.raises(CaptureError) as info:
        capture(*BUILDERS[name](layerdrop=0.1))
    assert f"Fix: set {setting}" in str(info.value), str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_hugging_face_layerdrop_captures_on_meta_as_on_cpu(name: str) -> None:
    pytest.importorskip("transformers")
    with torch.device("meta"):
        meta = capture(*BUILDERS[name]())
    cpu = capture(*BUILDERS[name]())
    assert meta.fingerprint() == cpu.fingerprint()
    said = "\n".join(cpu.meta["absorbed"])
    assert f"modeling_{name}.py:" in said and "always False" in said, said


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["own", "opt", "whisper"])
def test_absorbed_models_train_like_one_device(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if name != "own":
        pytest.importorskip("transformers")
    argv = ["train", f"{MODELS}:{name}", "--nproc", "2", "--steps", "2", "--check"]
    assert main(argv) == 0, capsys.readouterr().err


def test_materialize_checks_the_assumptions_on_the_inputs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--materialize` (issue #29: it failed as meta does) builds real inputs, on which the
    assumed checks run: a label past the vocabulary is refused there, and passes on meta,
    where it is reported unchecked."""
    model = f"{MODELS}:own"
    assert main(["capture", model, "--model-args", "label=9"]) == 0
    assert "unchecked on meta" in capsys.readouterr().out
    assert main(["capture", model, "--model-args", "label=9", "--materialize"]) != 0
    assert "raises on its example inputs (ValueError" in capsys.readouterr().err
    assert main(["capture", model, "--materialize"]) == 0
    assert "checked on the example inputs" in capsys.readouterr().out
