"""The house's size rule, read from the source: no module over 400 lines, no function over 80.

Counted over every Python file of the rooms and of bench/ (the benchmarks are read as much as the
code): a module's lines as the file has them, a function's from its `def` (decorators excluded)
to its last line, nested functions counted on their own and inside the function that holds them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("terminal", "launching", "costmodel", "autosbp", "runtime", "bench")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def _sources() -> list[Path]:
    return sorted(p for tree in TREES for p in (ROOT / tree).rglob("*.py"))


def test_the_trees_hold_python_sources() -> None:
    """The rule below reads real files: every room is where the test looks for it."""
    found = {p.relative_to(ROOT).parts[0] for p in _sources()}
    assert found == set(TREES)


def test_no_module_over_400_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in _sources()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_over_80_lines() -> None:
    long = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = lines
    assert long == {}, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
