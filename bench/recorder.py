"""What recording a trace costs per span (`autosbp.timeline.Recorder`), on this machine now.

A figure, not a test: a timed assertion fails when other work shares the cores (it did at 32.6
us per span with two test workers on two cores, against 2-5 us alone). Prints the median of 5
runs of 20,000 empty spans and the machine's load beside it.

Run: `python bench/recorder.py`
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

from autosbp.timeline import Recorder  # noqa: E402 - after the path fix above

SPANS, RUNS = 20_000, 5


def per_span_s() -> float:
    recorder = Recorder(0, 0)
    begin = time.perf_counter()
    for k in range(SPANS):
        with recorder.span("forward", k):
            pass
    return (time.perf_counter() - begin) / SPANS


def main() -> None:
    median = statistics.median(per_span_s() for _ in range(RUNS))
    load = os.getloadavg()[0]
    print(f"Recorder: {median * 1e6:.1f} us per span (median of {RUNS} x {SPANS}; load {load:.1f})")


if __name__ == "__main__":
    main()
