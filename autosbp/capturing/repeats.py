"""Repeated layers exported once: the graph of a model with L identical layers, built from
exports of the same model cut to 3, 4 and 5 of its layers.

Lives here: `capture_by_repeats` (the graph `capture` would give, or None where the layers are
not provably repeated) and the depth family it fits. Lives elsewhere: the export itself
(`export`, which calls this first and exports whole on None), which nodes form block k
(`blocks`), rebatching (`rebatch`: the same idea along the batch).

Why: torch.export traces every layer (Llama 3 405B: 126 layers, ~0.1 s of tracing each on
this 2-core machine, per micro-batch size), yet the layers of a transformer are one program.

How. The container is the model's ModuleList/Sequential with the most numbered children (>=
MIN_LAYERS; strictly more than any other module, so `blocks` picks it in the full graph too).
Its children must be alike (`_alike`): one type, the same submodule tree, parameters and
buffers of the same shapes, strides, dtypes and grad flags, no hooks, no tensor shared with
anything else, and equal plain attributes except an int equal to the child's own index (HF's
`layer_idx`). The model is then exported with the container cut to 3, 4 and 5 children
(`_PICKS`: the first, the last and spread middles in between, renumbered 0..k-1, so a layer's
`layer_idx` still says which layer it is, and a branch on the first, the last or an index
modulo 2..5 shows). Each graph's order is read as flat runs and regions (`_layout`: block 0,
1, ..., k-1 in turn); a node is a slot (flat, or a region's first, middle or last block, and
its position). Each slot's node must be the same node at every depth and block, up to its
fx name, module path and parameter name, whose digit runs are fitted as a j + b k + c (block
j, depth k) from depths 3 and 4; its inputs read the same slots (a block's relative to j, a
flat node's from the first or last block). The family is accepted only if the graphs it
generates at depths 3, 4 and 5 equal the three exports node for node (order, every field,
edges, meta, fingerprint); then the graph at depth L is generated.
Invariants: the result equals the whole export (tests/capturing/test_repeats.py: zoo gpt and a
Hugging Face Llama, node for node and by fingerprint); `program` is None (as a rebatched
graph's); `meta["repeated_from"]` names the depths; anything unproven returns None.
Limits: a forward that branches on a layer index none of the 12 exported layers has (`if
self.layer_idx == 100`) is not seen; such a model is told apart by nothing short of exporting
it whole.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from autosbp.capturing.depth_family import DepthFamily, NotRepeatedError, check_same, same
from autosbp.capturing.graph import OpGraph
from autosbp.errors import CaptureError

__all__ = ["MIN_LAYERS", "capture_by_repeats"]

_log = logging.getLogger(__name__)

MIN_LAYERS = 16  # below this, exporting 12 layers saves too little to be worth a family
_DEPTHS = (3, 4, 5)  # fitted from the first two, checked against all three

CaptureWhole = Callable[[nn.Module, tuple[torch.Tensor, ...], str], OpGraph]


def capture_by_repeats(
    model: nn.Module, args: tuple[torch.Tensor, ...], name: str, capture_whole: CaptureWhole
) -> OpGraph | None:
    """What `capture_whole(model, args, name)` returns, from exports at depths 3, 4 and 5;
    None where the model has no container of >= MIN_LAYERS alike layers or the family fails."""
    found = _container(model)
    if found is None:
        return None
    path, container = found
    start = time.perf_counter()
    graphs: dict[int, OpGraph] = {}
    said: list[warnings.WarningMessage] = []  # the last export's warnings, said once at the end
    for depth in _DEPTHS:
        try:
            with (
                _cut_to(container, _picks(len(container._modules), depth)),
                warnings.catch_warnings(record=True) as said,
            ):
                warnings.simplefilter("always")
                graphs[depth] = capture_whole(model, args, name)
        except CaptureError:  # the whole export says it with the user's full model
            return None
    try:
        if any(g.meta.get("block_container") != path for g in graphs.values()):
            raise NotRepeatedError(f"the exports' blocks are not the children of `{path}`")
        family = DepthFamily.fit(graphs[3], graphs[4])
        for depth, graph in graphs.items():
            check_same(family.graph_at(depth), graph)
    except NotRepeatedError as exc:
        _log.info("capture: exporting `%s` whole: %s", name, exc)
        return None
    for warning in said:
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    graph = family.graph_at(len(container._modules))
    graph.meta["capture_s"] = time.perf_counter() - start
    graph.meta["repeated_from"] = _DEPTHS
    return graph


# ----------------------------------------------------------------------------- the container
def _container(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The container of the repeated layers, if there is one and its children are alike."""
    counts = []
    for path, module in model.named_modules():
        numbered = [key for key in module._modules if key.isdigit()]
        if len(numbered) >= 2:
            counts.append((len(numbered), path, module))
    if not counts:
        return None
    counts.sort(key=lambda c: -c[0])
    size, path, module = counts[0]
    if size < MIN_LAYERS or (len(counts) > 1 and counts[1][0] == size):
        return None
    if not isinstance(module, nn.ModuleList | nn.Sequential):
        return None
    if list(module._modules) != [str(i) for i in range(size)]:
        return None
    children = [c for c in module._modules.values() if c is not None]
    if len(children) != size or not _alike(model, children):
        return None
    return path, module


def _alike(model: nn.Module, children: Sequence[nn.Module]) -> bool:
    """One type, one structure, no hooks, nothing shared, equal attributes (but the index)."""
    if len({id(c) for c in children}) != len(children):
        return False
    inside = [id(t) for c in children for t in _tensors(c)]
    outside = {id(t) for t in _tensors(model)} - set(inside)
    if len(set(inside)) != len(inside) or outside & set(inside):
        return False
    signatures = [_signature(c) for c in children]
    if any(sig is None for sig in signatures):
        return False
    rows = [sig[0] for sig in signatures if sig is not None]
    attrs = [sig[1] for sig in signatures if sig is not None]
    if any(row != rows[0] for row in rows) or any(set(a) != set(attrs[0]) for a in attrs):
        return False
    for key in attrs[0]:
        values = [a[key] for a in attrs]
        index = all(type(v) is int for v in values) and values == list(range(len(values)))
        if not index and not all(same(v, values[0]) for v in values):
            return False
    return True


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [
        *(t for _, t in module.named_parameters(remove_duplicate=False)),
        *(t for _, t in module.named_buffers(remove_duplicate=False)),
    ]


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _signature(child: nn.Module) -> tuple[list[Any], dict[tuple[str, str], Any]] | None:
    """A layer's structure (submodule types, tensor shapes, strides, dtypes, grad flags) and
    its plain attributes by (submodule, name); None where it holds what cannot be compared
    (a tensor or module attribute outside the registries, a hook)."""
    rows: list[Any] = []
    attrs: dict[tuple[str, str], Any] = {}
    for path, module in child.named_modules(remove_duplicate=False):
        if any(getattr(module, hooks, None) for hooks in _HOOKS):
            return None
        for key, value in vars(module).items():
            if key.startswith("_"):
                continue
            if isinstance(value, torch.Tensor | nn.Module):
                return None
            attrs[(path, key)] = value
        tensors = [
            (key, tuple(t.shape), t.stride(), t.dtype, t.requires_grad, type(t))
            for table in (module._parameters, module._buffers)
            for key, t in table.items()
            if t is not None
        ]
        persistent = sorted(set(module._buffers) - module._non_persistent_buffers_set)
        rows.append((path, type(module), tensors, persistent))
    return rows, attrs


def _picks(size: int, depth: int) -> list[int]:
    """The layers kept at `depth`: the first, spread middles, the last (see the header)."""
    middles = {3: [size // 2], 4: [1, size - 2], 5: [2, 3, 4]}[depth]
    return [0, *middles, size - 1]


@contextlib.contextmanager
def _cut_to(container: nn.Module, picks: Sequence[int]) -> Iterator[None]:
    """`container` holding only the children at `picks`, renumbered 0..len-1, for the block."""
    whole = container._modules
    children = list(whole.values())
    container._modules = type(whole)((str(k), children[i]) for k, i in enumerate(picks))
    try:
        yield
    finally:
        container._modules = whole
