"""Why a model could not be exported: torch.export failures as one-paragraph `CaptureError`s.

Lives here: `explain_export_failure`, which finds the user's frame (the innermost traceback frame
outside torch, the stdlib and autosbp), the module that ran it (by identity in the model's
`named_modules`), classifies the construct (an `if` on a tensor value, `.item()`, other) and
names a fix; `unsupported_node_message` for exported constructs that are not ATen ops
(autocast inside forward, torch.cond); `dependent_shape_message` for an op that exported but
whose output shape depends on tensor values (`x[mask]`, `nonzero`, `unique`: export names such
sizes by symbols, a plan needs numbers), with the user's line from the node's stack trace;
`torch_report_held_back`, which keeps
torch's own failure report (logged tracebacks, a printed partial graph) off the console. Lives
elsewhere: the export call itself (`export.capture`).

Invariants: the message is one paragraph with no torch traceback; the caller chains the original
exception (`raise ... from exc`) so the full torch report stays available to debuggers.
"""

from __future__ import annotations

import contextlib
import io
import linecache
import logging
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import torch
from torch import fx, nn

from autosbp.errors import CaptureError

__all__ = [
    "dependent_shape_message",
    "explain_export_failure",
    "torch_report_held_back",
    "unsupported_node_message",
]

_TORCH_DIR = str(Path(torch.__file__).parent)
_STDLIB_DIR = sysconfig.get_paths()["stdlib"]
_AUTOSBP_DIR = str(Path(__file__).parent)


def explain_export_failure(exc: Exception, model: nn.Module, name: str) -> CaptureError:
    """One paragraph: which module and line, which construct, and what to do instead."""
    frame = _user_frame(exc)
    where = _describe_frame(frame, model) if frame else f"model `{name}`"
    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip() if frame else ""
    construct, why, fix = _classify(exc, code)
    detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    return CaptureError(
        f"Cannot capture model `{name}`: {construct} in {where}"
        + (f" (`{code}`)" if code else "")
        + f" {why}. Fix: {fix}. (torch.export said: {type(exc).__name__}: {detail})"
    )


@contextlib.contextmanager
def torch_report_held_back() -> Iterator[None]:
    """Around torch.export: hold back torch's own report of a failure (meta-kernel tracebacks in
    its logs, the partial graph it prints to stderr), which the CaptureError replaces with one
    paragraph while chaining the exception. On success, what was printed is passed on; torch's
    log records below CRITICAL are dropped (loggers set by TORCH_LOGS keep their levels)."""
    torch_log = logging.getLogger("torch")
    level = torch_log.level
    printed = io.StringIO()
    torch_log.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(printed):
            yield
    finally:
        torch_log.setLevel(level)
    sys.stderr.write(printed.getvalue())


def _user_frame(exc: BaseException) -> FrameType | None:
    """The innermost traceback frame in user code (not torch, the stdlib or this module)."""
    found = None
    for frame, _ in _walk_tb(exc):
        filename = frame.f_code.co_filename
        if not filename.startswith((_TORCH_DIR, _STDLIB_DIR, _AUTOSBP_DIR)):
            found = frame
    return found


def _walk_tb(exc: BaseException) -> Iterator[tuple[FrameType, int]]:
    tb = exc.__traceback__
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next


def _describe_frame(frame: FrameType, model: nn.Module) -> str:
    location = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
    code = frame.f_code
    owner = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None  # `self`
    if isinstance(owner, nn.Module):
        paths = {id(m): p for p, m in model.named_modules()}
        path = paths.get(id(owner))
        label = f"`{path}`" if path else "`<top>`" if path == "" else "a module"
        return f"module {label} ({type(owner).__name__}.{code.co_name}, {location})"
    return f"function `{code.co_name}` ({location})"


_BRANCH_FIX = (
    "compute both branches and select with `torch.where(cond, a, b)` (or a mask), or move the "
    "decision out of forward (make it in the training loop or the constructor)"
)
_VALUE_FIX = (
    "keep the value a tensor and use tensor ops (masks, `torch.where`, fixed-size slices) "
    "instead of a Python number, or compute it outside forward and pass it to the constructor"
)


_VALUES_UNKNOWN = (
    "cannot be traced, because capture runs forward on shape-only tensors whose values are unknown"
)


def _classify(exc: Exception, code: str) -> tuple[str, str, str]:
    """(the construct, why it failed, the fix) for an export failure at source line `code`."""
    data_dependent = "data-dependent" in str(exc) or "DataDependent" in type(exc).__name__
    if not data_dependent:
        return (
            "a call",
            "failed while forward was traced on the example inputs",
            "first check that `model(*example_inputs)` runs without capture (the example inputs "
            "must have the shapes and dtypes forward expects); if it does, rewrite that line "
            "with torch tensor ops (no numpy, no Python values read from tensors, no shapes that "
            "depend on tensor values), or move it out of forward",
        )
    keyword = code.split(" ", 1)[0].rstrip(":")
    if keyword in ("if", "elif", "while", "assert"):
        construct = f"an `{keyword}` on a tensor value (data-dependent control flow)"
        return construct, _VALUES_UNKNOWN, _BRANCH_FIX
    if any(s in code for s in (".item()", "int(", "float(", "bool(", ".tolist()")):
        construct = "a Python number read from a tensor value (`.item()`, `int()` ...)"
        return construct, _VALUES_UNKNOWN, _VALUE_FIX
    return "a Python decision or shape that depends on a tensor value", _VALUES_UNKNOWN, _BRANCH_FIX


def dependent_shape_message(node: fx.Node, name: str) -> str:
    """For an exported op whose output's shape depends on tensor values: the user's line (the
    innermost stack-trace entry outside torch and autosbp), the module, and the fix."""
    module = list((node.meta.get("nn_module_stack") or {"": ("", "")}).values())[-1][0]
    where = _user_line(str(node.meta.get("stack_trace") or ""))
    return (
        f"Cannot capture model `{name}`: `{node.target}` in module `{module or '<top>'}`"
        + (f" ({where})" if where else "")
        + " makes a tensor whose shape depends on tensor values (data-dependent: boolean "
        "indexing, nonzero, unique, masked_select ...), so no plan can lay it out ahead of "
        "time. Fix: keep every shape fixed: compute on all elements and mask them (`torch.where"
        "(mask, x, 0)`, a weighted sum) instead of selecting the ones that pass."
    )


def _user_line(stack_trace: str) -> str:
    """ "file.py:12, `code`" for the innermost user frame of an fx node's stack trace."""
    found = ""
    lines = stack_trace.splitlines()
    for k, line in enumerate(lines):
        text = line.strip()
        if not text.startswith('File "'):
            continue
        filename = text.split('"')[1]
        if filename.startswith((_TORCH_DIR, _STDLIB_DIR, _AUTOSBP_DIR)):
            continue
        number = text.split(", line ")[1].split(",")[0] if ", line " in text else "?"
        code = lines[k + 1].strip() if k + 1 < len(lines) else ""
        found = f"{Path(filename).name}:{number}" + (f", `{code}`" if code else "")
    return found


# Substrings of higher-order op names -> what the user wrote.
_CONSTRUCTS = (
    ("set_grad_enabled", "`torch.no_grad()` / `torch.enable_grad()` inside forward"),
    ("autocast", "`torch.autocast` inside forward"),
    ("cond", "`torch.cond`"),
    ("checkpoint", "activation checkpointing inside forward"),
)


def unsupported_node_message(node: fx.Node) -> str:
    """For an export node that is not an ATen op on tensors (a higher-order op, a Python value)."""
    module = list((node.meta.get("nn_module_stack") or {"": ("", "")}).values())[-1][0]
    target = str(getattr(node.target, "__name__", node.target))
    construct = next((text for key, text in _CONSTRUCTS if key in target), f"`{target}`")
    return (
        f"Cannot capture: {construct} in module `{module or '<top>'}` is not a plain ATen op on "
        "tensors, so autosbp cannot assign it SBP signatures. Move it out of forward (autosbp "
        "plans gradients, precision and recomputation itself) or express it with tensor ops."
    )
