"""The model zoo: small, deterministic training models that return their own loss.

Lives here: `build_model(name, **kwargs) -> (model, example_inputs)` for the zoo models (`mlp`,
`gpt`, `widedeep`, `resnet`, `moe`), `model_arguments` (a model's `--model-args` and their
defaults, which `autosbp zoo` lists), `load_model` (a zoo name or a user's
`path/to/file.py:function`), `parse_model_args` (the CLI's `--model-args k=v,...`), calling
any user's `path/to/file.py:function` with its errors worded for what it is for
(`call_user_function`, `UserFunction`: models here, data sets in `runtime.data`) and GPT-3
175B's shape and Megatron-LM plan (`gpt3_175b`, `gpt3_megatron`). Lives elsewhere: the dense
models (`zoo.models`), the mixture-of-experts GPT (`zoo.moe`), capturing a model (`capturing`),
planning it (`planner`).

Invariants: `model(*example_inputs)` returns the scalar training loss; the same (name, kwargs,
seed) gives bit-identical weights and inputs, and leaves the global RNG untouched; no dropout, so
training is deterministic; `device="meta"` builds parameters and inputs without memory. Models
are in train mode and use only ops torch.export keeps as they are (linear, layer norm, SDPA, GELU,
embedding, conv2d, batch norm, cross-entropy ...) and, in `moe`, the routing ops of
`autosbp.rules.routing`. The GPT head is untied unless `tied=True`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from autosbp.capturing.on_meta import build_on_meta
from autosbp.errors import AutosbpError, CaptureError
from autosbp.zoo.models import build_gpt, build_mlp, build_resnet, build_widedeep
from autosbp.zoo.moe import MoeMlp, build_moe, expert_capacity

__all__ = [
    "GPT3_175B",
    "ZOO_MODELS",
    "MoeMlp",
    "UserFunction",
    "build_model",
    "call_user_function",
    "expert_capacity",
    "gpt3_175b",
    "gpt3_megatron",
    "is_function_spec",
    "load_model",
    "model_arguments",
    "parse_model_args",
]

ModelAndInputs = tuple[nn.Module, tuple[torch.Tensor, ...]]


# ------------------------------------------------------------------------------------- loading
_BUILDERS: dict[str, Callable[..., tuple[nn.Module, Callable[[], tuple[torch.Tensor, ...]]]]] = {
    "gpt": build_gpt,
    "mlp": build_mlp,
    "moe": build_moe,
    "resnet": build_resnet,
    "widedeep": build_widedeep,
}
ZOO_MODELS: tuple[str, ...] = tuple(sorted(_BUILDERS))


def build_model(
    name: str, *, device: str | torch.device = "cpu", seed: int = 0, **kwargs: Any
) -> ModelAndInputs:
    """A zoo model and its example inputs; weights and inputs depend only on (kwargs, seed).

    Parameters are created under `torch.device(device)` ("meta": no memory); inputs are drawn on
    the CPU from a generator seeded with `seed`, then moved to `device`.
    """
    builder = _BUILDERS.get(name)
    if builder is None:
        raise CaptureError(f"Unknown zoo model {name!r}: choose one of {', '.join(ZOO_MODELS)}.")
    _check_kwargs(name, kwargs)
    generator = torch.Generator().manual_seed(seed)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            with torch.device(device):
                model, make_inputs = builder(generator, **kwargs)
        inputs = tuple(t.to(device) for t in make_inputs())
    except (TypeError, ValueError, RuntimeError) as exc:
        given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise CaptureError(
            f"Zoo model {name!r} cannot be built with {given or 'its defaults'}: "
            f"{type(exc).__name__}: {exc}. Check the values of --model-args: sizes are positive "
            "whole numbers."
        ) from exc
    return model, inputs


# GPT-3 175B as trained by Brown et al. 2020 (table 2.1) and Narayanan et al. 2021 (the
# Megatron-LM scaling runs): global batch 1536 sequences of 2048 tokens.
GPT3_175B: dict[str, int] = {
    "layers": 96, "hidden": 12288, "heads": 96, "seq": 2048, "vocab": 51200, "batch": 1536,
}  # fmt: skip


def gpt3_175b(layers: int = GPT3_175B["layers"]) -> ModelAndInputs:
    """GPT-3 175B (or the same width with fewer `layers`) on the meta device, in bf16."""
    model, inputs = build_model("gpt", device="meta", **{**GPT3_175B, "layers": layers})
    return model.to(torch.bfloat16), inputs


def gpt3_megatron(layers: int = GPT3_175B["layers"], devices: int = 1024) -> tuple[str, int]:
    """The Megatron-LM plan for GPT-3 on `devices` DGX A100 GPUs (Narayanan et al. 2021, table
    1: tensor parallel 8 inside a node, 16 pipeline stages, data parallel for the rest, one
    sequence per micro-batch and data-parallel rank, full recomputation): its strategy string
    and micro-batch count. With fewer `layers`, as many stages (at most 16) as divide them."""
    stages = max(p for p in (1, 2, 4, 8, 16) if layers % p == 0 and devices % (8 * p) == 0)
    dp = devices // (8 * stages)
    count = GPT3_175B["batch"] // dp
    return f"megatron:tp=8,pp={stages},dp={dp},mb={count}", count


def model_arguments(name: str) -> dict[str, Any]:
    """The arguments zoo model `name` accepts (`--model-args`), with their defaults; `device`
    and `seed` are accepted by every model besides."""
    builder = _BUILDERS.get(name)
    if builder is None:
        raise CaptureError(f"Unknown zoo model {name!r}: choose one of {', '.join(ZOO_MODELS)}.")
    params = inspect.signature(builder).parameters.values()
    return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _check_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    accepted = model_arguments(name)
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        options = ", ".join(f"{k}={v!r}" for k, v in accepted.items())
        raise CaptureError(
            f"Zoo model {name!r} has no argument {', '.join(map(repr, unknown))}; "
            f"it accepts {options} (plus device and seed). `autosbp zoo` lists every model."
        )
    for key, value in kwargs.items():
        default = accepted[key]
        whole = isinstance(default, int) and not isinstance(default, bool)
        if whole and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise CaptureError(
                f"Zoo model {name!r} cannot be built with {key}={value!r}: {key} is a size or "
                f"a count, a whole number >= 1 (default {default}). Check the values of "
                "--model-args."
            )


def load_model(
    spec: str, model_args: dict[str, Any] | None = None, *, device: str | None = None
) -> ModelAndInputs:
    """A zoo name or `path/to/file.py:function`, called with `model_args`.

    A file's function must return `(nn.Module, example_inputs)`; with `device` set it runs under
    `torch.device(device)` (so "meta" builds it without parameter memory).
    """
    args = dict(model_args or {})
    if spec in _BUILDERS:
        return build_model(spec, device=device or "cpu", **args)
    if not is_function_spec(spec):
        raise CaptureError(
            f"Unknown model {spec!r}: give a zoo model ({', '.join(ZOO_MODELS)}) or "
            "`path/to/file.py:function` where the function returns (model, example_inputs)."
        )
    result = call_user_function(spec, args, _MODEL_FUNCTION, within=_building_on(device))
    return _check_model_and_inputs(result, spec)


def _building_on(device: str | None) -> contextlib.AbstractContextManager[Any]:
    """Where a builder's tensors are made: `device`, where given; on meta, its own device
    moves (`.to(device)`, `.cuda()`) stay on meta (`capturing.on_meta`)."""
    if device == "meta":
        return build_on_meta()
    return torch.device(device) if device else contextlib.nullcontext()


@dataclass(frozen=True, slots=True)
class UserFunction:
    """What a user's `path/to/file.py:function` is for, in the words its errors use."""

    kind: str  # "model", "data": "Model file x.py has no function ..."
    argument: str  # where the spec came from: "the MODEL argument", "--data"
    returns: str  # what the function must return: "(model, example_inputs)"
    args_flag: str  # the flag of its keyword arguments: "--model-args"
    error: type[AutosbpError]  # the class of every error about it
    hint: str = ""  # appended to "check the path" when the file is missing


_MODEL_FUNCTION = UserFunction(
    "model", "the MODEL argument", "(model, example_inputs)", "--model-args", CaptureError,
    f", or give a zoo model ({', '.join(ZOO_MODELS)})",
)  # fmt: skip


def is_function_spec(spec: str) -> bool:
    """Whether `spec` has the form `path/to/file.py:function`."""
    path_text, sep, func_name = spec.rpartition(":")
    return bool(sep and path_text.endswith(".py") and func_name)


def call_user_function(
    spec: str,
    args: dict[str, Any],
    what: UserFunction,
    within: contextlib.AbstractContextManager[Any] | None = None,
) -> object:
    """Import `path/to/file.py` of `spec` (`is_function_spec`) and call its function with `args`
    (inside `within`, where given: the device a model is built on).

    Every failure (no file, an import that fails, no such function, arguments it does not take,
    a call that raises, exits or calls os._exit) is a `what.error` naming the file and function.
    """
    path_text, _, func_name = spec.rpartition(":")
    func = _load_function(Path(path_text), func_name, what)
    try:
        inspect.signature(func).bind(**args)
    except TypeError as exc:
        raise what.error(
            f"{func_name}{inspect.signature(func)} in {path_text} cannot take {args!r}: {exc}. "
            f"Check {what.args_flag} against the function's parameters."
        ) from exc
    try:
        with _exit_refused(), within or contextlib.nullcontext():
            return func(**args)
    except (Exception, SystemExit) as exc:  # sys.exit in user code: an error, not our exit
        raise what.error(
            f"Calling {func_name}({', '.join(f'{k}={v!r}' for k, v in args.items())}) from "
            f"{path_text} failed with {_failure(exc)}. Fix the function (or "
            f"{what.args_flag}) so that it returns {what.returns}."
        ) from exc


def _load_function(path: Path, func_name: str, what: UserFunction) -> Callable[..., Any]:
    if not path.is_file():
        raise what.error(
            f"{what.kind.capitalize()} file {str(path)!r} (from {what.argument}) does not exist "
            f"(looked for {path.resolve()}); check the path{what.hint}."
        )
    module_name = f"autosbp_user_{what.kind}_{abs(hash(path.resolve()))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        with _exit_refused():
            module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # sys.exit in user code: an error, not our exit
        del sys.modules[module_name]
        raise what.error(
            f"Importing {what.kind} file {str(path)!r} failed with {_failure(exc)}. "
            f"Fix the file so that `python {path}` runs."
        ) from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        found = sorted(
            n
            for n, v in vars(module).items()
            if inspect.isfunction(v) and v.__module__ == module_name
        )
        raise what.error(
            f"{what.kind.capitalize()} file {str(path)!r} has no function {func_name!r}; its "
            f"functions are: {', '.join(found) or 'none'}. Name one that returns {what.returns}."
        )
    return func


class _ExitCalledError(Exception):
    """User code called os._exit while a model was being built (it would end autosbp unseen:
    exit code 0 and no summary)."""


@contextlib.contextmanager
def _exit_refused() -> Iterator[None]:
    """While user code runs, os._exit raises `_ExitCalledError` instead of ending the process."""
    real = os._exit

    def refuse(status: int) -> NoReturn:
        raise _ExitCalledError(f"os._exit({status}), which would end the process unseen")

    os._exit = refuse
    try:
        yield
    finally:
        os._exit = real


def _failure(exc: BaseException) -> str:
    if isinstance(exc, _ExitCalledError):
        return f"a call of {exc}"
    return f"{type(exc).__name__}: {exc}"


def _check_model_and_inputs(result: object, spec: str) -> ModelAndInputs:
    if isinstance(result, tuple) and len(result) == 2:
        model, inputs = result
        tensors = isinstance(inputs, Sequence) and all(isinstance(t, torch.Tensor) for t in inputs)
        if isinstance(model, nn.Module) and tensors:
            return model, tuple(inputs)
    raise CaptureError(
        f"{spec} returned {_describe(result)}; it must return a pair (model, example_inputs): "
        "an nn.Module whose forward returns the training loss, and a tuple of tensors."
    )


def _describe(value: object) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    name = type(value).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def parse_model_args(
    text: str | None, flag: str = "--model-args", error: type[AutosbpError] = CaptureError
) -> dict[str, Any]:
    """`"layers=2,hidden=64,tied=true,name=x"` -> {"layers": 2, ...}: int, float, bool or str.
    `flag` (and `error`) for other functions' arguments: `--data-args`."""
    if not text:
        return {}
    out: dict[str, Any] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key.isidentifier() or not value:
            raise error(
                f"Bad {flag} item {item.strip()!r} in {text!r}: write key=value pairs "
                f"separated by commas, e.g. {flag} layers=4,hidden=256,tied=true."
            )
        if key in out:
            raise error(f"{flag} gives {key!r} twice in {text!r}; give it once.")
        out[key] = _parse_value(value)
    return out


def _parse_value(text: str) -> int | float | bool | str:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text
