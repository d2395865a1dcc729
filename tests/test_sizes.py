"""The house's sizes, read from the source: a size is a smell to look at, and only a size that no
single idea needs is a failure.

Counted over every Python file of the rooms and of bench/ (the benchmarks are read as much as the
code): a module's lines as the file has them, a function's from its `def` (decorators excluded)
to its last line, nested functions counted on their own and inside the function that holds them.

Two levels (the house style, item 2; docs/architecture.md, "When to split"):
- guidance, reported as a warning, never a failure: a module past ~400 lines or a function past
  ~60 is worth a look for a second concept (formulate, solve, report), to split where one is
  found, never to meet a count (no compacted docstrings, no splits by length);
- failure: a module past 1000 lines or a function past 150. No single idea of this code base
  has needed that much (the largest module holds about 400 lines, the longest function 80), and
  the code the style guide warns against sits there (2,500-line modules, a 265-line solver
  function), so a count past them is a second concept that was never split out.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("terminal", "launching", "costmodel", "autosbp", "runtime", "bench")
GUIDE_MODULE_LINES, MAX_MODULE_LINES = 400, 1000
GUIDE_FUNCTION_LINES, MAX_FUNCTION_LINES = 60, 150


def _sources() -> list[Path]:
    return sorted(p for tree in TREES for p in (ROOT / tree).rglob("*.py"))


def _module_lines() -> dict[str, int]:
    return {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _sources()}


def _function_lines() -> dict[str, int]:
    found = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                found[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = lines
    return found


def _over(sizes: dict[str, int], limit: int) -> dict[str, int]:
    return {name: n for name, n in sizes.items() if n > limit}


def test_the_trees_hold_python_sources() -> None:
    """The rules below read real files: every room is where the test looks for it."""
    found = {p.relative_to(ROOT).parts[0] for p in _sources()}
    assert found == set(TREES)


def test_no_module_over_1000_lines() -> None:
    sizes = _module_lines()
    assert max(sizes.values()) > 100, "the counts read no real module"
    if guide := _over(sizes, GUIDE_MODULE_LINES):
        warnings.warn(
            f"modules over {GUIDE_MODULE_LINES} lines, worth a look for a second concept: {guide}",
            stacklevel=1,
        )
    assert _over(sizes, MAX_MODULE_LINES) == {}, f"modules over {MAX_MODULE_LINES} lines"


def test_no_function_over_150_lines() -> None:
    sizes = _function_lines()
    assert max(sizes.values()) > 20, "the counts read no real function"
    if guide := _over(sizes, GUIDE_FUNCTION_LINES):
        warnings.warn(
            f"functions over {GUIDE_FUNCTION_LINES} lines, worth a look for a second job: {guide}",
            stacklevel=1,
        )
    assert _over(sizes, MAX_FUNCTION_LINES) == {}, f"functions over {MAX_FUNCTION_LINES} lines"
