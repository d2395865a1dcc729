"""A worker whose module takes seconds to import in a spawned rank, as one importing torch does
on a loaded machine: tests/runtime/test_job_control.py kills the launcher while its ranks import it, to
check that a rank's parent-death signal is set before (launching.rank).

The launcher imports this module first, then sets SLOW_IMPORT_ENV; its ranks, spawned after,
inherit the variable and sleep on import (while unpickling their arguments).
"""

from __future__ import annotations

import os
import time

SLOW_IMPORT_ENV = "AUTOSBP_TEST_SLOW_IMPORT"
IMPORT_S = 20.0  # far beyond the 5 s a rank may outlive its parent

if os.environ.get(SLOW_IMPORT_ENV):
    time.sleep(IMPORT_S)


def idle(rank: int, world_size: int) -> None:
    """Never reached before the test kills the launcher."""
    time.sleep(IMPORT_S)
