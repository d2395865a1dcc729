"""From an exported program to graph nodes: one fx node at a time, in canonical form.

Lives here: `GraphBuilder` (placeholders, ATen calls and the loss output as the `OpNode`s of an
`OpGraph`), `node_bytes` (capture's byte formula) and the canonical form below. Lives elsewhere:
the export and the graph-level passes (`export`: tied parameters, blocks, unknown ops), export
failures (`failures`), flop formulas (`flops`).

The canonical form: the graph of a model must not depend on the device it was captured on (a
plan made on "meta" trains on "cpu" or "cuda": same nodes, same fingerprint). So:
- every device argument (`arange(device=...)`, `x.to(device)`) becomes `RUN_DEVICE`, the
  device the graph runs on, which the interpreters fill in;
- `contiguous` and `lift_fresh_copy` are dropped (their readers read their input): both copy
  values unchanged, and whether export records a `contiguous` depends on the strides a device's
  kernels chose (CPU attention returns a layout whose transpose is contiguous, meta does not),
  a `lift_fresh_copy` on whether the constant was made on "meta". Views read their input as
  `reshape` does (`graph.STRIDE_FREE`), so no op depends on a copy being there;
- `type_as(self, other)` reads only other's dtype, which the graph knows: it becomes
  `_to_copy(self, dtype=...)`, or is dropped where the dtypes agree (it returns self), so no
  edge ties an op to a tensor it does not read (Gemma's RMSNorm `output.type_as(x)` gave the
  planner 24 x 24 signatures per op on a 2-D mesh, its LPs 3x the columns of Qwen3's);
- a region under `torch.no_grad()` (HF's rotary embeddings), a higher-order op in export, is
  inlined, each of its outputs through `aten.detach` (no gradient crosses it, as under no_grad);
- an op that writes into an activation in place (`relu_`, `out += x`, `detach_`) becomes its
  functional twin (`relu`, `add`, `detach`), and later reads of the written tensor read the new
  value, when that is exact: the written tensor is no parameter or buffer (their updates stay
  in place: the runtime writes buffers back), is not itself a view, and no view of it was taken
  before. Otherwise the write stays in place and the planner keeps every edge of its alias chain
  unboxed (`autosbp.rules.pinned_inputs`).
A frozen parameter (`requires_grad=False`) is a buffer: state the step reads and never trains
(no gradient, no optimizer state, no sync), as torch's optimizers leave it.
Invariants: nodes are added in the export's program order, so `order` is a topological order;
an fx value lives at one (node, output index) and `_where` says which, including values folded
away (getitem, dropped copies, inlined regions).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import networkx as nx
import torch
from torch import fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from autosbp.capturing.failures import dependent_shape_message, unsupported_node_message
from autosbp.capturing.flops import count_flops, count_transcendentals
from autosbp.capturing.graph import RUN_DEVICE, InputRef, OpGraph, OpNode, Role, TensorMeta
from autosbp.errors import CaptureError

__all__ = ["GraphBuilder", "node_bytes", "tensor_meta", "tensors_of"]

_INPUT_ROLES = {
    InputKind.PARAMETER: Role.PARAMETER,
    InputKind.BUFFER: Role.BUFFER,
    InputKind.CONSTANT_TENSOR: Role.BUFFER,
    InputKind.USER_INPUT: Role.INPUT,
}
aten = torch.ops.aten
# Copies that change no value (see the module header): their readers read their input.
_DROPPED = (aten.contiguous.default, aten.lift_fresh_copy.default)
_SET_GRAD = "wrap_with_set_grad_enabled"

Location = tuple[str, int]  # (graph node, output index)


class GraphBuilder:
    """Adds fx nodes one at a time to `graph`; remembers where each fx value lives (node,
    output index)."""

    def __init__(self, program: ExportedProgram, name: str) -> None:
        self.name = name
        self.graph = OpGraph(nx.DiGraph(), [], name, program)
        self.module_stacks: dict[str, list[tuple[str, str]]] = {}
        self.sources: dict[str, str] = {}  # compute node -> the Python stack that made it
        self.buffer_mutations: dict[str, tuple[str, int]] = {}
        self._program = program
        self._specs = {s.arg.name: s for s in program.graph_signature.input_specs}
        self._output_specs = program.graph_signature.output_specs
        self._where: dict[str, Location] = {}  # fx value -> its location
        self._multi: dict[str, list[Location | None]] = {}  # tuple position -> location
        self._state: set[str] = set()  # fx values of parameters and buffers (written in place)
        self._views: set[str] = set()  # fx values made by a view op
        self._viewed: set[str] = set()  # fx values some view op has read
        self._prefix = ""  # names of nodes inlined from a region: "<region>_<name>"

    def add(self, node: fx.Node) -> None:
        if node.op == "placeholder":
            self._add_placeholder(node)
        elif node.op == "call_function" and node.target is operator.getitem:
            self._fold_getitem(node)
        elif node.op == "call_function" and getattr(node.target, "_name", "") == _SET_GRAD:
            self._inline_region(node)
        elif node.op == "call_function" and node.target in _DROPPED:
            self._where[self._key(node)] = self._location_of(node.args[0])
        elif node.op == "call_function" and node.target is aten.type_as.default:
            self._add_cast(node)
        elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            if tensors_of(node.meta.get("val")) or node.users:
                self._add_compute(node)
        elif node.op == "output":
            self._add_output(node)
        elif node.op != "get_attr":  # get_attr feeds higher-order ops, reported at their call
            raise CaptureError(unsupported_node_message(node))

    def _trainable(self, target: str | None) -> bool:
        """Does the parameter `target` require grad (torch trains only those)?"""
        found = self._program.state_dict.get(target or "")
        return found is None or found.requires_grad

    # ---------------------------------------------------------------------------- node kinds
    def _add_placeholder(self, node: fx.Node) -> None:
        spec = self._specs[node.name]
        role = _INPUT_ROLES.get(spec.kind)
        if role is None:
            raise CaptureError(f"Unsupported export input {node.name!r} of kind {spec.kind.name}.")
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            self._state.add(node.name)
        if role is Role.PARAMETER and not self._trainable(spec.target):
            role = Role.BUFFER  # frozen (requires_grad=False): state the step reads, never trains
        fqn = (spec.target or "") if role is not Role.INPUT else ""
        outputs = (tensor_meta(node.meta["val"]),)
        module_path = fqn.rpartition(".")[0]
        placeholder = OpNode(
            "placeholder", role, outputs=outputs, bytes=node_bytes((), outputs),
            module_path=module_path, name=fqn,
        )  # fmt: skip
        self.graph.add_node(node.name, placeholder)
        self._where[node.name] = (node.name, 0)

    def _fold_getitem(self, node: fx.Node) -> None:
        source, position = node.args
        assert isinstance(source, fx.Node), node.format_node()
        assert self._key(source) in self._multi and isinstance(position, int), node.format_node()
        location = self._multi[self._key(source)][position]
        if location is not None:
            self._where[self._key(node)] = location
        if self._key(source) in self._views:
            self._views.add(self._key(node))

    def _inline_region(self, node: fx.Node) -> None:
        """A `torch.no_grad()` / `enable_grad()` region: its nodes, named `<region>_<name>`;
        with grad disabled, each output through a detach (see the module header)."""
        enable, submodule, *args = node.args
        assert isinstance(submodule, fx.Node) and isinstance(submodule.target, str)
        body: fx.GraphModule = getattr(self._program.graph_module, submodule.target)
        bound = [self._location_of(arg) for arg in args]
        outer, self._prefix = self._prefix, f"{self._key(node)}_"
        outputs: list[Any] = []
        try:
            placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
            for inner, location in zip(placeholders, bound, strict=True):
                self._where[self._key(inner)] = location
            for inner in body.graph.nodes:
                if inner.op == "output":
                    outputs = list(inner.args[0])
                elif inner.op != "placeholder":
                    self.add(inner)
            locations = [self._location_of(v) if isinstance(v, fx.Node) else None for v in outputs]
        finally:
            self._prefix = outer
        if not enable:
            locations = [self._detached(node, k, loc) for k, loc in enumerate(locations)]
        self._multi[self._key(node)] = locations

    def _detached(self, region: fx.Node, index: int, location: Location | None) -> Location | None:
        if location is None:
            return None
        source = self.graph.node(location[0])
        meta = source.outputs[location[1]]
        name = f"{self._key(region)}_detach_{index}"
        detach = OpNode(
            "aten.detach.default", Role.COMPUTE, target=aten.detach.default, args=(InputRef(0),),
            inputs=(meta,), outputs=(meta,), bytes=node_bytes((meta,), (meta,)),
            module_path=source.module_path,
        )  # fmt: skip
        self.module_stacks[name] = self.module_stacks.get(location[0], [])
        self.sources[name] = region.meta.get("stack_trace") or ""
        self.graph.add_node(name, detach, [location])
        return (name, 0)

    def _add_cast(self, node: fx.Node) -> None:
        """`type_as(self, other)` in canonical form (the module header)."""
        value, other = node.args[:2]
        assert isinstance(value, fx.Node) and isinstance(other, fx.Node), node.format_node()
        dtype = other.meta["val"].dtype
        if value.meta["val"].dtype == dtype:
            self._where[self._key(node)] = self._location_of(value)
        else:
            self._add_compute(node, (aten._to_copy.default, (value,), {"dtype": dtype}))

    def _add_compute(
        self,
        node: fx.Node,
        call: tuple[torch._ops.OpOverload, tuple[Any, ...], dict[str, Any]] | None = None,
    ) -> None:
        """`node` as an OpNode; `call`: the (op, args, kwargs) to record instead of its own."""
        val = node.meta.get("val")
        if not all(_static(t) for t in tensors_of(val)):
            raise CaptureError(dependent_shape_message(node, self.name))
        target, written = self._functional(node) if call is None else (call[0], [])
        sources: list[Location] = []
        args = self._replace(node.args if call is None else call[1], sources)
        kwargs = self._replace(node.kwargs if call is None else call[2], sources)
        inputs = tuple(self.graph.node(s).outputs[i] for s, i in sources)
        outputs = tuple(tensor_meta(t) for t in tensors_of(val))
        op = str(target)
        name = self._key(node)
        stack = [(str(p), str(t)) for p, t in (node.meta.get("nn_module_stack") or {}).values()]
        self.module_stacks[name] = stack
        self.sources[name] = node.meta.get("stack_trace") or ""
        compute = OpNode(
            op, Role.COMPUTE, target=target, args=args, kwargs=kwargs, inputs=inputs,
            outputs=outputs, flops=count_flops(op, inputs, outputs),
            transcendentals=count_transcendentals(op, inputs, outputs),
            bytes=node_bytes(inputs, outputs), module_path=stack[-1][0] if stack else "",
        )  # fmt: skip
        self.graph.add_node(name, compute, sources)
        self._note_views(node)
        if isinstance(val, (list, tuple)):
            positions = [isinstance(v, torch.Tensor) for v in val]
            self._multi[name] = [
                (name, sum(positions[:i])) if p else None for i, p in enumerate(positions)
            ]
        else:
            self._where[name] = (name, 0)
        for value in written:  # later reads of a tensor written in place read the new value
            self._where[self._key(value)] = (name, 0)

    def _add_output(self, node: fx.Node) -> None:
        values = node.args[0]
        assert isinstance(values, (list, tuple)), node.format_node()
        for spec, value in zip(self._output_specs, values, strict=True):
            if spec.kind is OutputKind.BUFFER_MUTATION and isinstance(value, fx.Node):
                self.buffer_mutations[spec.target or ""] = self._location_of(value)
        sources: list[Location] = []
        loss_position = next(
            k for k, s in enumerate(self._output_specs) if s.kind is OutputKind.USER_OUTPUT
        )
        args = (self._replace(values[loss_position], sources),)
        loss = self.graph.node(sources[0][0]).outputs[sources[0][1]]
        output = OpNode(
            "output", Role.OUTPUT, args=args, inputs=(loss,), bytes=node_bytes((loss,), ())
        )
        self.graph.add_node("output", output, sources)

    # ------------------------------------------------------------------------ in-place writes
    def _functional(self, node: fx.Node) -> tuple[Callable[..., Any], list[fx.Node]]:
        """The op to record for `node`, and the fx values it writes in place: the functional
        twin and the written activations when the module header's conditions hold, else the
        op itself and nothing."""
        target = node.target
        assert isinstance(target, torch._ops.OpOverload)
        schema = target._schema
        written = [
            value
            for arg, value in zip(schema.arguments, node.args, strict=False)
            if arg.alias_info is not None and arg.alias_info.is_write
        ]
        twin = _functional_twin(target)
        values = [v for v in written if isinstance(v, fx.Node)]
        if twin is None or not values or len(values) != len(written):
            return target, []
        if any(self._key(v) in (self._state | self._views | self._viewed) for v in values):
            return target, []
        return twin, values

    def _note_views(self, node: fx.Node) -> None:
        """Remember view outputs and the values views were taken of (see `_functional`)."""
        target = node.target
        if not isinstance(target, torch._ops.OpOverload) or not _returns_alias(target):
            return
        self._views.add(self._key(node))
        for arg in node.args:
            if isinstance(arg, fx.Node):
                self._viewed.add(self._key(arg))

    # ------------------------------------------------------------------------------- values
    def _key(self, node: fx.Node) -> str:
        return f"{self._prefix}{node.name}"

    def _location_of(self, value: Any) -> Location:
        assert isinstance(value, fx.Node), value
        key = self._key(value)
        if key not in self._where:
            raise CaptureError(unsupported_node_message(value))
        return self._where[key]

    def _replace(self, value: Any, sources: list[Location]) -> Any:
        """`value` with every fx tensor value replaced by InputRef(i) (appending to `sources`)
        and every device by `RUN_DEVICE`."""
        if isinstance(value, fx.Node):
            key = self._key(value)
            if key in self._multi:  # a whole list of tensors used at once
                return [self._ref(loc, sources) for loc in self._multi[key] if loc is not None]
            return self._ref(self._location_of(value), sources)
        if isinstance(value, torch.device):
            return RUN_DEVICE
        if isinstance(value, (list, tuple)):
            items = [self._replace(v, sources) for v in value]
            return tuple(items) if isinstance(value, tuple) else items
        if isinstance(value, dict):
            return {k: self._replace(v, sources) for k, v in value.items()}
        return value

    def _ref(self, source: Location, sources: list[Location]) -> InputRef:
        sources.append(source)
        return InputRef(len(sources) - 1)


def _functional_twin(target: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """`aten.relu_.default` -> `aten.relu.default` (same arguments, a new output), if any."""
    packet = target.name().split("::")[-1].split(".")[0]
    if not packet.endswith("_") or packet.startswith("_"):
        return None
    functional = getattr(aten, packet[:-1], None)
    twin = getattr(functional, target._overloadname, None) if functional is not None else None
    if not isinstance(twin, torch._ops.OpOverload):
        return None
    ours, theirs = target._schema.arguments, twin._schema.arguments
    same = len(ours) == len(theirs) and all(
        a.kwarg_only == b.kwarg_only and (not a.kwarg_only or a.name == b.name)
        for a, b in zip(ours, theirs, strict=True)
    )
    return twin if same else None


def _static(t: torch.Tensor) -> bool:
    """Are all of the tensor's sizes numbers (not symbols standing for data-dependent sizes)?"""
    return all(isinstance(size, int) for size in t.shape)


def _returns_alias(target: torch._ops.OpOverload) -> bool:
    """Does the op return a view of an input (its schema aliases an output to an input, and
    not as the input it writes: `relu_` returns its input, no new view)?"""
    return any(
        r.alias_info is not None and not r.alias_info.is_write for r in target._schema.returns
    )


def node_bytes(inputs: tuple[TensorMeta, ...], outputs: tuple[TensorMeta, ...]) -> int:
    """Capture's `OpNode.bytes`: every input read and every output written once."""
    return sum(t.nbytes for t in inputs) + sum(t.nbytes for t in outputs)


def tensor_meta(value: Any) -> TensorMeta:
    return TensorMeta(tuple(int(s) for s in value.shape), value.dtype)


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensor outputs of an op's result (a tensor, or a list/tuple of values), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []
