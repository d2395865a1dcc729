"""DTensor export: `placements(plan, name)` and `device_mesh(plan)` in torch's terms, and
`autosbp.distribute` training a model with the user's own loop and torch's own op
propagation. Oracle: one device at the same weights, with `--check`'s bounds
(runtime.verify.step_check.Reference), on 2 gloo processes, for a data-parallel, an FSDP and a
tensor-parallel plan; the same check fails on torch 2.13's F.mse_loss bug (gradients 2x)."""

from __future__ import annotations

import dataclasses

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from autosbp import auto_parallelize
from autosbp.errors import PlanError
from autosbp.plan import Plan, device_mesh, placements
from autosbp.plan.dtensor import dtensor_placement
from autosbp.sbp import parse_nd_sbp
from launching.workers import run_workers
from runtime.distribute import input_names
from tests.plan.test_plan_json import sample_plan
from tests.support import distribute_workers as workers

STRATEGIES = {"dp": "dp", "fsdp": "fsdp", "tp": "megatron:tp=2,pp=1,dp=1"}


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    model, inputs = workers.build()
    return {
        name: auto_parallelize(model, inputs, profile="cpu-gloo", devices=2, strategy=strategy)
        for name, strategy in STRATEGIES.items()
    }


@pytest.mark.parametrize(
    ("sbp", "want"),
    [("S(1)", Shard(1)), ("B", Replicate()), ("P", Partial("sum")), ("P(max)", Partial("max"))],
    ids=["split", "broadcast", "partial-sum", "partial-max"],
)
def test_dtensor_placement(sbp: str, want: object) -> None:
    (one,) = parse_nd_sbp(sbp)
    assert dtensor_placement(one) == want


def test_placements_of_parameters_and_inputs() -> None:
    plan = sample_plan()  # a 2x2 mesh; fc.weight is BS(0), the linear node's output S(0)S(1)
    assert placements(plan, "fc.weight") == (Replicate(), Shard(0))
    assert placements(plan, "linear") == (Shard(0), Shard(1))
    with pytest.raises(PlanError, match=r"did you mean 'fc\.weight'"):
        placements(plan, "fc.weigth")


def test_device_mesh_refusals() -> None:
    plan = sample_plan()
    with pytest.raises(PlanError, match=r"initialized torch\.distributed world"):
        device_mesh(plan)
    two = dataclasses.replace(plan, stages=(plan.stages[0], plan.stages[0]))
    with pytest.raises(PlanError, match="2 pipeline stages"):
        device_mesh(two)
    with pytest.raises(PlanError, match=r"stage 5 is not one of 0\.\.1"):
        device_mesh(two, stage=5)


def test_input_names_in_forward_order(plans: dict[str, Plan]) -> None:
    assert input_names(plans["dp"]) == ["x", "target"]
    assert placements(plans["dp"], "x") == (Shard(0),)


@pytest.fixture(scope="module")
def trained(plans: dict[str, Plan]) -> dict[tuple[str, str], list[tuple[bool, float, str]]]:
    """Each strategy with the square loss, and dp with F.mse_loss, in one 2-process world."""
    cases = [(name, "pow") for name in STRATEGIES] + [("dp", "mse")]
    jobs = [(plans[name].to_json(), loss) for name, loss in cases]
    per_case, freed = run_workers(workers.distribute_worker, 2, (jobs,), timeout_s=120)[0]
    return {**dict(zip(cases, per_case, strict=True)), "freed at once": freed}


@pytest.mark.parametrize("strategy", list(STRATEGIES), ids=list(STRATEGIES))
def test_distributed_model_trains_like_one_device(
    strategy: str, plans: dict[str, Plan], trained: dict
) -> None:
    layouts = {placements(plans[strategy], name) for name in plans[strategy].params}
    assert layouts != {(Replicate(),)} or strategy == "dp"  # fsdp and tp shard something
    steps = trained[(strategy, "pow")]
    assert len(steps) == workers.STEPS
    for passed, worst, text in steps:
        assert passed, text
        assert worst <= 1.0


def test_a_distributed_model_is_freed_with_its_last_reference(trained: dict) -> None:
    """No cycle through the distributing forward: a model the user drops takes its DTensors
    with it at once, not at interpreter exit (where torch 2.13 on gloo may abort)."""
    assert trained["freed at once"]


def test_the_check_catches_torchs_mse_loss_bug(trained: dict) -> None:
    """The same check, on F.mse_loss under a batch-sharded input: torch 2.13's DTensor doubles
    the gradients (docs/limits.md), and the check says so (it can fail)."""
    passed, worst, text = trained[("dp", "mse")][0]
    if passed:
        pytest.skip("this torch's DTensor gets F.mse_loss's gradient right: update docs/limits.md")
    assert worst > 100, text  # a bug, 10^2+ times the rounding bound (measured: 4e5)
    assert "the forward is right" in text and "2 times one device's" in text, text
