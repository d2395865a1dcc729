"""The checkpoint manifest: what a checkpoint holds, as frozen values and as JSON.

Lives here: `Manifest`, `TensorEntry`, `RankFile`, their JSON, how dtypes and parameters are
named (`dtype_name`, `parameter_names`), the optimizer's parameter groups as JSON
(`group_json`, merged over pipeline stages by `merge_stage_groups`), and `read_manifest`
(checked reading, with a clear error for a missing, damaged or older-version manifest, and for
rank file names that would lead out of the checkpoint's folder), and `recover_checkpoint` (the
last complete checkpoint put back from `<path>.old` after a save killed between its renames). Lives elsewhere: writing the
tensors and the format's description (`runtime.state.checkpoint`), reading them
(`runtime.state.checkpoint_load`).

Versions: 1 had one mesh (`plan.device_ids`) and no stages; 2 (this one) records the plan's
pipeline stages, each tensor's stage, and the micro-batching (the graph fingerprint is that of
one micro-batch). Version 1 is refused with its cause and a fix, not guessed at.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from autosbp.errors import ExecutionError
from terminal.text import printable

__all__ = [
    "FORMAT",
    "MANIFEST",
    "VERSION",
    "Manifest",
    "RankFile",
    "TensorEntry",
    "dtype_name",
    "group_json",
    "hyperparameters",
    "merge_stage_groups",
    "parameter_names",
    "read_manifest",
    "recover_checkpoint",
]

FORMAT = "autosbp.checkpoint"
VERSION = 2
MANIFEST = "manifest.json"


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One saved tensor, owned by pipeline stage `stage`: `pieces[i]` is the rank whose file
    holds the piece of device i of that stage's mesh (row-major, as `Mesh.coords`)."""

    shape: tuple[int, ...]
    dtype: str
    nd_sbp: str
    stage: int
    pieces: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RankFile:
    rank: int
    name: str
    size_bytes: int
    sha256: str


@dataclass(frozen=True, slots=True)
class Manifest:
    """`stages[s]`: the global ranks of stage s's mesh (every stage has `mesh_shape`);
    `fingerprint`: the graph of one micro-batch of `global_batch / micro_batches` samples."""

    model_name: str
    fingerprint: str
    strategy: str
    mesh_shape: tuple[int, ...]
    stages: tuple[tuple[int, ...], ...]
    micro_batches: int
    global_batch: int
    optimizer_kind: str
    optimizer_step: int
    param_groups: tuple[dict[str, Any], ...]  # hyperparameters, "params": parameter names
    files: tuple[RankFile, ...]
    tensors: dict[str, TensorEntry]

    def __post_init__(self) -> None:
        size = math.prod(self.mesh_shape)
        if any(len(devices) != size for devices in self.stages):
            raise ValueError(f"stages {self.stages} are not meshes of shape {self.mesh_shape}")
        for key, entry in self.tensors.items():
            if not 0 <= entry.stage < len(self.stages) or len(entry.pieces) != size:
                raise ValueError(
                    f"{key}: stage {entry.stage} of {len(self.stages)}, {len(entry.pieces)} "
                    f"pieces for a mesh of {size} devices"
                )

    @property
    def micro_batch_size(self) -> int:
        """Samples per micro-batch: the batch size of the graph the fingerprint hashes."""
        return self.global_batch // self.micro_batches

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": {"name": self.model_name, "fingerprint": self.fingerprint},
            "plan": {
                "strategy": self.strategy,
                "mesh_shape": list(self.mesh_shape),
                "stages": [list(devices) for devices in self.stages],
                "micro_batches": self.micro_batches,
                "global_batch": self.global_batch,
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
        """Raises KeyError, TypeError or ValueError on a malformed manifest (`read_manifest`)."""
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(
                f"format {data.get('format')!r} version {data.get('version')!r}, expected "
                f"{FORMAT!r} version {VERSION}"
            )
        plan, optimizer = data["plan"], data["optimizer"]
        return cls(
            model_name=str(data["model"]["name"]),
            fingerprint=str(data["model"]["fingerprint"]),
            strategy=str(plan["strategy"]),
            mesh_shape=tuple(int(s) for s in plan["mesh_shape"]),
            stages=tuple(tuple(int(r) for r in devices) for devices in plan["stages"]),
            micro_batches=_count(plan["micro_batches"], "plan.micro_batches", least=1),
            global_batch=_count(plan["global_batch"], "plan.global_batch", least=1),
            optimizer_kind=str(optimizer["kind"]),
            optimizer_step=_count(optimizer["step"], "optimizer.step", least=0),
            param_groups=tuple(dict(g) for g in optimizer["param_groups"]),
            files=tuple(RankFile(**f) for f in data["files"]),
            tensors={
                key: TensorEntry(
                    tuple(e["shape"]), e["dtype"], e["nd_sbp"], int(e["stage"]), tuple(e["pieces"])
                )
                for key, e in data["tensors"].items()
            },
        )


def _count(value: Any, field: str, *, least: int) -> int:
    """A whole number >= `least` (ValueError otherwise: a manifest step of -7 is damage)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{field} is {value!r}, expected a whole number >= {least}")
    return value


# ------------------------------------------------------------------- optimizer groups
def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the manifest spells it ("float32")."""
    return str(dtype).removeprefix("torch.")


def parameter_names(parameters: Mapping[str, torch.Tensor]) -> dict[int, str]:
    """id(parameter) -> its name: how the optimizer's groups (which hold tensors) are named."""
    return {id(param): name for name, param in parameters.items()}


def group_json(group: Mapping[str, Any], names: Mapping[int, str]) -> dict[str, Any]:
    """One `torch.optim` parameter group as manifest JSON: its parameters by name (`names`: id
    of a parameter -> its name) and its hyperparameters (tuples as lists)."""
    out: dict[str, Any] = {"params": [names[id(p)] for p in group["params"]]}
    for key, value in group.items():
        if key in ("params", "param_names"):
            continue
        if not _is_plain(value):
            raise ExecutionError(
                f"save_checkpoint: optimizer hyperparameter {key!r} = {value!r} is not a plain "
                "number, string or tuple of them, so the manifest cannot hold it. Pass it as a "
                "Python number."
            )
        out[key] = list(value) if isinstance(value, tuple) else value
    return out


def merge_stage_groups(
    per_stage: Sequence[tuple[dict[str, Any], ...]],
) -> tuple[dict[str, Any], ...]:
    """The manifest's groups from each stage's (`group_json`, in stage order): group i holds the
    parameters of every stage's group i. Each stage builds its own optimizer with the same
    factory, so group i means the same everywhere; stages that disagree are refused."""
    first = [hyperparameters(g) for g in per_stage[0]]
    for stage, groups in enumerate(per_stage):
        hyper = [hyperparameters(g) for g in groups]
        if hyper != first:
            raise ExecutionError(
                f"save_checkpoint: the optimizers of stages 0 and {stage} have different "
                f"parameter groups ({len(first)} vs {len(hyper)} groups, hyperparameters "
                f"{first} vs {hyper}); a checkpoint holds one set per group. Build every "
                "stage's optimizer with the same groups and hyperparameters."
            )
    return tuple(
        {"params": [n for groups in per_stage for n in groups[i]["params"]], **hyper}
        for i, hyper in enumerate(first)
    )


def hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A group (torch's or the manifest's) without its parameters."""
    return {key: value for key, value in group.items() if key != "params"}


def _is_plain(value: Any) -> bool:
    if isinstance(value, list | tuple):
        return all(_is_plain(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str)


def recover_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Put back the last complete checkpoint where a save was killed between its two renames
    (`path` moved to `<path>.old`, the new one not yet at `path`): True if it did. Safe on
    every rank at once (one rename wins, the others find it done); a `path` that holds
    something else is left for the caller to refuse."""
    path = Path(path)
    old = path.with_name(path.name + ".old")
    if (path / MANIFEST).is_file() or not (old / MANIFEST).is_file():
        return False
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        return False
    with contextlib.suppress(FileNotFoundError):  # another rank put it back first
        os.replace(old, path)  # onto a missing or empty directory
    return True


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The manifest of the checkpoint at `path`, checked (ExecutionError if missing, damaged or
    of another format version)."""
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
        data = json.loads(file.read_text())
        _check_version(data, path)
        manifest = Manifest.from_json(data)
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
    for record in manifest.files:
        _check_inside(path, record.name, file)
    return manifest


def _check_inside(path: Path, name: str, manifest: Path) -> None:
    """A rank file's name is a plain file name that stays in the checkpoint's folder (no
    separator, no `..`, no symbolic link leading out): a manifest never makes a load read
    another file."""
    plain = name not in ("", ".", "..") and Path(name).name == name and "\\" not in name
    inside = plain and (path / name).resolve().is_relative_to(path.resolve())
    if not inside:
        raise ExecutionError(
            f"checkpoint manifest {manifest} names the rank file {printable(repr(name))}, which "
            f"is not a file of {path} (rank files are plain names such as rank00000.pt, inside "
            "the checkpoint's folder); the manifest was edited. Use another checkpoint."
        )


def _check_version(data: Any, path: Path) -> None:
    """A manifest of this format but another version is refused with its cause and a fix."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return  # not ours at all: reported as damaged by `Manifest.from_json`
    version = data.get("version")
    if version == VERSION:
        return
    raise ExecutionError(
        f"checkpoint {path} is in {FORMAT} version {version!r}, but this autosbp reads version "
        f"{VERSION} only (version 2 records each tensor's pipeline stage and the micro-batching; "
        "version 1 had one mesh and no stages). Load it with the autosbp release that wrote it, "
        "copy `Engine.full_state_dict()` into the model, then build an Engine here and save "
        "again (the optimizer state starts afresh)."
    )
