"""What a training job is: `TrainSpec`, plain data every rank rebuilds its job from.

Lives here: the spec (the model, the plan, the data, the optimizer and its schedule,
clipping, evaluation, checkpoints, metrics, the model out, backend and device). Lives
elsewhere: launching it and its results (`runtime.jobs`, which re-exports it), one rank's loop
(`runtime.trainer`), the defaults the CLI states (`runtime.defaults`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runtime.defaults import CHECKPOINT_EVERY, EVAL_BATCHES, STALL_TIMEOUT_S

__all__ = ["TrainSpec"]


@dataclass(frozen=True)
class TrainSpec:
    model: str
    model_args: dict[str, Any]
    plan: dict[str, Any]  # Plan.to_json(): plain data crosses process boundaries
    steps: int
    lr: float = 1e-2  # the peak learning rate (`runtime.optim.LrSchedule`)
    check: bool = False
    stall_timeout_s: float = STALL_TIMEOUT_S  # no progress this long on a rank ends the job
    trace: bool = False  # record every span of every rank (TrainResult.events)
    checkpoint_dir: str | None = None  # save the state here (runtime.state.checkpoint)
    checkpoint_every: int = CHECKPOINT_EVERY  # steps between saves; and after the last step
    resume: bool = False  # continue from the checkpoint in checkpoint_dir, if there is one
    backend: str = "gloo"  # or "nccl" (launching.torchrun.process_group_backend)
    device: str = "cpu"  # or "cuda": each rank takes the GPU of its local rank
    skip_non_finite: bool = False  # a nan/inf loss or gradient skips the update, not the job
    # The data (runtime.data): FILE.py:FUNCTION or a built-in data set, and its arguments; None:
    # the model's example inputs at every step
    data: str | None = None
    data_args: dict[str, Any] = field(default_factory=dict)
    seed: int = 0  # the data's shuffling
    eval_data: str | None = None
    eval_args: dict[str, Any] = field(default_factory=dict)
    eval_every: int = 0  # steps between evaluations (0: after the last step only)
    eval_batches: int | None = EVAL_BATCHES  # batches per evaluation (None: the whole set)
    # The optimizer (the plan's kind) and its schedule (`runtime.optim`), clipping
    weight_decay: float = 0.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    clip_grad_norm: float | None = None
    profile: str | None = None  # the profile the plan was made on (MFU's peak), when known
    save_model: str | None = None  # the trained model's state dict (.safetensors or .pt)
    save_dtype: str = "fp32"
    metrics: str | None = None  # rows of every step and evaluation, as JSON lines (rank 0)
    tensorboard: str | None = None  # the same as TensorBoard scalars (rank 0)
