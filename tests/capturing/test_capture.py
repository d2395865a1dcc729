"""Graph capture: the node/edge contract of autosbp.capturing.graph, exactness, blocks, errors, the CLI.

Oracle: eager torch. Interpreting a captured graph node by node (`run_graph`) must give the eager
loss bit for bit (same kernels, same order), and the same buffer updates.
"""

from __future__ import annotations

import networkx as nx
import pytest
import torch
from torch import nn

import autosbp
from autosbp import cli
from autosbp.capturing.export import capture, run_graph
from autosbp.capturing.flops import count_flops, count_transcendentals, op_family
from autosbp.capturing.graph import InputRef, OpGraph, Role, TensorMeta
from autosbp.capturing.rebatch import micro_batch_graphs
from autosbp.errors import CaptureError
from autosbp.zoo import ZOO_MODELS, build_model

_CAPTURED: dict[str, tuple[nn.Module, tuple[torch.Tensor, ...], OpGraph]] = {}


def captured(name: str, **kwargs: object) -> tuple[nn.Module, tuple[torch.Tensor, ...], OpGraph]:
    """Capture each (model, kwargs) once per session: export is the slow part."""
    key = f"{name}{sorted(kwargs.items())}"
    if key not in _CAPTURED:
        model, inputs = build_model(name, **kwargs)  # type: ignore[arg-type]
        _CAPTURED[key] = (model, inputs, capture(model, inputs, name=name))
    return _CAPTURED[key]


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of parameters and buffers, so eager and the interpreter start equal."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_public_capture_is_the_function() -> None:
    # The module is `capturing`, so importing it never shadows the public function `capture`.
    assert autosbp.capture is capture


# ------------------------------------------------------------------------- the node contract
_ATTR_TYPES = {
    "op": str,
    "role": Role,
    "args": tuple,
    "kwargs": dict,
    "inputs": tuple,
    "outputs": tuple,
    "flops": float,
    "transcendentals": float,
    "bytes": int,
    "module_path": str,
    "name": str,
}


@pytest.mark.parametrize("name", ZOO_MODELS)
def test_node_attributes_follow_the_contract(name: str) -> None:
    _, _, g = captured(name)
    for node, a in g.nodes():
        for attr, kind in _ATTR_TYPES.items():
            assert isinstance(getattr(a, attr), kind), (node, attr, getattr(a, attr))
        assert a.block is None or isinstance(a.block, int)
        assert all(isinstance(t, TensorMeta) for t in (*a.inputs, *a.outputs))
        assert a.bytes == sum(t.nbytes for t in (*a.inputs, *a.outputs))
        assert a.flops >= 0
        if a.role is Role.COMPUTE:
            assert isinstance(a.target, torch._ops.OpOverload) and a.op == str(a.target)
            assert a.outputs, f"{node}: a kept compute node must produce a tensor"
        else:
            assert a.target is None and a.flops == 0
            assert a.op == ("output" if a.role is Role.OUTPUT else "placeholder")
    assert [n for n, a in g.nodes(Role.OUTPUT)] == ["output"]
    assert not any("_assert" in a.op for _, a in g.nodes()), "bookkeeping nodes dropped"


@pytest.mark.parametrize("name", ZOO_MODELS)
def test_graph_is_a_dag_in_topological_order(name: str) -> None:
    _, _, g = captured(name)
    assert nx.is_directed_acyclic_graph(g.graph)
    assert sorted(g.order) == sorted(g.graph.nodes)
    position = {n: i for i, n in enumerate(g.order)}
    assert all(position[u] < position[v] for u, v in g.graph.edges)


@pytest.mark.parametrize("name", ZOO_MODELS)
def test_edges_feed_every_input_ref_once_with_matching_meta(name: str) -> None:
    _, _, g = captured(name)
    for node, a in g.nodes():
        refs = _input_refs((a.args, a.kwargs))
        assert sorted(refs) == list(range(len(a.inputs))), node
        for i, producer in enumerate(g.producers(node)):
            assert producer is not None, (node, i)
            src, out = producer
            assert g.node(src).outputs[out] == a.inputs[i]


def _input_refs(value: object) -> list[int]:
    if isinstance(value, InputRef):
        return [value.index]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [i for v in value for i in _input_refs(v)]
    return []


@pytest.mark.parametrize("name", ZOO_MODELS)
def test_parameters_and_buffers_found_by_name(name: str) -> None:
    model, inputs, g = captured(name)
    params = {a.name: a.outputs[0] for _, a in g.nodes(Role.PARAMETER)}
    buffers = {a.name for _, a in g.nodes(Role.BUFFER)}
    assert params == {k: TensorMeta(tuple(p.shape), p.dtype) for k, p in model.named_parameters()}
    assert buffers == {k for k, _ in model.named_buffers()}
    assert [a.outputs[0].shape for _, a in g.nodes(Role.INPUT)] == [t.shape for t in inputs]


@pytest.mark.parametrize("name", ZOO_MODELS)
def test_run_graph_equals_eager_loss_exactly(name: str) -> None:
    model, inputs, g = captured(name)
    state = state_of(model)
    eager = model(*inputs)
    assert torch.equal(run_graph(g, state, inputs), eager)
    for key, buffer in model.named_buffers():  # batch norm running stats, updated in place
        assert torch.equal(state[key], buffer), key


def test_capture_on_meta_then_run_on_cpu() -> None:
    meta_model, meta_inputs = build_model("gpt", device="meta")
    g = capture(meta_model, meta_inputs)
    assert all(p.is_meta for p in meta_model.parameters())
    model, inputs = build_model("gpt")
    assert torch.equal(run_graph(g, state_of(model), inputs, device="cpu"), model(*inputs))


def test_tied_parameter_is_one_node() -> None:
    model, inputs, g = captured("gpt", tied=True)
    params = {a.name: node for node, a in g.parameters()}
    (kept,) = {"wte.weight", "head.weight"} & set(params)
    dropped = ({"wte.weight", "head.weight"} - {kept}).pop()
    assert g.meta["tied"] == {dropped: kept}
    ops = {g.node(v).op for v in g.graph.successors(params[kept])}
    assert ops == {"aten.embedding.default", "aten.linear.default"}
    assert torch.equal(run_graph(g, state_of(model), inputs), model(*inputs))


def test_multi_output_split_is_folded_into_edges() -> None:
    _, _, g = captured("gpt")
    split = next(n for n, a in g.nodes() if a.op == "aten.split.Tensor")
    assert len(g.node(split).outputs) == 3
    used = sorted(o for v in g.graph.successors(split) for o, _ in g.uses(split, v))
    assert used == [0, 1, 2]
    assert not any("getitem" in a.op for _, a in g.nodes())


# ---------------------------------------------------------------------------- blocks, flops
@pytest.mark.parametrize(
    ("name", "kwargs", "container", "count"),
    [
        ("gpt", {"layers": 3}, "blocks", 3),
        ("mlp", {}, "blocks", 3),
        ("resnet", {}, "blocks", 2),
        ("widedeep", {}, "tables", 4),
    ],
    ids=["gpt-3-layers", "mlp", "resnet", "widedeep-tables"],
)
def test_repeated_blocks_have_identical_op_sequences(
    name: str, kwargs: dict, container: str, count: int
) -> None:
    _, _, g = captured(name, **kwargs)
    assert g.meta["block_container"] == container
    sequences: dict[int, list[tuple]] = {}
    for _, a in g.nodes(Role.COMPUTE):
        if a.block is not None:
            sequences.setdefault(a.block, []).append((a.op, a.inputs, a.outputs))
    assert sorted(sequences) == list(range(count))
    assert len({tuple(s) for s in sequences.values()}) == 1
    for _, a in g.parameters():
        in_block = a.name.startswith(f"{container}.")
        assert (a.block is not None) == in_block, a.name
        assert not in_block or a.name.split(".")[1] == str(a.block)


def test_flops_follow_the_documented_formulas() -> None:
    _, _, g = captured("gpt")  # batch 4, seq 16, hidden 64, heads 4, vocab 128
    b, s, h, heads = 4, 16, 64, 4
    by_op: dict[str, list[float]] = {}
    for _, a in g.nodes(Role.COMPUTE):
        by_op.setdefault(a.op, []).append(a.flops)
    assert by_op["aten.linear.default"][0] == 2 * b * s * h * 3 * h  # qkv
    assert by_op["aten.scaled_dot_product_attention.default"][0] == 4 * b * heads * s * s * (
        h // heads
    )
    assert set(by_op["aten.view.default"]) == {0.0}
    assert by_op["aten.gelu.default"][0] == b * s * 4 * h


def test_transcendentals_follow_the_documented_formulas() -> None:
    """One exp per softmax input and per attention score, one erf per GELU output; matmuls
    and views none; the captured GPT carries them and a rebatched graph recomputes them."""
    _, _, g = captured("gpt")  # batch 4, seq 16, hidden 64, heads 4, vocab 128
    b, s, h, heads, vocab = 4, 16, 64, 4, 128
    by_op: dict[str, list[float]] = {}
    for _, a in g.nodes(Role.COMPUTE):
        by_op.setdefault(a.op, []).append(a.transcendentals)
    assert by_op["aten.scaled_dot_product_attention.default"][0] == b * heads * s * s
    assert by_op["aten.gelu.default"][0] == b * s * 4 * h
    assert set(by_op["aten.linear.default"]) == {0.0}
    assert set(by_op["aten.view.default"]) == {0.0}
    logits = TensorMeta((b * s, vocab), torch.float32)
    for op in ("aten._log_softmax.default", "aten.cross_entropy_loss.default"):
        assert count_transcendentals(op, [logits], [logits]) == b * s * vocab
    assert count_transcendentals("aten.mse_loss.default", [logits, logits], [logits]) == 0.0
    assert count_transcendentals("aten.exp_.default", [logits], [logits]) == b * s * vocab
    small = micro_batch_graphs(*build_model("gpt", device="meta"), (2,), name="gpt")[2]
    for name, a in small.nodes(Role.COMPUTE):
        want = count_transcendentals(a.op, a.inputs, a.outputs)
        assert a.transcendentals == want, name


@pytest.mark.parametrize(
    ("op", "inputs", "outputs", "flops", "family"),
    [
        ("aten.mm.default", [(8, 16), (16, 4)], [(8, 4)], 2 * 8 * 16 * 4, "matmul"),
        ("aten.addmm.default", [(4,), (8, 16), (16, 4)], [(8, 4)], 2 * 8 * 16 * 4, "matmul"),
        (
            "aten.conv2d.default",
            [(2, 3, 8, 8), (6, 3, 3, 3)],
            [(2, 6, 8, 8)],
            2 * 2 * 6 * 8 * 8 * 3 * 3 * 3,
            "conv",
        ),
        ("aten.add_.Tensor", [(5,), (5,)], [(5,)], 5, "elementwise"),
        ("aten.transpose.int", [(4, 5)], [(5, 4)], 0, "view"),
        ("aten.some_new_op.default", [(3,)], [(3, 2)], 6, "elementwise"),
    ],
    ids=["mm", "addmm", "conv2d", "inplace-add", "view", "unknown-op"],
)
def test_count_flops_table(op: str, inputs: list, outputs: list, flops: float, family: str) -> None:
    meta = [TensorMeta(s, torch.float32) for s in inputs]
    out = [TensorMeta(s, torch.float32) for s in outputs]
    assert count_flops(op, meta, out) == flops
    assert op_family(op) == family


def test_unknown_ops_lists_ops_of_the_graph() -> None:
    _, _, g = captured("gpt")
    ops = {a.op for _, a in g.nodes(Role.COMPUTE)}
    assert isinstance(g.unknown_ops, tuple) and set(g.unknown_ops) <= ops


@pytest.mark.slow
def test_gpt3_175b_captures_on_meta() -> None:
    """The whole 96-layer GPT-3 captures on meta, nothing materialized (its capture time is a
    figure of bench/plan_speed.py, not asserted here)."""
    layers, hidden, vocab, seq = 96, 12288, 51200, 2048
    model, inputs = build_model(
        "gpt", device="meta", layers=layers, hidden=hidden, heads=96, vocab=vocab, seq=seq, batch=1
    )
    g = capture(model, inputs)
    assert all(p.is_meta for p in model.parameters())
    per_block = 12 * hidden * hidden + 13 * hidden  # qkv, proj, fc, fc2 weights+biases, 2 LNs
    numel = sum(a.outputs[0].numel for _, a in g.parameters())
    assert numel == layers * per_block + (vocab + seq) * hidden + 2 * hidden + vocab * hidden
    assert len(list(g.parameters())) == 12 * layers + 5
    assert len(list(g.nodes(Role.COMPUTE))) == 19 * layers + 9  # 19 ops per block, 9 outside
    assert len({a.block for _, a in g.nodes(Role.COMPUTE)} - {None}) == layers


# ------------------------------------------------------------------------------------ errors
class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if h.sum() > 0:
            return h * 2
        return h


class _GatedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = _Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x).sum()


class _ItemModel(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = int(x.sum().item())
        return x[:n].sum()


class _NoGradModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = self.fc(x)
        return (self.fc(x) * scale).sum()


class _Returns(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> object:
        y = self.fc(x)
        return {"tensor": y, "pair": (y.sum(), y), "int": y.sum().long()}[self.kind]


@pytest.mark.parametrize(
    ("model", "inputs", "fragments"),
    [
        (
            _GatedModel(),
            (torch.randn(2, 4),),
            ["an `if` on a tensor value", "module `gate`", "torch.where", "if h.sum() > 0"],
        ),
        (_ItemModel(), (torch.randn(2, 4),), ["`.item()`", "keep the value a tensor"]),
        (_Returns("tensor"), (torch.randn(2, 4),), ["shape [2, 4]", "scalar training loss"]),
        (_Returns("pair"), (torch.randn(2, 4),), ["returns 2 outputs", "scalar training loss"]),
        (_Returns("int"), (torch.randn(2, 4),), ["(int64)", "scalar training loss"]),
        (_Returns("tensor"), (torch.randn(2, 4), 3), ["#1 (int)", "must all be tensors"]),
    ],
    ids=[
        "data-dependent-if",
        "item",
        "non-scalar",
        "tuple-output",
        "int-loss",
        "non-tensor-input",
    ],
)
def test_capture_errors_name_construct_and_fix(
    model: nn.Module, inputs: tuple, fragments: list[str]
) -> None:
    with pytest.raises(CaptureError) as info:
        capture(model, inputs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message
    assert "\n" not in message and "Traceback" not in message


# --------------------------------------------------------------------------------------- CLI
@pytest.fixture
def capture_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the capture command: other commands' modules are not under test here."""
    only = tuple(c for c in cli.COMMANDS if c[0] == "capture")
    monkeypatch.setattr(cli, "COMMANDS", only)


@pytest.mark.usefixtures("capture_cli")
def test_cli_capture_prints_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["capture", "gpt", "--model-args", "layers=2"]) == 0
    out = capsys.readouterr().out
    for fragment in [
        "gpt",
        "nodes",
        "parameters  29 tensors",
        "FLOP",
        "nodes by op family",
        "matmul",
        "attention",
        "repeated blocks: 2 x `blocks.<k>`",
        "19 compute nodes per block",
        "ops without an SBP rule",
    ]:
        assert fragment in out, fragment


@pytest.mark.usefixtures("capture_cli")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["capture", "gpt", "--model-args", "layers"], "Bad --model-args item 'layers'"),
        (["capture", "gpt", "--model-args", "depth=2"], "no argument 'depth'"),
        (["capture", "nowhere.py:make"], "does not exist"),
    ],
    ids=["malformed-args", "unknown-arg", "missing-file"],
)
def test_cli_capture_bad_input_exits_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert cli.main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert message in err and "Traceback" not in err
