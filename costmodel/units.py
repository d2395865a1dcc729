"""The units a hardware profile may write, per physical dimension, and their scale to base units.

Lives here: one table per dimension (time, bytes, bandwidth, flop rate, ratio, counts) mapping
a unit string to the factor that converts it to the base unit of that dimension (s, bytes,
bytes/s, flop/s). Lives elsewhere: which field has which dimension (the JSON Schema in
costmodel/schemas/ lists the same units per field; a test keeps the two in step).

Invariants: unit strings are unique across dimensions, so a unit alone names its dimension; decimal
prefixes are powers of 1000 (GB = 1e9 bytes, as nccl-tests and NVIDIA spec sheets count), binary
prefixes are explicit (GiB); `Gb/s` is bits (network links are quoted in bits: 200 Gb/s = 25 GB/s).
"""

from __future__ import annotations

from enum import Enum


class Dimension(Enum):
    """What a profile number measures; each field of a profile has exactly one."""

    TIME = "time"
    BYTES = "bytes"
    BANDWIDTH = "bandwidth"
    FLOP_RATE = "flop rate"
    RATIO = "ratio"
    DEVICES = "devices"
    NODES = "nodes"


# unit -> factor to the dimension's base unit (s, bytes, bytes/s, flop/s, 1, 1, 1)
UNITS: dict[Dimension, dict[str, float]] = {
    Dimension.TIME: {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9},
    Dimension.BYTES: {
        "B": 1.0,
        "KB": 1e3,
        "MB": 1e6,
        "GB": 1e9,
        "TB": 1e12,
        "KiB": 2.0**10,
        "MiB": 2.0**20,
        "GiB": 2.0**30,
    },
    Dimension.BANDWIDTH: {
        "B/s": 1.0,
        "MB/s": 1e6,
        "GB/s": 1e9,
        "TB/s": 1e12,
        "GiB/s": 2.0**30,
        "Gb/s": 1e9 / 8,
    },
    Dimension.FLOP_RATE: {"flop/s": 1.0, "GFLOP/s": 1e9, "TFLOP/s": 1e12},
    Dimension.RATIO: {"ratio": 1.0},
    Dimension.DEVICES: {"devices": 1.0},
    Dimension.NODES: {"nodes": 1.0},
}

_SCALE: dict[str, float] = {unit: f for table in UNITS.values() for unit, f in table.items()}
_DIMENSION: dict[str, Dimension] = {unit: dim for dim, table in UNITS.items() for unit in table}
assert len(_SCALE) == sum(len(t) for t in UNITS.values()), "unit strings must be unique"


def to_base(value: float, unit: str) -> float:
    """`value` in `unit` converted to the base unit of its dimension (s, bytes, bytes/s, flop/s)."""
    try:
        return value * _SCALE[unit]
    except KeyError:
        raise ValueError(f"unknown unit {unit!r}; known units: {', '.join(_SCALE)}") from None


def from_base(value: float, unit: str) -> float:
    """The inverse of `to_base`: a base-unit value expressed in `unit`."""
    return value / _SCALE[unit]


def dimension_of(unit: str) -> Dimension:
    """The dimension a unit string belongs to (raises ValueError for an unknown unit)."""
    try:
        return _DIMENSION[unit]
    except KeyError:
        raise ValueError(f"unknown unit {unit!r}; known units: {', '.join(_SCALE)}") from None
