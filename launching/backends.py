"""The torch.distributed backends a job may use: gloo (CPU) and NCCL (GPU).

Light on purpose (no torch): the CLI lists them in `--help` without loading torch.distributed.
"""

from __future__ import annotations

__all__ = ["BACKENDS"]

BACKENDS = ("gloo", "nccl")
