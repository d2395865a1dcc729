"""A cluster = a profile + a node count; the object the planner asks for prices.

Lives here: `Cluster` (device count, memory per device, op / collective / p2p time, the fraction
of communication hidden beside compute) and the mapping of a communication group to a link class
(`link_class_for_group`, `link_class_for_mesh_dim`), in plain ints so costmodel stays ignorant of
meshes and SBP. Lives elsewhere: the formulas (`prices`); what is overlapped (the planner).

Device numbering is node-major: device d sits on node d // devices_per_node. A mesh is row-major
over consecutive devices starting at `first_device` (a pipeline stage's submesh starts later).
A group uses intra_node if it lies inside one node, else inter_node; a profile's inter_node
bus bandwidth is per GPU (node NIC bandwidth / devices per node), the bound when every device of a
node communicates at once, which is what all groups of a mesh dim do together.

Invariants: prices are precomputed at construction; a cluster that needs an inter_node link
(nodes > 1) or more nodes than its profile allows is refused with a ProfileError.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from costmodel.errors import ProfileError
from costmodel.prices import CollectivePrice, ComputePrice
from costmodel.profile import CollectiveKind, DType, LinkClass, Profile


@dataclass(frozen=True, slots=True)
class Cluster:
    """`nodes` nodes of the profile's kind: devices = nodes * devices_per_node."""

    profile: Profile
    nodes: int = 1
    _compute: ComputePrice = field(init=False, repr=False, compare=False)
    _prices: dict[tuple[LinkClass, CollectiveKind], CollectivePrice] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        limit = self.profile.topology.max_nodes
        if self.nodes < 1:
            raise ValueError(f"a cluster needs at least one node, got {self.nodes}")
        if limit is not None and self.nodes > limit:
            allowed = f"at most {limit} node(s)"
            raise ProfileError(
                f"cluster of {self.nodes} node(s) on profile {self.profile.name!r}, which "
                f"describes {allowed}. Use nodes <= {limit}, or a profile whose "
                'topology.nodes is "scalable".'
            )
        if self.nodes > 1:
            self.profile.link(LinkClass.INTER_NODE)  # raises if the profile cannot price it
        prices = {
            (link.link_class, cost.kind): CollectivePrice.of(cost)
            for link in self.profile.links
            for cost in link.collectives
        }
        object.__setattr__(self, "_compute", ComputePrice.of(self.profile))
        object.__setattr__(self, "_prices", prices)

    @property
    def devices_per_node(self) -> int:
        return int(self.profile.topology.devices_per_node.value)

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def memory_bytes(self) -> float:
        """Memory capacity of one device."""
        return self.profile.device.memory.base

    @property
    def overlap_efficiency(self) -> float:
        """Fraction (0-1) of a collective's time hidden when it runs beside compute.

        The profile's efficiency.overlap; 0.0 when the profile has none: nothing is assumed
        hidden, the conservative price (and what the planner priced before overlap existed).
        """
        overlap = self.profile.efficiency.overlap
        return 0.0 if overlap is None else overlap.base

    @property
    def causal_skip(self) -> float:
        """Fraction (0-1) of a causal attention's masked scores the device's kernel skips: the
        profile's efficiency.causal_skip; 0.0 when the profile has none (priced as a math
        kernel, which computes every score under the mask)."""
        skip = self.profile.efficiency.causal_skip
        return 0.0 if skip is None else skip.base

    def op_time_s(
        self, flops: float, nbytes: float, dtype: DType | str, transcendentals: float = 0.0
    ) -> float:
        """Time of one op on one device (see `prices`)."""
        return self._compute.op_time_s(flops, nbytes, dtype, transcendentals)

    def collective_time_s(
        self,
        kind: CollectiveKind | str,
        nbytes: float,
        group_size: int,
        link_class: LinkClass | str,
    ) -> float:
        """One collective: `nbytes` per rank in nccl-tests' convention (see `prices`)."""
        if group_size > self.devices:
            raise ValueError(f"group of {group_size} devices in a cluster of {self.devices}")
        key = (LinkClass(link_class), CollectiveKind(kind))
        if key not in self._prices:
            self.profile.link(key[0])  # raises ProfileError naming the missing link
        return self._prices[key].time_s(nbytes, group_size)

    def p2p_time_s(self, nbytes: float, link_class: LinkClass | str) -> float:
        """One send/recv of `nbytes` between two devices."""
        return self.collective_time_s(CollectiveKind.SEND_RECV, nbytes, 2, link_class)

    def link_class_for_group(
        self, group_size: int, stride: int = 1, first_device: int = 0
    ) -> LinkClass:
        """Link class of the group {first_device + i * stride for i < group_size}."""
        return link_class_for_group(group_size, stride, first_device, self.devices_per_node)

    def link_class_for_mesh_dim(
        self, mesh_shape: Sequence[int], mesh_dim: int, first_device: int = 0
    ) -> LinkClass:
        """Link class of the groups along `mesh_dim` of a row-major mesh (see module doc)."""
        total = math.prod(mesh_shape)
        if first_device + total > self.devices:
            raise ValueError(
                f"mesh {tuple(mesh_shape)} from device {first_device} needs "
                f"{first_device + total} devices; the cluster has {self.devices}"
            )
        return link_class_for_mesh_dim(
            tuple(mesh_shape), mesh_dim, first_device, self.devices_per_node
        )


def link_class_for_group(
    group_size: int, stride: int, first_device: int, devices_per_node: int
) -> LinkClass:
    """intra_node if the first and last device of the group share a node, else inter_node."""
    if group_size < 1 or stride < 1 or first_device < 0:
        raise ValueError(f"bad group: size {group_size}, stride {stride}, first {first_device}")
    last = first_device + (group_size - 1) * stride
    same = first_device // devices_per_node == last // devices_per_node
    return LinkClass.INTRA_NODE if same else LinkClass.INTER_NODE


@lru_cache(maxsize=4096)
def link_class_for_mesh_dim(
    mesh_shape: tuple[int, ...], mesh_dim: int, first_device: int, devices_per_node: int
) -> LinkClass:
    """inter_node if any group along `mesh_dim` spans two nodes (every group is checked)."""
    if not 0 <= mesh_dim < len(mesh_shape):
        raise ValueError(f"mesh dim {mesh_dim} out of range for mesh {mesh_shape}")
    size, stride = mesh_shape[mesh_dim], math.prod(mesh_shape[mesh_dim + 1 :])
    for offset in range(math.prod(mesh_shape)):
        if (offset // stride) % size == 0:  # the first device of a group
            link = link_class_for_group(size, stride, first_device + offset, devices_per_node)
            if link is LinkClass.INTER_NODE:
                return link
    return LinkClass.INTRA_NODE
