"""Process groups for the collectives of boxing steps: one per 1D group of every mesh dim.

Lives here: `ProcessGroups` (a cache from a tuple of global ranks to its torch.distributed group)
and `build_groups` (makes every group of some meshes). Lives elsewhere: the collectives that use
them (`runtime.execute.collectives`); the gradient sync's own groups, spanning several mesh dims
(`runtime.parallel.grad_sync.build_sync_groups`); meshes and their groups (`autosbp.sbp.Mesh.groups`).

Invariants: `dist.new_group` is a collective over the whole world, so every rank builds the same
groups in the same order: `build_groups` walks meshes in the order given, mesh dims in order, and
groups in `Mesh.groups` order, and skips groups it already has (the same on every rank) and groups
of one rank (steps on a mesh dim of size 1 are local). Nothing here creates a group lazily: a
missing group is a clear error, never a hang. Send/recv between stages uses the default group and
global ranks, so it needs no group.
Reference: torch.distributed.new_group; torch/distributed/device_mesh.py (one group per mesh dim).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable

import torch
import torch.distributed as dist

from autosbp.errors import ExecutionError
from autosbp.sbp import Mesh

__all__ = ["ProcessGroups", "build_groups", "world_timeout"]


class ProcessGroups:
    """The groups of some meshes, built once on every rank; look one up by its global ranks."""

    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self.meshes: list[Mesh] = []

    def add_mesh(self, mesh: Mesh) -> None:
        """Create the groups of every mesh dim of `mesh` (a collective: all ranks call it)."""
        for mesh_dim in range(mesh.ndim):
            self.add_groups(mesh, mesh.groups(mesh_dim))

    def add_groups(self, mesh: Mesh, groups: Iterable[tuple[int, ...]]) -> None:
        """Create `groups` (global ranks) of `mesh` not created yet (a collective: all ranks
        call it with the same groups in the same order)."""
        for ranks in groups:
            if len(ranks) > 1 and ranks not in self._groups:
                self._groups[ranks] = dist.new_group(list(ranks), timeout=world_timeout())
        if mesh not in self.meshes:
            self.meshes.append(mesh)

    def get(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        try:
            return self._groups[ranks]
        except KeyError:
            raise ExecutionError(
                f"no process group for ranks {list(ranks)}: the meshes given to build_groups "
                f"were {self.meshes}. Call build_groups with every mesh of the plan on every "
                "rank, before the first boxing."
            ) from None


def build_groups(meshes: Iterable[Mesh]) -> ProcessGroups:
    """The groups of every mesh dim of `meshes`. Call on every rank, same meshes, same order."""
    groups = ProcessGroups()
    for mesh in meshes:
        groups.add_mesh(mesh)
    return groups


def world_timeout() -> datetime.timedelta:
    """The default group's timeout: new_group would otherwise take the backend's (30 min)."""
    pg = dist.distributed_c10d._get_default_group()
    return pg._get_backend(torch.device("cpu")).options._timeout
