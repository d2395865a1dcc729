"""Kills this process at a chosen point of a checkpoint save (tests/runtime/test_checkpoint.py).

Put on PYTHONPATH of a job's process, Python runs it at start-up; the job's forkserver, a new
interpreter with that environment, runs it too, and the ranks it forks inherit what it patched. With
PUBLISH_KILL_DIR=DIR and PUBLISH_KILL_AT=K it counts the renames and removals a process makes of
DIR, DIR.tmp and DIR.old (`os.replace`, `shutil.rmtree`: the steps of a checkpoint publish) and
SIGKILLs itself just before the K-th (1-based); PUBLISH_KILL_MIDWAY=1 kills it instead halfway
through the K-th, a removal then having deleted one file. A kill, not an exception: nothing of
the process's own cleanup runs, as when a machine loses power or the OOM killer strikes.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any

_DIR = os.environ.get("PUBLISH_KILL_DIR")
_AT = int(os.environ.get("PUBLISH_KILL_AT", "0"))
_MIDWAY = os.environ.get("PUBLISH_KILL_MIDWAY") == "1"
_seen = 0


def _watched(path: Any) -> bool:
    target = Path(_DIR or "")
    name = Path(os.fspath(path))
    return name.parent == target.parent and name.name in (
        target.name,
        f"{target.name}.tmp",
        f"{target.name}.old",
    )


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _counting(real: Any, remove: bool) -> Any:
    def step(path: Any, *args: Any, **kwargs: Any) -> Any:
        global _seen
        if _watched(path):
            _seen += 1
            if _seen == _AT and not _MIDWAY:
                _kill()
            if _seen == _AT and remove:
                next(p for p in Path(path).rglob("*") if p.is_file()).unlink()
                _kill()
            if _seen == _AT:  # a rename is atomic: there is no halfway
                real(path, *args, **kwargs)
                _kill()
        return real(path, *args, **kwargs)

    return step


if _DIR and _AT:
    os.replace = _counting(os.replace, remove=False)
    shutil.rmtree = _counting(shutil.rmtree, remove=True)
