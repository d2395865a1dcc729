"""The `if`s libraries put in training forwards, absorbed by capture instead of refused.

Lives here: `absorbing_ifs`, the context capture exports a model in, and `Absorbed`, what it
absorbed (each with the user's line: capture reports them). Two forms, both decided by the
mode below as a Python bool, so export never sees a decision on a tensor's value:
- a random draw compared with a probability that makes the branch constant: LayerDrop
  (`torch.rand([]) < self.layerdrop` in OPT, BART, Whisper, Wav2Vec2, run in every training
  forward): `torch.rand` of one element lies in [0, 1), so `draw < p` is False for p <= 0 and
  True for p >= 1 (`>`, `<=`, `>=` alike where the bound leaves no doubt). A probability inside
  (0, 1) decides per step whether a layer runs, which one graph cannot hold: refused, naming
  the line and the fix (layerdrop 0 for a plan);
- an `if` whose body only raises (`if labels.max() >= vocab: raise ValueError(...)`, an
  argument check) or an `assert`: assumed not to raise, so the graph is the path that trains.
  The assumption is checked once on the example inputs, where they hold values (`check`:
  one eager forward); on meta it is reported as unchecked.
Anything else that decides on a tensor's value still fails as before, with the user's line
(`capturing.failures`). Lives elsewhere: the export (`capturing.export`), the report
(`commands.capture`).

Invariants: a comparison is absorbed only when one side is a draw this mode saw made and the
other a Python number; a `bool()` only where torch cannot decide it (a value unknown on
shape-only tensors) and the statement at the user's line is an `if` with a raise-only body and
no `else`, or an `assert`.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import linecache
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.export import ExportedProgram
from torch.overrides import TorchFunctionMode

from autosbp.errors import CaptureError

__all__ = ["Absorbed", "absorbing_ifs", "check_assumptions", "drop_dead_code", "user_line"]

# (draw on the left) comparison -> its value for every draw in [0, 1), or None if it depends
_COMPARE: dict[Any, Callable[[float], bool | None]] = {
    torch.Tensor.lt: lambda p: False if p <= 0 else True if p >= 1 else None,
    torch.Tensor.le: lambda p: False if p < 0 else True if p >= 1 else None,
    torch.Tensor.gt: lambda p: True if p < 0 else False if p >= 1 else None,
    torch.Tensor.ge: lambda p: True if p <= 0 else False if p >= 1 else None,
}
_MIRROR = {torch.Tensor.lt: torch.Tensor.gt, torch.Tensor.le: torch.Tensor.ge}
_MIRROR |= {v: k for k, v in _MIRROR.items()}
_ALIASES = {
    torch.Tensor.__lt__: torch.Tensor.lt, torch.Tensor.__le__: torch.Tensor.le,
    torch.Tensor.__gt__: torch.Tensor.gt, torch.Tensor.__ge__: torch.Tensor.ge,
    torch.lt: torch.Tensor.lt, torch.le: torch.Tensor.le, torch.gt: torch.Tensor.gt,
    torch.ge: torch.Tensor.ge,
}  # fmt: skip
_TORCH_DIR = str(Path(torch.__file__).parent)
_MODE_FILES = {__file__, str(Path(__file__).with_name("ctc.py"))}  # frames of capture's modes


@dataclass
class Absorbed:
    """What capture absorbed: per statement, (the user's `file:line`, its code, how)."""

    draws: list[tuple[str, str, str]] = field(default_factory=list)
    assumed: list[tuple[str, str, str]] = field(default_factory=list)
    rewritten: list[tuple[str, str, str]] = field(default_factory=list)
    """Calls capture traced in another form of the same values (`capturing.ctc`)."""

    def lines(self) -> list[str]:
        """One line per absorbed statement, for capture's report."""
        every = [*self.draws, *self.assumed, *self.rewritten]
        rows = [f"{where} `{code}`: {how}" for where, code, how in every]
        return list(dict.fromkeys(rows))  # a line run once per layer is said once


class _Absorbing(TorchFunctionMode):
    def __init__(self, absorbed: Absorbed) -> None:
        super().__init__()
        self.absorbed = absorbed
        self._draws: dict[int, torch.Tensor] = {}  # id -> the draw (held: ids stay unique)

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        compare = _ALIASES.get(func, func)
        if compare in _COMPARE and len(args) == 2 and not kwargs:
            decided = self._compare(compare, *args)
            if decided is not None:
                return decided
        if func is torch.Tensor.__bool__:
            return self._bool(func, args)
        result = func(*args, **kwargs)
        if func is torch.rand and isinstance(result, torch.Tensor) and result.numel() == 1:
            self._draws[id(result)] = result
        return result

    def _compare(self, compare: Any, left: Any, right: Any) -> bool | None:
        if id(right) in self._draws and _is_number(left):
            compare, left, right = _MIRROR[compare], right, left
        if id(left) not in self._draws or not _is_number(right):
            return None
        where, code = user_line()
        value = _COMPARE[compare](float(right))
        if value is None:
            raise CaptureError(
                f"{where} `{code}` compares a random draw with {right}: whether the branch runs "
                "is decided anew every step (LayerDrop), and one graph holds one path (a layer "
                f"skipped per step is not supported). Fix: {_setting(float(right))} before "
                "building the model; at 0 the branch never runs and capture drops it."
            )
        self.absorbed.draws.append((where, code, f"always {value} (a draw in [0, 1) vs {right})"))
        return value

    def _bool(self, func: Any, args: tuple[Any, ...]) -> bool:
        """A raise-only `if` (or `assert`) on a value capture cannot know: assumed, without
        asking torch (which would record the question in the graph); else torch's answer."""
        if isinstance(args[0], FakeTensor) and args[0].constant is None:
            where, code, assumed = _raise_only()
            if assumed is not None:
                how = "not taken" if assumed is False else "holds"
                self.absorbed.assumed.append(
                    (where, code, f"assumed {how} (a check that only raises), checked on the "
                     "example inputs")
                )  # fmt: skip
                return assumed
        return bool(func(*args))


def _setting(probability: float) -> str:
    """What to set to 0: the model config's LayerDrop fields of this value, else the attribute
    of the module (`self`) at the user's line that holds it."""
    frame = _user_frame()
    owner = frame.f_locals.get("self") if frame is not None else None
    config = getattr(owner, "config", None)
    fields = [
        k for k, v in vars(config).items() if "layer" in k and "drop" in k and v == probability
    ] if config is not None and hasattr(config, "__dict__") else []  # fmt: skip
    if fields:
        settings = " and ".join(f"`{k}=0.0`" for k in fields)
        return f"set {settings} in the model's `{type(config).__name__}`"
    held = [k for k, v in vars(owner).items() if v == probability] if owner is not None else []
    if held:
        return f"set `{type(owner).__name__}.{held[0]}` to 0.0 (it holds {probability})"
    return "set the model's LayerDrop probability to 0.0 (e.g. `layerdrop=0.0` in its config)"


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _user_frame() -> FrameType | None:
    """The innermost frame outside torch and capture's modes: the model's code."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code.co_filename in _MODE_FILES
    ):
        frame = frame.f_back
    return frame


def user_line() -> tuple[str, str]:
    frame = _user_frame()
    if frame is None:
        return "<unknown>", ""
    filename, line = frame.f_code.co_filename, frame.f_lineno
    return f"{Path(filename).name}:{line}", linecache.getline(filename, line).strip()


def _raise_only() -> tuple[str, str, bool | None]:
    """(where, code, the value to assume) for the `bool()` at the user's line: False for an
    `if` whose body only raises and that has no else, True for an `assert`; None otherwise."""
    frame = _user_frame()
    if frame is None:
        return "<unknown>", "", None
    filename, line = frame.f_code.co_filename, frame.f_lineno
    where, code = f"{Path(filename).name}:{line}", linecache.getline(filename, line).strip()
    for node in _statements(filename):
        test = getattr(node, "test", None)
        if test is None or not test.lineno <= line <= (test.end_lineno or test.lineno):
            continue
        if isinstance(node, ast.Assert):
            return where, code, True
        if isinstance(node, ast.If) and not node.orelse and _raises(node.body):
            return where, code, False
    return where, code, None


def _raises(body: list[ast.stmt]) -> bool:
    """Does this block only raise (a raise, after nothing but expressions and assignments)?"""
    return (
        bool(body)
        and isinstance(body[-1], ast.Raise)
        and all(isinstance(s, ast.Expr | ast.Assign | ast.AnnAssign) for s in body[:-1])
    )


@functools.lru_cache(maxsize=64)
def _statements(filename: str) -> tuple[ast.stmt, ...]:
    source = "".join(linecache.getlines(filename))
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ()
    return tuple(n for n in ast.walk(tree) if isinstance(n, ast.If | ast.Assert))


@contextlib.contextmanager
def absorbing_ifs(absorbed: Absorbed) -> Iterator[None]:
    """Export inside this: LayerDrop draws and raise-only `if`s decided as the module header
    says, each recorded in `absorbed`."""
    with _Absorbing(absorbed):
        yield


def check_assumptions(
    absorbed: Absorbed, model: nn.Module, inputs: tuple[torch.Tensor, ...], name: str
) -> None:
    """Run `model` once on `inputs` (real values) to see that no assumed check raises; on meta
    there is nothing to run: the assumptions stay as reported."""
    if not absorbed.assumed:
        return
    state = [*model.parameters(), *model.buffers(), *inputs]
    if any(t.is_meta for t in state):
        absorbed.assumed[:] = [
            (where, code, how.replace("checked on", "unchecked on meta, to hold on"))
            for where, code, how in absorbed.assumed
        ]
        return
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(*inputs)
    except Exception as exc:
        where, code, _ = absorbed.assumed[0]
        raise CaptureError(
            f"model `{name}` raises on its example inputs ({type(exc).__name__}: {exc}); capture "
            f"assumed {where} `{code}` would not (its branch only raises). Fix the inputs so "
            "that forward runs on them."
        ) from None


def drop_dead_code(program: ExportedProgram, absorbed: Absorbed) -> None:
    """Where something was absorbed, erase what nothing reads any more: the decided draws (a
    random op is impure, so export keeps it) and the ops that computed an assumed check's
    condition, so the graph computes no value it does not use. Ops that write in place or
    assert stay."""
    if not absorbed.draws and not absorbed.assumed and not absorbed.rewritten:
        return
    graph = program.graph_module.graph
    erased: set[fx.Node] = set()
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node in erased:
            continue
        checks = _size_checks_only(node)
        if checks is not None:  # its size checked, its value read by nothing
            for check in reversed([n for n in graph.nodes if n in checks]):
                graph.erase_node(check)
            erased |= checks
        if not node.users and (node.target in _DRAW_OPS or not node.is_impure()):
            graph.erase_node(node)
    program.graph_module.recompile()


def _size_checks_only(node: fx.Node) -> set[fx.Node] | None:
    """The nodes downstream of `node` when all they do is check its size (export's runtime
    assertions on a data-dependent size: `sym_size`, comparisons, `_assert_scalar`), else None."""
    seen: set[fx.Node] = set()
    todo = list(node.users)
    while todo:
        user = todo.pop()
        if user in seen:
            continue
        if user.op != "call_function" or (
            isinstance(user.target, torch._ops.OpOverload) and user.target not in _SIZE_CHECKS
        ):
            return None
        seen.add(user)
        todo.extend(user.users)
    return seen or None


_DRAW_OPS = (torch.ops.aten.rand.default, torch.ops.aten.rand.generator)
_SIZE_CHECKS = (torch.ops.aten.sym_size.int, torch.ops.aten._assert_scalar.default)
