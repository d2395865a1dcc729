"""Building a model on the meta device when its builder moves it (`.to(device)`, `.cuda()`).

Lives here: `build_on_meta`, the context a model builder runs in for a capture without memory:
`torch.device("meta")` (factories make meta tensors), and a torch-function mode under which a
device move of a meta tensor keeps it on meta: `Tensor.to(device)`, `.to(device, dtype)`,
`.cuda()`, `.cpu()` (and so `Module.to`, `.cuda`, `.cpu`, which call them per tensor) change
the dtype they ask for and nothing else. Lives elsewhere: loading a builder
(`autosbp.zoo.load_model`), capture (`capturing.export`), whose canonical form records every
device as `RUN_DEVICE` (`capturing.builder`).

Why: `model = Net().to(device)` is the most common line in a training script; on meta it
raises "Cannot copy out of meta tensor", and `.cuda()` on a machine without a GPU "Torch not
compiled with CUDA". The move says where the model will run, which the plan decides, not what
it computes: so the graph, and its fingerprint, are those of the same builder without the move.

Invariants: a tensor that is not on meta moves as asked (a builder that loads real weights
stays correct); dtype conversions apply (`.to(torch.bfloat16)` is part of the model).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["build_on_meta"]

_MOVES = (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu)


class _StayOnMeta(TorchFunctionMode):
    """A device move of a meta tensor keeps its dtype conversion and stays on meta."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func not in _MOVES or not args or not _is_meta(args[0]):
            return func(*args, **kwargs)
        tensor = args[0]
        if func is torch.Tensor.to:
            dtype = _dtype_of_to(tensor, args[1:], kwargs)
            return tensor if dtype is None or dtype == tensor.dtype else tensor.to(dtype=dtype)
        return tensor  # .cuda() / .cpu(): a move only


def _is_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "meta"


def _dtype_of_to(tensor: torch.Tensor, rest: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """The dtype `tensor.to(*rest, **kwargs)` asks for (None: keep): torch's own parser reads
    every form (device, dtype, a tensor to match; positional or keyword)."""
    if rest and isinstance(rest[0], torch.Tensor):
        return rest[0].dtype
    if isinstance(kwargs.get("other"), torch.Tensor):
        return kwargs["other"].dtype
    options = {k: v for k, v in kwargs.items() if k in ("device", "dtype", "non_blocking", "copy")}
    options.pop("copy", None)
    _, dtype, _, _ = torch._C._nn._parse_to(*rest, **options)
    return dtype


@contextlib.contextmanager
def build_on_meta() -> Iterator[None]:
    """Run a model builder here: its tensors on meta, its device moves kept there."""
    with torch.device("meta"), _StayOnMeta():
        yield
