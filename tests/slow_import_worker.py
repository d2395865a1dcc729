"""A worker whose module takes seconds to import in a spawned rank, as one importing torch does
on a loaded machine: tests/test_job_control.py kills the launcher while its ranks import it, to
check that a rank's parent-death signal is set before (costmodel.rank)."""

from __future__ import annotations

import multiprocessing
import time

IMPORT_S = 20.0  # far beyond the 5 s a rank may outlive its parent

if multiprocessing.parent_process() is not None:  # in a spawned rank, not in the launcher
    time.sleep(IMPORT_S)


def idle(rank: int, world_size: int) -> None:
    """Never reached before the test kills the launcher."""
    time.sleep(IMPORT_S)
