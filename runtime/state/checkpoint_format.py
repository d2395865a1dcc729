"""The checkpoint manifest: what a checkpoint holds, as frozen values and as JSON.

Lives here: `Manifest`, `TensorEntry`, `RankFile`, their JSON, how dtypes and parameters are
named (`dtype_name`, `parameter_names`), the optimizer's parameter groups as JSON
(`group_json`, merged over pipeline stages by `merge_stage_groups`), the job's own state
(`json_extra`: checked to be JSON that reads back equal), `read_manifest` (checked reading,
with a clear error for a missing, damaged or unknown-version manifest, and for rank file names
that would lead out of the checkpoint's folder), and `recover_checkpoint` (the last complete
checkpoint put back from `<path>.old` after a save killed between its renames). Lives
elsewhere: writing the tensors and the format's description (`runtime.state.checkpoint`),
reading them (`runtime.state.checkpoint_load`).

Versions: 1 had one mesh (`plan.device_ids`) and no stages; 2 records the plan's pipeline
stages, each tensor's stage, and the micro-batching (the graph fingerprint is that of one
micro-batch), and resumed from Adam's `step` (`optimizer.step`); 3 (this one)
stores the steps trained explicitly and the job's own state (`training.step`,
`training.extra`, and fp16's dynamic loss scale, `training.loss_scale`, where the engine has
one), and the interleaved plans' chunks (`plan.virtual_stages`; `plan.stages` lists every
virtual stage). Version 2 is read as version 3 with its `optimizer.step` as the
steps trained (what a version 2 job resumed from) and no extra state; version 1 and versions newer than this one are refused with their cause and a fix, not
guessed at.
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
    "json_extra",
    "merge_stage_groups",
    "parameter_names",
    "read_manifest",
    "recover_checkpoint",
]

FORMAT = "autosbp.checkpoint"
VERSION = 3
READABLE = (2, 3)  # versions `read_manifest` reads (2 as 3: see the header)
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
    """`stages[s]`: the global ranks of (virtual) stage s's mesh (every stage has
    `mesh_shape`; interleaved, stage s + k * len(stages) / virtual_stages runs on stage s's
    devices); `fingerprint`: the graph of one micro-batch of `global_batch / micro_batches`
    samples; `step`: the training steps done (stored, never read off an optimizer's state);
    `extra`: the job's own JSON state (`save_checkpoint(extra=...)`), {} where none."""

    model_name: str
    fingerprint: str
    strategy: str
    mesh_shape: tuple[int, ...]
    stages: tuple[tuple[int, ...], ...]
    micro_batches: int
    global_batch: int
    optimizer_kind: str
    param_groups: tuple[dict[str, Any], ...]  # hyperparameters, "params": parameter names
    files: tuple[RankFile, ...]
    tensors: dict[str, TensorEntry]
    step: int
    extra: dict[str, Any]
    virtual_stages: int = 1
    # fp16's dynamic loss scale (`runtime.parallel.precision.LossScale.state`); None elsewhere
    loss_scale: dict[str, float | int] | None = None

    def __post_init__(self) -> None:
        size = math.prod(self.mesh_shape)
        if self.virtual_stages < 1 or len(self.stages) % self.virtual_stages:
            raise ValueError(
                f"{len(self.stages)} stages are not {self.virtual_stages} chunks per stage"
            )
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
                "virtual_stages": self.virtual_stages,
                "micro_batches": self.micro_batches,
                "global_batch": self.global_batch,
            },
            "training": {
                "step": self.step,
                "extra": self.extra,
                **({"loss_scale": self.loss_scale} if self.loss_scale is not None else {}),
            },
            "optimizer": {"kind": self.optimizer_kind, "param_groups": list(self.param_groups)},
            "files": [asdict(f) for f in self.files],
            "tensors": {key: asdict(entry) for key, entry in self.tensors.items()},
        }

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        """Raises KeyError, TypeError or ValueError on a malformed manifest (`read_manifest`).
        Reads version 2 too (its `optimizer.step` as the steps trained, no extra state)."""
        version = data.get("version")
        if data.get("format") != FORMAT or version not in READABLE:
            raise ValueError(
                f"format {data.get('format')!r} version {version!r}, expected {FORMAT!r} "
                f"version {' or '.join(map(str, READABLE))}"
            )
        plan, optimizer = data["plan"], data["optimizer"]
        loss_scale = None
        if version == 2:
            step, extra = _count(optimizer["step"], "optimizer.step", least=0), {}
        else:
            training = data["training"]
            step = _count(training["step"], "training.step", least=0)
            extra = training["extra"]
            if not isinstance(extra, dict):
                raise TypeError(f"training.extra is a {type(extra).__name__}, not an object")
            loss_scale = training.get("loss_scale")
            if loss_scale is not None and not isinstance(loss_scale, dict):
                raise TypeError(f"training.loss_scale is a {type(loss_scale).__name__}")
        return cls(
            model_name=str(data["model"]["name"]),
            fingerprint=str(data["model"]["fingerprint"]),
            strategy=str(plan["strategy"]),
            mesh_shape=tuple(int(s) for s in plan["mesh_shape"]),
            stages=tuple(tuple(int(r) for r in devices) for devices in plan["stages"]),
            micro_batches=_count(plan["micro_batches"], "plan.micro_batches", least=1),
            global_batch=_count(plan["global_batch"], "plan.global_batch", least=1),
            optimizer_kind=str(optimizer["kind"]),
            param_groups=tuple(dict(g) for g in optimizer["param_groups"]),
            files=tuple(RankFile(**f) for f in data["files"]),
            tensors={
                key: TensorEntry(
                    tuple(e["shape"]), e["dtype"], e["nd_sbp"], int(e["stage"]), tuple(e["pieces"])
                )
                for key, e in data["tensors"].items()
            },
            step=step,
            extra=extra,
            virtual_stages=_count(plan.get("virtual_stages", 1), "plan.virtual_stages", least=1),
            loss_scale=loss_scale,
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


def json_extra(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The job's own state for the manifest: `extra` as the manifest's JSON gives it back
    (tuples as lists). ExecutionError, naming the first offending entry, unless it is a dict
    of strings to strings, finite numbers, booleans, None, lists and such dicts."""
    if extra is None:
        return {}
    where = _not_json(extra, "extra") if isinstance(extra, Mapping) else "extra"
    if where is not None:
        raise ExecutionError(
            f"save_checkpoint: {printable(where)} is not JSON; the manifest holds the job's extra "
            "state as JSON. Pass a dict of strings to strings, finite numbers, booleans, None, "
            "lists and such dicts (a generator's state as a list of numbers, say)."
        )
    loaded: dict[str, Any] = json.loads(json.dumps(dict(extra)))
    return loaded


def _not_json(value: Any, where: str) -> str | None:
    """The path of the first part of `value` that JSON would not give back, else None."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{where}[{key!r}] (a {type(key).__name__} key)"
            found = _not_json(item, f"{where}[{key!r}]")
            if found is not None:
                return found
        return None
    if isinstance(value, list | tuple):
        return next(
            (f for i, v in enumerate(value) if (f := _not_json(v, f"{where}[{i}]")) is not None),
            None,
        )
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where} ({value})"
    ok = value is None or isinstance(value, bool | int | float | str)
    return None if ok else f"{where} (a {type(value).__name__})"


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
    """A manifest of this format but a version this release does not read is refused with its
    cause and a fix."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return  # not ours at all: reported as damaged by `Manifest.from_json`
    version = data.get("version")
    if version in READABLE:
        return
    newer = isinstance(version, int) and not isinstance(version, bool) and version > VERSION
    fix = (
        "It was written by a newer autosbp: load it with that release (or upgrade this one)."
        if newer
        else "Load it with the autosbp release that wrote it, copy `Engine.full_state_dict()` "
        "into the model, then build an Engine here and save again (the optimizer state starts "
        "afresh)."
    )
    raise ExecutionError(
        f"checkpoint {path} is in {FORMAT} version {printable(repr(version))}, but this autosbp "
        f"reads versions {READABLE[0]} to {VERSION} (version 1 had one mesh and no stages). " + fix
    )
