"""The operator graph the planner sees: ATen ops as nodes of a networkx DiGraph.

Lives here: the node/edge vocabulary (`Role`, `TensorMeta`, `InputRef`, `OpGraph`) shared by
capture (which builds graphs), rules (which read a node's op, args and shapes), the planner and
the runtime (which interprets the same nodes with local shapes). Lives elsewhere: building a
graph from a model (`export`), signatures of ops (`rules`).

Node attributes (every node):
  op           str, the ATen overload name ("aten.linear.default"), or "placeholder"/"output"
  role         Role
  target       the callable (torch OpOverload) for compute nodes, else None
  args, kwargs the call's arguments with every tensor input replaced by InputRef(i) and every
               device by RUN_DEVICE (the graph does not depend on the capture device)
  inputs       tuple[TensorMeta, ...], the tensor inputs in InputRef order
  outputs      tuple[TensorMeta, ...], the tensor outputs (multi-output ops list all)
  flops        float, forward flops of the op (0 for views and placeholders)
  transcendentals float, exp/log/erf/tanh evaluations of the forward (`flops`)
  bytes        int, bytes read + written by the op (inputs + outputs)
  module_path  str, the nn.Module path it came from ("" at the top)
  block        int | None, index of the repeated block (transformer layer k), if any
  name         str, parameter/buffer fully qualified name for PARAMETER/BUFFER nodes, else ""
Edge (u, v) attributes:
  uses         tuple[tuple[int, int], ...]: (output index of u, input index of v) for each use
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch


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
    """Stands in a node's args for its tensor input number `index` (see node attr `inputs`)."""

    index: int


@dataclass(frozen=True, slots=True)
class RunDevice:
    """Stands in a node's args for a device argument (`arange(device=...)`, `x.to(device)`):
    the device the graph runs on, which whoever interprets the graph fills in
    (`run_device`). Capture on "meta" and on "cpu" thus records the same arguments."""

    def __repr__(self) -> str:
        return "RUN_DEVICE"


RUN_DEVICE = RunDevice()

# Ops whose kernel needs strides a device may not give: run as the stride-free op of the same
# values. Capture drops `contiguous` (its presence depends on the capture device's strides), so
# a `view` may meet a tensor that `reshape` (a view where strides allow, else a copy) can take.
STRIDE_FREE: dict[Any, Callable[..., Any]] = {
    torch.ops.aten.view.default: torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default: torch.ops.aten.reshape.default,
}


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

    def nodes(self, role: Role | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
        for name in self.order:
            attrs = self.graph.nodes[name]
            if role is None or attrs["role"] is role:
                yield name, attrs

    def parameters(self) -> Iterator[tuple[str, dict[str, Any]]]:
        return self.nodes(Role.PARAMETER)

    def producers(self, name: str) -> list[tuple[str, int] | None]:
        """For each tensor input of `name`, (producer node, its output index)."""
        attrs = self.graph.nodes[name]
        out: list[tuple[str, int] | None] = [None] * len(attrs["inputs"])
        for src in self.graph.predecessors(name):
            for out_idx, in_idx in self.graph.edges[src, name]["uses"]:
                out[in_idx] = (src, out_idx)
        return out

    @functools.cached_property
    def weight_only(self) -> frozenset[str]:
        """Nodes whose value comes from parameters and buffers alone, no model input: the
        weights themselves and what is computed from them only (a transpose, a cast, a view).
        Read after capture has built the graph (the set is computed once)."""
        found: set[str] = set()
        for name in self.order:
            attrs = self.graph.nodes[name]
            if attrs["role"] in (Role.PARAMETER, Role.BUFFER):
                found.add(name)
            elif attrs["role"] is Role.COMPUTE:
                producers = [p for p in self.producers(name) if p is not None]
                if producers and all(src in found for src, _ in producers):
                    found.add(name)
        return frozenset(found)

    def fingerprint(self) -> str:
        """A hash of ops, shapes, dtypes and edges: equal for the same model and input shapes."""
        digest = hashlib.sha256()
        for name in self.order:
            a = self.graph.nodes[name]
            row = [
                name,
                a["op"],
                a["role"].value,
                [repr(t) for t in a["inputs"]],
                [repr(t) for t in a["outputs"]],
                a.get("name", ""),
            ]
            digest.update(json.dumps(row).encode())
            for src in sorted(self.graph.predecessors(name)):
                digest.update(
                    json.dumps([src, name, list(self.graph.edges[src, name]["uses"])]).encode()
                )
        return digest.hexdigest()[:16]
