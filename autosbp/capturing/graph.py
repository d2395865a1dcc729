"""The operator graph the planner sees: ATen ops as nodes of a networkx DiGraph.

Lives here: the node/edge vocabulary (`Role`, `TensorMeta`, `InputRef`, `OpNode`, `OpGraph`)
shared by capture (which builds graphs), rules (which read a node's op, args and shapes), the
planner and the runtime (which interprets the same nodes with local shapes). Lives elsewhere: building a
graph from a model (`export`), signatures of ops (`rules`).

A node's data is one `OpNode` (a frozen dataclass: its fields document the node contract), read
through `OpGraph.node` / `OpGraph.nodes`; an edge (u, v) carries `uses` (`OpGraph.uses`): the
(output index of u, input index of v) pairs, one per use. networkx holds each under one
attribute that only this module reads or writes (`_NODE`, `_USES`).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch

from autosbp.capturing.fused_norms import rms_norm as fused_rms_norm


class Role(enum.Enum):
    PARAMETER = "parameter"
    BUFFER = "buffer"
    INPUT = "input"
    OUTPUT = "output"
    COMPUTE = "compute"


@dataclass(frozen=True, slots=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


@dataclass(frozen=True, slots=True)
class InputRef:
    """Stands in a node's args for its tensor input number `index` (see `OpNode.inputs`)."""

    index: int


@dataclass(frozen=True, slots=True)
class RunDevice:
    """Stands in a node's args for a device argument (`arange(device=...)`, `x.to(device)`):
    the device the graph runs on, which whoever interprets the graph fills in
    (`run_device`). Capture on "meta" and on "cpu" thus records the same arguments."""

    def __repr__(self) -> str:
        return "RUN_DEVICE"


RUN_DEVICE = RunDevice()

Uses = tuple[tuple[int, int], ...]  # an edge's (producer output index, consumer input index)


@dataclass(frozen=True, slots=True)
class OpNode:
    """One node of the graph: an ATen call, a placeholder (parameter, buffer, input) or the
    output. Capture builds them whole (`builder`); a pass that changes one builds a new one
    (`dataclasses.replace`)."""

    op: str
    """The ATen overload name ("aten.linear.default"), or "placeholder" / "output"."""
    role: Role
    target: Callable[..., Any] | None = None
    """The callable (a torch OpOverload) for compute nodes, else None."""
    args: tuple[Any, ...] = ()
    """The call's positional arguments, every tensor input replaced by InputRef(i) and every
    device by RUN_DEVICE (the graph does not depend on the capture device)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """The call's keyword arguments, replaced as `args` are."""
    inputs: tuple[TensorMeta, ...] = ()
    """The tensor inputs in InputRef order."""
    outputs: tuple[TensorMeta, ...] = ()
    """The tensor outputs (a multi-output op lists all)."""
    flops: float = 0.0
    """Forward flops of the op (0 for views and placeholders)."""
    transcendentals: float = 0.0
    """exp/log/erf/tanh evaluations of the forward (beside `flops`)."""
    bytes: int = 0
    """Bytes read + written by the op (capture: inputs + outputs, `builder.node_bytes`)."""
    module_path: str = ""
    """The nn.Module path it came from ("" at the top)."""
    block: int | None = None
    """Index of the repeated block (transformer layer k) it belongs to, if any (`blocks`)."""
    name: str = ""
    """The parameter/buffer fully qualified name for PARAMETER/BUFFER nodes, else ""."""

    @property
    def schema(self) -> torch._C.FunctionSchema | None:
        """The ATen schema of `target` (None for placeholders, the output, plain callables)."""
        return getattr(self.target, "_schema", None)


_NODE = "node"  # the networkx node attribute holding its OpNode
_USES = "uses"  # the networkx edge attribute holding its Uses

# Ops whose kernel needs strides a device may not give: run as the stride-free op of the same
# values. Capture drops `contiguous` (its presence depends on the capture device's strides), so
# a `view` may meet a tensor that `reshape` (a view where strides allow, else a copy) can take.
STRIDE_FREE: dict[Any, Callable[..., Any]] = {
    torch.ops.aten.view.default: torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default: torch.ops.aten.reshape.default,
}


def kernel_of(target: Callable[..., Any]) -> Callable[..., Any]:
    """What a compute node of `target` runs as, wherever a graph is interpreted (the reference
    interpreter, the runtime's kernels, the probe of what autograd keeps): the op itself, but
    views as `STRIDE_FREE` says and `rms_norm` as `fused_norms.rms_norm` (torch's op, keeping
    for backward what its fused kernel keeps on every device)."""
    if target is torch.ops.aten.rms_norm.default:
        return fused_rms_norm
    return STRIDE_FREE.get(target, target)


def run_device(value: Any, device: torch.device) -> Any:
    """`value` (args, kwargs, nested lists and dicts) with every RUN_DEVICE replaced by `device`."""
    if isinstance(value, RunDevice):
        return device
    if isinstance(value, list | tuple):
        return type(value)(run_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: run_device(v, device) for k, v in value.items()}
    return value


@dataclass
class OpGraph:
    """A captured model: `graph` (networkx DiGraph) plus what is needed to run and identify it.

    `order` is a topological order of the nodes (the program order of the export).
    `program` is the torch.export ExportedProgram it came from (None for hand-built graphs).
    """

    graph: nx.DiGraph
    order: list[str]
    model_name: str = "model"
    program: Any = None
    unknown_ops: tuple[str, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)

    def node(self, name: str) -> OpNode:
        """The data of node `name`."""
        node: OpNode = self.graph._node[name][_NODE]  # the node view's lookup, without its checks
        return node

    def nodes(self, role: Role | None = None) -> Iterator[tuple[str, OpNode]]:
        """(name, node) in `order`, those of `role` only when given."""
        for name in self.order:
            node = self.node(name)
            if role is None or node.role is role:
                yield name, node

    def parameters(self) -> Iterator[tuple[str, OpNode]]:
        return self.nodes(Role.PARAMETER)

    def uses(self, src: str, dst: str) -> Uses:
        """The uses of edge `src` -> `dst`: (output index of src, input index of dst) pairs."""
        uses: Uses = self.graph.edges[src, dst][_USES]
        return uses

    def edges(self) -> Iterator[tuple[str, str, Uses]]:
        """Every edge as (src, dst, uses), in networkx's order (by src insertion)."""
        for src, dst in self.graph.edges:
            yield src, dst, self.uses(src, dst)

    def readers(self, name: str) -> list[str]:
        """The nodes that read an output of `name`."""
        return list(self.graph.successors(name))

    def producers(self, name: str) -> list[tuple[str, int] | None]:
        """For each tensor input of `name`, (producer node, its output index)."""
        out: list[tuple[str, int] | None] = [None] * len(self.node(name).inputs)
        for src in self.graph.predecessors(name):
            for out_idx, in_idx in self.uses(src, name):
                out[in_idx] = (src, out_idx)
        return out

    # ---------------------------------------------------- building (capture's passes only)
    def add_node(self, name: str, node: OpNode, sources: Sequence[tuple[str, int]] = ()) -> None:
        """Append node `name` (to `order` too), its input k read from `sources[k]` (producer,
        output index): one edge per producer, its uses in input order."""
        self.graph.add_node(name, **{_NODE: node})
        self.order.append(name)
        for in_index, (src, out_index) in enumerate(sources):
            if self.graph.has_edge(src, name):
                self.graph.edges[src, name][_USES] += ((out_index, in_index),)
            else:
                self.graph.add_edge(src, name, **{_USES: ((out_index, in_index),)})

    def set_node(self, name: str, node: OpNode) -> None:
        """Replace the data of node `name` (its edges stay)."""
        self.graph.nodes[name][_NODE] = node

    def rename(self, mapping: Mapping[str, str]) -> None:
        """Give node `old` the name `mapping[old]`, `mapping` a permutation of some names: the
        nodes trade places in `order`, which keeps its list of names. The networkx graph is
        rebuilt as `add_node` builds it (nodes in `order`, each one's edges in input order)."""
        if not mapping:
            return
        old_of = {new: old for old, new in mapping.items()}
        assert sorted(old_of) == sorted(mapping), "a rename must be a permutation of names"
        source, graph = self.graph, nx.DiGraph()
        for name in self.order:
            graph.add_node(name, **{_NODE: self.node(old_of.get(name, name))})
        for name in self.order:
            for src, attrs in source.pred[old_of.get(name, name)].items():
                graph.add_edge(mapping.get(src, src), name, **{_USES: attrs[_USES]})
        self.graph = graph
        self.__dict__.pop("weight_only", None)  # a cached property of the old names

    def remove_node(self, name: str) -> None:
        """Drop node `name` and its edges (and from `order`)."""
        self.graph.remove_node(name)
        self.order.remove(name)

    @functools.cached_property
    def weight_only(self) -> frozenset[str]:
        """Nodes whose value comes from parameters and buffers alone, no model input: the
        weights themselves and what is computed from them only (a transpose, a cast, a view).
        Read after capture has built the graph (the set is computed once)."""
        found: set[str] = set()
        for name, node in self.nodes():
            if node.role in (Role.PARAMETER, Role.BUFFER):
                found.add(name)
            elif node.role is Role.COMPUTE:
                producers = [p for p in self.producers(name) if p is not None]
                if producers and all(src in found for src, _ in producers):
                    found.add(name)
        return frozenset(found)

    def fingerprint(self) -> str:
        """A hash of ops, shapes, dtypes and edges: equal for the same model and input shapes."""
        digest = hashlib.sha256()
        for name, node in self.nodes():
            row = [
                name,
                node.op,
                node.role.value,
                [repr(t) for t in node.inputs],
                [repr(t) for t in node.outputs],
                node.name,
            ]
            digest.update(json.dumps(row).encode())
            for src in sorted(self.graph.predecessors(name)):
                digest.update(json.dumps([src, name, list(self.uses(src, name))]).encode())
        return digest.hexdigest()[:16]
