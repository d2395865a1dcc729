"""Capture's canonical form, each rule from a pure-torch reproduction of what real models do.

Oracle: eager torch. The graph of a model must not depend on the device it was captured on
(meta or cpu: same nodes, arguments and fingerprint), and interpreting it (`run_graph`) must
give the eager loss and gradients. Reproduced here in a few lines each (issue #17: what Hugging
Face, torchvision and timm models do): attention's `transpose().contiguous()` (whose presence
depended on the device's strides), `x.to(device)` and `arange(device=...)`, indexing assignment
with a Python scalar (T5's `_shift_right`: `fill_` on the CPU, a materialized scalar elsewhere),
an empty constant (HF's KV cache), in-place activations (`ReLU(inplace=True)`, `out += x`,
hardswish_), in-place writes through views, `torch.no_grad()` regions (HF's rotary
embeddings), data-dependent shapes, and a micro-batch BatchNorm cannot train on.
Lives elsewhere: the node contract on the zoo models (tests/capturing/test_capture.py), third-party
models end to end (tests/models/test_real_models.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autosbp.capturing.export import capture, capture_micro_batch, run_graph
from autosbp.capturing.graph import RUN_DEVICE, OpGraph, Role
from autosbp.errors import CaptureError, MicroBatchError
from autosbp.rules import mutated_inputs, pinned_inputs
from tests.support.canonical_models import BATCH, CASES, build


def _rows(graph: OpGraph) -> list[str]:
    return [
        f"{name} {a.op} {a.inputs} {a.outputs} {a.args!r} {a.kwargs!r} {a.name}"
        for name, a in graph.nodes()
    ]


def _loss_and_grads(
    model: nn.Module, inputs: tuple[torch.Tensor, ...], graph: OpGraph | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and parameter gradients of eager (graph None) or of interpreting `graph`."""
    params = {k: v.detach().clone().requires_grad_(True) for k, v in model.named_parameters()}
    state = {**{k: v.detach().clone() for k, v in model.named_buffers()}, **params}
    if graph is None:
        loss = torch.func.functional_call(model, state, inputs)
    else:
        loss = run_graph(graph, state, inputs)
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return loss.detach(), {k: g for k, g in zip(params, grads, strict=True) if g is not None}


@pytest.mark.parametrize("case", CASES)
def test_graph_and_fingerprint_do_not_depend_on_the_capture_device(case: str) -> None:
    on_meta = capture(*build(case, "meta"), name=case)
    model, inputs = build(case, "cpu")
    on_cpu = capture(model, inputs, name=case)
    assert _rows(on_meta) == _rows(on_cpu)
    assert on_meta.fingerprint() == on_cpu.fingerprint()
    devices = [
        v for _, a in on_cpu.nodes() for v in (*a.args, *a.kwargs.values())
        if isinstance(v, torch.device)
    ]  # fmt: skip
    assert devices == [], "devices are recorded as RUN_DEVICE"


@pytest.mark.parametrize("case", CASES)
def test_graph_captured_on_meta_trains_like_eager_on_cpu(case: str) -> None:
    graph = capture(*build(case, "meta"), name=case)
    model, inputs = build(case, "cpu")
    eager_loss, eager_grads = _loss_and_grads(model, inputs, None)
    loss, grads = _loss_and_grads(model, inputs, graph)
    torch.testing.assert_close(loss, eager_loss, rtol=0, atol=0)
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():  # same kernels; views may run as reshape: same values
        torch.testing.assert_close(grad, eager_grads[name], rtol=0, atol=0, msg=name)


def test_non_persistent_buffers_keep_the_models_values() -> None:
    """Capture traces on fake tensors; a buffer export lifts as a constant must come back as the
    model's own tensor (its values), not the fake: the state dict does not hold it."""
    model, inputs = build("position-buffer", "cpu")
    graph = capture(model, inputs)
    assert "scale" not in model.state_dict()
    assert graph.meta["constants"]["scale"] is model.scale
    got = run_graph(graph, dict(model.state_dict()), inputs)
    torch.testing.assert_close(got, model(*inputs), rtol=0, atol=0)


def test_device_arguments_become_run_device() -> None:
    graph = capture(*build("device-moves", "meta"))
    recorded = [
        v for _, a in graph.nodes() for v in (*a.args, *a.kwargs.values()) if v is RUN_DEVICE
    ]
    assert len(recorded) >= 3  # arange(device=), to(device, dtype), x.to(weight.device)


def _ops(graph: OpGraph) -> list[str]:
    return [a.op for _, a in graph.nodes(Role.COMPUTE)]


def test_inplace_activations_become_their_functional_twins() -> None:
    graph = capture(*build("inplace-cnn", "cpu"))
    writes = [
        (a.op, graph.producers(n)[i])
        for n, a in graph.nodes(Role.COMPUTE)
        for i in mutated_inputs(a)
    ]
    roles = {graph.node(p[0]).role for _, p in writes if p is not None}
    assert roles == {Role.BUFFER}, f"only buffer updates stay in place: {writes}"
    ops = _ops(graph)
    assert ops.count("aten.relu.default") == 2 and "aten.hardswish.default" in ops
    assert "aten.add.Tensor" in ops  # out += h


def test_write_through_a_view_stays_in_place_and_pins_its_alias_chain() -> None:
    graph = capture(*build("shift-right", "cpu"))
    pinned = {n: pinned_inputs(graph, n) for n in graph.order}
    ops = {n: graph.node(n).op for n in graph.order}
    assert any(ops[n] == "aten.copy_.default" and p == {0} for n, p in pinned.items())
    assert any(ops[n] == "aten.slice.Tensor" and p == {0} for n, p in pinned.items())
    assert not any(p for n, p in pinned.items() if ops[n] == "aten.embedding.default")


def test_no_grad_region_is_inlined_behind_a_detach() -> None:
    graph = capture(*build("no-grad", "cpu"))
    detached = [n for n, a in graph.nodes() if a.op == "aten.detach.default"]
    assert len(detached) == 1  # the region's one output
    model, inputs = build("no-grad", "cpu")
    _, grads = _loss_and_grads(model, inputs, graph)
    assert "gate.weight" not in grads and "fc.weight" in grads


def test_type_as_is_a_cast_of_self_and_reads_no_other_tensor() -> None:
    """type_as reads only its other input's dtype: the graph holds a cast where the dtypes
    differ and nothing where they agree, and no edge from the other input (the eager loss and
    gradients of the case: test_graph_captured_on_meta_trains_like_eager_on_cpu)."""
    graph = capture(*build("type-as", "meta"))
    ops = _ops(graph)
    assert "aten.type_as.default" not in ops
    casts = [a for _, a in graph.nodes(Role.COMPUTE) if a.op == "aten._to_copy.default"]
    assert [a.kwargs["dtype"] for a in casts] == [torch.float64, torch.float32]
    assert all(len(a.inputs) == 1 for a in casts)


class _Mask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h[h > 0].sum()


class _Nonzero(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        rows = torch.nonzero(h > 0)[:, 0]
        return h[rows].sum()


@pytest.mark.parametrize(
    ("model", "fragments"),
    [
        (_Mask(), ["`aten.index.Tensor`", "return h[h > 0].sum()", "torch.where"]),
        (_Nonzero(), ["`aten.nonzero.default`", "rows = torch.nonzero(h > 0)[:, 0]", "mask"]),
    ],
    ids=["boolean-mask", "nonzero"],
)
def test_data_dependent_shapes_name_the_line_and_the_fix(
    model: nn.Module, fragments: list[str]
) -> None:
    with pytest.raises(CaptureError) as info:
        capture(model, (torch.randn(2, 4),))
    message = str(info.value)
    assert "depends on tensor values" in message and "\n" not in message
    for fragment in fragments:
        assert fragment in message


class _BnMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x)).pow(2).mean()


def test_batch_norm_on_one_sample_is_a_micro_batch_error() -> None:
    model, inputs = _BnMlp(), (torch.randn(BATCH, 4),)
    assert capture_micro_batch(model, inputs, 2).fingerprint()  # 2 samples: fine
    with pytest.raises(MicroBatchError, match="micro-batch of 1 samples") as info:
        capture_micro_batch(model, inputs, BATCH)
    assert "more than 1 value per channel" in str(info.value)


def test_a_model_that_never_captures_is_no_micro_batch_error() -> None:
    with pytest.raises(CaptureError) as info:
        capture_micro_batch(_Mask(), (torch.randn(4, 4),), 2)
    assert not isinstance(info.value, MicroBatchError)
