"""The space of the outer search: stage meshes, micro-batch counts, configurations.

Lives here: the stage meshes of a device count (`mesh_shapes`), the micro-batch counts of a
batch (`divisors`, and `powers_of_two_dividing` for callers that want those alone), one
configuration (`Config`), and what cutting a graph into stages reads of it (`structure`, so
counts whose graphs cut alike share the cut). Lives elsewhere: what a strategy allows
(`space.strategy.Space`), the search over these (`search`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from autosbp.planner.space.ties import TiedGraph
from autosbp.sbp import Mesh

LinkOf = Callable[[tuple[int, ...], int], str]  # (mesh shape, mesh dim) -> link class name


def mesh_shapes(devices: int, link_of: LinkOf, devices_per_node: int | None = None) -> list[Mesh]:
    """The 1D mesh and the 2D factorizations of `devices` (row-major over node-major device
    ids) whose inner dim stays inside a node (divides `devices_per_node`; every factorization
    when None); each mesh dim gets the link class its groups cross."""
    inner_ok = (
        (lambda n: True) if devices_per_node is None else (lambda n: devices_per_node % n == 0)
    )
    shapes = [(devices,)] + [
        (devices // inner, inner)
        for inner in range(2, devices)
        if devices % inner == 0 and inner_ok(inner)
    ]
    return [
        Mesh(
            shape,
            tuple(f"d{i}" for i in range(len(shape))),
            link_classes=tuple(link_of(shape, d) for d in range(len(shape))),
        )
        for shape in shapes
    ]


def divisors(n: int) -> tuple[int, ...]:
    """Every count that divides `n`, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(sorted({*small, *(n // d for d in small)}))


def powers_of_two_dividing(batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... while they divide `batch`."""
    counts, count = [], 1
    while count <= batch and batch % count == 0:
        counts.append(count)
        count *= 2
    return tuple(counts)


@dataclass(frozen=True)
class Config:
    """One configuration of the space."""

    num_stages: int
    mesh: Mesh
    count: int  # micro-batches
    recompute: str

    def describe(self) -> str:
        return (
            f"stages {self.num_stages}, mesh {'x'.join(map(str, self.mesh.shape))}, "
            f"{self.count} micro-batches, recompute {self.recompute}"
        )


def structure(tied: TiedGraph) -> Hashable:
    """What cutting a graph into stages and counting its ties reads: node order, roles and
    blocks, edges, and the ties (equal for graphs that cut and tie alike)."""
    return (
        tuple((n, tied.graph.node(n).role, tied.graph.node(n).block) for n in tied.graph.order),
        tuple(tied.graph.edges()),
        tuple(tied.member.items()),
        tuple(tied.representative.items()),
        tuple(tied.read_outside.items()),
    )
