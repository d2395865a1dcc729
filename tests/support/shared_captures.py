"""One capture per model for all of a test session's processes: the parent that plans and the
ranks that train share it.

Lives here: `shared_captures`, a context manager (and `shares_captures`, the decorator of a
rank's worker that runs it inside one) under which `autosbp.capturing.export.capture`
(what `capture_micro_batch`, the planner and the Engine capture with) returns a copy of the
graph captured first for the same key, and `capture_key`, that key. Lives elsewhere: capture
itself (`autosbp.capturing.export`); who shares: the pytest process for the modules of
tests/models, planner and runtime (tests/conftest.py) and the runtime tests' ranks (the
workers of tests/support/*_workers.py, `shares_captures`).

Why: capturing (torch.export) was about half of a checked world's rank time: every rank of a
world captured every case's model, and the parent captured it again for each plan. Under
`shared_captures` a graph is captured once per session (per pytest process: the folder is
that process's `AUTOSBP_CACHE_DIR`, which its ranks inherit) and read back by the others.

The key (`capture_key`) is everything capture reads, hashed: the model pickled by value
(every module's attributes and flags: config, `training`, dropout's p, hooks; every parameter
and buffer by type, shape, stride, dtype, device, `requires_grad` and values; every class and
function by its module's file (or name), qualified name and that file's bytes), the example
inputs alike, the name, the capture dtype (`capture`'s, or the `capturing_in` around it),
torch's default dtype, grad mode and version, and autosbp's own code (the bytes of every file
of the package: a folder left by a session that died keeps graphs of the code it ran). A model that does not pickle so (a lambda, a
local class, a module without a file of its own, the object not found under its name) has no
key and is captured as usual, as is every capture outside `shared_captures`.

Invariants:
- Every call returns its own object, unpickled from the stored bytes (the first caller's too),
  so no two callers share a mutable graph. What the copy lacks is `OpGraph.program` (the
  ExportedProgram; nothing in autosbp or runtime reads it: `capturing.rebatch`'s header).
- A capture that raises stores nothing: the error comes back to every caller from its own
  capture.
- Processes wait for one another on a lock per key (`fcntl.flock`, released by the OS when a
  process dies), so the ranks of a world capture a new key once, not once each.
- What the key cannot see is code the model reaches outside its own classes' files (a helper
  imported from another module) and state its forward reads from outside the model
  (environment, rank): the tests' models read neither; a model that did would get one graph
  for all its captures in a session.
- The ranks of a sharing world run one graph, so their agreement on it
  (`runtime.state.startup.agree_on_graph`) holds by construction there. That capture gives one
  graph whatever the process (its hash seed) is proven where nothing is shared:
  tests/capturing/test_interchangeable.py (subprocesses under several seeds), the real-model
  training world of tests/models (set-ordered models on 2 ranks) and test_job_control's
  workers.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import io
import os
import pickle
import shutil
import sys
import tempfile
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ParamSpec, TypeVar
from unittest import mock

import torch
from torch import nn

from autosbp.capturing import export
from autosbp.capturing.graph import OpGraph

__all__ = ["capture_key", "forget_captures", "shared_captures", "shares_captures"]

P = ParamSpec("P")
R = TypeVar("R")

_stored: dict[str, bytes] = {}  # key -> pickled graph, this process's copies


@contextlib.contextmanager
def shared_captures() -> Iterator[None]:
    """Inside, `autosbp.capturing.export.capture` shares its graphs (the module's header)."""
    if getattr(export.capture, "_shared", False):  # inside another: already shared
        yield
        return
    with mock.patch.object(export, "capture", _shared(export.capture)):
        yield


def shares_captures(worker: Callable[P, R]) -> Callable[P, R]:
    """`worker` (a rank's function for `run_workers`) run inside `shared_captures`."""

    @functools.wraps(worker)
    def shared(*args: P.args, **kwargs: P.kwargs) -> R:
        with shared_captures():
            return worker(*args, **kwargs)

    return shared


def _shared(capture: Any) -> Any:
    def shared(
        model: nn.Module,
        example_inputs: Sequence[torch.Tensor],
        *,
        name: str | None = None,
        dtype: torch.dtype | None = None,
    ) -> OpGraph:
        def captured() -> OpGraph:
            graph: OpGraph = capture(model, example_inputs, name=name, dtype=dtype)
            return graph

        key = capture_key(model, example_inputs, name, dtype)
        if key is None:
            return captured()
        if key not in _stored:
            data = _load_or_capture(key, captured)
            if isinstance(data, OpGraph):  # a graph that does not pickle: not shared
                return data
            _stored[key] = data
        graph: OpGraph = pickle.loads(_stored[key])
        return graph

    shared._shared = True  # type: ignore[attr-defined]
    shared.__wrapped__ = capture  # type: ignore[attr-defined]
    return shared


def capture_key(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    name: str | None,
    dtype: torch.dtype | None,
) -> str | None:
    """The hash of everything `capture(model, example_inputs, name=name, dtype=dtype)` reads, or
    None where the model or an input does not pickle by value (the module's header)."""
    cast = dtype if dtype is not None else export._CAST.get()
    settings = (
        name or type(model).__name__, str(cast), str(torch.get_default_dtype()),
        torch.is_grad_enabled(), torch.__version__, _autosbp_code(),
    )  # fmt: skip
    out = io.BytesIO()
    try:
        _KeyPickler(out).dump((settings, model, tuple(example_inputs)))
    except (pickle.PicklingError, TypeError, AttributeError, RuntimeError):
        return None
    return hashlib.sha256(out.getvalue()).hexdigest()


@functools.cache
def _autosbp_code() -> str:
    """The sha256 of every Python file of the autosbp package, in path order (read once)."""
    root = Path(export.__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _tensor_token(*fields: Any) -> None:
    """Stands in the key for a tensor (never called: the key is hashed, not loaded)."""


def _code_token(*fields: Any) -> None:
    """Stands in the key for a class or function (never called)."""


def _set_token(*items: Any) -> None:
    """Stands in the key for a set, its items in the order of their reprs (never called)."""


_TOKENS = (_tensor_token, _code_token, _set_token)
# Attributes that hold a number of this process's hash seed, which capture does not read:
# transformers' GenerationConfig records hash(self), a hash of its JSON text.
_PER_PROCESS = frozenset({"_original_object_hash"})


class _KeyPickler(pickle._Pickler):  # type: ignore[name-defined,misc]
    """Pickles tensors by value, code by its source file's bytes, and sets in one order
    (`capture_key`). Python's own pickler, not the C one: only it asks `reducer_override`
    about sets and dicts, whose order must not depend on the process's hash seed."""

    def __init__(self, out: io.BytesIO) -> None:
        super().__init__(out)
        self.sources: dict[str, str] = {}  # path -> sha256 of its bytes, read once per key

    def reducer_override(self, obj: Any) -> Any:
        if any(obj is token for token in _TOKENS):
            return NotImplemented  # the tokens themselves, by name
        if isinstance(obj, torch.Tensor):
            return _tensor_token, _tensor_fields(obj)
        if isinstance(obj, type | types.FunctionType | types.BuiltinFunctionType):
            return _code_token, _code_fields(obj, self.sources)
        if isinstance(obj, set | frozenset):
            return _set_token, (type(obj).__name__, *sorted(obj, key=repr))
        if type(obj) is dict and not _PER_PROCESS.isdisjoint(obj):
            return dict, ([(k, v) for k, v in obj.items() if k not in _PER_PROCESS],)
        return NotImplemented


def _tensor_fields(t: torch.Tensor) -> tuple[Any, ...]:
    fields = (type(t).__qualname__, tuple(t.shape), t.stride(), str(t.dtype), str(t.device))
    if t.is_meta:
        return (*fields, t.requires_grad, None)
    data = t.detach().cpu().contiguous().reshape(-1)
    raw = data.view(torch.uint8) if data.numel() else data.to(torch.uint8)
    return (*fields, t.requires_grad, hashlib.sha256(raw.numpy().tobytes()).hexdigest())


def _code_fields(obj: Any, sources: dict[str, str]) -> tuple[str, str, str | None]:
    """(where: its module's file, else the module's name; qualified name; the file's sha256,
    None for code without a file: C extensions' and the interpreter's own, which cannot change
    within a session). A file, not a module name: a model file the zoo loads gets a module
    name per process (`zoo.call_user_function`), the same code in every one."""
    module_name, qualname = obj.__module__, obj.__qualname__
    module = sys.modules.get(module_name)
    found: Any = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if found is not obj:  # a local class or function, or not under its name: no key
        raise pickle.PicklingError(f"{module_name}.{qualname} is not importable by name")
    path = getattr(module, "__file__", None)
    if path is None or not path.endswith(".py"):
        return module_name, qualname, None
    if path not in sources:
        sources[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return str(Path(path).resolve()), qualname, sources[path]


def forget_captures() -> None:
    """Remove this session's stored graphs (at its end: tests/conftest.py)."""
    _stored.clear()
    if _folder().exists():  # not where nothing was shared
        shutil.rmtree(_folder())


def _folder() -> Path:
    return Path(os.environ.get("AUTOSBP_CACHE_DIR", tempfile.gettempdir())) / "test-graphs"


def _load_or_capture(key: str, capture: Callable[[], OpGraph]) -> bytes | OpGraph:
    """The stored graph of `key`, captured and stored first where no process has yet (under
    the key's lock); the graph itself where it does not pickle."""
    folder = _folder()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key}.pickle"
    with open(folder / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return path.read_bytes()
        graph = capture()
        try:
            data = _dumps(graph)
        except (pickle.PicklingError, TypeError, AttributeError):
            return graph
        part = folder / f"{key}.{os.getpid()}.part"
        part.write_bytes(data)
        part.replace(path)
        return data


def _op_overload(qualified: str) -> Any:
    """`torch.ops.NAMESPACE.OP.OVERLOAD` from "NAMESPACE::OP.OVERLOAD" (`OpOverload.name()`)."""
    namespace, _, rest = qualified.partition("::")
    op, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")


class _GraphPickler(pickle.Pickler):
    """Pickles ATen ops by name (torch's `OpOverload` does not pickle)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch._ops.OpOverload):
            return _op_overload, (obj.name(),)
        return NotImplemented


def _dumps(graph: OpGraph) -> bytes:
    out = io.BytesIO()
    _GraphPickler(out).dump(_without_program(graph))
    return out.getvalue()


def _without_program(graph: OpGraph) -> OpGraph:
    return OpGraph(graph.graph, graph.order, graph.model_name, None, graph.unknown_ops, graph.meta)
