"""What a plan file must be to be read: its JSON, its published schema, and what a schema
cannot say.

Lives here: `read_plan_text` (a file's JSON, with one clear error for a file that is missing,
unreadable, not JSON, nested beyond a reader's depth, or holding NaN/Infinity or one key twice
in an object, which Python's reader takes by default) and `validate_plan_json` (the format and
version, then every value: finite, within int64, texts of at most MAX_TEXT characters without
control characters, nesting bounded; then the schema in autosbp/schemas/plan.schema.json, with
`integer` meaning a JSON integer). Lives elsewhere: the
plan's values (`plan.values`), whether they agree with each other (`plan.checks`).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterator
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

from autosbp.errors import PlanError
from terminal.text import has_control, printable

__all__ = [
    "FORMAT", "MAX_DEPTH", "MAX_INT", "MAX_TEXT", "READABLE_VERSIONS", "VERSION", "plan_schema",
    "read_plan_text", "validate_plan_json",
]  # fmt: skip

FORMAT = "autosbp.plan"
VERSION = 2
# Every version this autosbp reads: 1 (before nodes stated their recomputation; `plan.recompute`
# gives format 1's rule for it) and 2.
READABLE_VERSIONS = (1, 2)
MAX_INT = 2**63 - 1  # int64: the largest count or size torch (and other JSON readers) can hold
# The schema nests at most 5 levels (alternatives -> node -> list -> entry -> field); deeper
# data is not a plan, and bounding it keeps every reader iterative and fast.
MAX_DEPTH = 16
# The longest text a plan holds: names of models (a file path and a function), nodes, parameters
# and SBPs are far shorter; a megabyte name is damage, and would flood the terminal when shown.
MAX_TEXT = 4096
_FIX = "make it again with `autosbp plan`"


def read_plan_text(path: Path) -> Any:
    """The JSON data in `path` (PlanError naming the file, the problem and the fix)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PlanError(f"plan file {path} does not exist; make one with `autosbp plan`.") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise PlanError(
            f"plan file {path} cannot be read ({reason}); pass a plan JSON file written by "
            "`autosbp plan`."
        ) from None
    try:
        return json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_unique_keys)
    except _DuplicateKeyError as exc:
        raise PlanError(
            f"plan file {path} names {printable(repr(exc.key))} {exc.count} times in one object; "
            f"a JSON reader keeps only the last, so the others would be dropped unseen. The file "
            f"was edited or damaged: {_FIX}."
        ) from None
    except json.JSONDecodeError as exc:
        raise PlanError(
            f"plan file {path} is not valid JSON ({exc.msg} at line {exc.lineno}); it may be "
            f"truncated: {_FIX}."
        ) from None
    except RecursionError:
        raise PlanError(
            f"plan file {path} nests deeper than a JSON reader goes (a plan nests {MAX_DEPTH} "
            f"levels at most), so it is not a plan: {_FIX}."
        ) from None
    except _NonFiniteError as exc:
        raise PlanError(
            f"plan file {path} holds {exc}, which is not a finite number; plans hold finite "
            f"numbers only. The file was edited or damaged: {_FIX}."
        ) from None


@cache
def plan_schema() -> dict[str, Any]:
    """The published JSON Schema of plan files."""
    text = resources.files("autosbp").joinpath("schemas/plan.schema.json").read_text()
    return json.loads(text)


@cache
def _validator() -> Any:
    """The schema's validator, with `integer` meaning a JSON integer (2, not 2.0: the draft's
    own rule lets 2.0 through, and a count of 2.0 breaks `range`)."""
    base = jsonschema.Draft202012Validator
    checker = base.TYPE_CHECKER.redefine(
        "integer", lambda _, value: isinstance(value, int) and not isinstance(value, bool)
    )
    return jsonschema.validators.extend(base, type_checker=checker)(plan_schema())


def validate_plan_json(data: Any, source: str = "plan") -> None:
    fix = f"The file was edited or damaged; {_FIX}."
    if isinstance(data, dict) and data.get("format") != FORMAT:
        raise PlanError(
            f"{source} is not an autosbp plan (format {printable(repr(data.get('format')))}, "
            f"expected {FORMAT!r}); pass a file written by `autosbp plan` or autosbp.plan.save_plan()."
        )
    version = data.get("version") if isinstance(data, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
        raise PlanError(
            f"{source} is plan version {version}, newer than any this autosbp writes (version "
            f"{VERSION}; it reads {', '.join(map(str, READABLE_VERSIONS))}): a newer autosbp wrote "
            "it, with fields this one would misread. Upgrade autosbp to use it, or make the plan "
            "again with this version of autosbp."
        )
    if isinstance(data, dict) and version not in READABLE_VERSIONS:
        raise PlanError(
            f"{source} is plan version {printable(repr(data.get('version')))} but this autosbp "
            f"reads versions {', '.join(map(str, READABLE_VERSIONS))}; make the plan again with "
            "this version of autosbp."
        )
    for where, value in _leaves(data, source, fix):
        if isinstance(value, float) and not math.isfinite(value):
            raise PlanError(f"{source} holds {value} at {where}: not a finite number. {fix}")
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise PlanError(
                f"{source} holds a {len(str(abs(value)))}-digit number at {where}, beyond the "
                f"largest count a plan can hold (2^63 - 1). {fix}"
            )
        if isinstance(value, str) and len(value) > MAX_TEXT:
            raise PlanError(
                f"{source} holds a text of {len(value)} characters at {where} (it begins "
                f"{printable(repr(value[:40]))}); plan texts are names, at most {MAX_TEXT} "
                f"characters. {fix}"
            )
        if isinstance(value, str) and has_control(value):
            raise PlanError(
                f"{source} holds the text {printable(repr(value))} at {where}, with control "
                f"characters, which no plan holds (they would drive the terminal). {fix}"
            )
    error = jsonschema.exceptions.best_match(_validator().iter_errors(data))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        raise PlanError(
            f"{source} does not match the plan schema at {where}: {printable(error.message)}. {fix}"
        )


def _leaves(data: Any, source: str, fix: str) -> Iterator[tuple[str, Any]]:
    """(JSON path, value) of every number and string in `data`, keys included, without
    recursion (nesting beyond MAX_DEPTH is refused)."""
    stack: list[tuple[str, Any, int]] = [("(top level)", data, 0)]
    while stack:
        where, value, depth = stack.pop()
        if isinstance(value, dict | list) and depth >= MAX_DEPTH:
            raise PlanError(
                f"{source} nests deeper than {MAX_DEPTH} levels at {where}; a plan nests 5. {fix}"
            )
        if isinstance(value, dict):
            for key, item in value.items():
                path = key if where == "(top level)" else f"{where}/{key}"
                yield where, key
                stack.append((path, item, depth + 1))
        elif isinstance(value, list):
            stack.extend((f"{where}/{i}", item, depth + 1) for i, item in enumerate(value))
        else:
            yield where, value


class _DuplicateKeyError(ValueError):
    """A key given more than once in one JSON object (Python's reader keeps the last)."""

    def __init__(self, key: str, count: int) -> None:
        super().__init__(key)
        self.key, self.count = key, count


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        key, count = Counter(k for k, _ in pairs).most_common(1)[0]
        raise _DuplicateKeyError(key, count)
    return out


class _NonFiniteError(ValueError):
    """`NaN`, `Infinity` or `-Infinity` in a JSON text (Python's reader takes them by default)."""


def _refuse_constant(name: str) -> Any:
    raise _NonFiniteError(name)
