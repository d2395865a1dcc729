"""The whole resume matrix: a checkpoint saved under each of dp, tp=2, pp=2, vp=2, zero=1,
zero=2 and cp=2, resumed under each other (42 pairs), against the uninterrupted runs.

The suite runs a slice of it (tests/runtime/test_checkpoint.py, MATRIX_SLICE: every plan saved
and loaded at least once); this runs every pair with the same cases and oracles in one world of
2 gloo processes and prints, per pair: whether the checkpoint saved again under B right after
the load holds exactly A's tensors (the conversion, bit for bit), whether A's state after the
saved steps is B's bit for bit, and how B's resumed losses and final state differ from B's
uninterrupted run (bit for bit, or the largest relative difference). Exits 1 if a pair breaks
the test's rule (exact conversion; the uninterrupted run's numbers bit for bit where the
states agree, else within rel 1e-5).

Run: `python bench/checkpoint_matrix.py` (49 cases: 50 s on 2 cores at load 7, 32 s of CPU).
Measured 2026-12-07: 42 pairs, every conversion exact; the 20 pairs among dp, pp=2, vp=2, zero=1
and zero=2 (whose states after the saved steps agree bit for bit) continue bit for bit; the 22
with tp=2 or cp=2 on one side within 6.5e-8 (losses) and 8.7e-7 (final states, relative) of
B's uninterrupted run.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

from launching.workers import run_workers  # noqa: E402 - after the path fix above
from tests.runtime.test_checkpoint import (  # noqa: E402
    MATRIX_PLANS,
    REL_TOL,
    WORKER_TIMEOUT_S,
    _matrix,
    resumed,
)
from tests.support.checkpoint_workers import run_checkpoint_cases  # noqa: E402

PAIRS = [(a, b) for a in MATRIX_PLANS for b in MATRIX_PLANS if a != b]


def main() -> int:
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        cases = _matrix(root, PAIRS)
        begin = time.perf_counter()
        per_rank = run_workers(run_checkpoint_cases, 2, (cases,), timeout_s=WORKER_TIMEOUT_S * 4)
        took_s = time.perf_counter() - begin
        results = {c["id"]: [r[i] for r in per_rank] for i, c in enumerate(cases)}
        print(f"{'pair':<13} {'conversion':<11} {'A = B at':<9} {'losses':<10} {'state':<10}")
        broken = 0
        for a, b in PAIRS:
            found = resumed(root, results, a, b)
            ok = found.converted_exactly and (
                found.losses_equal and found.state_equal
                if found.same_state
                else max(found.losses_rel, found.state_rel) <= REL_TOL
            )
            broken += not ok
            losses = "bitwise" if found.losses_equal else f"{found.losses_rel:.1e}"
            state = "bitwise" if found.state_equal else f"{found.state_rel:.1e}"
            exact = "exact" if found.converted_exactly else "DIFFERS"
            print(
                f"{a + '>' + b:<13} {exact:<11} {'yes' if found.same_state else 'no':<9} "
                f"{losses:<10} {state:<10}{'' if ok else '  BROKEN'}"
            )
    print(f"{len(PAIRS)} pairs, {broken} broken; {len(cases)} cases in {took_s:.1f} s")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
