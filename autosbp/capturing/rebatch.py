"""Rebatching: the graph of a model at any batch size from two captures, without exporting again.

Lives here: `BatchFamily` (fitted from two captures of one model at batches b1 != b2, both >= 2;
`graph_at(b)` is the graph at batch b) and `micro_batch_graphs` (one micro-batch graph per
micro-batch count, exporting at most twice when the model rebatches). Lives elsewhere: capture
itself and its nodes (`export`, `graph.OpNode`), flop formulas (`flops`), cutting a batch
into micro-batches (`capturing.batches`).

Why: an export of GPT-3 (96 layers) takes ~11 s, and the planner wants the micro-batch graph for
several micro-batch counts. With static shapes, every batch-dependent int of the graph (a tensor
dim, a `view` size) is a*batch + c for the models this project captures, so two captures fix it.

Invariants:
- A family is rebatchable only if the two captures have the same structure: node order and names,
  every node field except the shape-derived ones (op, role, target, module_path, block, name),
  the types and nesting of args/kwargs, tensor ranks and dtypes, edges and their `uses`, and the
  graph's `meta` (constants by name, shape and dtype; tied, block_container, buffer_mutations).
  Otherwise `reason` says which node differs and `graph_at` raises `CaptureError` with it.
- An int equal in both captures is a constant. An int that differs is a*batch + c, solved from
  the two points; a or c not whole, a non-positive value at either point (batch-dependent ints
  are sizes), or a float or bool that differs, makes the family not rebatchable.
- `graph_at(b)` evaluates every such int at b (a result <= 0 raises `CaptureError` naming the
  node), recomputes `flops` and `transcendentals` (`flops`, compute nodes only) and `bytes`
  (capture's own formula, `builder.node_bytes`) from the new shapes, and copies everything else
  from the b1 capture. Its `fingerprint()` equals that of a real capture at b
  (tests/capturing/test_rebatch.py).
- A rebatched graph has `program = None`: the b1 ExportedProgram has b1 shapes and would lie.
  Nothing in autosbp or runtime reads `OpGraph.program` (the runtime interprets the nodes), so a
  rebatched graph plans and runs like a captured one. `meta["capture_s"]` is the seconds the
  rebatch took and `meta["rebatched_from"]` is (b1, b2).
Limits: two points cannot see a model that branches on the batch (`if x.shape[0] > 8`) only
between or beyond them, nor an int that is affine at the two points only by chance
(`(b + 1) // 2` at b = 2, 3); a plan made on such a graph is refused by the runtime's fingerprint
check, never run. Batch 1 is never rebatched: size-1 dims broadcast and squeeze, so its graph
can differ in ways a family fitted at >= 2 cannot see; capture it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autosbp.capturing.batches import split_micro_batches
from autosbp.capturing.builder import node_bytes
from autosbp.capturing.export import capture_micro_batch
from autosbp.capturing.flops import count_flops, count_transcendentals
from autosbp.capturing.graph import OpGraph, OpNode, Role, TensorMeta
from autosbp.errors import CaptureError

__all__ = ["BatchFamily", "micro_batch_graphs"]

_log = logging.getLogger(__name__)

_FITTED = (
    "inputs",
    "outputs",
    "args",
    "kwargs",
)  # OpNode fields that may hold batch-dependent ints
_DERIVED = ("flops", "transcendentals", "bytes")  # OpNode fields recomputed from the fitted ones
_COPIED = tuple(f.name for f in dataclasses.fields(OpNode) if f.name not in {*_FITTED, *_DERIVED})


@dataclass(frozen=True, slots=True)
class _Affine:
    """A batch-dependent int: a * batch + c; `where` names it for errors."""

    a: int
    c: int
    where: str

    def at(self, batch: int) -> int:
        value = self.a * batch + self.c
        if value <= 0:
            raise CaptureError(
                f"Rebatching to batch {batch}: {self.where} = {self.a}*batch + {self.c} = {value}, "
                "but it is a size and must be positive. Use a larger batch, or capture at this "
                "batch (autosbp.capturing.capture_micro_batch)."
            )
        return value


@dataclass(frozen=True, slots=True)
class _MetaTemplate:
    """A TensorMeta whose shape holds at least one `_Affine`."""

    shape: tuple[int | _Affine, ...]
    dtype: torch.dtype


class _MismatchError(Exception):
    """Internal: the two captures differ in a way no affine int explains (the message says how)."""


@dataclass(frozen=True, slots=True)
class BatchFamily:
    """The graphs of one model at every batch size, fitted from captures at two batches.

    Build with `BatchFamily.fit`; check `rebatchable` (or `reason`) before `graph_at`.
    """

    base: OpGraph  # the capture at `batches[0]`: structure and every non-fitted attribute
    batches: tuple[int, int]
    reason: str | None  # why the family is not rebatchable; None when it is
    templates: dict[str, tuple[Any, ...]]  # node -> its _FITTED fields with _Affine leaves

    @classmethod
    def fit(
        cls, first: OpGraph, first_batch: int, second: OpGraph, second_batch: int
    ) -> BatchFamily:
        """The family through `first` (captured at `first_batch`) and `second`.

        Never raises for captures that differ: the family is then not rebatchable and `reason`
        says why. Raises `CaptureError` for batches < 2 or equal.
        """
        if first_batch < 2 or second_batch < 2 or first_batch == second_batch:
            raise CaptureError(
                f"BatchFamily.fit needs two different batches >= 2, got {first_batch} and "
                f"{second_batch}: batch 1 broadcasts and squeezes, so it does not show how the "
                "graph grows with the batch."
            )
        batches = (first_batch, second_batch)
        try:
            _check_graph_level(first, second)
            templates = {n: _fit_node(first, second, n, batches) for n in first.order}
            _check_edges(first, second)
        except _MismatchError as exc:
            return cls(first, batches, f"{exc}; capture each batch size instead.", {})
        return cls(first, batches, None, templates)

    @property
    def rebatchable(self) -> bool:
        return self.reason is None

    def graph_at(self, batch: int) -> OpGraph:
        """The graph a capture at `batch` would give (fingerprint included), with `program` None.

        Raises `CaptureError` when the family is not rebatchable (the message is `reason`), for
        batch 1, or when a size would not be positive at `batch`.
        """
        if self.reason is not None:
            raise CaptureError(f"`{self.base.model_name}` is not rebatchable: {self.reason}")
        if batch < 2:
            raise CaptureError(
                f"Rebatching `{self.base.model_name}` to batch {batch}: only batches >= 2 "
                "rebatch (size-1 dims broadcast and squeeze); capture this batch instead."
            )
        start = time.perf_counter()
        base = self.base
        # the base's nodes in their order and its edges, so iteration matches a capture
        graph = OpGraph(
            base.graph.copy(), list(base.order), base.model_name, None, base.unknown_ops
        )
        for name, node in base.nodes():
            graph.set_node(name, _node_at(node, self.templates[name], batch))
        capture_s = time.perf_counter() - start
        graph.meta = {**base.meta, "capture_s": capture_s, "rebatched_from": self.batches}
        return graph


def micro_batch_graphs(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    counts: Sequence[int],
    *,
    name: str | None = None,
) -> dict[int, OpGraph]:
    """The graph of one micro-batch for each micro-batch count (the global batch is dim 0 of
    `example_inputs`), as `capture_micro_batch` would give it.

    Exports the two largest micro-batch sizes (>= 2) and rebatches the others; a micro-batch of 1
    is always captured (see the module header), and a model that does not rebatch is captured
    once per count. Raises what `capture_micro_batch` raises (a count that does not divide the
    batch: `SbpError`).
    """
    sizes = {count: _micro_batch_size(example_inputs, count) for count in counts}
    graphs = _rebatched_sizes(model, example_inputs, sizes, name)  # by micro-batch size
    result: dict[int, OpGraph] = {}
    for count, size in sizes.items():
        if size not in graphs:  # None: unbatched inputs
            graphs[size] = capture_micro_batch(model, example_inputs, count, name=name)
        result[count] = graphs[size]
    return result


def _rebatched_sizes(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    sizes: dict[int, int | None],
    name: str | None,
) -> dict[int | None, OpGraph]:
    """With >= 3 micro-batch sizes >= 2: the two largest captured, the others rebatched if the
    model rebatches. Fewer sizes are simply all captured (by the caller): nothing to save."""
    distinct = sorted({s for s in sizes.values() if s is not None and s >= 2}, reverse=True)
    if len(distinct) < 3:
        return {}
    count_of = {s: c for c, s in sizes.items()}
    big, small = distinct[:2]
    graphs: dict[int | None, OpGraph] = {
        s: capture_micro_batch(model, example_inputs, count_of[s], name=name) for s in (big, small)
    }
    family = BatchFamily.fit(graphs[big], big, graphs[small], small)
    if family.rebatchable:
        graphs.update((s, family.graph_at(s)) for s in distinct[2:])
    else:
        _log.info("micro_batch_graphs: capturing each size of `%s`: %s", name, family.reason)
    return graphs


def _micro_batch_size(example_inputs: Sequence[torch.Tensor], count: int) -> int | None:
    """Dim 0 of the first input's first micro-batch (None for no or unbatched inputs); raises
    `SbpError` where `count` does not cut the batch, as capture_micro_batch would."""
    first = split_micro_batches(example_inputs, count)[0]
    return int(first[0].shape[0]) if first and first[0].dim() else None


# ------------------------------------------------------------------------------------ fitting
def _check_graph_level(first: OpGraph, second: OpGraph) -> None:
    if first.order != second.order or set(first.graph) != set(second.graph):
        missing = sorted(set(first.order) ^ set(second.order))[:5]
        raise _MismatchError(
            "the two captures have different nodes or node order "
            f"(first differing names: {missing or 'same names, other order'})"
        )
    for attr in ("model_name", "unknown_ops"):
        if getattr(first, attr) != getattr(second, attr):
            raise _MismatchError(f"the two captures differ in `{attr}`")
    if set(first.meta) != set(second.meta):
        raise _MismatchError("the two captures have different `meta` keys")
    for key, value in first.meta.items():
        if key == "capture_s":
            continue
        if key == "constants":
            _check_constants(value, second.meta[key])
        elif not _same(value, second.meta[key]):
            raise _MismatchError(f"the two captures differ in meta[{key!r}]")


def _check_constants(first: dict[str, Any], second: dict[str, Any]) -> None:
    """Lifted constants are module state, not batch data: same names, shapes and dtypes."""
    if set(first) != set(second):
        raise _MismatchError("the two captures lift different constant tensors")
    for key, tensor in first.items():
        other = second[key]
        if (tensor.shape, tensor.dtype) != (other.shape, other.dtype):
            raise _MismatchError(
                f"constant {key!r} has shape {list(tensor.shape)} and {list(other.shape)}"
            )


def _check_edges(first: OpGraph, second: OpGraph) -> None:
    if first.graph.number_of_edges() != second.graph.number_of_edges():
        raise _MismatchError("the two captures have different numbers of edges")
    for u, v, uses in first.edges():
        if not second.graph.has_edge(u, v) or second.uses(u, v) != uses:
            raise _MismatchError(f"edge {u} -> {v} differs between the two captures")


def _fit_node(
    first: OpGraph, second: OpGraph, name: str, batches: tuple[int, int]
) -> tuple[Any, ...]:
    n1, n2 = first.node(name), second.node(name)
    label = f"node `{name}` ({n1.op}, module `{n1.module_path}`)"
    for key in _COPIED:
        v1, v2 = getattr(n1, key), getattr(n2, key)
        if not _same(v1, v2):
            raise _MismatchError(f"{label} differs in `{key}`: {v1!r} and {v2!r}")
    return tuple(
        _fit_value(getattr(n1, k), getattr(n2, k), batches, f"{label} {k}") for k in _FITTED
    )


def _fit_value(x1: Any, x2: Any, batches: tuple[int, int], where: str) -> Any:
    """`x1` with every int that differs from `x2` replaced by its `_Affine`; raises `_MismatchError`."""
    if type(x1) is not type(x2):
        raise _MismatchError(f"{where} is a {type(x1).__name__} and a {type(x2).__name__}")
    if type(x1) is int:
        return x1 if x1 == x2 else _fit_int(x1, x2, batches, where)
    if isinstance(x1, TensorMeta):
        if x1.dtype != x2.dtype or len(x1.shape) != len(x2.shape):
            raise _MismatchError(f"{where} is {x1!r} and {x2!r}: rank or dtype differs")
        shape = _fit_value(x1.shape, x2.shape, batches, f"{where} shape")
        return x1 if shape == x1.shape else _MetaTemplate(shape, x1.dtype)
    if type(x1) in (list, tuple):
        if len(x1) != len(x2):
            raise _MismatchError(f"{where} has {len(x1)} and {len(x2)} items")
        items = [
            _fit_value(v1, v2, batches, f"{where}[{i}]")
            for i, (v1, v2) in enumerate(zip(x1, x2, strict=True))
        ]
        return items if type(x1) is list else tuple(items)
    if type(x1) is dict:
        if list(x1) != list(x2):
            raise _MismatchError(f"{where} has keys {list(x1)} and {list(x2)}")
        return {k: _fit_value(v, x2[k], batches, f"{where}[{k!r}]") for k, v in x1.items()}
    if not _same(x1, x2):
        raise _MismatchError(f"{where} is {x1!r} and {x2!r}: only ints may depend on the batch")
    return x1


def _fit_int(x1: int, x2: int, batches: tuple[int, int], where: str) -> _Affine:
    b1, b2 = batches
    a, remainder = divmod(x2 - x1, b2 - b1)
    if remainder or x1 <= 0 or x2 <= 0:
        raise _MismatchError(
            f"{where} is {x1} at batch {b1} and {x2} at batch {b2}: not a positive "
            "a*batch + c with whole a and c"
        )
    return _Affine(a, x1 - a * b1, where)


def _same(x: Any, y: Any) -> bool:
    """Equality for attribute values: NaN equals NaN; tensors are equal only if identical."""
    if x is y:
        return True
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return False
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    if type(x) in (list, tuple) and type(y) is type(x):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y, strict=True))
    if type(x) is dict and type(y) is dict:
        return list(x) == list(y) and all(_same(v, y[k]) for k, v in x.items())
    return bool(x == y)


# --------------------------------------------------------------------------------- evaluating
def _node_at(base: OpNode, template: tuple[Any, ...], batch: int) -> OpNode:
    """A node at `batch`: fitted fields evaluated, derived ones recomputed."""
    inputs, outputs, args, kwargs = (_value_at(t, batch) for t in template)
    compute = base.role is Role.COMPUTE
    flops = count_flops(base.op, inputs, outputs) if compute else base.flops
    transcendentals = count_transcendentals(base.op, inputs, outputs) if compute else 0.0
    return dataclasses.replace(
        base, inputs=inputs, outputs=outputs, args=args, kwargs=kwargs, flops=flops,
        transcendentals=transcendentals, bytes=node_bytes(inputs, outputs),
    )  # fmt: skip


def _value_at(template: Any, batch: int) -> Any:
    """`template` with each `_Affine` evaluated at `batch` (containers rebuilt, leaves shared)."""
    kind = type(template)
    if kind is _Affine:
        return template.at(batch)
    if kind is _MetaTemplate:
        return TensorMeta(tuple(_value_at(d, batch) for d in template.shape), template.dtype)
    if kind is tuple:
        return tuple(_value_at(v, batch) for v in template)
    if kind is list:
        return [_value_at(v, batch) for v in template]
    if kind is dict:
        return {k: _value_at(v, batch) for k, v in template.items()}
    return template
