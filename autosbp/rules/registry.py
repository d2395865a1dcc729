"""The registry of op rules: op name -> OpRule, filled here and only here.

Lives here: `RULES`, built by `build_registry` from each family module's `rules()` table, in one
explicit list (no registration as an import side effect). Lives elsewhere: the rules themselves
(one module per op family), the public queries over them (`autosbp.rules`).

Invariants: an op has at most one rule (a second one is a bug, caught at import); op names are
the ATen overload names capture writes in a node's `op` ("aten.linear.default"), plus
"placeholder" and "output".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from autosbp.rules import (
    along_dim,
    attention,
    boundary,
    conv,
    embedding,
    factory,
    indexing,
    loss,
    matmul,
    norm,
    pointwise,
    reduction,
    routing,
    view,
)
from autosbp.rules.core import OpRule

FAMILIES: tuple[Callable[[], dict[str, OpRule]], ...] = (
    boundary.rules,
    pointwise.rules,
    matmul.rules,
    attention.rules,
    reduction.rules,
    norm.rules,
    embedding.rules,
    view.rules,
    indexing.rules,
    conv.rules,
    loss.rules,
    factory.rules,
    routing.rules,
    along_dim.rules,
)


def build_registry() -> dict[str, OpRule]:
    registry: dict[str, OpRule] = {}
    for family in FAMILIES:
        for op, rule in family().items():
            assert op not in registry, f"{op} has a rule in two families"
            registry[op] = rule
    return registry


RULES: Mapping[str, OpRule] = build_registry()
