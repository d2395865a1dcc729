"""Fixtures shared by test modules: `one_thread` (torch on one intra-op thread for a module).

Modules of many tiny ops use it (`pytestmark = pytest.mark.usefixtures("one_thread")`): on 2
shared cores, OpenMP's spinning threads make such ops 20-50x slower than one thread does.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
