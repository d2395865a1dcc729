"""The trained model out of autosbp: a state dict under the model's own names, in one file that
plain PyTorch (and Hugging Face's `save_pretrained`) reads.

Lives here: `model_state` (an engine's assembled tensors under the keys of the model's own
`state_dict()`: what `load_state_dict(strict=True)` takes), `checkpoint_state` (the same from a
sharded checkpoint, on one process: `autosbp export`) and `write_model` (a `.safetensors` or
`.pt` file, in the dtype asked, written atomically). Lives elsewhere: assembling an engine's
shards (`Engine.full_state_dict`, a collective), reading a checkpoint's pieces
(`runtime.state.checkpoint_load`).

Invariants:
- The keys are exactly the model's `state_dict()` keys, in its order: the graph's lifted
  constants and non-persistent buffers (rotary tables) are left out, tied names are each
  written (as their own copies: safetensors refuses shared storage), and a state entry the
  graph never read (a buffer forward does not use) keeps the model's own value.
- Floating tensors are cast to the asked dtype (fp32 by default: the masters' precision);
  integer and bool ones (counters, masks) are written as they are.
- Atomic: written beside the target and renamed over it, so a killed job leaves the old file
  or the new one, never half of one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from autosbp.errors import ExecutionError
from autosbp.plan.values import DTYPES

__all__ = ["MODEL_SUFFIXES", "checkpoint_state", "model_state", "write_model"]

MODEL_SUFFIXES = (".safetensors", ".pt")


def model_state(assembled: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """`assembled` (name -> whole tensor, `Engine.full_state_dict`) under the keys of
    `model.state_dict()`, in its order; a key the engine does not hold keeps the model's
    value."""
    own = model.state_dict()
    return {key: assembled.get(key, value).detach() for key, value in own.items()}


def checkpoint_state(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The model of the checkpoint at `path`, whole, under the model's own names: the keys its
    job recorded (`extra["model_keys"]`, its model's `state_dict()`; tied names from
    `extra["tied"]`), or, for a checkpoint saved without them, every parameter and buffer it
    holds (non-persistent buffers included: such a file may need `strict=False`)."""
    from runtime.state.checkpoint_format import read_manifest, recover_checkpoint
    from runtime.state.checkpoint_load import RankFiles, whole_tensor

    recover_checkpoint(path)
    manifest = read_manifest(path)
    files = RankFiles(Path(path), manifest)
    saved = [key.removeprefix("state/") for key in manifest.tensors if key.startswith("state/")]
    tied: dict[str, str] = dict(manifest.extra.get("tied", {}))
    keys = list(manifest.extra.get("model_keys", saved))
    missing = [k for k in keys if k not in saved and tied.get(k) not in saved]
    if missing:
        raise ExecutionError(
            f"checkpoint {path} holds no tensor for {len(missing)} of its model's keys "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); the checkpoint "
            "is damaged or was saved by another job: export it with the job that wrote it."
        )
    return {
        k: whole_tensor(f"state/{tied.get(k, k) if k not in saved else k}", files) for k in keys
    }


def write_model(
    state: Mapping[str, torch.Tensor], path: str | os.PathLike[str], dtype: str
) -> Path:
    """`state` into `path` (.safetensors or .pt), floating tensors in `dtype` (a name of
    `DTYPES`), atomically. Returns the path."""
    target = Path(path)
    check_model_path(target, dtype)
    cast = DTYPES[dtype]
    tensors = {
        key: (t.to(cast) if t.is_floating_point() else t).to("cpu").contiguous().clone()
        for key, t in state.items()
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    try:
        if target.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file(tensors, str(partial), metadata={"format": "pt", "writer": "autosbp"})
        else:
            torch.save(tensors, partial)
        os.replace(partial, target)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise ExecutionError(
            f"writing the model to {target} failed ({exc.strerror or exc}); free space or "
            "choose another --save-model path. The checkpoint, if any, is intact."
        ) from None
    return target


def check_model_path(path: Path, dtype: str) -> None:
    """A path and dtype the model can be written to, refused before any training otherwise."""
    if path.suffix not in MODEL_SUFFIXES:
        raise ExecutionError(
            f"--save-model {path}: the file must end in {' or '.join(MODEL_SUFFIXES)} "
            "(safetensors, or torch.save's format)."
        )
    if dtype not in DTYPES:
        raise ExecutionError(
            f"--save-dtype {dtype!r} is not known; use one of {', '.join(DTYPES)} (fp32 keeps "
            "the masters' precision)."
        )
    if path.is_dir():
        raise ExecutionError(f"--save-model {path} is a folder; give a file path.")
