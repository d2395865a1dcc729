"""Every op of every zoo model has a rule, and the signatures of its nodes execute correctly.

Each tiny zoo model (float64) is captured; the graph is interpreted node by node to get every
node's real global inputs (valid indices, targets, statistics); then a deterministic sample of
each node's nd signatures on meshes (2,) and (2, 2) runs through the simulation oracle and must
reproduce the node's outputs.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from autosbp.capturing.export import capture
from autosbp.capturing.graph import OpGraph, Role
from autosbp.rules import has_rule, nd_signatures
from autosbp.rules.oracle import run_global, simulate
from autosbp.zoo import build_model

# tiny sizes: every dim a multiple of 4 where the model allows it
TINY: dict[str, dict[str, Any]] = {
    "gpt": {"layers": 1, "hidden": 16, "heads": 4, "vocab": 32, "seq": 8, "batch": 4, "tied": True},
    "mlp": {"layers": 1, "hidden": 16, "features": 8, "outputs": 4, "batch": 8},
    "widedeep": {
        "tables": 2,
        "rows": 16,
        "dim": 4,
        "dense": 4,
        "hidden": 8,
        "layers": 1,
        "batch": 8,
    },
    "resnet": {"channels": 4, "blocks": 1, "classes": 4, "image": 4, "batch": 4},
}
SAMPLES_PER_NODE = 10


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def node_values(
    graph: OpGraph, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]
) -> dict[str, list[torch.Tensor]]:
    """Every node's outputs, interpreting the graph with `run_global` (the op on whole tensors)."""
    state = {**graph.meta.get("constants", {}), **model.state_dict()}
    state = {k: v.clone() for k, v in state.items()}  # eager forward later updates BN buffers
    user = iter(inputs)
    values: dict[str, list[torch.Tensor]] = {}
    for name, attrs in graph.nodes():
        if attrs.role is Role.INPUT:
            values[name] = [next(user)]
        elif attrs.role in (Role.PARAMETER, Role.BUFFER):
            values[name] = [state[attrs.name]]
        elif attrs.role is Role.OUTPUT:
            values[name] = []
        else:
            values[name] = list(run_global(attrs, node_inputs(graph, name, values)))
    return values


def node_inputs(
    graph: OpGraph, name: str, values: dict[str, list[torch.Tensor]]
) -> list[torch.Tensor]:
    return [values[src][index] for src, index in graph.producers(name)]  # type: ignore[misc]


@pytest.fixture(scope="module", params=sorted(TINY))
def zoo_graph(request: pytest.FixtureRequest) -> tuple[str, OpGraph, dict[str, list[torch.Tensor]]]:
    name = request.param
    model, inputs = build_model(name, **TINY[name])
    model = model.double()
    inputs = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    graph = capture(model, inputs, name=name)
    values = node_values(graph, model, inputs)
    ((output, _),) = graph.nodes(Role.OUTPUT)
    torch.testing.assert_close(
        node_inputs(graph, output, values)[0], model(*inputs), rtol=1e-12, atol=1e-12
    )
    return name, graph, values


def test_every_zoo_op_has_a_rule(zoo_graph: tuple[str, OpGraph, Any]) -> None:
    name, graph, _ = zoo_graph
    missing = sorted({a.op for _, a in graph.nodes() if not has_rule(a.op)})
    assert not missing, f"{name}: ops without a rule: {missing}"
    assert graph.unknown_ops == ()


@pytest.mark.parametrize("mesh", [(2,), (2, 2)], ids=["2", "2x2"])
def test_sampled_signatures_of_every_node_execute(
    zoo_graph: tuple[str, OpGraph, Any], mesh: tuple[int, ...]
) -> None:
    name, graph, values = zoo_graph
    checked = 0
    for node_name, attrs in graph.nodes():
        if attrs.role not in (Role.COMPUTE, Role.OUTPUT):
            continue  # placeholders have no kernel: the runtime shards their values
        inputs = node_inputs(graph, node_name, values)
        want = values[node_name]
        sigs = nd_signatures(attrs, mesh)
        scalars_only = all(m.shape == () for m in (*attrs.inputs, *attrs.outputs))
        assert len(sigs) > 1 or scalars_only, f"{name}: {node_name} ({attrs.op}) is all-B only"
        rng = random.Random(f"{name}/{node_name}/{mesh}")
        sample = [sigs[0], *rng.sample(sigs[1:], min(SAMPLES_PER_NODE - 1, len(sigs) - 1))]
        for sig in sample:
            got = simulate(attrs, sig, mesh, inputs).outputs
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(
                    g,
                    w,
                    rtol=1e-9,
                    atol=1e-9,
                    msg=lambda m, where=f"{node_name} {attrs.op} {sig}": f"{where}: {m}",
                )
            checked += 1
    assert checked > 0
