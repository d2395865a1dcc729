"""Checkpoints of an Engine: sharded state saved under one plan, loaded under any other.

Lives here: `save_checkpoint` / `load_checkpoint` (collectives: every rank of the world calls
them). Lives elsewhere: the manifest's values and JSON (`runtime.checkpoint_format`, re-exported
here), cutting and assembling pieces by an nd-SBP (`autosbp.layout`), the state being saved
(`runtime.engine`).

Format (`autosbp.checkpoint`, version 1): a directory with one `rank{r:05d}.pt` per rank that
holds a piece (a flat dict key -> tensor, written by `torch.save`, read with `weights_only=True`;
a rank whose pieces are all B copies of another's writes none) and `manifest.json`:
the model's graph fingerprint, the plan's mesh and device ids, the optimizer's kind, step count
and hyperparameters, the files' sizes and sha256, and per tensor its global shape, dtype, nd-SBP
and which rank file holds the piece of each mesh device. Keys: `state/<name>` for parameters and
buffers, `optim/<name>/<field>` for optimizer state (Adam's `exp_avg`, `exp_avg_sq`, `step`).

Invariants:
- Only ranks at coordinate 0 of every B mesh dim of a tensor write its piece: B copies are saved
  once. A tensor's pieces are enough to rebuild it (`assemble_tensor`); state is never P.
- Optimizer state that has its parameter's local shape follows the parameter's layout; a 0-dim
  tensor (Adam's step) is replicated. Anything else is refused (only elementwise optimizers shard
  exactly, see runtime.engine).
- Atomic: ranks write into `<path>.tmp`, rank 0 writes the manifest last and renames the
  directory to `<path>`. A directory without a manifest is never taken for a checkpoint. An
  existing checkpoint at `<path>` is replaced only after the new one is complete.
- Loading changes nothing until every tensor of this rank has been read and checked, and every
  rank has; a failure on one rank makes every rank raise, naming it (never a hang).
- Loading restores the optimizer's hyperparameters (lr, betas ...) from the checkpoint, as
  `torch.optim.Optimizer.load_state_dict` does.

Scope: every rank reads whole rank files and rebuilds each global tensor, then cuts its own piece
(`_local_piece`); fine at the sizes tested. A production loader would read only the saved slices
that overlap this rank's piece (a change local to `_local_piece` and `_RankFiles`). Ranks must
see one shared filesystem.
Reference: design.md 3.7; torch.distributed.checkpoint (per-rank files + a metadata file).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from autosbp.errors import ExecutionError, PlanError
from autosbp.layout import assemble_tensor, shard_tensor
from autosbp.sbp import B, Broadcast, Mesh, NdSbp, format_nd_sbp, local_shape, parse_nd_sbp
from runtime.checkpoint_format import (
    MANIFEST,
    Manifest,
    RankFile,
    TensorEntry,
    read_manifest,
)
from runtime.engine import Engine

T = TypeVar("T")

__all__ = [
    "Manifest",
    "RankFile",
    "TensorEntry",
    "load_checkpoint",
    "read_manifest",
    "save_checkpoint",
]


# ------------------------------------------------------------------------------------ saving
def save_checkpoint(engine: Engine, path: str | os.PathLike[str]) -> Path:
    """Save `engine`'s parameters, buffers and optimizer state at `path` (a directory). A
    collective: every rank calls it; it returns once the checkpoint is complete on disk."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    rank = dist.get_rank()
    entries, mine = _save_plan(engine, rank)
    _agree("save_checkpoint (prepare)", lambda: _fresh_dir(tmp, path) if rank == 0 else None)
    record = _agree("save_checkpoint (write)", lambda: _write_rank_file(tmp, rank, mine))
    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)

    def publish() -> None:
        manifest = _manifest(engine, entries, tuple(r for r in records if r is not None))
        _write_bytes(tmp / MANIFEST, (json.dumps(manifest.to_json(), indent=1) + "\n").encode())
        _publish(tmp, path)

    _agree("save_checkpoint (publish)", publish if rank == 0 else lambda: None)
    return path


def _save_plan(engine: Engine, rank: int) -> tuple[dict[str, TensorEntry], dict[str, torch.Tensor]]:
    """Every tensor's entry, and the pieces this rank writes (cloned: a view would save its
    whole storage)."""
    entries: dict[str, TensorEntry] = {}
    mine: dict[str, torch.Tensor] = {}
    mesh, index = engine.mesh, engine.mesh.device_ids.index(rank)
    for key, (local, shape, layout) in _saved_tensors(engine).items():
        owners = tuple(mesh.device_ids[_owner(layout, mesh, i)] for i in range(mesh.size))
        dtype = str(local.dtype).removeprefix("torch.")
        entries[key] = TensorEntry(tuple(shape), dtype, format_nd_sbp(layout), owners)
        if owners[index] == rank:
            mine[key] = local.detach().clone()
    return entries, mine


def _saved_tensors(engine: Engine) -> dict[str, tuple[torch.Tensor, tuple[int, ...], NdSbp]]:
    """key -> (local tensor, global shape, layout) for the state and the optimizer's tensors."""
    out = {
        f"state/{name}": (local, tuple(engine.shapes[name]), engine.layouts[name])
        for name, local in engine.state.items()
    }
    replicated = (B,) * engine.mesh.ndim
    for name, param in engine.parameters.items():
        for field, value in engine.optimizer.state.get(param, {}).items():
            if not isinstance(value, torch.Tensor):
                raise ExecutionError(
                    f"save_checkpoint: optimizer state {field!r} of {name!r} is a "
                    f"{type(value).__name__}, not a tensor; only tensor state can be saved."
                )
            if value.shape == param.shape:
                out[f"optim/{name}/{field}"] = (
                    value,
                    tuple(engine.shapes[name]),
                    engine.layouts[name],
                )
            elif value.dim() == 0:
                out[f"optim/{name}/{field}"] = (value, (), replicated)
            else:
                raise ExecutionError(
                    f"save_checkpoint: optimizer state {field!r} of parameter {name!r} has shape "
                    f"{tuple(value.shape)}, neither the local shard's {tuple(param.shape)} nor a "
                    f"scalar: {type(engine.optimizer).__name__} is not elementwise, so its state "
                    "cannot follow the parameter's SBP. Use an elementwise optimizer (SGD, Adam, "
                    "AdamW)."
                )
    return out


def _owner(layout: NdSbp, mesh: Mesh, index: int) -> int:
    """The mesh device whose file holds device `index`'s piece: its coordinates with every B
    mesh dim set to 0 (B copies are equal, so one is saved)."""
    coords = mesh.coords(index)
    return mesh.index(
        [0 if isinstance(s, Broadcast) else c for s, c in zip(layout, coords, strict=True)]
    )


def _fresh_dir(tmp: Path, path: Path) -> None:
    if path.exists() and not (path / MANIFEST).is_file():
        raise ExecutionError(
            f"save_checkpoint: {path} exists and is not a checkpoint (no {MANIFEST}); refusing "
            "to replace it. Choose another path or remove it."
        )
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a save that crashed: never published, safe to drop
    tmp.mkdir(parents=True)


def _write_rank_file(tmp: Path, rank: int, tensors: dict[str, torch.Tensor]) -> RankFile | None:
    """This rank's file, or none where it holds no piece (every tensor B where it sits)."""
    if not tensors:
        return None
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    data = buffer.getvalue()
    name = f"rank{rank:05d}.pt"
    _write_bytes(tmp / name, data)
    return RankFile(rank, name, len(data), hashlib.sha256(data).hexdigest())


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _publish(tmp: Path, path: Path) -> None:
    """Rename the complete `tmp` to `path`; an old checkpoint there is moved aside first and
    removed after (a crash in between leaves it whole at `<path>.old`)."""
    old = path.with_name(path.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    if old.exists():
        shutil.rmtree(old)


def _manifest(
    engine: Engine, entries: dict[str, TensorEntry], files: tuple[RankFile, ...]
) -> Manifest:
    optimizer = engine.optimizer
    steps = [
        int(state["step"]) for state in optimizer.state.values() if "step" in state
    ]  # torch keeps Adam's step per parameter; they agree
    return Manifest(
        model_name=engine.graph.model_name,
        fingerprint=engine.graph.fingerprint(),
        strategy=engine.plan.strategy,
        mesh_shape=engine.mesh.shape,
        device_ids=engine.mesh.device_ids,
        optimizer_kind=type(optimizer).__name__,
        optimizer_step=max(steps, default=0),
        param_groups=tuple(_group_json(g, _names_by_id(engine)) for g in optimizer.param_groups),
        files=files,
        tensors=entries,
    )


def _names_by_id(engine: Engine) -> dict[int, str]:
    return {id(param): name for name, param in engine.parameters.items()}


def _group_json(group: Mapping[str, Any], names: Mapping[int, str]) -> dict[str, Any]:
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


def _is_plain(value: Any) -> bool:
    if isinstance(value, list | tuple):
        return all(_is_plain(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str)


# ----------------------------------------------------------------------------------- loading
def load_checkpoint(engine: Engine, path: str | os.PathLike[str]) -> Manifest:
    """Load the checkpoint at `path` into `engine`, whatever plan, mesh or world size it was
    saved under. A collective: every rank calls it. Returns the manifest."""
    path = Path(path)
    manifest = _agree("load_checkpoint", lambda: _checked_manifest(engine, path))
    state, optimizer_state = _agree("load_checkpoint", lambda: _read_local(engine, manifest, path))
    with torch.no_grad():
        for name, local in state.items():
            engine.state[name].copy_(local)
    engine.optimizer.load_state_dict(optimizer_state)
    return manifest


def _checked_manifest(engine: Engine, path: Path) -> Manifest:
    manifest = read_manifest(path)
    fingerprint = engine.graph.fingerprint()
    if manifest.fingerprint != fingerprint:
        raise PlanError(
            f"checkpoint {path} was saved from a model with graph fingerprint "
            f"{manifest.fingerprint} ({manifest.model_name}), but this engine's model "
            f"`{engine.graph.model_name}` has fingerprint {fingerprint}: the model or its example "
            "input shapes differ. Load a checkpoint of this model."
        )
    kind = type(engine.optimizer).__name__
    if manifest.optimizer_kind != kind:
        raise PlanError(
            f"checkpoint {path} holds {manifest.optimizer_kind} state but this engine's optimizer "
            f"is {kind}; their states do not convert. Build the Engine with a "
            f"{manifest.optimizer_kind} optimizer_factory."
        )
    _check_tensors(engine, manifest, path)
    missing = [f.name for f in manifest.files if not (path / f.name).is_file()]
    if missing:
        raise ExecutionError(
            f"checkpoint {path}: the rank files {missing} listed in its manifest are missing "
            "(copied partially?); every one is needed. Copy the whole checkpoint directory."
        )
    return manifest


def _check_tensors(engine: Engine, manifest: Manifest, path: Path) -> None:
    for name, local in engine.state.items():
        entry = manifest.tensors.get(f"state/{name}")
        want = (tuple(engine.shapes[name]), str(local.dtype).removeprefix("torch."))
        if entry is None or (entry.shape, entry.dtype) != want:
            got = "nothing" if entry is None else f"{entry.dtype}{list(entry.shape)}"
            raise PlanError(
                f"checkpoint {path} holds {got} for {name!r}, but the engine has "
                f"{want[1]}{list(want[0])}: it belongs to another model. Load a checkpoint of "
                "this model."
            )


def _read_local(
    engine: Engine, manifest: Manifest, path: Path
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's piece of every state tensor, and the optimizer's state dict with its pieces:
    everything read and checked before the engine is changed."""
    files = _RankFiles(path, manifest)
    state = {
        name: _local_piece(
            manifest.tensors[f"state/{name}"], f"state/{name}", engine, layout, files
        )
        for name, layout in ((n, engine.layouts[n]) for n in engine.state)
    }
    optim: dict[str, dict[str, torch.Tensor]] = {}
    replicated = (B,) * engine.mesh.ndim
    for key, entry in manifest.tensors.items():
        if not key.startswith("optim/"):
            continue
        name, field = key.removeprefix("optim/").rsplit("/", 1)
        if name not in engine.parameters:
            raise PlanError(f"checkpoint has optimizer state for {name!r}, not a parameter here.")
        layout = engine.layouts[name] if entry.shape else replicated
        optim.setdefault(name, {})[field] = _local_piece(entry, key, engine, layout, files)
    return state, _optimizer_state_dict(engine, manifest, optim)


def _local_piece(
    entry: TensorEntry, key: str, engine: Engine, layout: NdSbp, files: _RankFiles
) -> torch.Tensor:
    """This rank's piece under `layout`: the saved pieces assembled whole, then cut. (A
    production loader would read only the saved slices that overlap this piece.)"""
    saved_mesh = Mesh(files.manifest.mesh_shape, device_ids=files.manifest.device_ids)
    saved_layout = parse_nd_sbp(entry.nd_sbp)
    want = local_shape(entry.shape, saved_layout, saved_mesh.shape)
    pieces = [files.piece(rank, key, want) for rank in entry.pieces]
    whole = assemble_tensor(pieces, saved_layout, saved_mesh)
    return shard_tensor(whole, layout, engine.mesh, engine.coords).clone()


class _RankFiles:
    """The checkpoint's rank files, each read once, checked against its size and sha256."""

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path, self.manifest = path, manifest
        self.records = {f.rank: f for f in manifest.files}
        self.loaded: dict[int, dict[str, torch.Tensor]] = {}

    def piece(self, rank: int, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        if rank not in self.loaded:
            self.loaded[rank] = self._read(rank)
        tensor = self.loaded[rank].get(key)
        if tensor is None or tuple(tensor.shape) != shape:
            got = "nothing" if tensor is None else list(tensor.shape)
            raise ExecutionError(
                f"checkpoint {self.path}: rank file of rank {rank} holds {got} for {key!r}, the "
                f"manifest says a piece of shape {list(shape)}; the checkpoint is damaged."
            )
        return tensor

    def _read(self, rank: int) -> dict[str, torch.Tensor]:
        record = self.records.get(rank)
        if record is None:
            raise ExecutionError(
                f"checkpoint {self.path}: the manifest names rank {rank} as holding pieces but "
                "lists no file of it; the manifest is damaged. Save the checkpoint again."
            )
        file = self.path / record.name
        data = file.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != record.size_bytes or digest != record.sha256:
            raise ExecutionError(
                f"checkpoint {self.path}: rank file {file.name} is damaged ({len(data)} bytes, "
                f"sha256 {digest[:12]}...; the manifest says {record.size_bytes} bytes, sha256 "
                f"{record.sha256[:12]}...). Use another checkpoint or copy this one again."
            )
        loaded = torch.load(io.BytesIO(data), weights_only=True)
        assert isinstance(loaded, dict), f"{file}: a rank file holds a dict"
        return loaded


def _optimizer_state_dict(
    engine: Engine, manifest: Manifest, optim: dict[str, dict[str, torch.Tensor]]
) -> dict[str, Any]:
    """The optimizer's own `state_dict` format: parameters by their index in the groups."""
    names = _names_by_id(engine)
    current = [[names[id(p)] for p in g["params"]] for g in engine.optimizer.param_groups]
    saved = [list(g["params"]) for g in manifest.param_groups]
    if saved != current:
        raise PlanError(
            "load_checkpoint: the optimizer's parameter groups differ from the checkpoint's "
            f"({[len(g) for g in saved]} vs {[len(g) for g in current]} parameters per group); "
            "build the optimizer with the same groups as when saving."
        )
    index = {name: i for i, name in enumerate(n for group in current for n in group)}
    state: dict[int, dict[str, Any]] = {}
    for name, fields in optim.items():
        state[index[name]] = dict(fields)
    groups = [
        {
            **{k: tuple(v) if isinstance(v, list) else v for k, v in g.items()},
            "params": [index[n] for n in g["params"]],
        }
        for g in manifest.param_groups
    ]
    return {"state": state, "param_groups": groups}


# ------------------------------------------------------------------------------ agreement
def _agree(what: str, fn: Callable[[], T]) -> T:
    """Run `fn` on every rank, then tell every rank who failed: the failing rank re-raises its
    error, the others raise one naming it. So no rank waits in a collective for one that quit."""
    error: Exception | None = None
    result: Any = None
    try:
        result = fn()
    except Exception as exc:  # re-raised below, after the other ranks have been told
        error = exc
    messages: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    for rank, message in enumerate(messages):
        if message is not None:
            raise ExecutionError(f"{what}: rank {rank} failed, so every rank stops. {message}")
    return result
