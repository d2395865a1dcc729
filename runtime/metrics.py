"""What a training job reports per step: loss, learning rate, gradient norm, throughput, MFU,
memory, data loading; and where it writes them (a JSONL file, TensorBoard).

Lives here: `StepRow` and `EvalRow` (one row each, as the table, the metrics file and
TensorBoard show them), `Throughput` (a step's samples, tokens and model FLOPs, read off the
plan's graph once), `peak_memory_bytes` (what this rank held at most) and `MetricsSink` (the
JSONL file and TensorBoard writer, on rank 0). Lives elsewhere: the job that measures and
gathers them (`runtime.jobs`), the live table (`autosbp.commands.train`).

Definitions (torchtitan's components/metrics.py; PaLM, Chowdhery et al. 2022, appendix B):
- A step's time is its slowest rank's (`runtime.jobs`); samples/s and tokens/s are the global
  batch's over it. Tokens are the elements of the first integer input of two or more
  dimensions (token ids, batch x sequence); a model without one reports none.
- MFU (model FLOPs utilization): the model's FLOPs of one step, forward and backward (3 x the
  forward FLOPs capture counted, per micro-batch, times the micro-batches: recomputation not
  counted, so MFU does not reward it), over the step's time x the devices x the profile's
  peak rate for the plan's dtype. On a CPU profile the "peak" is the matmul rate the profiler
  measured, so CPU MFU reads as a share of that.
- Peak memory: on CUDA the allocator's peak since the last step (`max_memory_allocated`); on
  the CPU, where torch keeps no allocator statistics, the process's largest resident set so far
  (`ru_maxrss`: everything the process holds, Python and torch included; it never falls).
- Data share: the seconds this rank spent loading its pieces over the step's time (the rank
  that loaded longest).
"""

from __future__ import annotations

import json
import resource
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from autosbp.capturing.graph import OpGraph, Role
from autosbp.errors import ExecutionError

__all__ = ["EvalRow", "MetricsSink", "StepRow", "Throughput", "peak_memory_bytes"]


@dataclass(frozen=True, slots=True)
class StepRow:
    """One trained step, as rank 0 reports it."""

    step: int  # 1-based, as the table counts
    loss: float
    lr: float
    grad_norm: float  # before clipping
    step_s: float
    samples_per_s: float
    tokens_per_s: float | None
    mfu: float | None  # None where the profile states no peak for the dtype
    peak_memory_bytes: int  # the largest over the ranks
    data_share: float  # of the step, loading data (the slowest loader)
    skipped: bool = False  # no update: a non-finite step skipped, or fp16's scale lowered

    def to_json(self) -> dict[str, Any]:
        return {"kind": "train", **asdict(self)}


@dataclass(frozen=True, slots=True)
class EvalRow:
    """One evaluation: the mean loss over the evaluation batches, after `step` steps."""

    step: int
    eval_loss: float
    batches: int
    eval_s: float

    def to_json(self) -> dict[str, Any]:
        return {"kind": "eval", **asdict(self)}


@dataclass(frozen=True, slots=True)
class Throughput:
    """What one step processes: samples, tokens (None: no token ids) and model FLOPs."""

    samples: int
    tokens: int | None
    model_flops: float

    @classmethod
    def of(cls, graph: OpGraph, micro_batches: int, global_batch: int) -> Throughput:
        """Off the graph of one micro-batch (the plan's)."""
        forward = sum(a.flops for _, a in graph.nodes(Role.COMPUTE))
        tokens = None
        for _, attrs in graph.nodes(Role.INPUT):
            meta = attrs.outputs[0]
            if not meta.dtype.is_floating_point and len(meta.shape) >= 2:
                per_micro = 1
                for n in meta.shape:
                    per_micro *= n
                tokens = per_micro * micro_batches
                break
        return cls(global_batch, tokens, 3.0 * forward * micro_batches)

    def row(
        self,
        *,
        step: int,
        loss: float,
        lr: float,
        grad_norm: float,
        step_s: float,
        load_s: float,
        peak_bytes: int,
        peak_flops: float | None,
        devices: int,
        skipped: bool,
    ) -> StepRow:
        """A step's row from its measurements."""
        per_s = 1.0 / step_s if step_s > 0 else 0.0
        mfu = self.model_flops * per_s / (devices * peak_flops) if peak_flops else None
        return StepRow(
            step, loss, lr, grad_norm, step_s, self.samples * per_s,
            None if self.tokens is None else self.tokens * per_s, mfu, peak_bytes,
            load_s * per_s, skipped,
        )  # fmt: skip


def peak_memory_bytes(device: torch.device) -> int:
    """This rank's peak: the CUDA allocator's since the last call (then reset), or the
    process's largest resident set (see the header)."""
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)  # Linux: KiB


class MetricsSink:
    """Rows to a JSONL file (one object per line, flushed per row: a killed job keeps what it
    reported) and to TensorBoard, where asked. Rank 0 only."""

    def __init__(self, path: Path | None, tensorboard: Path | None, *, append: bool) -> None:
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a" if append else "w", encoding="utf-8")
        self._board = None
        if tensorboard is not None:
            self._board = _summary_writer(tensorboard)

    def write(self, row: StepRow | EvalRow) -> None:
        if self._file is not None:
            self._file.write(json.dumps(row.to_json()) + "\n")
            self._file.flush()
        if self._board is not None:
            for key, value in row.to_json().items():
                if isinstance(value, (int, float)) and key != "step" and value is not None:
                    prefix = "eval" if isinstance(row, EvalRow) else "train"
                    self._board.add_scalar(f"{prefix}/{key}", value, row.step)
            self._board.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._board is not None:
            self._board.close()


def _summary_writer(directory: Path) -> Any:
    """TensorBoard's writer, or an error that says how to install it."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ExecutionError(
            f"--tensorboard needs the tensorboard package ({exc}); install it with "
            "`pip install 'autosbp[tensorboard]'` (or `pip install tensorboard`), or use "
            "--metrics FILE.jsonl."
        ) from None
    return SummaryWriter(log_dir=str(directory))
