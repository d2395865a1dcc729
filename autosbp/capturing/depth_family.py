"""The depth family of `repeats`: a model's graph at any depth L from its exports at depths 3
and 4 (the container of its layers cut to that many children).

Lives here: `DepthFamily` (`fit`, `graph_at`), `check_same` (two graphs equal node for node)
and `NotRepeatedError`. Lives elsewhere: which container, which layers are exported and why the
result is trusted (`repeats`), the nodes themselves (`graph`).

The layout. A graph's order is flat runs (nodes of no block) and regions: the nodes of block
0, then of block 1, ..., of block k-1 (parameters first, compute later: two regions), every
block of a region the same length. A node is at (segment, block j or None, position); its
slot is (segment, kind, position), kind "first" (j = 0), "last" (j = k - 1), "mid" or "flat".
Every node of a slot is the slot's template (the depth-4 node) up to three strings (its fx
name, module path and parameter name: `_Pattern`, each digit run a j + b k + c), and reads the
same producers: a block's relative to its own j, a flat node's from block 0 or from the
k-th last block. `fit` refuses (`NotRepeatedError`) what does not hold at depths 3 and 4.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import networkx as nx
import numpy as np
import torch

from autosbp.capturing.graph import OpGraph, OpNode, Role

__all__ = ["DepthFamily", "NotRepeatedError", "check_same", "same"]

Location = tuple[int, int | None, int]  # (segment, block or None, position)
Slot = tuple[int, str, int]  # (segment, kind, position)
Ref = tuple[str, int, int, int, int]  # (how, segment, block, position, output index)
_META_KEYS = ("tied", "block_container", "buffer_mutations", "absorbed", "fused_norms")


class NotRepeatedError(Exception):
    """The layers are not provably repeated (the message says where)."""


# ---------------------------------------------------------------------------------- strings
@dataclass(frozen=True, slots=True)
class _Pattern:
    """A string whose digit runs may be a j + b k + c (block j, depth k); `implicit`: a trailing
    "_0" is dropped (fx names the first `mm` "mm", the next ones "mm_1", "mm_2"...)."""

    parts: tuple[str | tuple[int, int, int], ...]
    implicit: bool

    @staticmethod
    def fit(samples: Sequence[tuple[int, int, str]], implicit: bool) -> _Pattern:
        texts = [s for _, _, s in samples]
        if len(set(texts)) == 1:
            return _Pattern((texts[0],), False)
        suffixed = [re.search(r"_\d+$", s) is not None for s in texts]
        implicit = implicit and any(suffixed) and not all(suffixed)
        if implicit:
            texts = [s if has else f"{s}_0" for s, has in zip(texts, suffixed, strict=True)]
        tokens = [re.split(r"(\d+)", s) for s in texts]
        skeletons = {tuple(t[0::2]) for t in tokens}
        if len(skeletons) != 1:
            raise NotRepeatedError(f"names {sorted(set(texts))[:3]} differ beyond their numbers")
        parts: list[str | tuple[int, int, int]] = []
        for i, token in enumerate(tokens[0]):
            column = [t[i] for t in tokens]
            if i % 2 == 0 or len(set(column)) == 1:
                parts.append(token)
                continue
            points = [(j, k, int(v)) for (k, j, _), v in zip(samples, column, strict=True)]
            parts.append(_affine(points, texts))
        pattern = _Pattern(tuple(parts), implicit)
        if any(pattern.render(k, j) != s for k, j, s in samples):
            raise NotRepeatedError(f"names {sorted(set(texts))[:3]} are not affine in the block")
        return pattern

    def render(self, depth: int, block: int) -> str:
        out = []
        for part in self.parts:
            if isinstance(part, str):
                out.append(part)
                continue
            value = part[0] * block + part[1] * depth + part[2]
            if value < 0:
                raise NotRepeatedError(f"a name's number would be {value} at depth {depth}")
            out.append(str(value))
        text = "".join(out)
        if self.implicit and not isinstance(self.parts[-1], str) and text.endswith("_0"):
            text = text.removesuffix("_0")
        return text


def _affine(points: list[tuple[int, int, int]], texts: list[str]) -> tuple[int, int, int]:
    """(a, b, c) with a j + b k + c = v at every (j, k, v), whole numbers."""
    rows = np.array([[j, k, 1] for j, k, _ in points], dtype=float)
    values = np.array([v for _, _, v in points], dtype=float)
    solution = np.linalg.lstsq(rows, values, rcond=None)[0]
    a, b, c = (round(float(x)) for x in solution)
    if any(a * j + b * k + c != v for j, k, v in points):
        raise NotRepeatedError(f"names {sorted(set(texts))[:3]} are not affine in the block")
    return a, b, c


# ----------------------------------------------------------------------------------- layout
def _layout(graph: OpGraph, depth: int) -> tuple[list[int | None], dict[str, Location]]:
    """Per segment its block length (None: flat, then its node count is in the locations), and
    each node's location; `NotRepeatedError` where the order is not flat runs and whole regions."""
    order, blocks = graph.order, [graph.node(n).block for n in graph.order]
    segments: list[int | None] = []
    where: dict[str, Location] = {}
    i = 0
    while i < len(order):
        seg, start = len(segments), i
        if blocks[i] is None:
            while i < len(order) and blocks[i] is None:
                where[order[i]] = (seg, None, i - start)
                i += 1
            segments.append(None)
            continue
        sizes = []
        for j in range(depth):
            first = i
            while i < len(order) and blocks[i] == j:
                where[order[i]] = (seg, j, i - first)
                i += 1
            sizes.append(i - first)
        if len(set(sizes)) != 1 or sizes[0] == 0:
            raise NotRepeatedError(f"the blocks of region {seg} are not one run each of one length")
        segments.append(sizes[0])
    return segments, where


def _kind(block: int | None, depth: int) -> str:
    if block is None:
        return "flat"
    return "first" if block == 0 else "last" if block == depth - 1 else "mid"


@dataclass(frozen=True, slots=True)
class _Captured:
    """One export of the family: its graph, depth, layout and locations."""

    graph: OpGraph
    depth: int
    segments: list[int | None]
    where: dict[str, Location]

    @staticmethod
    def of(graph: OpGraph, depth: int) -> _Captured:
        return _Captured(graph, depth, *_layout(graph, depth))

    def refs(self, name: str) -> tuple[Ref, ...]:
        """Where node `name`'s inputs come from, relative to its own block (see the header)."""
        _, j, _ = self.where[name]
        out = []
        for producer in self.graph.producers(name):
            if producer is None:
                raise NotRepeatedError(f"node `{name}` has an input without a producer")
            seg, sj, pos = self.where[producer[0]]
            if sj is None:
                out.append(("flat", seg, 0, pos, producer[1]))
            elif j is not None:
                out.append(("rel", seg, sj - j, pos, producer[1]))
            else:
                out.append(("abs", seg, sj if sj == 0 else sj - self.depth, pos, producer[1]))
        return tuple(out)


# ----------------------------------------------------------------------------------- family
@dataclass(frozen=True, slots=True)
class _SlotFamily:
    """One slot: its template node, its producers, and its three strings."""

    node: OpNode
    refs: tuple[Ref, ...]
    constant: torch.Tensor | None  # a lifted constant's value (the node's `name` its key)
    key: _Pattern
    module_path: _Pattern
    name: _Pattern


@dataclass(frozen=True, slots=True)
class DepthFamily:
    """The graph at any depth >= 2, from the exports at depths 3 and 4 (see the header)."""

    base: OpGraph
    segments: list[int | None]
    flat_sizes: dict[int, int]
    slots: dict[Slot, _SlotFamily]
    constant_order: tuple[tuple[Any, ...], ...]  # `_constant_order`

    @staticmethod
    def fit(shallow: OpGraph, deep: OpGraph) -> DepthFamily:
        """The family of the exports at depths 3 (`shallow`) and 4 (`deep`)."""
        captures = [_Captured.of(shallow, 3), _Captured.of(deep, 4)]
        if captures[0].segments != captures[1].segments:
            raise NotRepeatedError("the exports at depths 3 and 4 have different layouts")
        _check_meta(shallow, deep)
        instances: dict[Slot, list[tuple[_Captured, str]]] = {}
        for cap in captures:
            for name, (seg, j, pos) in cap.where.items():
                instances.setdefault((seg, _kind(j, cap.depth), pos), []).append((cap, name))
        slots = {slot: _fit_slot(found) for slot, found in instances.items()}
        flat = {
            seg: sum(1 for s, j, _ in captures[1].where.values() if s == seg and j is None)
            for seg, size in enumerate(captures[1].segments)
            if size is None
        }
        order = _constant_order(captures[1])
        return DepthFamily(deep, captures[1].segments, flat, slots, order)

    def graph_at(self, depth: int) -> OpGraph:
        """The graph of the model with `depth` layers (`program` None)."""
        names = self._names(depth)
        graph = OpGraph(nx.DiGraph(), [], self.base.model_name, None, self.base.unknown_ops)
        constants = _loose_constants(self.base)
        located: dict[str, Location] = {}
        for (seg, j, pos), name in names.items():
            family = self.slots[(seg, _kind(j, depth), pos)]
            node = replace(
                family.node,
                module_path=family.module_path.render(depth, _j(j, depth)),
                name=family.name.render(depth, _j(j, depth)),
                block=j,
            )
            sources = [_resolve(ref, j, depth, names) for ref in family.refs]
            graph.add_node(name, node, sources)
            if family.constant is not None:
                constants[node.name] = family.constant
                located[node.name] = (seg, j, pos)
        graph.meta = {**self.base.meta, "constants": self._ordered(constants, located)}
        return graph

    def _ordered(self, constants: dict[str, Any], located: dict[str, Location]) -> dict[str, Any]:
        """`constants` in the export's order (`_constant_order`)."""
        keys: list[str] = []
        for item in self.constant_order:
            if item[0] == "loose":
                keys.append(item[1])
            elif item[0] == "flat":
                keys.extend(k for k, loc in located.items() if loc == (item[1], None, item[2]))
            else:
                region = [k for k, loc in located.items() if loc[0] == item[1]]
                keys.extend(sorted(region, key=lambda k: (located[k][1], located[k][2])))
        if sorted(keys) != sorted(constants):
            raise NotRepeatedError("the lifted constants cannot be put in the export's order")
        return {k: constants[k] for k in keys}

    def _names(self, depth: int) -> dict[Location, str]:
        """Every node's name by location, in the graph's order."""
        names: dict[Location, str] = {}
        for seg, size in enumerate(self.segments):
            if size is None:
                for pos in range(self.flat_sizes[seg]):
                    names[(seg, None, pos)] = self.slots[(seg, "flat", pos)].key.render(depth, 0)
                continue
            for j in range(depth):
                for pos in range(size):
                    key = self.slots[(seg, _kind(j, depth), pos)].key
                    names[(seg, j, pos)] = key.render(depth, _j(j, depth))
        if len(set(names.values())) != len(names):
            raise NotRepeatedError(f"two nodes would have one name at depth {depth}")
        return names


def _j(block: int | None, depth: int) -> int:
    """The block index a slot's strings are fitted in: a middle block's own, else 0 (the first
    and last blocks and flat nodes vary with the depth alone)."""
    return block if block is not None and _kind(block, depth) == "mid" else 0


def _resolve(ref: Ref, block: int | None, depth: int, names: dict[Location, str]) -> tuple:
    how, seg, j, pos, output = ref
    if how == "flat":
        return names[(seg, None, pos)], output
    source = (block or 0) + j if how == "rel" else j if j >= 0 else depth + j
    if not 0 <= source < depth:
        raise NotRepeatedError(f"an input would come from block {source} at depth {depth}")
    return names[(seg, source, pos)], output


def _fit_slot(found: list[tuple[_Captured, str]]) -> _SlotFamily:
    """The slot's template (its deepest instance) and patterns; `NotRepeatedError` where instances
    differ in anything else."""
    cap, name = found[-1]
    template, refs = cap.graph.node(name), cap.refs(name)
    constant = _constant(cap.graph, template)
    for other_cap, other in found:
        node = other_cap.graph.node(other)
        like = replace(template, module_path=node.module_path, name=node.name, block=node.block)
        if not same(node, like) or other_cap.refs(other) != refs:
            raise NotRepeatedError(f"node `{other}` differs from `{name}` beyond its names")
        if not same(_constant(other_cap.graph, node), constant):
            raise NotRepeatedError(f"the constant of node `{other}` differs from `{name}`'s")
    samples = [(c.depth, _j(c.where[n][1], c.depth), n, c.graph.node(n)) for c, n in found]
    return _SlotFamily(
        template,
        refs,
        constant,
        _Pattern.fit([(k, j, n) for k, j, n, _ in samples], implicit=True),
        _Pattern.fit([(k, j, a.module_path) for k, j, _, a in samples], implicit=False),
        _Pattern.fit([(k, j, a.name) for k, j, _, a in samples], implicit=False),
    )


def _constant(graph: OpGraph, node: OpNode) -> torch.Tensor | None:
    found: torch.Tensor | None = graph.meta.get("constants", {}).get(node.name)
    return found if node.name and node.role is Role.BUFFER else None


def _constant_order(cap: _Captured) -> tuple[tuple[Any, ...], ...]:
    """The export's order of its lifted constants: ("loose", key), ("flat", segment,
    position) and ("region", segment) for a run of a region's constants, by block then
    position."""
    at = {cap.graph.node(n).name: loc for n, loc in cap.where.items() if cap.graph.node(n).name}
    items: list[tuple[Any, ...]] = []
    for key in cap.graph.meta.get("constants", {}):
        seg, j, pos = at.get(key, (None, None, None))
        if seg is None:
            item: tuple[Any, ...] = ("loose", key)
        else:
            item = ("flat", seg, pos) if j is None else ("region", seg)
        if not items or item != items[-1] or item[0] != "region":
            items.append(item)
    return tuple(items)


def _loose_constants(graph: OpGraph) -> dict[str, Any]:
    """The lifted constants no placeholder names (none in the models seen so far)."""
    named = {node.name for _, node in graph.nodes(Role.BUFFER)}
    return {k: v for k, v in graph.meta.get("constants", {}).items() if k not in named}


def _same_tables(first: dict[str, Any], second: dict[str, Any]) -> bool:
    return set(first) == set(second) and all(same(first[k], second[k]) for k in first)


# ---------------------------------------------------------------------------------- checks
def same(x: Any, y: Any) -> bool:
    """Equal values of one type; tensors by dtype, shape and values (meta: shape only)."""
    if type(x) is not type(y):
        return False
    if isinstance(x, torch.Tensor):
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        return x.is_meta or y.is_meta or bool(torch.equal(x, y))
    try:
        return bool(x == y)
    except (RuntimeError, TypeError, ValueError):  # a tensor inside: no truth value
        return repr(x) == repr(y)


def _check_meta(first: OpGraph, second: OpGraph) -> None:
    if first.model_name != second.model_name or first.unknown_ops != second.unknown_ops:
        raise NotRepeatedError("the exports differ in model name or unknown ops")
    for key in _META_KEYS:
        if not same(first.meta.get(key), second.meta.get(key)):
            raise NotRepeatedError(f"the exports differ in meta `{key}`")
    if not _same_tables(_loose_constants(first), _loose_constants(second)):
        raise NotRepeatedError("the exports' lifted constants differ")


def check_same(got: OpGraph, want: OpGraph) -> None:
    """`NotRepeatedError` unless `got` equals `want`: order, nodes, edges, meta, fingerprint."""
    if got.order != want.order:
        raise NotRepeatedError(f"the generated order differs from the export at {len(want.order)}")
    for name in want.order:
        if not same(got.node(name), want.node(name)):
            raise NotRepeatedError(f"the generated node `{name}` differs from the export's")
    if list(got.edges()) != list(want.edges()):
        raise NotRepeatedError("the generated edges differ from the export's")
    _check_meta(got, want)
    constants = got.meta.get("constants", {}), want.meta.get("constants", {})
    if list(constants[0]) != list(constants[1]) or not _same_tables(*constants):
        raise NotRepeatedError("the generated lifted constants differ from the export's")
    if got.fingerprint() != want.fingerprint():
        raise NotRepeatedError("the generated fingerprint differs from the export's")
