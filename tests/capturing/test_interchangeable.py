"""One graph for one model whatever the process (issue #48 item 1): a loop over a `set` (Gemma3's
and ModernBERT's rotary tables, per layer type) records its iterations in the order Python's
per-process hash seed gives, and capture puts them in one order (autosbp/capturing/interchangeable.py).

Oracles: the same model looping in every order of its keys captures one graph (node for node:
names, ops, shapes, arguments, producers; and fingerprint), and that graph computes the eager
loss; under several PYTHONHASHSEED values (subprocesses, which do iterate the sets in different
orders: checked, so the test can fail) the pure-torch reproduction and a tiny Gemma3 give one
graph each. Lives elsewhere: the ranks' agreement on one graph before a step
(tests/runtime/test_job_control.py), the real models under `--check`
(tests/models/test_real_models.py).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from autosbp.capturing.export import capture, run_graph
from tests.support import canonical_models
from tests.support.hash_seed_capture import rows_digest

ROOT = Path(__file__).resolve().parents[2]
KINDS = sorted(set(canonical_models.KeyedTables.KINDS))
SEEDS = (0, 1, 2)  # each set of SETS is iterated in more than one order among these (asserted)
HASH_SEED_MODELS = ("set-loop", "gemma3")


def _keyed(order: tuple[str, ...]) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    model, inputs = canonical_models.build("set-loop", "cpu")
    model.order = order
    return model, inputs


def test_every_loop_order_captures_one_graph_that_computes_the_loss() -> None:
    seen = {}
    for order in itertools.permutations(KINDS):
        model, inputs = _keyed(order)
        graph = capture(model, inputs, name="keyed")
        seen[order] = (rows_digest(graph), graph.fingerprint())
        state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        with torch.no_grad():
            torch.testing.assert_close(run_graph(graph, state, inputs), model(*inputs))
    assert len(set(seen.values())) == 1, seen


def _capture_under(seed: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONHASHSEED": str(seed)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.hash_seed_capture", *HASH_SEED_MODELS],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_graph_whatever_the_hash_seed() -> None:
    with ThreadPoolExecutor(len(SEEDS)) as pool:
        results = list(pool.map(_capture_under, SEEDS))
    for k in range(len(results[0]["set_orders"])):  # the processes did loop in other orders
        assert len({tuple(r["set_orders"][k]) for r in results}) > 1, results
    for name in HASH_SEED_MODELS:
        graphs = {json.dumps(r["graphs"][name], sort_keys=True) for r in results}
        assert len(graphs) == 1, f"{name}: {graphs}"
