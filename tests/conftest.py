"""Fixtures shared by test modules: `one_thread` (torch on one intra-op thread for a module);
and the profile every test plans with by default.

Modules of many tiny ops use `one_thread` (`pytestmark = pytest.mark.usefixtures("one_thread")`):
on 2 shared cores, OpenMP's spinning threads make such ops 20-50x slower than one thread does.

Local CPU work's default profile is this machine's, measured on first use
(`costmodel.machine_profile`); the suite plans with the shipped cpu-gloo instead, the same on every
machine, and never measures unless a test measures on purpose (tests/costmodel/
test_machine_profile.py, which unsets these). Set in the environment, so that the commands the
tests run as subprocesses inherit them; the cache folder is one no test run shares with a user's.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ["AUTOSBP_DEFAULT_PROFILE"] = "cpu-gloo"
os.environ["AUTOSBP_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / f"autosbp-tests-{os.getpid()}")


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
