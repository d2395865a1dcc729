"""Plan JSON: round trip through the published schema, and clear errors for damaged files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from autosbp.errors import PlanError
from autosbp.plan import (
    NodePlan,
    ParamPlan,
    Plan,
    Predicted,
    SolverReport,
    StagePlan,
    load_plan,
    save_plan,
)
from autosbp.plan.values import PRICED_GRAD_BUCKET_BYTES


def sample_plan() -> Plan:
    return Plan(
        model_name="mlp",
        fingerprint="abc123",
        profile="cpu-gloo",
        device_count=4,
        memory_limit_bytes=1 << 30,
        strategy="auto",
        mesh_shape=(2, 2),
        mesh_dims=("d0", "d1"),
        link_classes=("intra_node", "intra_node"),
        stages=(StagePlan((0, 1, 2, 3), (2, 2), (0, 1), 0.01, 1234),),
        micro_batches=1,
        recompute="none",
        global_batch=8,
        dtype="fp32",
        optimizer="adam",
        nodes={"linear": NodePlan("aten.linear.default", ("S(0)B", "BS(0)"), ("S(0)S(1)",))},
        params={"fc.weight": ParamPlan("BS(0)", 0, "BS(0)", (16, 8))},
        predicted=Predicted(0.01, 1234, 800.0, {"compute_s": 0.008, "comm_s": 0.002}),
        solver=SolverReport("optimal", 0.0, 0.1),
    )


def test_round_trip(tmp_path: Path) -> None:
    plan = sample_plan()
    path = save_plan(plan, tmp_path / "plan.json")
    assert load_plan(path) == plan
    data = json.loads(path.read_text())
    assert data["nodes"]["linear"]["inputs_dtensor"] == [
        "(Shard(0), Replicate())",
        "(Replicate(), Shard(0))",
    ]


def test_plans_written_before_the_bucket_cap_was_recorded_load_with_what_they_priced(
    tmp_path: Path,
) -> None:
    older = Path(__file__).parents[1] / "runtime" / "data" / "format1-full-gpt-2l.json"
    assert "grad_bucket_bytes" not in json.loads(older.read_text())
    assert load_plan(older).grad_bucket_bytes == PRICED_GRAD_BUCKET_BYTES == 25 * 2**20
    stated = dataclasses.replace(sample_plan(), grad_bucket_bytes=1 << 20)
    assert load_plan(save_plan(stated, tmp_path / "plan.json")).grad_bucket_bytes == 1 << 20


def test_plans_written_before_the_search_effort_was_recorded_load(tmp_path: Path) -> None:
    path = save_plan(sample_plan(), tmp_path / "plan.json")
    data = json.loads(path.read_text())
    assert data["solver"] == {
        "status": "optimal", "gap": 0.0, "seconds": 0.1, "configurations": 0, "bounded": 0,
        "solved": 0,
    }  # fmt: skip
    for key in ("configurations", "bounded", "solved"):
        del data["solver"][key]
    path.write_text(json.dumps(data))
    assert load_plan(path) == sample_plan()


def _damage(data: dict, how: str) -> dict | str:
    if how == "truncated":
        return json.dumps(data)[:200]
    if how == "foreign":
        return {"hello": "world"}
    if how == "version":
        return {**data, "version": 99}
    if how == "bad_sbp":
        data["params"]["fc.weight"]["sbp"] = "X(3)"
        return data
    if how == "missing":
        del data["predicted"]
        return data
    raise AssertionError(how)


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("truncated", "not valid JSON"),
        ("foreign", "not an autosbp plan"),
        ("version", "plan version 99"),
        ("bad_sbp", "params/fc.weight/sbp"),
        ("missing", "'predicted' is a required property"),
    ],
)
def test_damaged_files_give_clear_errors(tmp_path: Path, how: str, expected: str) -> None:
    damaged = _damage(sample_plan().to_json(), how)
    path = tmp_path / "plan.json"
    path.write_text(damaged if isinstance(damaged, str) else json.dumps(damaged))
    with pytest.raises(PlanError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        load_plan(path)


def test_plan_refuses_another_model_and_world() -> None:
    plan = sample_plan()
    with pytest.raises(PlanError, match="fingerprint"):
        plan.check_model("zzz")
    with pytest.raises(PlanError, match="--nproc 4"):
        plan.check_world(2)
