"""Graph capture: an nn.Module and example inputs -> an `OpGraph` of ATen ops; and its interpreter.

Lives here: `capture` (torch.export in training IR, then one networkx node per placeholder, ATen
call and the loss output, with the attributes documented in `capturing.graph`) and `run_graph`, the reference
interpreter of a captured graph. Lives elsewhere: the node/edge vocabulary (`graph`),
export failures as messages (`failures`), flop formulas and op families (`flops`),
repeated blocks (`blocks`), SBP rules (`rules`), the distributed interpreter (`runtime`).

Invariants:
- Nodes are the export's placeholders (PARAMETER/BUFFER/INPUT), its ATen calls (COMPUTE) minus
  bookkeeping calls that return no tensor and have no users (`_assert_tensor_metadata` ...), and
  one OUTPUT node named "output" fed by the scalar loss. `order` is the export's program order.
- `getitem` is folded: an edge's `uses` holds (tensor output index of the producer, InputRef index
  of the consumer); a multi-output op lists its tensor outputs in order (non-tensors skipped).
- In-place ops of the training IR (`add_` on `num_batches_tracked`, batch norm's running stats)
  are kept, so interpreting the nodes in `order` computes the loss and buffer updates exactly.
- A tied parameter (one tensor under two names) is one PARAMETER node, under the name export
  feeds its uses from; `meta["tied"]` maps the other names to it.
- `OpGraph.meta`: "constants" (lifted constant tensors by name), "buffer_mutations" (buffer name ->
  (node, output index), empty in training IR), "tied", "block_container", "capture_s".
Reference: torch.export programming model (training IR); OneFlow paper section 3.
"""

from __future__ import annotations

import inspect
import operator
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import networkx as nx
import torch
from torch import fx, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from autosbp.capturing.batches import split_micro_batches
from autosbp.capturing.blocks import assign_blocks
from autosbp.capturing.failures import (
    explain_export_failure,
    torch_report_held_back,
    unsupported_node_message,
)
from autosbp.capturing.flops import count_flops, count_transcendentals
from autosbp.capturing.graph import InputRef, OpGraph, Role, TensorMeta
from autosbp.errors import CaptureError

__all__ = ["capture", "capture_micro_batch", "run_graph"]

_INPUT_ROLES = {
    InputKind.PARAMETER: Role.PARAMETER,
    InputKind.BUFFER: Role.BUFFER,
    InputKind.CONSTANT_TENSOR: Role.BUFFER,
    InputKind.USER_INPUT: Role.INPUT,
}


def capture(
    model: nn.Module, example_inputs: Sequence[torch.Tensor], *, name: str | None = None
) -> OpGraph:
    """Export `model(*example_inputs)` (which must return the scalar loss) to an `OpGraph`.

    Works on the meta device (no parameter memory). Raises `CaptureError` when the model cannot
    be exported or does not return a scalar.
    """
    name = name or type(model).__name__
    args = _check_inputs(model, example_inputs, name)
    start = time.perf_counter()
    program = _export(model, args, name)
    _check_loss(program, name)
    opgraph = _build_opgraph(program, model, name)
    opgraph.meta["capture_s"] = time.perf_counter() - start
    return opgraph


def capture_micro_batch(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    micro_batches: int = 1,
    *,
    name: str | None = None,
) -> OpGraph:
    """The graph of one micro-batch of `example_inputs` (a global batch): what a plan with
    `micro_batches` is made for, and what the runtime runs once per micro-batch."""
    return capture(model, list(split_micro_batches(example_inputs, micro_batches)[0]), name=name)


def _check_inputs(
    model: nn.Module, example_inputs: Sequence[torch.Tensor], name: str
) -> tuple[torch.Tensor, ...]:
    if not isinstance(model, nn.Module):
        raise CaptureError(
            f"capture needs an nn.Module, got {type(model).__name__} `{name}`; wrap it in a module "
            "whose forward returns the training loss."
        )
    args = tuple(example_inputs)
    bad = [
        f"#{i} ({type(a).__name__})" for i, a in enumerate(args) if not isinstance(a, torch.Tensor)
    ]
    if bad:
        raise CaptureError(
            f"Example inputs of model `{name}` must all be tensors; {', '.join(bad)} is not. "
            "Pass non-tensor settings to the model's constructor instead of to forward."
        )
    try:
        signature = inspect.signature(model.forward)
    except ValueError:  # not introspectable: export reports a mismatch itself
        return args
    try:
        signature.bind(*args)
    except TypeError as exc:
        raise CaptureError(
            f"Model `{name}`: forward{signature} cannot take the "
            f"{len(args)} example input(s) ({exc}); pass one example tensor per forward argument."
        ) from None
    return args


def _export(model: nn.Module, args: tuple[torch.Tensor, ...], name: str) -> ExportedProgram:
    try:
        with torch_report_held_back():
            return torch.export.export(model, args, strict=False)
    except Exception as exc:
        raise explain_export_failure(exc, model, name) from exc


def _check_loss(program: ExportedProgram, name: str) -> None:
    user = _user_output_positions(program.graph_signature.output_specs)
    outputs = program.graph.output_node().args[0]
    assert isinstance(outputs, (list, tuple)), outputs
    loss = outputs[user[0]] if len(user) == 1 else None
    loss = loss.meta.get("val") if isinstance(loss, fx.Node) else loss
    if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point():
        return
    if len(user) != 1:
        got = f"{len(user)} outputs"
    elif isinstance(loss, torch.Tensor):
        got = f"a tensor of shape {list(loss.shape)} ({str(loss.dtype).removeprefix('torch.')})"
    else:
        got = f"a {type(loss).__name__}"
    raise CaptureError(
        f"Model `{name}` returns {got}, but autosbp plans training: forward must return the "
        "scalar training loss (a float tensor of shape []). Compute the loss inside forward, e.g. "
        "`return F.cross_entropy(logits.flatten(0, 1), targets.flatten())`, with the targets "
        "passed as an example input."
    )


def _user_output_positions(output_specs: Sequence[Any]) -> list[int]:
    return [i for i, spec in enumerate(output_specs) if spec.kind is OutputKind.USER_OUTPUT]


# ---------------------------------------------------------------------------------- the graph
def _build_opgraph(program: ExportedProgram, model: nn.Module, name: str) -> OpGraph:
    builder = _GraphBuilder(program)
    for node in program.graph.nodes:
        builder.add(node)
    tied = _drop_tied_aliases(builder.graph, builder.order, model)
    unknown = _unknown_ops(
        {a["op"] for _, a in builder.graph.nodes(data=True) if a["role"] is Role.COMPUTE}
    )
    meta: dict[str, Any] = {
        "constants": dict(program.constants),
        "buffer_mutations": builder.buffer_mutations,
        "tied": tied,
        "block_container": assign_blocks(builder.graph, builder.order, builder.module_stacks),
    }
    return OpGraph(builder.graph, builder.order, name, program, unknown, meta)


class _GraphBuilder:
    """Adds fx nodes one at a time; remembers where each fx value lives (node, output index)."""

    def __init__(self, program: ExportedProgram) -> None:
        self.graph = nx.DiGraph()
        self.order: list[str] = []
        self.module_stacks: dict[str, list[tuple[str, str]]] = {}
        self.buffer_mutations: dict[str, tuple[str, int]] = {}
        self._specs = {s.arg.name: s for s in program.graph_signature.input_specs}
        self._output_specs = program.graph_signature.output_specs
        self._where: dict[str, tuple[str, int]] = {}  # fx value -> (graph node, output index)
        self._multi: dict[str, list[int | None]] = {}  # tuple position -> tensor output index

    def add(self, node: fx.Node) -> None:
        if node.op == "placeholder":
            self._add_placeholder(node)
        elif node.op == "call_function" and node.target is operator.getitem:
            self._fold_getitem(node)
        elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            if _tensors(node.meta.get("val")) or node.users:
                self._add_compute(node)
        elif node.op == "output":
            self._add_output(node)
        elif node.op != "get_attr":  # get_attr feeds higher-order ops, reported at their call
            raise CaptureError(unsupported_node_message(node))

    def _add_placeholder(self, node: fx.Node) -> None:
        spec = self._specs[node.name]
        role = _INPUT_ROLES.get(spec.kind)
        if role is None:
            raise CaptureError(f"Unsupported export input {node.name!r} of kind {spec.kind.name}.")
        fqn = (spec.target or "") if role is not Role.INPUT else ""
        outputs = (_meta(node.meta["val"]),)
        attrs = _attrs("placeholder", role, outputs=outputs, module_path=fqn.rpartition(".")[0])
        self._insert(node.name, {**attrs, "name": fqn}, sources=[])
        self._where[node.name] = (node.name, 0)

    def _fold_getitem(self, node: fx.Node) -> None:
        source, position = node.args
        assert isinstance(source, fx.Node) and source.name in self._multi, node.format_node()
        assert isinstance(position, int), node.format_node()
        index = self._multi[source.name][position]
        if index is not None:
            self._where[node.name] = (source.name, index)

    def _add_compute(self, node: fx.Node) -> None:
        sources: list[tuple[str, int]] = []
        args = self._replace(node.args, sources)
        kwargs = self._replace(node.kwargs, sources)
        inputs = tuple(self.graph.nodes[s]["outputs"][i] for s, i in sources)
        val = node.meta.get("val")
        outputs = tuple(_meta(t) for t in _tensors(val))
        op = str(node.target)
        stack = [(str(p), str(t)) for p, t in (node.meta.get("nn_module_stack") or {}).values()]
        self.module_stacks[node.name] = stack
        attrs = _attrs(
            op,
            Role.COMPUTE,
            inputs=inputs,
            outputs=outputs,
            module_path=stack[-1][0] if stack else "",
        )
        attrs.update(
            target=node.target, args=args, kwargs=kwargs, flops=count_flops(op, inputs, outputs),
            transcendentals=count_transcendentals(op, inputs, outputs),
        )  # fmt: skip
        self._insert(node.name, attrs, sources=sources)
        if isinstance(val, (list, tuple)):
            positions = [isinstance(v, torch.Tensor) for v in val]
            self._multi[node.name] = [
                sum(positions[:i]) if p else None for i, p in enumerate(positions)
            ]
        else:
            self._where[node.name] = (node.name, 0)

    def _add_output(self, node: fx.Node) -> None:
        values = node.args[0]
        assert isinstance(values, (list, tuple)), node.format_node()
        for spec, value in zip(self._output_specs, values, strict=True):
            if spec.kind is OutputKind.BUFFER_MUTATION and isinstance(value, fx.Node):
                self.buffer_mutations[spec.target or ""] = self._where[value.name]
        sources: list[tuple[str, int]] = []
        loss_position = _user_output_positions(self._output_specs)[0]
        args = (self._replace(values[loss_position], sources),)
        loss = self.graph.nodes[sources[0][0]]["outputs"][sources[0][1]]
        self._insert(
            "output",
            {**_attrs("output", Role.OUTPUT, inputs=(loss,)), "args": args},
            sources=sources,
        )

    def _replace(self, value: Any, sources: list[tuple[str, int]]) -> Any:
        """`value` with every fx tensor value replaced by InputRef(i); appends to `sources`."""
        if isinstance(value, fx.Node):
            if value.name in self._multi:  # a whole list of tensors used at once
                name = value.name
                return [self._ref((name, i), sources) for i in range(self._tensor_count(name))]
            if value.name not in self._where:
                raise CaptureError(unsupported_node_message(value))
            return self._ref(self._where[value.name], sources)
        if isinstance(value, (list, tuple)):
            items = [self._replace(v, sources) for v in value]
            return tuple(items) if isinstance(value, tuple) else items
        if isinstance(value, dict):
            return {k: self._replace(v, sources) for k, v in value.items()}
        return value

    def _ref(self, source: tuple[str, int], sources: list[tuple[str, int]]) -> InputRef:
        sources.append(source)
        return InputRef(len(sources) - 1)

    def _tensor_count(self, name: str) -> int:
        return len(self.graph.nodes[name]["outputs"])

    def _insert(
        self, node_name: str, attrs: dict[str, Any], *, sources: list[tuple[str, int]]
    ) -> None:
        self.graph.add_node(node_name, **attrs)
        self.order.append(node_name)
        for in_index, (src, out_index) in enumerate(sources):
            if self.graph.has_edge(src, node_name):
                self.graph.edges[src, node_name]["uses"] += ((out_index, in_index),)
            else:
                self.graph.add_edge(src, node_name, uses=((out_index, in_index),))


def _attrs(
    op: str,
    role: Role,
    *,
    inputs: tuple[TensorMeta, ...] = (),
    outputs: tuple[TensorMeta, ...] = (),
    module_path: str = "",
) -> dict[str, Any]:
    """A node's attributes (see `autosbp.capturing.graph`) with the defaults of a non-compute node."""
    nbytes = sum(t.nbytes for t in inputs) + sum(t.nbytes for t in outputs)
    return {
        "op": op,
        "role": role,
        "target": None,
        "args": (),
        "kwargs": {},
        "inputs": inputs,
        "outputs": outputs,
        "flops": 0.0,
        "transcendentals": 0.0,
        "bytes": nbytes,
        "module_path": module_path,
        "block": None,
        "name": "",
    }


def _meta(value: Any) -> TensorMeta:
    return TensorMeta(tuple(int(s) for s in value.shape), value.dtype)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensor outputs of an op's result (a tensor, or a list/tuple of values), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _drop_tied_aliases(graph: nx.DiGraph, order: list[str], model: nn.Module) -> dict[str, str]:
    """Export keeps one placeholder per name of a tied tensor (e.g. `wte.weight` and
    `head.weight`) but feeds every use from one of them: drop the unused ones, so a tied
    parameter is one node. Returns {dropped name: kept name}."""
    names_of: dict[int, list[str]] = defaultdict(list)
    for fqn, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        names_of[id(tensor)].append(fqn)
    node_of = {
        a["name"]: n
        for n, a in graph.nodes(data=True)
        if a["role"] in (Role.PARAMETER, Role.BUFFER)
    }
    tied: dict[str, str] = {}
    for names in names_of.values():
        nodes = [node_of[fqn] for fqn in names if fqn in node_of]
        used = [n for n in nodes if graph.out_degree(n)]
        if len(nodes) < 2 or len(used) != 1:
            continue
        for n in nodes:
            if n != used[0]:
                tied[graph.nodes[n]["name"]] = graph.nodes[used[0]]["name"]
                graph.remove_node(n)
                order.remove(n)
    return tied


def _unknown_ops(ops: set[str]) -> tuple[str, ...]:
    """The ops without an SBP rule (the planner gives them the all-B signature), named in one
    warning."""
    from autosbp.rules import warn_unknown_ops  # lazy: rules import torch-heavy op modules

    return warn_unknown_ops(ops)


# ------------------------------------------------------------------------------ interpreting
def run_graph(
    opgraph: OpGraph,
    params: Mapping[str, torch.Tensor],
    inputs: Sequence[torch.Tensor],
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Interpret the graph node by node: the loss of the model on `params` and `inputs`.

    `params` maps parameter and buffer names (`state_dict` keys) to tensors (buffers are updated
    in place, as eager would); lifted constants come from the capture. `device`, if set, is where
    factory ops (arange, zeros ...) create tensors, e.g. to run a graph captured on "meta".
    """
    values: dict[str, list[torch.Tensor]] = {}
    user_inputs = iter(inputs)
    for name, attrs in opgraph.nodes():
        role = attrs["role"]
        if role is Role.INPUT:
            values[name] = [next(user_inputs)]
        elif role in (Role.PARAMETER, Role.BUFFER):
            values[name] = [_lookup_state(params, opgraph.meta.get("constants", {}), attrs["name"])]
        else:
            tensors = [values[src][index] for src, index in _producers(opgraph, name)]
            if role is Role.OUTPUT:
                return tensors[0]
            args = _resolve(attrs["args"], tensors)
            kwargs = _resolve(attrs["kwargs"], tensors)
            if device is not None and "device" in kwargs:
                kwargs["device"] = torch.device(device)
            values[name] = _tensors(attrs["target"](*args, **kwargs))
    raise CaptureError(f"Graph of `{opgraph.model_name}` has no output node.")


def _producers(opgraph: OpGraph, name: str) -> list[tuple[str, int]]:
    found = opgraph.producers(name)
    assert all(p is not None for p in found), f"{name}: an input without a producer"
    return found  # type: ignore[return-value]


def _lookup_state(
    params: Mapping[str, torch.Tensor], constants: Mapping[str, torch.Tensor], fqn: str
) -> torch.Tensor:
    if fqn in params:
        return params[fqn]
    if fqn in constants:
        return constants[fqn]
    raise CaptureError(
        f"run_graph: no tensor for parameter/buffer {fqn!r}; pass the model's state, e.g. "
        "`dict(model.state_dict(keep_vars=True))`."
    )


def _resolve(value: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """`value` with every InputRef(i) replaced by tensors[i] (lists, tuples, dicts included)."""
    if isinstance(value, InputRef):
        return tensors[value.index]
    if isinstance(value, (list, tuple)):
        items = [_resolve(v, tensors) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, dict):
        return {k: _resolve(v, tensors) for k, v in value.items()}
    return value
