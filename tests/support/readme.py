"""README.md and docs/*.md read as their code: sections, fenced blocks and shell commands, so
that the tests run what the pages say, never a copy of it.

Lives here: `page`, `section`, `blocks`, `shell_commands` and `options`. Lives elsewhere: the
tests that run what they read (tests/cli/test_readme.py, tests/runtime/test_training_job.py)
and the links' and names' checks (tests/test_docs.py).

Invariants: a heading is a line of `#`s and a space outside a fenced block; a block is what
lies between a fence line "```LANGUAGE" and the next "```"; a command's lines joined at a
trailing backslash, comment lines and blank ones left out.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

__all__ = ["REPO", "blocks", "options", "page", "section", "shell_commands"]

REPO = Path(__file__).resolve().parents[2]


def page(name: str = "README.md") -> str:
    """The text of README.md or of a page (`docs/cluster.md`), from the repository's root."""
    return (REPO / name).read_text()


def section(text: str, title: str) -> str:
    """`text` from the heading `title` (written whole: `## Commands`) to the next heading of its
    level or above."""
    level = len(title.split(" ", 1)[0])
    lines = text[text.index(f"{title}\n") :].splitlines(keepends=True)
    fenced = False
    for index, line in enumerate(lines[1:], start=1):
        fenced ^= line.startswith("```")
        hashes = len(line) - len(line.lstrip("#"))
        if not fenced and 0 < hashes <= level and line[hashes : hashes + 1] == " ":
            return "".join(lines[:index])
    return "".join(lines)


def blocks(text: str, language: str | None = None) -> list[str]:
    """The fenced blocks of `text` in `language` (None: every block), in order."""
    found = re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
    return [body for lang, body in found if language is None or lang == language]


def shell_commands(block: str) -> list[list[str]]:
    """A shell block's commands as argument lists: backslash-continued lines joined, comment and
    blank lines left out."""
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = [line.strip() for line in joined.splitlines()]
    return [shlex.split(line) for line in lines if line and not line.startswith("#")]


def options(argv: list[str]) -> dict[str, str]:
    """`--name value` pairs of a command's arguments (a flag without a value maps to "")."""
    found: dict[str, str] = {}
    for index, word in enumerate(argv):
        if word.startswith("--"):
            value = argv[index + 1] if index + 1 < len(argv) else ""
            found[word] = "" if value.startswith("--") else value
    return found
