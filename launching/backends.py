"""The torch.distributed backends a job may use: gloo (CPU) and NCCL (GPU).

Light on purpose (torch only inside functions): the CLI lists them in `--help` without loading
torch.distributed; `device_and_backend` settles --device and --backend before any rank starts.
"""

from __future__ import annotations

from launching.errors import ExecutionError

__all__ = ["BACKENDS", "device_and_backend"]

BACKENDS = ("gloo", "nccl")


def device_and_backend(device: str | None, backend: str | None) -> tuple[str, str]:
    """--device and --backend with their defaults (see --help); NCCL needs GPUs."""
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if backend == "nccl" and device != "cuda":
        raise ExecutionError(
            "--backend nccl moves GPU tensors only; train with --device cuda, or with --backend "
            "gloo on the CPU."
        )
    if device == "cuda":
        _check_gpus(backend)
        if backend == "gloo":
            raise ExecutionError(
                "--device cuda --backend gloo: the runtime moves a GPU rank's tensors with NCCL "
                "(gloo carries CPU tensors here); use --backend nccl, or --device cpu --backend "
                "gloo."
            )
    return device, backend


def _check_gpus(backend: str) -> None:
    """--device cuda on a machine where torch sees no GPU (or without NCCL) is refused here,
    before any rank starts, rather than by torch in every rank."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        build = "built without CUDA" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise ExecutionError(
            f"--device cuda: torch {torch.__version__} ({build}) sees no GPU on this machine. "
            "Train on the CPU with --device cpu --backend gloo, or run on a machine with GPUs "
            "and a CUDA build of torch."
        )
    if backend == "nccl" and not dist.is_nccl_available():
        raise ExecutionError(
            f"--backend nccl: torch {torch.__version__} was built without NCCL. Use --backend "
            "gloo, or install a CUDA build of torch."
        )
