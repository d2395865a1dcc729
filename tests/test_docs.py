"""The docs name what exists: every file path and every dotted module or code name that
docs/*.md mention is read from the page and found in the code, so a rename that leaves a page
stale fails here. And the docs are one site with README.md as its front door: every page is
linked from the README, the README stays a front door (at most README_MAX_LINES lines), and
every relative link of the README and the pages leads to a file that exists (and, with a
`#fragment`, to a heading of that file).

What counts as a name (the rest of a page is prose):
- a path: a token holding a `/` that ends in a file name with an extension (`runtime/engine.py`,
  `autosbp/schemas/plan.schema.json`) or in `/` (a folder: `autosbp/planner/timing/`), found
  from the repository's root or from one of the rooms (pages write `rules/core.py` for
  `autosbp/rules/core.py`);
- a dotted name in backticks (`runtime.parallel.pipeline`, `schedule.run_schedule`,
  `Space.may_gather`): it resolves as a module followed by attributes (a dataclass field
  counts), the module named whole from its room (`runtime.engine`: a name that starts with a
  room must be whole) or by its last parts (`timing.candidates`, `files.load_plan`), or as a
  class or function of the code followed by its attributes; a file name (`chains.py`) is
  found anywhere in the rooms. Names of other libraries and of placeholders are listed in
  NOT_CODE, each with its reason; paths that are placeholders in PLACEHOLDER_PATHS.
- a link: `[text](target)` or `![alt](target)` whose target is not a URL (`https:`,
  `mailto:`), read from the README and every page, inside code blocks too (no page puts a link
  in one).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
ROOMS = ("autosbp", "runtime", "costmodel", "launching", "terminal")
# Where a page's short paths and names start from: the root, the rooms, the planner.
PATH_BASES = (ROOT, *(ROOT / room for room in ROOMS), ROOT / "autosbp" / "planner")
MODULE_ROOTS = (*ROOMS, "tests.support")
NOT_CODE = {  # first word of a dotted name that is not this code's
    "torch": "torch's own API (torch.distributed.pipelining, torch.profiler)",
    "nn": "torch.nn",
    "F": "torch.nn.functional",
    "dataclasses": "the standard library",
    "aten": "ATen op names as torch.export writes them",
    "efficiency": "a hardware profile's JSON field (costmodel/schemas/profile.schema.json)",
    "topology": "a hardware profile's JSON field",
    "DIR": "a placeholder: the checkpoint folder a user names",
    "dist": "torch.distributed, as the README's train.py imports it",
    "gc": "the standard library",
    "self": "a user's nn.Module attribute (self.training)",
}
PLACEHOLDER_PATHS = {"path/to/file.py": "a user's model file (`path/to/file.py:function`)"}
README = ROOT / "README.md"
README_MAX_LINES = 150  # issue #46: a front door a newcomer reads in five minutes
LINK = re.compile(r"!?\[[^\]]*\]\(([^()\s]+)\)")
FILE = re.compile(r"[\w-]+\.(?:py|md|json|toml|sh|txt|png)")

PATH = re.compile(
    r"(?<![\w./-])((?:\.?\w[\w-]*/)+(?:[\w.-]+\.(?:py|md|json|toml|sh|txt|png)|))(?![\w/])"
)
DOTTED = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`")


def _mentions(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    """(page, mention) for every match of `pattern` outside fenced code blocks' diagrams."""
    found = []
    for page in DOCS:
        for match in pattern.finditer(page.read_text()):
            found.append((page.name, match.group(1)))
    return sorted(set(found))


def _path_exists(path: str) -> bool:
    return any((base / path).exists() for base in PATH_BASES)


@cache
def _modules() -> tuple[str, ...]:
    """Every module name of the rooms and of tests/support."""
    names = []
    for root in MODULE_ROOTS:
        package = importlib.import_module(root)
        names.append(root)
        names += [info.name for info in pkgutil.walk_packages(package.__path__, f"{root}.")]
    return tuple(names)


@cache
def _definitions() -> dict[str, list[Any]]:
    """Every top-level class and function of the project, by name (a name may have several)."""
    names: dict[str, list[Any]] = {}
    for room in ROOMS:
        package = importlib.import_module(room)
        modules = [package] + [
            importlib.import_module(info.name)
            for info in pkgutil.walk_packages(package.__path__, f"{room}.")
        ]
        for module in modules:
            for name, value in vars(module).items():
                if getattr(value, "__module__", None) == module.__name__:
                    names.setdefault(name, []).append(value)
    return names


def _has(obj: Any, name: str) -> bool:
    if hasattr(obj, name):
        return True
    if dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)}:
        return True
    return name in getattr(obj, "__annotations__", {})


def _attributes_resolve(obj: Any, attributes: list[str]) -> bool:
    for name in attributes:
        if not _has(obj, name):
            return False
        obj = getattr(obj, name, None)
        if obj is None:  # a dataclass field without a default: nothing further to look into
            return True
    return True


def _module_path_resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        return _attributes_resolve(module, parts[i:])
    return False


def _name_resolves(dotted: str) -> bool:
    if FILE.fullmatch(dotted):
        return any(any((ROOT / room).rglob(dotted)) for room in ROOMS)
    first, *rest = dotted.split(".")
    if first in ROOMS:
        return _module_path_resolves(dotted)
    parts = dotted.split(".")
    for module in _modules():  # a module named by its last parts, then attributes
        tail = module.split(".")
        for i in range(1, len(parts) + 1):
            if tail[-i:] == parts[:i] and _attributes_resolve(
                importlib.import_module(module), parts[i:]
            ):
                return True
    return any(_attributes_resolve(value, rest) for value in _definitions().get(first, []))


@pytest.mark.parametrize(("page", "path"), _mentions(PATH), ids=lambda x: str(x))
def test_every_path_the_docs_mention_exists(page: str, path: str) -> None:
    if path in PLACEHOLDER_PATHS:
        return
    assert _path_exists(path), f"{page} mentions {path}, which is not in the repository"


@pytest.mark.parametrize(("page", "name"), _mentions(DOTTED), ids=lambda x: str(x))
def test_every_dotted_name_the_docs_mention_exists(page: str, name: str) -> None:
    if name.split(".")[0] in NOT_CODE:
        return
    assert _name_resolves(name), f"{page} mentions `{name}`, which the code does not define"


def test_the_docs_are_read() -> None:
    """The reading above finds what the pages hold (a pattern that matched nothing would pass
    every stale name)."""
    assert {p.name for p in DOCS} >= {"architecture.md", "planner.md"}
    paths, names = dict(_mentions(PATH)), _mentions(DOTTED)
    assert len(paths) > 1 and len(names) > 50
    assert ("architecture.md", "autosbp/planner/timing/") in _mentions(PATH)
    assert not _path_exists("autosbp/planner/saved.py")
    assert not _name_resolves("strategies.Space") and not _name_resolves("runtime.program")
    assert _name_resolves("Space.may_gather") and _name_resolves("schedule.run_schedule")


def _links(page: Path) -> list[str]:
    """The relative link targets of `page` (URLs left out)."""
    return _relative_links(page.read_text())


def _relative_links(text: str) -> list[str]:
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    headings = re.findall(
        r"^#{1,6} (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M
    )
    return {_anchor(h) for h in headings}


def test_every_page_is_linked_from_the_readme() -> None:
    linked = {(ROOT / t.split("#")[0]).resolve() for t in _links(README) if t.split("#")[0]}
    missing = [p.name for p in DOCS if p.resolve() not in linked]
    assert not missing, f"README.md links no docs/{missing}: add them to its Read more line"


def test_the_readme_is_a_front_door() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move the detail to a page "
        "of docs/ and link it"
    )


@pytest.mark.parametrize(
    ("page", "target"),
    [(p.relative_to(ROOT).as_posix(), t) for p in (README, *DOCS) for t in _links(p)],
    ids=lambda x: str(x),
)
def test_every_relative_link_resolves(page: str, target: str) -> None:
    source = ROOT / page
    path, _, fragment = target.partition("#")
    file = (source.parent / path).resolve() if path else source
    assert file.is_file(), f"{page} links {target}, but {file.relative_to(ROOT)} is not a file"
    if fragment:
        assert fragment in _anchors(file), (
            f"{page} links {target}: no such heading in {path or page}"
        )


def test_the_links_are_read() -> None:
    """The reading above finds the links the pages hold (a pattern that matched nothing would
    pass every broken link)."""
    assert "docs/architecture.md" in _links(README)
    assert "docs/images/demo-loss.png" in _links(README)
    text = "[a](https://pytorch.org) [b](docs/x.md#y) ![c](i.png) [d](mailto:a@b.c) (e)"
    assert _relative_links(text) == ["docs/x.md#y", "i.png"]
    assert _anchor("Peak memory: predicted vs measured") == "peak-memory-predicted-vs-measured"
    assert _anchor("The runtime beside torch (measured)") == "the-runtime-beside-torch-measured"
