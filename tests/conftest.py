"""Fixtures shared by test modules: `one_thread` (torch on one intra-op thread for a module);
and the profile every test plans with by default.

Modules of many tiny ops use `one_thread` (`pytestmark = pytest.mark.usefixtures("one_thread")`):
on 2 shared cores, OpenMP's spinning threads make such ops 20-50x slower than one thread does.

Local CPU work's default profile is this machine's, measured on first use
(`costmodel.machine_profile`); the suite plans with the shipped cpu-gloo instead, the same on every
machine, and never measures unless a test measures on purpose (tests/costmodel/
test_machine_profile.py, which unsets these). Set in the environment, so that the commands the
tests run as subprocesses inherit them; the cache folder is one no test run shares with a user's.

The modules of `SHARED_CAPTURES`' folders capture through `shared_captures` in this process
(tests/support/shared_captures.py): a model planned for several cases is captured once per
session. Not tests/capturing and tests/cli, whose subject is capture and what it reports.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ["AUTOSBP_DEFAULT_PROFILE"] = "cpu-gloo"
os.environ["AUTOSBP_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / f"autosbp-tests-{os.getpid()}")
SHARED_CAPTURES = ("models", "planner", "runtime")  # folders of tests/


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def _shared_captures(request: pytest.FixtureRequest) -> Iterator[None]:
    folder = Path(request.path).parent.relative_to(Path(__file__).parent).parts[:1]
    if not folder or folder[0] not in SHARED_CAPTURES:
        yield
        return
    from tests.support.shared_captures import shared_captures

    with shared_captures():
        yield


def pytest_sessionfinish(session: pytest.Session) -> None:
    if "tests.support.shared_captures" in sys.modules:
        from tests.support.shared_captures import forget_captures

        forget_captures()
