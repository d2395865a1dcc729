"""A user's data: loaded from `path/to/file.py:function` or a built-in name, told apart (samples
or whole batches), and checked against the model's inputs.

Lives here: `load_data` (the CLI's `--data FILE.py:FUNCTION --data-args k=v,...`, or a built-in
data set: `BUILT_IN`), `as_data` (any object -> `SampleData` | `BatchData`, or refused), the size
of a data set (`sample_count`) and the checks of one item or one batch (`read_item`,
`check_item`, `check_batch`), each refusal a `DataError` that names the user's function and says
how to fix it. Lives elsewhere: calling a user's function (`autosbp.zoo.call_user_function`, one
loader for models and data), the batches' order (`runtime.data.sampler`), reading a rank's rows
(`runtime.data.loader`), the built-in data sets (`runtime.data.tokens`).

Invariants:
- A data function returns either a map-style data set (`len` and `[i]`, not an
  IterableDataset) whose items are tuples of per-sample tensors, one per model input in
  forward's order; or an iterable of whole global batches (tuples of tensors whose dim 0 is the
  global batch). Every rank calls it, so it must be deterministic: the same arguments give the
  same samples in the same order on every rank and after a restart.
- An item (a batch) fits the model when it holds one tensor per input, each of the example
  input's per-sample shape (batch shape), of its dtype; floating data of any floating dtype
  fits a floating input (the loader casts it to the plan's dtype), any other dtype must match.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset

from autosbp.errors import DataError
from autosbp.zoo import UserFunction, call_user_function, is_function_spec
from runtime.data.layout import InputSpec
from runtime.data.tokens import stdlib_text, token_file

__all__ = [
    "BUILT_IN",
    "BatchData",
    "Data",
    "SampleData",
    "as_data",
    "check_batch",
    "check_item",
    "load_data",
    "read_item",
    "sample_count",
]

RETURNS = (
    "a map-style Dataset (len and [i]) whose items are tuples of per-sample tensors, one per "
    "model input in forward's order, or an iterable of whole global batches (tuples of tensors), "
    "the same on every rank (every rank calls it: it must be deterministic)"
)
# Data sets every Python has, by name (as zoo names stand beside model files).
BUILT_IN: dict[str, Callable[..., Any]] = {"stdlib_text": stdlib_text, "token_file": token_file}


@dataclass(frozen=True, slots=True)
class SampleData:
    """A map-style data set: `len(samples)` samples, `samples[i]` a tuple of tensors."""

    samples: Any
    origin: str  # what errors name: "data.py:train (--data)"


@dataclass(frozen=True, slots=True)
class BatchData:
    """An iterable of whole global batches (each pass a fresh `iter`)."""

    batches: Iterable[Any]
    origin: str


Data = SampleData | BatchData


def load_data(
    spec: str, args: dict[str, Any] | None = None, *, flag: str = "--data", args_flag: str = ""
) -> Data:
    """The data of `spec`: a built-in name (`BUILT_IN`) or `path/to/file.py:function`, called
    with `args` (from `args_flag`, by default `flag` + "-args")."""
    args, args_flag = dict(args or {}), args_flag or f"{flag}-args"
    origin = f"{spec} ({flag})"
    if spec in BUILT_IN:
        return as_data(_call_built_in(spec, args, args_flag), origin)
    if not is_function_spec(spec):
        raise DataError(
            f"Unknown data set {spec!r} ({flag}): give a built-in one "
            f"({', '.join(sorted(BUILT_IN))}) or `path/to/file.py:function` where the function "
            f"returns {RETURNS}."
        )
    what = UserFunction("data", flag, RETURNS, args_flag, DataError)
    return as_data(call_user_function(spec, args, what), origin)


def as_data(value: object, origin: str = "the data set") -> Data:
    """`value` as samples or batches: what has `len` and `[i]` (a Dataset, a list of tuples) is
    samples; an IterableDataset, a generator or any other iterable is batches (wrap a list of
    whole batches in `BatchData`); anything else is refused."""
    if isinstance(value, SampleData | BatchData):
        return value
    if not isinstance(value, str | bytes | Mapping):
        indexed = hasattr(value, "__len__") and hasattr(value, "__getitem__")
        if indexed and not isinstance(value, IterableDataset):
            return SampleData(value, origin)
        if isinstance(value, Iterable):
            return BatchData(value, origin)
    raise DataError(f"{origin} returned {_describe(value)}; it must return {RETURNS}.")


def sample_count(data: SampleData, global_batch: int) -> int:
    """The data set's size, at least one global batch."""
    try:
        size = len(data.samples)
    except Exception as exc:
        raise DataError(
            f"len() of {data.origin} failed with {type(exc).__name__}: {exc}. A map-style data "
            "set needs __len__; else return an iterable of whole global batches."
        ) from exc
    if size < global_batch:
        raise DataError(
            f"{data.origin} has {size} samples, fewer than one global batch of {global_batch}: "
            "every step takes a whole batch (an epoch's last partial batch is dropped). Give "
            "more samples, or plan with a smaller global batch (--global-batch)."
        )
    return size


def read_item(
    data: SampleData, index: int, inputs: tuple[InputSpec, ...]
) -> tuple[torch.Tensor, ...]:
    """Item `index` of the data set, checked (`check_item`)."""
    try:
        item = data.samples[index]
    except Exception as exc:
        raise DataError(
            f"Reading item {index} of {data.origin} failed with {type(exc).__name__}: {exc}. "
            "Fix the data set so that [i] works for every i in 0..len-1."
        ) from exc
    return check_item(item, inputs, f"item {index} of {data.origin}")


def check_item(item: object, inputs: tuple[InputSpec, ...], where: str) -> tuple[torch.Tensor, ...]:
    """`item` as a tuple of tensors, one per input of its per-sample shape and dtype."""
    return _check_tensors(item, inputs, (), where)


def check_batch(
    batch: object, inputs: tuple[InputSpec, ...], global_batch: int, where: str
) -> tuple[torch.Tensor, ...]:
    """`batch` as a tuple of tensors, one per input, each `global_batch` samples."""
    return _check_tensors(batch, inputs, (global_batch,), where)


def _check_tensors(
    value: object, inputs: tuple[InputSpec, ...], lead: tuple[int, ...], where: str
) -> tuple[torch.Tensor, ...]:
    names = ", ".join(spec.describe(i) for i, spec in enumerate(inputs))
    what = "whole global batch" if lead else "item"
    if not isinstance(value, tuple | list) or not all(isinstance(t, torch.Tensor) for t in value):
        hint = (
            " (a dict: return its tensors as a tuple in forward's order, e.g. "
            "(item['input_ids'], item['labels']))"
            if isinstance(value, Mapping)
            else ""
        )
        raise DataError(
            f"{where} is {_describe(value)}{hint}; each {what} must be a tuple of "
            f"{len(inputs)} tensors, one per model input in forward's order ({names})."
        )
    if len(value) != len(inputs):
        raise DataError(
            f"{where} holds {len(value)} tensors but the model takes {len(inputs)} inputs "
            f"({names}); return one tensor per model input, in forward's order."
        )
    for position, (tensor, spec) in enumerate(zip(value, inputs, strict=True)):
        _check_tensor(tensor, spec, lead, f"{where}: {spec.describe(position)}")
    return tuple(value)


def _check_tensor(tensor: torch.Tensor, spec: InputSpec, lead: tuple[int, ...], where: str) -> None:
    want = (*lead, *spec.sample_shape)
    if tuple(tensor.shape) != want:
        batch = "whole batches" if lead else "samples, the example input's shape without dim 0"
        hint = (
            "; if each item is a whole batch, return them from an IterableDataset or a generator "
            "(whatever has len and [i], a list too, is read as samples)"
            if not lead and tensor.dim() == len(want) + 1
            else ""
        )
        raise DataError(
            f"{where} has shape {list(tensor.shape)} but the model takes {list(want)} ({batch})"
            f"{hint}. Make the data match the example inputs the plan was made with, or make "
            "the plan with example inputs of the data's shapes."
        )
    fits = (
        spec.dtype.is_floating_point if tensor.is_floating_point() else tensor.dtype == spec.dtype
    )
    if not fits:
        raise DataError(
            f"{where} is {tensor.dtype} but the model's example input is {spec.dtype} (floating "
            "data is cast to the plan's floating dtype; other dtypes must match). Convert it in "
            f"the data set (e.g. `.to({spec.dtype})`), or give example inputs of its dtype."
        )


def _call_built_in(name: str, args: dict[str, Any], args_flag: str) -> object:
    func = BUILT_IN[name]
    try:
        inspect.signature(func).bind(**args)
    except TypeError as exc:
        raise DataError(
            f"Built-in data set {name}{inspect.signature(func)} cannot take {args!r}: {exc}. "
            f"Check {args_flag} against its parameters."
        ) from exc
    return func(**args)


def _describe(value: object) -> str:
    if isinstance(value, tuple | list):
        kinds = ", ".join(type(v).__name__ for v in value)
        return f"a {type(value).__name__} of {len(value)} ({kinds})"
    name = type(value).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"
