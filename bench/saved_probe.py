"""What autograd keeps, probed (`planner.memory.autograd_probe`) vs read off autograd's nodes, for
every model of the real-model suite (tests/support/real_models.py, MobileNetV2 included): one row
per model.

The check is tests/planner/test_saved.py's (`check_graph`), which CI runs on the zoo models; the
real models' captures take about a minute on 2 cores, so they run here. Prints a markdown table:
the model, the ops checked (distinct op and input flags), pass or the first line of the reason.

Run: `python bench/saved_probe.py [model,model,...]` (default: every model).
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autosbp.capturing.export import capture
from tests.planner.test_saved import check_graph
from tests.rules.test_rules_zoo import node_values
from tests.support.real_models import BUILDERS


def row(name: str) -> str:
    start = time.perf_counter()
    model, inputs = BUILDERS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unknown ops are reported by the real-model bench
        graph = capture(model, inputs, name=name)
    try:
        ops = check_graph(graph, node_values(graph, model, inputs))
        verdict = "pass"
    except AssertionError as exc:
        ops, verdict = 0, str(exc).splitlines()[0]
    return f"| {name} | {ops} | {verdict} | {time.perf_counter() - start:.1f} |"


def main() -> None:
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(BUILDERS)
    torch.set_num_threads(1)
    sys.stdout.write("| model | ops checked | probe = autograd's saved attributes | s |\n")
    sys.stdout.write("|---|---|---|---|\n")
    for name in names:
        sys.stdout.write(row(name) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
