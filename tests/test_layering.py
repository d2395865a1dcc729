"""The layering the architecture promises, read from the source: who may import whom.

Every import counts: at module level, inside functions, under TYPE_CHECKING.
- the rooms are ordered: runtime -> autosbp -> costmodel -> launching -> terminal (an arrow
  may skip rooms: autosbp uses terminal directly); nothing imports upward, except the face;
- the face, named here and nowhere else: the public API (`autosbp`, whose `Engine` and
  `distribute` live in runtime) and the CLI's `train` command (which runs jobs) may reach
  runtime, lazily so that `autosbp --help` does not load torch;
- runtime executes what the plan says and never imports the planner;
- the planner's folders import one way, each only those before it: ilp, space, memory, timing,
  problem, bounds, search; its top modules (`api`, `assemble`) may import any of them, and none
  imports the top;
- capture knows nothing of the planner, the schedule, boxing or plans (it may name the ops
  without a rule, lazily: `rules`);
- no import circles among modules;
- the top of `autosbp` holds at most 10 modules: what every part shares and the faces.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
# Lowest first: a room may import the rooms before it.
ROOMS = ("terminal", "launching", "costmodel", "autosbp", "runtime")
FACE = {"autosbp", "autosbp.commands.export", "autosbp.commands.train"}


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
                if name.split(".")[0] in ROOMS:
                    (lazy if deferred else eager).add(name)

    visit(tree, False)
    _add_lazy_module_names(tree, lazy)
    return eager, lazy


def _add_lazy_module_names(tree: ast.AST, lazy: set[str]) -> None:
    """Module names held in strings and loaded by importlib (`_LAZY = {"Engine": "runtime.engine"}`)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in MODULES:
            lazy.add(node.value)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for room in ROOMS for p in sorted((ROOT / room).rglob("*.py"))}


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module an imported name lives in (a `from a.b import c` may name module a.b.c)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    for module, path in MODULES.items():
        eager, lazy = _imports(path)
        graph.add_node(module)
        for name in eager | lazy:
            target = _resolve(name)
            if target is not None and target != module:
                graph.add_edge(module, target)
    return graph


GRAPH = _graph()


def _room(module: str) -> int:
    return ROOMS.index(module.split(".")[0])


def test_the_layering_test_sees_lazy_imports() -> None:
    assert GRAPH.has_edge("autosbp", "runtime.engine"), "the API's lazy Engine is not seen"
    assert any(t.startswith("runtime.") for t in GRAPH.successors("autosbp.commands.train"))


def test_no_import_circles() -> None:
    graph = GRAPH.copy()
    for module in list(graph):
        for target in list(graph.successors(module)):
            # A package's __init__ re-exporting its own submodules is not a circle of
            # knowledge; nor is the face's reach up into runtime (lazy, and only from FACE:
            # runtime depends on autosbp, the face merely hands its names to users).
            if target.startswith(module + ".") or (
                module in FACE and _room(target) > _room(module)
            ):
                graph.remove_edge(module, target)
    assert list(nx.simple_cycles(graph)) == []


def test_arrows_go_down_except_from_the_face() -> None:
    upward = [
        (module, target)
        for module, target in GRAPH.edges
        if _room(target) > _room(module) and module not in FACE
    ]
    assert upward == []


def test_the_face_reaches_only_what_it_names() -> None:
    """The face may reach runtime; it stays the two modules named in FACE."""
    reaching = sorted({m for m, t in GRAPH.edges if _room(t) > _room(m)})
    assert set(reaching) <= FACE, reaching


def test_runtime_never_imports_the_planner() -> None:
    wrong = [
        (m, t)
        for m, t in GRAPH.edges
        if m.startswith("runtime") and (t == "autosbp.planner" or t.startswith("autosbp.planner."))
    ]
    assert wrong == []


# Lowest first: a planner folder may import the folders before it (autosbp/planner/__init__.py).
PLANNER_FOLDERS = ("ilp", "space", "memory", "timing", "problem", "bounds", "search")


def _planner_part(module: str) -> str | None:
    """The planner folder (or top module) `module` is in; None outside the planner."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["autosbp", "planner"] and len(parts) > 2 else None


def test_the_planner_folders_import_one_way() -> None:
    folders = {p.name for p in (ROOT / "autosbp" / "planner").iterdir() if p.is_dir()}
    assert folders - {"__pycache__"} == set(PLANNER_FOLDERS)
    rank = {folder: i for i, folder in enumerate(PLANNER_FOLDERS)}
    wrong = [
        (module, target)
        for module, target in GRAPH.edges
        if (source := _planner_part(module)) in rank
        and (into := _planner_part(target)) is not None
        and into != source
        and rank.get(into, len(rank)) > rank[source]  # a later folder, or a top module
    ]
    assert wrong == []


CAPTURE_MAY_IMPORT = ("autosbp.capturing", "autosbp.errors", "autosbp.rules", "costmodel")


def test_capture_knows_nothing_of_planner_schedule_or_boxing() -> None:
    wrong = [
        (module, target)
        for module, target in GRAPH.edges
        if module.startswith("autosbp.capturing")
        and not any(target == ok or target.startswith(ok + ".") for ok in CAPTURE_MAY_IMPORT)
        and _room(target) >= _room("autosbp")
    ]
    assert wrong == []
    into_rules = [
        (m, t) for m, t in GRAPH.edges if m.startswith("autosbp.capturing.") and ".rules" in t
    ]
    assert into_rules, "the layering test no longer sees capture's lazy import of rules"
    for module, _ in into_rules:
        eager, _lazy = _imports(MODULES[module])
        assert not any(".rules" in name for name in eager), f"{module} imports rules eagerly"


def test_the_top_of_autosbp_holds_at_most_ten_modules() -> None:
    top = sorted(p.name for p in (ROOT / "autosbp").glob("*.py"))
    assert len(top) <= 10, top
