"""Checkpoints of an Engine: sharded state saved under one plan, loaded under any other.

Lives here: the format and the invariants that saving and loading keep, and `save_checkpoint`
(a collective: every rank of the world calls it). Lives elsewhere: `load_checkpoint`
(`runtime.state.checkpoint_load`, re-exported here), the manifest's values and JSON
(`runtime.state.checkpoint_format`, re-exported here), one job per checkpoint folder
(`runtime.state.checkpoint_lock`), cutting and assembling pieces by an nd-SBP
(`autosbp.layout`), the state being saved (`runtime.state.shards`, through the Engine), the
agreement on failures (`runtime.state.startup.agree`).

Format (`autosbp.checkpoint`, version 3): a directory with one `rank{r:05d}.pt` per rank that
holds a piece (a flat dict key -> tensor, written by `torch.save`, read with `weights_only=True`;
a rank whose pieces are all B copies of another's writes none) and `manifest.json`: the model's
graph fingerprint (of one micro-batch), the plan's mesh shape, pipeline stages (each virtual
stage's global ranks: interleaved, every chunk of the plan is a stage of its own) and
micro-batching, the training steps done (`training.step`, given by the caller: never read off
an optimizer's state, which skipped steps and optimizers without a step count would get wrong)
and the job's own state (`training.extra`: any JSON object the caller passes, such as a
learning-rate schedule's or a data sampler's position and random seeds; {} where none), the
optimizer's kind and hyperparameters (one set per parameter group, listing the parameters of
every stage), the files' sizes and sha256, and per tensor its global shape, dtype, nd-SBP,
owning (virtual) stage and which rank file holds the piece of each device of that stage's mesh.
Keys: `state/<name>` for parameters and buffers, `optim/<name>/<field>` for the optimizer's
per-parameter state (Adam's `exp_avg`, `exp_avg_sq`, `step`; SGD's `momentum_buffer`; any
torch optimizer's fields). Version 2 checkpoints (no `training`) still load
(`runtime.state.checkpoint_format`).

Invariants:
- A tensor is saved by the stage that owns it (`Engine.owner`: interleaved, a rank's chunks
  are its stage's) and loaded by the stage that owns it under the new plan, whatever the two
  plans' stage counts, chunks, meshes and world sizes; a rank reads only the rank files that
  hold pieces of its own stage's tensors.
- Only ranks at coordinate 0 of every B mesh dim of a tensor (in its stage's mesh) write its
  piece: B copies are saved once. A tensor's pieces are enough to rebuild it
  (`assemble_tensor`); state is never P.
- Optimizer state is saved in the layout of the tensor the optimizer steps (the parameter's
  piece, or its ZeRO-1/2 shard: `Engine.optimized_layouts`) and loaded into the layout of the
  one it steps under the new plan: state that has that tensor's local shape follows its
  layout, a 0-dim tensor (Adam's step) is replicated on the parameter's stage. So any torch
  optimizer whose state is elementwise (Adam, AdamW, SGD with or without momentum, Adagrad,
  RMSprop ...) converts exactly between any two plans; state of another shape (Adafactor's
  row and column factors) or not a tensor is refused, naming it.
- The ZeRO shards the optimizer steps (fp32 copies of the weight's pieces) are cut again from
  the loaded weights: a shard is not saved (it equals its weight's piece), and a load that
  left it stale would undo the load at the next step's gather.
- Same model: when both plans run micro-batches of the same size, the graph fingerprints must be
  equal; otherwise (their graphs differ in batch size) every parameter and buffer must match by
  name, shape and dtype. Either way the state's names, shapes and dtypes are checked.
- Atomic: ranks write into `<path>.tmp`, rank 0 writes the manifest last and renames the
  directory to `<path>`. A directory without a manifest is never taken for a checkpoint. An
  existing checkpoint at `<path>` is replaced only after the new one is complete: moved to
  `<path>.old`, the new one renamed in, then the old removed. A kill between the renames leaves
  the last complete one at `<path>.old`; resuming and saving put it back first
  (`recover_checkpoint`), and `<path>.old` is never removed while `<path>` is incomplete. A save
  that fails (a full disk) removes its `<path>.tmp` and leaves the last complete checkpoint
  where it was.
- Saving and loading run each fallible part on every rank and then agree (`agree`): a failure
  on one rank makes every rank raise, naming it (never a hang). Loading changes nothing until
  every tensor of this rank has been read and checked, and every rank has. Every rank passes
  the same `step` and `extra` (checked).
- Loading restores the optimizer's hyperparameters (lr, betas ...) from the checkpoint, as
  `torch.optim.Optimizer.load_state_dict` does.

Scope: ranks must see one shared filesystem; how much a rank reads when loading is
`runtime.state.checkpoint_load`'s.
Reference: docs/architecture.md ("The rooms in detail"); torch.distributed.checkpoint (per-rank
files + a metadata file).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
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
    json_extra,
    merge_stage_groups,
    parameter_names,
    read_manifest,
    recover_checkpoint,
)
from runtime.state.checkpoint_load import load_checkpoint
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
    """What a pipeline stage tells rank 0 for the manifest (its first rank speaks for it; the
    others would say the same): its tensors' entries (of every chunk it runs) and its
    optimizer's groups."""

    stage: int
    tensors: dict[str, TensorEntry]
    param_groups: tuple[dict[str, Any], ...]


def save_checkpoint(
    engine: Engine,
    path: str | os.PathLike[str],
    *,
    step: int,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Save `engine`'s parameters, buffers and optimizer state at `path` (a directory), with
    `step` (the training steps done: what `Manifest.step` gives back) and `extra` (the job's
    own state, a JSON-able dict: `Manifest.extra` gives it back). A collective: every rank
    calls it, with the same `step` and `extra`; it returns once the checkpoint is complete on
    disk. A failed save (a full disk) raises on every rank, removes what it wrote, and leaves
    the last complete checkpoint at `path`."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    rank = dist.get_rank()

    def prepare() -> tuple[_StageReport, dict[str, torch.Tensor], str]:
        told = json.dumps([_count_of(step), json_extra(extra)], sort_keys=True)
        report, mine = _stage_report(engine, rank)
        if rank == 0:
            _fresh_dir(tmp, path)
        return report, mine, told

    try:
        report, mine, told = agree("save_checkpoint (prepare)", prepare)
        record = agree("save_checkpoint (write)", lambda: _write_rank_file(tmp, path, rank, mine))
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (record, report if engine.index == 0 else None, told))

        def publish() -> None:
            files = tuple(f for f, _, _ in gathered if f is not None)
            reports = sorted((r for _, r, _ in gathered if r is not None), key=lambda r: r.stage)
            manifest = _manifest(engine, reports, files, _one_job_state(gathered))
            text = json.dumps(manifest.to_json(), indent=1) + "\n"
            _write_bytes(tmp / MANIFEST, text.encode(), tmp, path)
            _publish(tmp, path)

        agree("save_checkpoint (publish)", publish if rank == 0 else lambda: None)
    except Exception:
        if rank == 0:  # every rank has stopped writing (each failure was agreed on)
            _discard(tmp, path)
        raise
    return path


def _count_of(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ExecutionError(
            f"save_checkpoint: step={step!r} is not a whole number >= 0; pass the number of "
            "training steps done (what a resumed job starts from)."
        )
    return step


def _one_job_state(gathered: Sequence[Any]) -> tuple[int, dict[str, Any]]:
    """The `step` and `extra` every rank passed (ExecutionError naming a rank that differs)."""
    mine = gathered[0][2]
    for rank, (_, _, theirs) in enumerate(gathered):
        if theirs != mine:
            raise ExecutionError(
                f"save_checkpoint: rank {rank} passed step and extra {theirs[:200]}, rank 0 "
                f"{mine[:200]}; a checkpoint holds one job state. Pass the same on every rank "
                "(state that differs per rank as a list indexed by rank)."
            )
    step, extra = json.loads(mine)
    return step, extra


def _stage_report(engine: Engine, rank: int) -> tuple[_StageReport, dict[str, torch.Tensor]]:
    """The entries of every tensor of this rank's stage (every chunk of it), and the pieces this
    rank writes (cloned: a view would save its whole storage)."""
    plan, mesh = engine.plan, engine.mesh
    assert all(plan.stages[c].devices == mesh.device_ids for c in engine.chunks), (
        "a rank's chunks run on its stage's devices"
    )
    entries: dict[str, TensorEntry] = {}
    mine: dict[str, torch.Tensor] = {}
    for key, (name, local, shape, layout) in _saved_tensors(engine).items():
        holders = tuple(mesh.device_ids[_owner(layout, mesh, i)] for i in range(mesh.size))
        dtype = dtype_name(local.dtype)
        entries[key] = TensorEntry(shape, dtype, format_nd_sbp(layout), engine.owner[name], holders)
        if holders[engine.index] == rank:
            mine[key] = local.detach().clone()
    names = parameter_names(engine.optimized)
    groups = tuple(group_json(g, names) for g in engine.optimizer.param_groups)
    return _StageReport(engine.stage, entries, groups), mine


def _saved_tensors(
    engine: Engine,
) -> dict[str, tuple[str, torch.Tensor, tuple[int, ...], NdSbp]]:
    """key -> (its parameter's or buffer's name, local tensor, global shape, layout) for the
    state and the optimizer's tensors of this rank's stage."""
    out = {  # a master held as its ZeRO shard is saved from the shard
        f"state/{name}": (name, local, tuple(engine.shapes[name]), layout)
        for name, (local, layout) in engine.held_state.items()
    }
    replicated = (B,) * engine.mesh.ndim
    kind = type(engine.optimizer).__name__
    for name, param in engine.optimized.items():  # a parameter, or its ZeRO-1/2 shard
        for field, value in engine.optimizer.state.get(param, {}).items():
            key = f"optim/{name}/{field}"
            if not isinstance(value, torch.Tensor):
                raise ExecutionError(
                    f"save_checkpoint: {kind}'s state {field!r} of parameter {name!r} is a "
                    f"{type(value).__name__}, not a tensor; checkpoints hold the optimizer's "
                    "tensor state. Use an optimizer whose per-parameter state is tensors (Adam, "
                    "AdamW, SGD, Adagrad, RMSprop ...)."
                )
            if value.shape == param.shape:
                layout = engine.optimized_layouts[name]
                out[key] = (name, value, tuple(engine.shapes[name]), layout)
            elif value.dim() == 0:
                out[key] = (name, value, (), replicated)
            else:
                raise ExecutionError(
                    f"save_checkpoint: {kind}'s state {field!r} of parameter {name!r} has shape "
                    f"{tuple(value.shape)}, neither the stepped shard's {tuple(param.shape)} nor "
                    f"a scalar: {kind} is not elementwise, so its state cannot follow the "
                    "parameter's SBP (and its update on a shard is not the whole tensor's). Use "
                    "an elementwise optimizer (Adam, AdamW, SGD, Adagrad, RMSprop ...)."
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
    with _disk_errors(f"making {tmp}", tmp, path):
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a save that crashed: never published, safe to drop
        tmp.mkdir(parents=True)


def _write_rank_file(
    tmp: Path, path: Path, rank: int, tensors: dict[str, torch.Tensor]
) -> RankFile | None:
    """This rank's file, or none where it holds no piece (every tensor B where it sits)."""
    if not tensors:
        return None
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    data = buffer.getvalue()
    name = f"rank{rank:05d}.pt"
    _write_bytes(tmp / name, data, tmp, path)
    return RankFile(rank, name, len(data), hashlib.sha256(data).hexdigest())


def _write_bytes(file: Path, data: bytes, tmp: Path, path: Path) -> None:
    """`data` into `file`, synced to disk."""
    what = f"writing {file.name} ({len(data)} bytes) into {tmp}"
    with _disk_errors(what, tmp, path), open(file, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


@contextlib.contextmanager
def _disk_errors(what: str, tmp: Path, path: Path) -> Iterator[None]:
    """An OSError (a full disk, a quota, a read-only folder) as an ExecutionError that says
    what is kept and what to do (`save_checkpoint` then removes `tmp`)."""
    try:
        yield
    except OSError as exc:
        raise ExecutionError(
            f"save_checkpoint: {what} failed: {exc.strerror or exc}. This checkpoint was not "
            f"saved: {tmp.name} is removed and the last complete checkpoint at {path} (if any) "
            "is kept as it was. Free space on that filesystem (or raise its quota), or save to "
            "another folder; then resume."
        ) from None


def _discard(tmp: Path, path: Path) -> None:
    """After a failed save: its `tmp` removed, and the last complete checkpoint back at `path`
    where the failure came between the renames of `_publish`."""
    shutil.rmtree(tmp, ignore_errors=True)
    recover_checkpoint(path)


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
    engine: Engine,
    reports: Sequence[_StageReport],
    files: tuple[RankFile, ...],
    job: tuple[int, dict[str, Any]],
) -> Manifest:
    plan = engine.plan
    assert [r.stage for r in reports] == list(range(plan.pipeline_stages)), "one per stage"
    step, extra = job
    return Manifest(
        model_name=engine.graph.model_name,
        fingerprint=engine.graph.fingerprint(),
        strategy=plan.strategy,
        mesh_shape=engine.mesh.shape,
        stages=tuple(tuple(stage.devices) for stage in plan.stages),
        micro_batches=plan.micro_batches,
        global_batch=plan.global_batch,
        optimizer_kind=type(engine.optimizer).__name__,
        param_groups=merge_stage_groups([r.param_groups for r in reports]),
        files=files,
        tensors={key: entry for r in reports for key, entry in r.tensors.items()},
        step=step,
        extra=extra,
        virtual_stages=plan.virtual_stages,
        loss_scale=engine.loss_scale.state() if engine.loss_scale is not None else None,
    )
