"""`runtime.verify.peak_memory.measure_peak_bytes` against steps whose peak is known by
construction (the oracle the memory tests of tests/runtime/test_memory.py stand on).

Why a thread: a gloo collective's output can die on gloo's worker thread, which torch's
profiler does not watch; its free must still lower the running total the peak is read from.
"""

from __future__ import annotations

import threading

import torch

from runtime.verify.peak_memory import measure_peak_bytes

MB = 1 << 20


def _freed_on_another_thread() -> None:
    """Holds 1 MB, lets another thread drop the last reference (and join it), then takes
    another 1 MB: never more than 1 MB at once."""
    first = [torch.empty(MB, dtype=torch.uint8)]
    dropper = threading.Thread(target=first.clear)
    dropper.start()
    dropper.join()
    second = torch.empty(MB, dtype=torch.uint8)
    del second


def test_a_free_on_another_thread_lowers_the_peak() -> None:
    peak = measure_peak_bytes(_freed_on_another_thread, list)
    # Beside the 1 MB: the small tensors of torch's own bookkeeping, if any (well under 64 kB);
    # a missed free would read 2 MB.
    assert MB <= peak < MB + 64 * 1024, peak


def test_what_the_caller_holds_is_counted_once() -> None:
    held = torch.empty(MB, dtype=torch.uint8)
    peak = measure_peak_bytes(lambda: torch.empty(MB, dtype=torch.uint8), lambda: [held, held[:10]])
    assert 2 * MB <= peak < 2 * MB + 64 * 1024, peak
