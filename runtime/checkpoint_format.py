"""The checkpoint manifest: what a checkpoint holds, as frozen values and as JSON.

Lives here: `Manifest`, `TensorEntry`, `RankFile`, their JSON, and `read_manifest` (checked
reading, with a clear error for a missing or damaged manifest). Lives elsewhere: writing and
reading the tensors, and the format's description (`runtime.checkpoint`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from autosbp.errors import ExecutionError

__all__ = ["FORMAT", "MANIFEST", "VERSION", "Manifest", "RankFile", "TensorEntry", "read_manifest"]

FORMAT = "autosbp.checkpoint"
VERSION = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One saved tensor: `pieces[i]` is the rank whose file holds mesh device i's piece."""

    shape: tuple[int, ...]
    dtype: str
    nd_sbp: str
    pieces: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RankFile:
    rank: int
    name: str
    size_bytes: int
    sha256: str


@dataclass(frozen=True, slots=True)
class Manifest:
    model_name: str
    fingerprint: str
    strategy: str
    mesh_shape: tuple[int, ...]
    device_ids: tuple[int, ...]
    optimizer_kind: str
    optimizer_step: int
    param_groups: tuple[dict[str, Any], ...]  # hyperparameters, "params": parameter names
    files: tuple[RankFile, ...]
    tensors: dict[str, TensorEntry]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": {"name": self.model_name, "fingerprint": self.fingerprint},
            "plan": {
                "strategy": self.strategy,
                "mesh_shape": list(self.mesh_shape),
                "device_ids": list(self.device_ids),
            },
            "optimizer": {
                "kind": self.optimizer_kind,
                "step": self.optimizer_step,
                "param_groups": list(self.param_groups),
            },
            "files": [asdict(f) for f in self.files],
            "tensors": {key: asdict(entry) for key, entry in self.tensors.items()},
        }

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        """Raises KeyError, TypeError or ValueError on a malformed manifest (see `read_manifest`)."""
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(
                f"format {data.get('format')!r} version {data.get('version')!r}, expected "
                f"{FORMAT!r} version {VERSION}"
            )
        optimizer = data["optimizer"]
        return cls(
            model_name=str(data["model"]["name"]),
            fingerprint=str(data["model"]["fingerprint"]),
            strategy=str(data["plan"]["strategy"]),
            mesh_shape=tuple(int(s) for s in data["plan"]["mesh_shape"]),
            device_ids=tuple(int(r) for r in data["plan"]["device_ids"]),
            optimizer_kind=str(optimizer["kind"]),
            optimizer_step=int(optimizer["step"]),
            param_groups=tuple(dict(g) for g in optimizer["param_groups"]),
            files=tuple(RankFile(**f) for f in data["files"]),
            tensors={
                key: TensorEntry(tuple(e["shape"]), e["dtype"], e["nd_sbp"], tuple(e["pieces"]))
                for key, e in data["tensors"].items()
            },
        )


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The manifest of the checkpoint at `path`, checked (ExecutionError if missing or damaged)."""
    path = Path(path)
    file = path / MANIFEST
    if not file.is_file():
        what = (
            "does not exist"
            if not path.exists()
            else f"has no {MANIFEST}: it is incomplete (a save that did not finish)"
        )
        raise ExecutionError(
            f"checkpoint {path} {what}. Pass a directory written by save_checkpoint."
        )
    try:
        return Manifest.from_json(json.loads(file.read_text()))
    except (
        json.JSONDecodeError,
        UnicodeDecodeError,
        KeyError,
        TypeError,
        ValueError,
        AttributeError,
    ) as exc:
        raise ExecutionError(
            f"checkpoint manifest {file} is damaged ({type(exc).__name__}: {exc}); it was "
            "truncated or edited. Use another checkpoint, or save again."
        ) from exc
