"""Repeated blocks: which captured nodes belong to transformer layer k (or residual block k).

Lives here: `assign_blocks`, which picks the repeated-block container of a captured graph and sets
each node's `block` (a new `OpNode` each). Lives elsewhere: capture itself (`export`), tying blocks in the planner.

The container is a module path whose numbered children (`blocks.0`, `blocks.1`, ... from a
ModuleList or Sequential) are >= 2 modules of one type; among those, the one with the most
children wins (then the outermost). It is accepted only if every child runs the same sequence of
compute ops with the same input/output shapes and dtypes, so equal-structure blocks can share
planner variables; otherwise the next candidate is tried, and with none left every `block` is
None. A node's block comes from its module path (parameters: their owning module's path).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from autosbp.capturing.graph import OpGraph, OpNode, Role

__all__ = ["assign_blocks"]

ModuleStack = list[tuple[str, str]]  # (module path, module type name), outermost first


def assign_blocks(graph: OpGraph, stacks: Mapping[str, ModuleStack]) -> str | None:
    """Set `block` on every node of `graph`; return the container's module path (or None).

    `stacks` maps each compute node to its nn_module_stack (the export's `nn_module_stack`).
    """
    for container in _block_candidates(stacks):
        blocks = {name: _block_index(_node_path(node), container) for name, node in graph.nodes()}
        if _blocks_identical(graph, blocks):
            for name, block in blocks.items():
                graph.set_node(name, dataclasses.replace(graph.node(name), block=block))
            return container
    return None


def _block_candidates(stacks: Mapping[str, ModuleStack]) -> list[str]:
    """Containers with >= 2 numbered children of one module type: most children first."""
    children: dict[str, dict[int, str]] = defaultdict(dict)
    for stack in stacks.values():
        for path, type_name in stack:
            parent, _, last = path.rpartition(".")
            if last.isdigit():
                children[parent][int(last)] = type_name
    ranked = sorted(
        (-len(kids), parent.count("."), parent)
        for parent, kids in children.items()
        if len(kids) >= 2 and len(set(kids.values())) == 1
    )
    return [parent for _, _, parent in ranked]


def _node_path(node: OpNode) -> str:
    return node.name or node.module_path


def _block_index(path: str, container: str) -> int | None:
    prefix = f"{container}." if container else ""
    if not path.startswith(prefix):
        return None
    head = path[len(prefix) :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _blocks_identical(graph: OpGraph, blocks: Mapping[str, int | None]) -> bool:
    signatures: dict[int, list[tuple[Any, ...]]] = defaultdict(list)
    for name, node in graph.nodes():
        block = blocks[name]
        if block is not None and node.role is Role.COMPUTE:
            signatures[block].append((node.op, node.inputs, node.outputs))
    distinct = {tuple(sig) for sig in signatures.values()}
    return len(signatures) >= 2 and len(distinct) == 1
