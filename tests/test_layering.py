"""The layering the architecture promises, read from the source: who may import whom.

- arrows go one way: runtime -> autosbp -> costmodel (autosbp reaches runtime only lazily, from
  the public `Engine` name and the `train` command);
- capture knows nothing of the planner, the schedule, boxing or plans (it may name the ops
  without a rule, lazily: `rules`);
- no import circles among modules (module-level imports; imports inside functions are lazy by
  intent and listed apart);
- the top of `autosbp` holds at most 10 modules: what every part shares and the faces.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("autosbp", "costmodel", "runtime")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """The project modules `path` imports at module level, and those it imports lazily (inside
    a function or under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text(), str(path))
    eager: set[str] = set()
    lazy: set[str] = set()

    def visit(node: ast.AST, deferred: bool) -> None:
        for child in ast.iter_child_nodes(node):
            is_scope = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            is_typing = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
            if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                names = [child.module] + [f"{child.module}.{a.name}" for a in child.names]
            elif isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            else:
                visit(child, deferred or is_scope or is_typing)
                continue
            for name in names:
                if name.split(".")[0] in PACKAGES:
                    (lazy if deferred else eager).add(name)

    visit(tree, False)
    return eager, lazy


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module an imported name lives in (a `from a.b import c` may name module a.b.c)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _graph(include_lazy: bool) -> nx.DiGraph:
    graph = nx.DiGraph()
    for module, path in MODULES.items():
        eager, lazy = _imports(path)
        graph.add_node(module)
        for name in eager | (lazy if include_lazy else set()):
            target = _resolve(name)
            if target is not None and target != module:
                graph.add_edge(module, target)
    return graph


def test_no_import_circles() -> None:
    graph = _graph(include_lazy=False)
    # A package's __init__ re-exporting its own submodules is not a circle of knowledge.
    for module in list(graph):
        for target in list(graph.successors(module)):
            if target.startswith(module + "."):
                graph.remove_edge(module, target)
    assert list(nx.simple_cycles(graph)) == []


LAZY_REACH_INTO_RUNTIME = {"autosbp", "autosbp.commands.train"}  # Engine; the train command


@pytest.mark.parametrize(
    ("importer", "forbidden"),
    [("costmodel", ("autosbp", "runtime")), ("autosbp", ("runtime",))],
    ids=["costmodel", "autosbp"],
)
def test_arrows_go_one_way(importer: str, forbidden: tuple[str, ...]) -> None:
    graph = _graph(include_lazy=True)
    wrong = [
        (module, target)
        for module, target in graph.edges
        if module.split(".")[0] == importer
        and target.split(".")[0] in forbidden
        and module not in LAZY_REACH_INTO_RUNTIME
    ]
    assert wrong == []


CAPTURE_MAY_IMPORT = ("autosbp.capturing", "autosbp.errors", "autosbp.rules", "costmodel")


def test_capture_knows_nothing_of_planner_schedule_or_boxing() -> None:
    graph = _graph(include_lazy=True)
    wrong = [
        (module, target)
        for module, target in graph.edges
        if module.startswith("autosbp.capturing")
        and not any(target == ok or target.startswith(ok + ".") for ok in CAPTURE_MAY_IMPORT)
    ]
    assert wrong == []
    eager = _graph(include_lazy=False)
    into_rules = [
        (m, t) for m, t in graph.edges if m.startswith("autosbp.capturing.") and ".rules" in t
    ]
    assert into_rules, "the layering test no longer sees capture's lazy import of rules"
    assert not any(eager.has_edge(m, t) for m, t in into_rules), "capture imports rules eagerly"


def test_the_top_of_autosbp_holds_at_most_ten_modules() -> None:
    top = sorted(p.name for p in (ROOT / "autosbp").glob("*.py"))
    assert len(top) <= 10, top
