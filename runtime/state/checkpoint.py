"""Checkpoints of an Engine: sharded state saved under one plan, loaded under any other.

Lives here: the format and the invariants that saving and loading keep, and `save_checkpoint`
(a collective: every rank of the world calls it). Lives elsewhere: `load_checkpoint`
(`runtime.state.checkpoint_load`, re-exported here), the manifest's values and JSON
(`runtime.state.checkpoint_format`, re-exported here), cutting and assembling pieces by an
nd-SBP (`autosbp.layout`), the state being saved (`runtime.state.shards`, through the Engine),
the agreement on failures (`runtime.state.startup.agree`).

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
  existing checkpoint at `<path>` is replaced only after the new one is complete: moved to
  `<path>.old`, the new one renamed in, then the old removed. A kill between the renames leaves
  the last complete one at `<path>.old`; resuming and saving put it back first
  (`recover_checkpoint`), and `<path>.old` is never removed while `<path>` is incomplete.
- Saving and loading run each fallible part on every rank and then agree (`agree`): a failure
  on one rank makes every rank raise, naming it (never a hang). Loading changes nothing until
  every tensor of this rank has been read and checked, and every rank has.
- Loading restores the optimizer's hyperparameters (lr, betas ...) from the checkpoint, as
  `torch.optim.Optimizer.load_state_dict` does.

Scope: ranks must see one shared filesystem; how much a rank reads when loading is
`runtime.state.checkpoint_load`'s.
Reference: docs/architecture.md ("The rooms in detail"); torch.distributed.checkpoint (per-rank
files + a metadata file).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autosbp.errors import ExecutionError
from autosbp.sbp import B, Broadcast, Mesh, NdSbp, format_nd_sbp
from runtime.engine import Engine
from runtime.state.checkpoint_format import (
    MANIFEST,
    Manifest,
    RankFile,
    TensorEntry,
    dtype_name,
    group_json,
    merge_stage_groups,
    parameter_names,
    read_manifest,
    recover_checkpoint,
)
from runtime.state.checkpoint_load import load_checkpoint, refuse_interleaved
from runtime.state.startup import agree

__all__ = [
    "MANIFEST",
    "Manifest",
    "RankFile",
    "TensorEntry",
    "load_checkpoint",
    "read_manifest",
    "save_checkpoint",
]


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
    refuse_interleaved(engine.plan.virtual_stages, "save")
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    rank = dist.get_rank()

    def prepare() -> tuple[_StageReport, dict[str, torch.Tensor]]:
        report, mine = _stage_report(engine, rank)
        if rank == 0:
            _fresh_dir(tmp, path)
        return report, mine

    report, mine = agree("save_checkpoint (prepare)", prepare)
    record = agree("save_checkpoint (write)", lambda: _write_rank_file(tmp, rank, mine))
    told: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(told, (record, report if engine.index == 0 else None))

    def publish() -> None:
        files = tuple(f for f, _ in told if f is not None)
        reports = sorted((r for _, r in told if r is not None), key=lambda r: r.stage)
        manifest = _manifest(engine, reports, files)
        _write_bytes(tmp / MANIFEST, (json.dumps(manifest.to_json(), indent=1) + "\n").encode())
        _publish(tmp, path)

    agree("save_checkpoint (publish)", publish if rank == 0 else lambda: None)
    return path


def _stage_report(engine: Engine, rank: int) -> tuple[_StageReport, dict[str, torch.Tensor]]:
    """The entries of every tensor of this rank's stage, and the pieces this rank writes
    (cloned: a view would save its whole storage)."""
    entries: dict[str, TensorEntry] = {}
    mine: dict[str, torch.Tensor] = {}
    mesh = engine.mesh
    for key, (local, shape, layout) in _saved_tensors(engine).items():
        holders = tuple(mesh.device_ids[_owner(layout, mesh, i)] for i in range(mesh.size))
        dtype = dtype_name(local.dtype)
        entries[key] = TensorEntry(shape, dtype, format_nd_sbp(layout), engine.stage, holders)
        if holders[engine.index] == rank:
            mine[key] = local.detach().clone()
    names = parameter_names(engine.optimized)
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
    for name, param in engine.optimized.items():  # a parameter, or its ZeRO-1 shard
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
                    engine.optimized_layouts[name],
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
    recover_checkpoint(path)  # a save killed between its renames: its last good one back first
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
    removed after. A kill at any point leaves a complete checkpoint: at `path`, or whole at
    `<path>.old` between the renames (`recover_checkpoint` puts it back); `<path>.old` is
    removed only while `path` holds a complete one."""
    old = path.with_name(path.name + ".old")
    recover_checkpoint(path)
    if old.exists():  # beside a complete `path` now, or itself incomplete: never the last good one
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
