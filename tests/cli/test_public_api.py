"""The public API: the names in autosbp.__all__, each importable and never shadowed."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import autosbp


def test_public_names_are_never_shadowed_by_submodules() -> None:
    # Python binds a submodule on its package when it is first imported: a module named like a
    # public function would replace the function (autosbp.capture once did). Import everything,
    # then check every public name.
    for info in pkgutil.walk_packages(autosbp.__path__, "autosbp."):
        importlib.import_module(info.name)
    assert autosbp.__all__ == sorted(autosbp.__all__)
    for name in autosbp.__all__:
        value = getattr(autosbp, name)
        assert not inspect.ismodule(value), f"autosbp.{name} is a module"


def test_public_api_end_to_end_in_a_few_lines() -> None:
    from autosbp import S, auto_parallelize, explain
    from autosbp.zoo import build_model

    model, inputs = build_model("mlp")
    plan = auto_parallelize(model, inputs, profile="cpu-gloo", devices=2)
    assert plan.device_count == 2
    assert plan.solver.status == "optimal"
    assert repr(S(0)) == "S(0)"
    assert explain(plan, "linear").alternatives


def test_distribute_is_the_runtimes() -> None:
    from runtime.distribute import distribute

    assert autosbp.distribute is distribute  # loaded on first use, like Engine
