"""Checkpoints of an Engine: sharded state saved under one plan, loaded under any other.

Lives here: `save_checkpoint` / `load_checkpoint` (collectives: every rank of the world calls
them). Lives elsewhere: the manifest's values and JSON (`runtime.state.checkpoint_format`, re-exported
here), cutting and assembling pieces by an nd-SBP (`autosbp.layout`), the state being saved
(`runtime.engine`).

Format (`autosbp.checkpoint`, version 2): a directory with one `rank{r:05d}.pt` per rank that
holds a piece (a flat dict key -> tensor, written by `torch.save`, read with `weights_only=True`;
a rank whose pieces are all B copies of another's writes none) and `manifest.json`: the model's
graph fingerprint (of one micro-batch), the plan's mesh shape, pipeline stages (each stage's
global ranks) and micro-batching, the optimizer's kind, step count and hyperparameters (one set
per parameter group, listing the parameters of every stage), the files' sizes and sha256, and per
tensor its global shape, dtype, nd-SBP, owning stage and which rank file holds the piece of each
device of that stage's mesh. Keys: `state/<name>` for parameters and buffers,
`optim/<name>/<field>` for optimizer state (Adam's `exp_avg`, `exp_avg_sq`, `step`).

Invariants:
- A tensor is saved by the stage that owns it (`Engine.owner`) and loaded by the stage that owns
  it under the new plan, whatever the two plans' stage counts, meshes and world sizes; a rank
  reads only the rank files that hold pieces of its own stage's tensors.
- Only ranks at coordinate 0 of every B mesh dim of a tensor (in its stage's mesh) write its
  piece: B copies are saved once. A tensor's pieces are enough to rebuild it
  (`assemble_tensor`); state is never P.
- Optimizer state that has its parameter's local shape follows the parameter's layout; a 0-dim
  tensor (Adam's step) is replicated on the parameter's stage. Anything else is refused (only
  elementwise optimizers shard exactly, see runtime.engine).
- Same model: when both plans run micro-batches of the same size, the graph fingerprints must be
  equal; otherwise (their graphs differ in batch size) every parameter and buffer must match by
  name, shape and dtype. Either way the state's names, shapes and dtypes are checked.
- Atomic: ranks write into `<path>.tmp`, rank 0 writes the manifest last and renames the
  directory to `<path>`. A directory without a manifest is never taken for a checkpoint. An
  existing checkpoint at `<path>` is replaced only after the new one is complete.
- Saving and loading run each fallible part on every rank and then agree (`_agree`): a failure
  on one rank makes every rank raise, naming it (never a hang). Loading changes nothing until
  every tensor of this rank has been read and checked, and every rank has.
- Loading restores the optimizer's hyperparameters (lr, betas ...) from the checkpoint, as
  `torch.optim.Optimizer.load_state_dict` does.

Scope: every rank reads whole rank files and rebuilds each global tensor of its stage, then cuts
its own piece (`_local_piece`); fine at the sizes tested. A production loader would read only
the saved slices that overlap this rank's piece (a change local to `_local_piece` and
`_RankFiles`). Ranks must see one shared filesystem.
Reference: docs/architecture.md ("Runtime"); torch.distributed.checkpoint (per-rank files + a metadata file).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from autosbp.capturing.graph import Role
from autosbp.errors import ExecutionError, PlanError
from autosbp.layout import assemble_tensor, shard_tensor
from autosbp.sbp import B, Broadcast, Mesh, NdSbp, format_nd_sbp, local_shape, parse_nd_sbp
from runtime.engine import Engine
from runtime.state.checkpoint_format import (
    MANIFEST,
    Manifest,
    RankFile,
    TensorEntry,
    group_json,
    hyperparameters,
    merge_stage_groups,
    read_manifest,
)

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
@dataclass(frozen=True, slots=True)
class _StageReport:
    """What a stage tells rank 0 for the manifest (its first rank speaks for it; the others
    would say the same): its tensors' entries, its optimizer's groups and step count."""

    stage: int
    tensors: dict[str, TensorEntry]
    param_groups: tuple[dict[str, Any], ...]
    optimizer_step: int


def save_checkpoint(engine: Engine, path: str | os.PathLike[str]) -> Path:
    """Save `engine`'s parameters, buffers and optimizer state at `path` (a directory). A
    collective: every rank calls it; it returns once the checkpoint is complete on disk."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    rank = dist.get_rank()

    def prepare() -> tuple[_StageReport, dict[str, torch.Tensor]]:
        report, mine = _stage_report(engine, rank)
        if rank == 0:
            _fresh_dir(tmp, path)
        return report, mine

    report, mine = _agree("save_checkpoint (prepare)", prepare)
    record = _agree("save_checkpoint (write)", lambda: _write_rank_file(tmp, rank, mine))
    told: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(told, (record, report if engine.index == 0 else None))

    def publish() -> None:
        files = tuple(f for f, _ in told if f is not None)
        reports = sorted((r for _, r in told if r is not None), key=lambda r: r.stage)
        manifest = _manifest(engine, reports, files)
        _write_bytes(tmp / MANIFEST, (json.dumps(manifest.to_json(), indent=1) + "\n").encode())
        _publish(tmp, path)

    _agree("save_checkpoint (publish)", publish if rank == 0 else lambda: None)
    return path


def _stage_report(engine: Engine, rank: int) -> tuple[_StageReport, dict[str, torch.Tensor]]:
    """The entries of every tensor of this rank's stage, and the pieces this rank writes
    (cloned: a view would save its whole storage)."""
    entries: dict[str, TensorEntry] = {}
    mine: dict[str, torch.Tensor] = {}
    mesh = engine.mesh
    for key, (local, shape, layout) in _saved_tensors(engine).items():
        holders = tuple(mesh.device_ids[_owner(layout, mesh, i)] for i in range(mesh.size))
        dtype = _dtype_name(local.dtype)
        entries[key] = TensorEntry(shape, dtype, format_nd_sbp(layout), engine.stage, holders)
        if holders[engine.index] == rank:
            mine[key] = local.detach().clone()
    names = _names_by_id(engine)
    groups = tuple(group_json(g, names) for g in engine.optimizer.param_groups)
    steps = [int(s["step"]) for s in engine.optimizer.state.values() if "step" in s]
    return _StageReport(engine.stage, entries, groups, max(steps, default=0)), mine


def _saved_tensors(engine: Engine) -> dict[str, tuple[torch.Tensor, tuple[int, ...], NdSbp]]:
    """key -> (local tensor, global shape, layout) for the state and the optimizer's tensors of
    this rank's stage."""
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
    engine: Engine, reports: Sequence[_StageReport], files: tuple[RankFile, ...]
) -> Manifest:
    plan = engine.plan
    assert [r.stage for r in reports] == list(range(len(plan.stages))), "one report per stage"
    return Manifest(
        model_name=engine.graph.model_name,
        fingerprint=engine.graph.fingerprint(),
        strategy=plan.strategy,
        mesh_shape=engine.mesh.shape,
        stages=tuple(tuple(stage.devices) for stage in plan.stages),
        micro_batches=plan.micro_batches,
        global_batch=plan.global_batch,
        optimizer_kind=type(engine.optimizer).__name__,
        optimizer_step=max(r.optimizer_step for r in reports),  # torch keeps Adam's per param
        param_groups=merge_stage_groups([r.param_groups for r in reports]),
        files=files,
        tensors={key: entry for r in reports for key, entry in r.tensors.items()},
    )


def _names_by_id(engine: Engine) -> dict[int, str]:
    return {id(param): name for name, param in engine.parameters.items()}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------------- loading
def load_checkpoint(engine: Engine, path: str | os.PathLike[str]) -> Manifest:
    """Load the checkpoint at `path` into `engine`, whatever plan, stages, mesh or world size it
    was saved under. A collective: every rank calls it. Returns the manifest."""
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
    plan = engine.plan
    micro_batch_size = plan.global_batch // plan.micro_batches
    if manifest.fingerprint != fingerprint and manifest.micro_batch_size == micro_batch_size:
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
    _check_state(engine, manifest, path, micro_batch_size)
    missing = [f.name for f in manifest.files if not (path / f.name).is_file()]
    if missing:
        raise ExecutionError(
            f"checkpoint {path}: the rank files {missing} listed in its manifest are missing "
            "(copied partially?); every one is needed. Copy the whole checkpoint directory."
        )
    return manifest


def _check_state(engine: Engine, manifest: Manifest, path: Path, micro_batch_size: int) -> None:
    """The checkpoint holds exactly the model's parameters and buffers (every stage's), each
    with its shape and dtype."""
    want = {
        attrs.name: (tuple(attrs.outputs[0].shape), _dtype_name(attrs.outputs[0].dtype))
        for role in (Role.PARAMETER, Role.BUFFER)
        for _, attrs in engine.graph.nodes(role)
    }
    saved = {
        key.removeprefix("state/"): (entry.shape, entry.dtype)
        for key, entry in manifest.tensors.items()
        if key.startswith("state/")
    }
    differ = sorted(n for n in want.keys() | saved.keys() if want.get(n) != saved.get(n))
    if not differ:
        return
    name = differ[0]
    got, have = (
        f"{d[1]}{list(d[0])}" if d else "nothing" for d in (saved.get(name), want.get(name))
    )
    why = (
        ""
        if manifest.micro_batch_size == micro_batch_size
        else f" (saved at micro-batches of {manifest.micro_batch_size} samples, run here at "
        f"{micro_batch_size}, so the graph fingerprints {manifest.fingerprint} and "
        f"{engine.graph.fingerprint()} are not comparable and the state was compared instead)"
    )
    raise PlanError(
        f"checkpoint {path} holds {got} for {name!r} ({len(differ)} parameter(s) or buffer(s) "
        f"differ), but this engine's model `{engine.graph.model_name}` has {have}: it belongs "
        f"to another model{why}. Load a checkpoint of this model."
    )


def _read_local(
    engine: Engine, manifest: Manifest, path: Path
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's piece of every state tensor of its stage, and the optimizer's state dict with
    its pieces: everything read and checked before the engine is changed."""
    files = _RankFiles(path, manifest)
    state = {
        name: _local_piece(f"state/{name}", engine, engine.layouts[name], files)
        for name in engine.state
    }
    optim: dict[str, dict[str, torch.Tensor]] = {}
    replicated = (B,) * engine.mesh.ndim
    for key, entry in manifest.tensors.items():
        if not key.startswith("optim/"):
            continue
        name, field = key.removeprefix("optim/").rsplit("/", 1)
        if name not in engine.owner or (
            engine.owner[name] == engine.stage and name not in engine.parameters
        ):
            raise PlanError(
                f"checkpoint {path} has optimizer state for {name!r}, which is not a parameter "
                "of this model: it belongs to another model. Load a checkpoint of this model."
            )
        if name not in engine.parameters:
            continue  # another stage's parameter: that stage loads it
        layout = engine.layouts[name] if entry.shape else replicated
        optim.setdefault(name, {})[field] = _local_piece(key, engine, layout, files)
    return state, _optimizer_state_dict(engine, manifest, optim)


def _local_piece(key: str, engine: Engine, layout: NdSbp, files: _RankFiles) -> torch.Tensor:
    """This rank's piece under `layout`: the saved pieces assembled whole, then cut. (A
    production loader would read only the saved slices that overlap this piece.)"""
    manifest = files.manifest
    entry = manifest.tensors[key]
    saved_mesh = Mesh(manifest.mesh_shape, device_ids=manifest.stages[entry.stage])
    saved_layout = parse_nd_sbp(entry.nd_sbp)
    want = local_shape(entry.shape, saved_layout, saved_mesh.shape)
    pieces = [files.piece(rank, key, want) for rank in entry.pieces]
    whole = assemble_tensor(pieces, saved_layout, saved_mesh)
    return shard_tensor(whole, layout, engine.mesh, engine.coords).clone()


class _RankFiles:
    """The checkpoint's rank files, each read once (when a piece in it is first asked for),
    checked against its size and sha256."""

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
    """The optimizer's own `state_dict` format: this stage's parameters by their index in its
    groups; each group takes the hyperparameters of the checkpoint's group of that index, whose
    parameters (of every stage) must include the group's here."""
    names = _names_by_id(engine)
    current = [[names[id(p)] for p in g["params"]] for g in engine.optimizer.param_groups]
    saved = [set(g["params"]) for g in manifest.param_groups]
    stray = [n for group, held in zip(current, saved, strict=False) for n in group if n not in held]
    if len(saved) != len(current) or stray:
        raise PlanError(
            "load_checkpoint: the optimizer's parameter groups differ from the checkpoint's: "
            f"{len(current)} group(s) here, {len(saved)} saved"
            + (f"; {stray[:3]} are not in the saved group of that index" if stray else "")
            + ". Build the optimizer with the same groups as when saving."
        )
    index = {name: i for i, name in enumerate(n for group in current for n in group)}
    groups = [
        {
            **{k: tuple(v) if isinstance(v, list) else v for k, v in hyperparameters(g).items()},
            "params": [index[n] for n in group],
        }
        for g, group in zip(manifest.param_groups, current, strict=True)
    ]
    state = {index[name]: dict(fields) for name, fields in optim.items()}
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
