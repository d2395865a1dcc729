"""Loading a checkpoint into an Engine, whatever plan it was saved under (resharding).

Lives here: `load_checkpoint` (a collective: every rank of the world calls it): the manifest
checked against this engine's model and optimizer, this rank's piece of every tensor of its
stage read from the rank files that hold it, then the state and the optimizer's state dict
loaded. Lives elsewhere: the format and the invariants both sides keep
(`runtime.state.checkpoint`, which re-exports `load_checkpoint`), the manifest's values
(`runtime.state.checkpoint_format`), cutting and assembling pieces (`autosbp.layout`), the
agreement on failures (`runtime.state.startup.agree`).

Invariants:
- Loading changes nothing until every tensor of this rank has been read and checked, and every
  rank has; a failure on one rank makes every rank raise, naming it.
- A tensor is loaded by the stage that owns it under this engine's plan (interleaved: the
  rank's chunks); a rank reads only the rank files that hold pieces of its own stage's tensors,
  each checked against its size and sha256.
- Optimizer state is cut in the layout of the tensor this engine's optimizer steps (the
  parameter's piece or its ZeRO shard), whatever layout it was saved in; the ZeRO shards
  themselves are cut again from the loaded weights (else the step after the load would gather
  the stale shards back into the weights).
- Same model: the graph fingerprints must be equal where both plans run micro-batches of the
  same size; otherwise every parameter and buffer must match by name, shape and dtype.
- The optimizer's hyperparameters (lr, betas ...) come from the checkpoint, as
  `torch.optim.Optimizer.load_state_dict` does.

Scope: every rank reads whole rank files and rebuilds each global tensor of its stage, then cuts
its own piece (`_local_piece`); fine at the sizes tested. A production loader would read only
the saved slices that overlap this rank's piece (a change local to `_local_piece` and
`RankFiles`).
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any

import torch

from autosbp.capturing.graph import OpNode, Role
from autosbp.errors import ExecutionError, PlanError
from autosbp.layout import assemble_tensor, shard_tensor
from autosbp.sbp import B, Mesh, NdSbp, local_shape, parse_nd_sbp
from runtime.engine import Engine
from runtime.parallel.precision import LossScale
from runtime.state.checkpoint_format import (
    Manifest,
    dtype_name,
    hyperparameters,
    parameter_names,
    read_manifest,
)
from runtime.state.startup import agree

__all__ = ["RankFiles", "load_checkpoint", "whole_tensor"]


def load_checkpoint(engine: Engine, path: str | os.PathLike[str]) -> Manifest:
    """Load the checkpoint at `path` into `engine`, whatever plan, stages, mesh or world size it
    was saved under. A collective: every rank calls it. Returns the manifest: the steps
    trained (`Manifest.step`) and the job's own state (`Manifest.extra`) are the caller's to
    restore."""
    path = Path(path)
    manifest = agree("load_checkpoint", lambda: _checked_manifest(engine, path))
    loaded = agree("load_checkpoint", lambda: _read_local(engine, manifest, path))
    state, optimizer_state, shards = loaded
    released = engine.weights.released  # masters held as their shards: their copies cast here
    with torch.no_grad():
        for name, local in state.items():
            (engine.weights.compute[name] if name in released else engine.state[name]).copy_(local)
        for name, piece in shards.items():  # ZeRO's fp32 shards: cut again from the weights
            engine.optimized[name].copy_(piece)
    engine.weights.refresh()  # a mixed recipe's compute copies, cast from the loaded masters
    engine.optimizer.load_state_dict(optimizer_state)
    if manifest.loss_scale is not None and engine.loss_scale is not None:  # fp16 on both sides
        engine.loss_scale = LossScale.from_state(manifest.loss_scale)
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
        attrs.name: (tuple(attrs.outputs[0].shape), dtype_name(_held(engine, role, attrs)))
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


def _held(engine: Engine, role: Role, attrs: OpNode) -> torch.dtype:
    """The dtype the engine holds and saves of a tensor the graph traced in its own: a floating
    parameter's fp32 master under a mixed recipe (`Engine.shards`), else the traced dtype."""
    dtype = attrs.outputs[0].dtype
    if role is Role.PARAMETER and engine.precision.mixed and dtype.is_floating_point:
        return torch.float32
    return dtype


def _read_local(
    engine: Engine, manifest: Manifest, path: Path
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, torch.Tensor]]:
    """This rank's piece of every state tensor of its stage, the optimizer's state dict with
    its pieces, and the pieces of the ZeRO shards it steps (name -> the weight in the shard's
    layout): everything read and checked before the engine is changed."""
    files = RankFiles(path, manifest)
    state = {
        name: _local_piece(f"state/{name}", engine, engine.layouts[name], files)
        for name in engine.state
    }
    params, optimized = engine.parameters, engine.optimized
    shards = {
        name: _local_piece(f"state/{name}", engine, engine.optimized_layouts[name], files)
        for name, stepped in optimized.items()
        if stepped is not params[name]
    }
    optim: dict[str, dict[str, torch.Tensor]] = {}
    replicated = (B,) * engine.mesh.ndim
    for key, entry in manifest.tensors.items():
        if not key.startswith("optim/"):
            continue
        name, field = key.removeprefix("optim/").rsplit("/", 1)
        if name not in engine.owner or (
            engine.owner[name] in engine.chunks and name not in engine.parameters
        ):
            raise PlanError(
                f"checkpoint {path} has optimizer state for {name!r}, which is not a parameter "
                "of this model: it belongs to another model. Load a checkpoint of this model."
            )
        if name not in engine.parameters:
            continue  # another stage's parameter: that stage loads it
        layout = engine.optimized_layouts[name] if entry.shape else replicated
        optim.setdefault(name, {})[field] = _local_piece(key, engine, layout, files)
    return state, _optimizer_state_dict(engine, manifest, optim), shards


def _local_piece(key: str, engine: Engine, layout: NdSbp, files: RankFiles) -> torch.Tensor:
    """This rank's piece under `layout`: the saved pieces assembled whole, then cut. (A
    production loader would read only the saved slices that overlap this piece.)"""
    whole = whole_tensor(key, files)
    return shard_tensor(whole, layout, engine.mesh, engine.coords).clone()


def whole_tensor(key: str, files: RankFiles) -> torch.Tensor:
    """The saved tensor `key` assembled whole from its pieces (every rank file it needs read
    once and checked)."""
    manifest = files.manifest
    entry = manifest.tensors[key]
    saved_mesh = Mesh(manifest.mesh_shape, device_ids=manifest.stages[entry.stage])
    saved_layout = parse_nd_sbp(entry.nd_sbp)
    want = local_shape(entry.shape, saved_layout, saved_mesh.shape)
    pieces = [files.piece(rank, key, want) for rank in entry.pieces]
    return assemble_tensor(pieces, saved_layout, saved_mesh)


class RankFiles:
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
        # On the CPU whatever device saved it: a rank file holds another rank's pieces (on
        # NCCL its GPU), and the pieces of a tensor are assembled in one place.
        loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        assert isinstance(loaded, dict), f"{file}: a rank file holds a dict"
        return loaded


def _optimizer_state_dict(
    engine: Engine, manifest: Manifest, optim: dict[str, dict[str, torch.Tensor]]
) -> dict[str, Any]:
    """The optimizer's own `state_dict` format: this stage's parameters by their index in its
    groups; each group takes the hyperparameters of the checkpoint's group of that index, whose
    parameters (of every stage) must include the group's here."""
    names = parameter_names(engine.optimized)
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
