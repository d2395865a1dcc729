"""What autograd keeps, as `planner.memory.autograd_probe` reads it, equals what autograd's own
nodes hold.

The probe (`memory.autograd_probe.saved_by`) runs each op on fake tensors under
`saved_tensors_hooks`. The oracle here runs the same op on the node's real inputs (the zoo graphs
interpreted node by node, `test_rules_zoo.node_values`: valid indices and targets), walks the
autograd graph from its outputs back to its inputs, and reads every node's `_saved_*` attributes (a
different reader of the same facts: the attributes torch's generated backward code uses). Both must
agree, op by op, on which inputs and outputs are kept, the bytes of the other tensors kept, and
which outputs require grad, for every compute op of every zoo model here, and of every model of the
real-model suite in `bench/saved_probe.py` (its captures take a minute: outside the CI suite). A few
well-known rows are pinned too, so a silent change of both readers at once is seen.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from autosbp.capturing.export import capture
from autosbp.capturing.graph import (
    InputRef,
    OpGraph,
    OpNode,
    Role,
    TensorMeta,
    kernel_of,
    run_device,
)
from autosbp.planner.memory.autograd_probe import PROBE_DEVICE, Saved, requires_grad_of, saved_by
from autosbp.rules.core import resolve_refs
from autosbp.zoo import build_model
from tests.rules.test_rules_zoo import TINY, node_inputs, node_values

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module", params=sorted(TINY))
def graph_and_values(request: pytest.FixtureRequest) -> tuple[OpGraph, dict[str, list[Any]]]:
    model, inputs = build_model(request.param, **TINY[request.param])
    graph = capture(model, inputs, name=request.param)
    return graph, node_values(graph, model, inputs)


def _storage_key(t: torch.Tensor) -> tuple:
    storage = t.untyped_storage()
    return ("ptr", storage.data_ptr()) if storage.nbytes() else ("empty", id(t))


def _saved_tensors(fn: Any) -> Iterator[torch.Tensor]:
    """Every tensor an autograd node holds: its `_saved_*` attributes (aten ops), or
    `saved_tensors` (a custom autograd.Function's `ctx.save_for_backward`)."""
    values = [getattr(fn, a) for a in dir(fn) if a.startswith("_saved_")]
    if not values and hasattr(fn, "saved_tensors"):
        values = [fn.saved_tensors]
    for value in values:
        items = value if isinstance(value, list | tuple) else (value,)
        yield from (t for t in items if isinstance(t, torch.Tensor))


def _nodes_between(outputs: list[torch.Tensor], stop: set[Any]) -> Iterator[Any]:
    """The autograd nodes from `outputs` back to (not into) the inputs' nodes `stop`."""
    seen: set[Any] = set()
    todo = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while todo:
        fn = todo.pop()
        if fn in seen or fn in stop:
            continue
        seen.add(fn)
        yield fn
        todo += [nxt for nxt, _ in fn.next_functions if nxt is not None]


def _flat(result: Any) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, list | tuple):
        return [t for item in result for t in _flat(item)]
    return []


def saved_by_autograd(attrs: OpNode, inputs: list[torch.Tensor], flags: tuple[bool, ...]) -> Saved:
    """The oracle: the op on real `inputs` (requiring grad as `flags` say), read through its
    autograd nodes' saved attributes."""
    tensors = []
    for t, flag in zip(inputs, flags, strict=True):
        t = t.detach().clone(memory_format=torch.contiguous_format)  # as the probe's are
        differentiable = t.is_floating_point() or t.is_complex()
        tensors.append(t.requires_grad_().clone() if flag and differentiable else t)
    stop = {t.grad_fn for t in tensors if t.grad_fn is not None}
    kernel = kernel_of(attrs.target)
    args = resolve_refs(run_device(attrs.args, PROBE_DEVICE), tensors)
    kwargs = {
        k: resolve_refs(v, tensors) for k, v in run_device(attrs.kwargs, PROBE_DEVICE).items()
    }
    outputs = _flat(kernel(*args, **kwargs))
    of_input = {_storage_key(t): i for i, t in enumerate(tensors)}
    of_output = {_storage_key(t): i for i, t in enumerate(outputs)}
    kept_in, kept_out, extras = set(), set(), {}
    for fn in _nodes_between(outputs, stop):
        for t in _saved_tensors(fn):
            key = _storage_key(t)
            if key in of_input:
                kept_in.add(of_input[key])
            elif key in of_output:
                kept_out.add(of_output[key])
            else:
                extras[key] = t.untyped_storage().nbytes()
    flags_out = tuple(bool(t.requires_grad) for t in outputs)
    return Saved(frozenset(kept_in), frozenset(kept_out), sum(extras.values()), flags_out)


def test_probe_equals_autograds_saved_attributes(
    graph_and_values: tuple[OpGraph, dict[str, list[Any]]],
) -> None:
    assert check_graph(*graph_and_values) > 0


def check_graph(graph: OpGraph, values: dict[str, list[Any]]) -> int:
    """Hold the probe to the oracle for each op of `graph` (once per op and input flags, at its
    first node), with each node's real inputs `values`; the number of ops checked."""
    flags = requires_grad_of(graph)
    checked: set[tuple] = set()
    for name, attrs in graph.nodes(Role.COMPUTE):
        ins = tuple(flags[p] if p is not None else False for p in graph.producers(name))
        if (attrs.op, ins) in checked:
            continue
        got = saved_by(attrs, ins)
        assert got.known, f"{name} ({attrs.op}): the probe could not ask autograd"
        want = saved_by_autograd(attrs, node_inputs(graph, name, values), ins)
        assert_same(got, want, attrs, f"{name} ({attrs.op}, inputs requiring grad {ins})")
        checked.add((attrs.op, ins))
    return len(checked)


def assert_same(got: Saved, want: Saved, attrs: OpNode, where: str) -> None:
    """Equal, but for the Python numbers among the op's arguments: autograd saves each it
    needs as a 0-dim tensor (8 bytes) without calling the hooks the probe reads (mul by 0.5),
    so the oracle may see up to 8 bytes per such argument more."""
    numbers = sum(isinstance(a, int | float) and not isinstance(a, bool) for a in attrs.args)
    assert replace(got, extra_bytes=0) == replace(want, extra_bytes=0), where
    assert 0 <= want.extra_bytes - got.extra_bytes <= 8 * numbers, where


ATEN = torch.ops.aten
# (op, input shapes, which require grad, what autograd keeps: inputs, outputs, extra bytes)
PINNED = [
    ("linear", ATEN.linear.default, [(4, 8), (6, 8)], (True, True), {0, 1}, set(), 0),
    ("linear-on-data", ATEN.linear.default, [(4, 8), (6, 8)], (False, True), {0}, set(), 0),
    ("gelu", ATEN.gelu.default, [(4, 8)], (True,), {0}, set(), 0),
    ("add", ATEN.add.Tensor, [(4, 8), (4, 8)], (True, True), set(), set(), 0),
    ("softmax", ATEN.softmax.int, [(4, 8)], (True,), set(), {0}, 0),
    # mean and rstd beside the input and affine parameters: 2 x 4 fp32 per row statistic
    ("layer_norm", ATEN.layer_norm.default, [(4, 8), (8,), (8,)], (True, True, True),
     {0, 1, 2}, set(), 2 * 4 * 4),
    # the fused kernel's saves (`capturing.fused_norms`): input, weight and an fp32 rstd per
    # row, where torch's CPU composite keeps the fp32 upcast and products too
    ("rms_norm", ATEN.rms_norm.default, [(4, 8), (8,)], (True, True), {0, 1}, set(), 4 * 4),
]  # fmt: skip
EXTRA_ARGS = {"softmax": (-1,), "layer_norm": ([8],), "rms_norm": ([8],)}


@pytest.mark.parametrize(
    ("target", "shapes", "flags", "inputs", "outputs", "extra"),
    [pytest.param(*row[1:], id=row[0]) for row in PINNED],
)
def test_well_known_rows(
    request: pytest.FixtureRequest,
    target: Any,
    shapes: list[tuple[int, ...]],
    flags: tuple[bool, ...],
    inputs: set[int],
    outputs: set[int],
    extra: int,
) -> None:
    # linear keeps the weight only for the input's gradient and the input only for the
    # weight's: on user data (no grad) it keeps the input alone; softmax keeps its output.
    name = request.node.callspec.id
    refs = [InputRef(i) for i in range(len(shapes))]
    args = (refs[0], *EXTRA_ARGS.get(name, ()), *refs[1:])
    metas = tuple(TensorMeta(s, torch.float32) for s in shapes)
    attrs = OpNode(name, Role.COMPUTE, target=target, args=args, inputs=metas)
    got = saved_by(attrs, flags)
    assert got.known
    assert (set(got.inputs), set(got.outputs), got.extra_bytes) == (inputs, outputs, extra)
    real = [torch.randn(s) for s in shapes]
    assert_same(got, saved_by_autograd(attrs, real, flags), attrs, name)


def test_an_op_the_probe_cannot_run_keeps_everything(caplog: pytest.LogCaptureFixture) -> None:
    # nonzero's output shape depends on the data, which fake tensors do not hold: the probe
    # falls back to the upper bound (every input and output kept) and says so.
    x = TensorMeta((4, 3), torch.float32)
    attrs = OpNode(
        "nonzero", Role.COMPUTE, target=ATEN.nonzero.default, args=(InputRef(0),), inputs=(x,),
        outputs=(TensorMeta((5, 2), torch.int64),),
    )  # fmt: skip
    with caplog.at_level("INFO", logger="autosbp.planner.memory.autograd_probe"):
        got = saved_by(attrs, (True,))
    assert got == Saved(frozenset({0}), frozenset({0}), 0, (False,), known=False)
    assert "not probed" in caplog.text
