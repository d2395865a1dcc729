"""Capture models in this process and print what identifies their graphs, as JSON: run under
several PYTHONHASHSEED values by tests/capturing/test_interchangeable.py (issue #48: one graph
for one model whatever the process).

Run: `python -m tests.support.hash_seed_capture NAME [NAME ...]`, each NAME a case of
tests/support/canonical_models.py or a builder of tests/support/real_model_families.py. Prints
{"set_orders": the orders this process iterates the sets the models loop over, "graphs": {NAME:
{"fingerprint": ..., "rows": sha256 of every node's name, op, shapes, arguments and inputs}}}.
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings

import torch

from autosbp.capturing.export import capture
from autosbp.capturing.graph import OpGraph
from tests.support import canonical_models
from tests.support.real_model_families import BUILDERS

# The sets the models iterate: KeyedTables' kinds, Gemma3's and ModernBERT's layer types.
SETS = (canonical_models.KeyedTables.KINDS, ("sliding_attention", "full_attention"))


def rows_digest(graph: OpGraph) -> str:
    """sha256 over the nodes in order: name, op, shapes, arguments, parameter name, producers."""
    digest = hashlib.sha256()
    for name, node in graph.nodes():
        row = f"{name} {node.op} {node.inputs} {node.outputs} {node.args!r} {node.kwargs!r}"
        digest.update(f"{row} {node.name} {graph.producers(name)}\n".encode())
    return digest.hexdigest()


def main(names: list[str]) -> None:
    warnings.simplefilter("ignore")
    graphs = {}
    for name in names:
        with torch.device("meta"):
            if name in canonical_models.CASES:
                model, inputs = canonical_models.build(name, "meta")
            else:
                model, inputs = BUILDERS[name]()
        graph = capture(model, inputs, name=name)
        graphs[name] = {"fingerprint": graph.fingerprint(), "rows": rows_digest(graph)}
    print(json.dumps({"set_orders": [list(set(s)) for s in SETS], "graphs": graphs}))


if __name__ == "__main__":
    main(sys.argv[1:])
