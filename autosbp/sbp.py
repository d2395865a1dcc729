"""SBP values and device meshes: the vocabulary every other module speaks.

Lives here: the three SBP kinds (split, broadcast, partial), nD SBP tuples and their text form,
DTensor names, and `Mesh` (shape, dim names, device ids, the link class of each mesh dim);
splits on a mesh (`split_factors`, `local_shape`, and `divisibility_shape`: a shape reduced to
which mesh-dim products divide each dim, what divisibility checks read).
Lives elsewhere: how a global tensor is cut per SBP (`layout`), conversions between SBPs
(`boxing`), which SBPs an op accepts (`rules`).

Invariants: values are frozen and hashable; `repr` is the short form a person reads (`S(0)`, `B`,
`P`, `P(max)`); `format_nd_sbp` / `parse_nd_sbp` round-trip (`S(0)B` <-> `(S(0), B)`).
Reference: OneFlow paper (Yuan et al. 2021) section 3.1; torch/distributed/tensor/placement_types.py.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TypeAlias

from autosbp.errors import SbpError

PARTIAL_OPS = ("sum", "max", "min")


@dataclass(frozen=True, slots=True)
class Split:
    """S(dim): the tensor is cut into equal pieces along tensor dimension `dim`."""

    dim: int

    def __repr__(self) -> str:
        return f"S({self.dim})"

    @property
    def dtensor_name(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True, slots=True)
class Broadcast:
    """B: every device of the mesh dim holds the whole tensor."""

    def __repr__(self) -> str:
        return "B"

    @property
    def dtensor_name(self) -> str:
        return "Replicate()"


@dataclass(frozen=True, slots=True)
class Partial:
    """P: each device holds an addend; the tensor is the reduction (`op`) of all of them.

    `P` is the sum form; `P("max")` builds another reduce op.
    """

    op: str = "sum"

    def __post_init__(self) -> None:
        if self.op not in PARTIAL_OPS:
            raise SbpError(f"P({self.op!r}) is not a partial reduce op; use one of {PARTIAL_OPS}.")

    def __repr__(self) -> str:
        return "P" if self.op == "sum" else f"P({self.op})"

    def __call__(self, op: str) -> Partial:
        return Partial(op)

    @property
    def dtensor_name(self) -> str:
        return "Partial()" if self.op == "sum" else f"Partial({self.op})"


Sbp: TypeAlias = Split | Broadcast | Partial
NdSbp: TypeAlias = tuple[Sbp, ...]

S = Split
B = Broadcast()
P = Partial()


def is_split(sbp: Sbp, dim: int | None = None) -> bool:
    return isinstance(sbp, Split) and (dim is None or sbp.dim == dim)


def as_nd_sbp(value: Sbp | Sequence[Sbp] | str) -> NdSbp:
    """Accept one SBP, a sequence of them, or their text (`"S(0)B"`) and return the tuple."""
    if isinstance(value, str):
        return parse_nd_sbp(value)
    if isinstance(value, Split | Broadcast | Partial):
        return (value,)
    nd = tuple(value)
    for item in nd:
        if not isinstance(item, Split | Broadcast | Partial):
            raise SbpError(
                f"{item!r} is not an SBP; use S(dim), B or P (from autosbp import S, B, P)."
            )
    return nd


def format_nd_sbp(nd_sbp: Sequence[Sbp]) -> str:
    """`(S(0), B)` -> `"S(0)B"`."""
    return "".join(repr(sbp) for sbp in nd_sbp)


def dtensor_names(nd_sbp: Sequence[Sbp]) -> str:
    """`(S(0), B)` -> `"(Shard(0), Replicate())"`: the torch DTensor placements."""
    return "(" + ", ".join(sbp.dtensor_name for sbp in nd_sbp) + ")"


_TOKEN = re.compile(
    r"Shard\((-?\d+)\)|Replicate\(\)|Partial\((sum|max|min)?\)|S\((-?\d+)\)|P\((sum|max|min)\)|B|P"
)


def parse_nd_sbp(text: str) -> NdSbp:
    """Parse `"S(0)B"`, `"P(max)"`, or DTensor names (`"Shard(0),Replicate()"`)."""
    if not isinstance(text, str):
        raise SbpError(
            f"SBP text must be a string like 'S(0)B', got {type(text).__name__} {text!r}; "
            "pass text, or a tuple of S(dim), B and P."
        )
    body = text.replace(" ", "").strip("()[]") if text.startswith(("(", "[")) else text.strip()
    body = body.replace(",", "")
    out: list[Sbp] = []
    pos = 0
    while pos < len(body):
        match = _TOKEN.match(body, pos)
        if match is None:
            raise SbpError(
                f"cannot read SBP text {text!r} at {body[pos:]!r}; write it like 'S(0)B', 'P', "
                "'P(max)' or with DTensor names 'Shard(0),Replicate()'."
            )
        shard_dim, split_dim = match.group(1), match.group(3)
        partial_op = match.group(2) or match.group(4)
        token = match.group(0)
        if shard_dim is not None or split_dim is not None:
            out.append(Split(int(shard_dim if shard_dim is not None else split_dim)))
        elif token in ("B", "Replicate()"):
            out.append(B)
        else:
            out.append(Partial(partial_op or "sum"))
        pos = match.end()
    if not out:
        raise SbpError(f"empty SBP text {text!r}; write one SBP per mesh dim, like 'S(0)B'.")
    return tuple(out)


def check_nd_sbp(
    nd_sbp: NdSbp, shape: Sequence[int], mesh_shape: Sequence[int], what: str = "tensor"
) -> None:
    """Raise SbpError unless `nd_sbp` fits a tensor of `shape` on a mesh of `mesh_shape`.

    Rules: one SBP per mesh dim; a split names an existing tensor dim; the split dim's length is
    divisible by the product of the mesh dims that split it (first version: even splits only).
    """
    if len(nd_sbp) != len(mesh_shape):
        raise SbpError(
            f"{what}: SBP {format_nd_sbp(nd_sbp)} has {len(nd_sbp)} entries but the mesh "
            f"{tuple(mesh_shape)} has {len(mesh_shape)} dims; give one SBP per mesh dim."
        )
    for dim, parts in split_factors(nd_sbp, mesh_shape).items():
        if not 0 <= dim < len(shape):
            raise SbpError(
                f"{what}: SBP {format_nd_sbp(nd_sbp)} splits dim {dim} but the tensor of shape "
                f"{tuple(shape)} has {len(shape)} dims; split a dim in 0..{len(shape) - 1}."
            )
        if shape[dim] % parts:
            raise SbpError(
                f"{what}: SBP {format_nd_sbp(nd_sbp)} splits dim {dim} of length {shape[dim]} "
                f"into {parts} parts, which does not divide it; choose another SBP or a size "
                f"divisible by {parts}."
            )


def split_factors(nd_sbp: Sequence[Sbp], mesh_shape: Sequence[int]) -> dict[int, int]:
    """Tensor dim -> number of pieces it is cut into across all mesh dims."""
    factors: dict[int, int] = {}
    for sbp, size in zip(nd_sbp, mesh_shape, strict=True):
        if isinstance(sbp, Split):
            factors[sbp.dim] = factors.get(sbp.dim, 1) * size
    return factors


@lru_cache(maxsize=65536)  # profiled: ~7e4 calls per GPT-3 search, on far fewer shapes
def divisibility_shape(shape: tuple[int, ...], mesh_sizes: tuple[int, ...]) -> tuple[int, ...]:
    """A shape whose dims are divisible by the same products of mesh dim sizes (`split_factors`'
    values: a dim is split over a subset of the mesh dims) as `shape`'s: per dim, the lcm of
    those products that divide it (a product divides it iff it divides the lcm, which divides
    the dim). On a 128x8 mesh, dims of 768 and 1536 both become 128."""
    products = {1}  # of every subset of the mesh dims: the group sizes a dim can be split over
    for n in mesh_sizes:
        products |= {p * n for p in products}
    return tuple(math.lcm(*(p for p in products if n % p == 0)) for n in shape)


def local_shape(
    shape: Sequence[int], nd_sbp: Sequence[Sbp], mesh_shape: Sequence[int]
) -> tuple[int, ...]:
    """Shape of one device's piece (even splits only)."""
    out = list(shape)
    for dim, parts in split_factors(nd_sbp, mesh_shape).items():
        out[dim] //= parts
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# Meshes


@dataclass(frozen=True, slots=True)
class Mesh:
    """An nD arrangement of devices. Device `device_ids[i]` sits at `coords(i)` (row-major).

    `link_classes[d]` names the profile link class that mesh dim d crosses (e.g. "intra_node" for
    NVLink inside a node, "inter_node" for InfiniBand across nodes).
    """

    shape: tuple[int, ...]
    dim_names: tuple[str, ...] = ()
    device_ids: tuple[int, ...] = ()
    link_classes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        try:
            shape = tuple(int(s) for s in self.shape)
        except (TypeError, ValueError):
            shape = ()
        if not shape or any(s < 1 for s in shape):
            raise SbpError(
                f"mesh shape {self.shape!r} must be a non-empty tuple of positive sizes, "
                "e.g. Mesh((2, 2)) for 4 devices."
            )
        object.__setattr__(self, "shape", shape)
        names = tuple(self.dim_names) or tuple(f"d{i}" for i in range(len(shape)))
        ids = tuple(self.device_ids) or tuple(range(math.prod(shape)))
        links = tuple(self.link_classes) or ("intra_node",) * len(shape)
        if len(names) != len(shape) or len(links) != len(shape):
            raise SbpError(f"mesh {shape}: give one dim name and one link class per mesh dim.")
        if len(ids) != math.prod(shape) or len(set(ids)) != len(ids):
            raise SbpError(
                f"mesh {shape} holds {math.prod(shape)} devices but {len(ids)} device ids "
                f"(distinct: {len(set(ids))}) were given; give each device once."
            )
        object.__setattr__(self, "dim_names", names)
        object.__setattr__(self, "device_ids", ids)
        object.__setattr__(self, "link_classes", links)

    @classmethod
    def of(cls, mesh: Mesh | Sequence[int] | int) -> Mesh:
        """A Mesh as is, or one built from a shape such as `(2, 2)` or `4`."""
        if isinstance(mesh, Mesh):
            return mesh
        if isinstance(mesh, int):
            return cls((mesh,))
        return cls(tuple(mesh))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def coords(self, index: int) -> tuple[int, ...]:
        """Mesh coordinates of the device at position `index` of `device_ids`."""
        out = []
        for size in reversed(self.shape):
            out.append(index % size)
            index //= size
        return tuple(reversed(out))

    def index(self, coords: Sequence[int]) -> int:
        idx = 0
        for c, size in zip(coords, self.shape, strict=True):
            idx = idx * size + c
        return idx

    def groups(self, mesh_dim: int) -> list[tuple[int, ...]]:
        """Device ids of every 1D group along `mesh_dim` (the other coordinates fixed), in order."""
        return self.groups_over((mesh_dim,))

    def groups_over(self, mesh_dims: Sequence[int]) -> list[tuple[int, ...]]:
        """Device ids of every group spanning `mesh_dims` (the other coordinates fixed), each
        row-major, groups in the order of their first member."""
        return [
            self.group_of(self.coords(index), mesh_dims)
            for index in range(self.size)
            if all(self.coords(index)[d] == 0 for d in mesh_dims)
        ]

    def group_of(self, coords: Sequence[int], mesh_dims: Sequence[int]) -> tuple[int, ...]:
        """Device ids of the group spanning `mesh_dims` through `coords`, row-major."""
        sub = [self.shape[d] for d in mesh_dims]
        members = []
        for flat in range(math.prod(sub)):
            c = list(coords)
            for d, size in zip(reversed(mesh_dims), reversed(sub), strict=True):
                c[d], flat = flat % size, flat // size
            members.append(self.device_ids[self.index(c)])
        return tuple(members)

    def __repr__(self) -> str:
        dims = "x".join(str(s) for s in self.shape)
        return f"Mesh({dims}, devices={list(self.device_ids)})"
