"""The runtime's proof: training under a plan on 2 and 4 gloo processes equals one device.

Oracle: the same zoo model on one device, compared at every step as `--check` does
(runtime/verify/step_check.py, which derives the bounds): at the plan's own weights, the loss, gradients and
updated buffers against float64 within one device's own fp32 rounding (times 16), and the Adam
update (lr 1e-2) against the same optimizer on whole tensors. Every plan (dp, fsdp,
megatron:tp=2,dp=2, auto, pipelines, micro-batches, recomputation) must pass every step, every
rank must report the same losses, and the state must hold every tensor of the model. Also the
refusals: a plan of another model, of another world size, with pipeline stages, or without a
distributed world.

How it runs: plans are made here (planning is deterministic up to the solver's time limit) and
sent to the workers as JSON; one `run_workers` call per world size trains every case of that
world (process start-up and the first capture cost seconds; the cases are cheap).
Lives elsewhere: the workers (tests/support/runtime_workers.py).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from autosbp.capturing.export import capture_micro_batch
from autosbp.capturing.graph import OpGraph
from autosbp.errors import ExecutionError, PlanError
from autosbp.plan import Plan
from autosbp.plan.values import DTYPES
from autosbp.planner.assemble import PlanContext, assemble_plan
from autosbp.planner.search.entry import search
from autosbp.planner.space.strategy import strategy_space
from autosbp.zoo import build_model
from launching.workers import run_workers
from runtime import Engine
from runtime.verify.verdict import judge
from tests.support.runtime_workers import run_cases
from tests.support.worlds import cases_by_world

STEPS = 3
LR = 1e-2
PLAN_TIME_LIMIT_S = 30.0  # per mesh shape; a merely "feasible" plan still must train exactly
WORKER_TIMEOUT_S = 120.0

# Case name -> (zoo model, its arguments). Tiny sizes: every split the plans use divides (2x2
# meshes, 2 heads over tp=2). gpt-tied shares the embedding with the LM head (one parameter).
GPT = {"layers": 1, "hidden": 16, "heads": 2, "vocab": 32, "seq": 8, "batch": 4}
WIDEDEEP = {"tables": 2, "rows": 64, "dim": 8, "dense": 8, "hidden": 16, "layers": 1, "batch": 8}
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mlp": ("mlp", {"layers": 2, "hidden": 16, "features": 8, "outputs": 4, "batch": 8}),
    "gpt": ("gpt", GPT),
    "gpt-tied": ("gpt", {**GPT, "tied": True}),
    "gpt-2l": ("gpt", {**GPT, "layers": 2}),
    "gpt-2l-tied": ("gpt", {**GPT, "layers": 2, "tied": True}),
    "gpt-4l": ("gpt", {**GPT, "layers": 4}),  # 4 blocks: vp=2 runs 2 x 2 chunks (test_checkpoint)
    "widedeep": ("widedeep", WIDEDEEP),
    "resnet": ("resnet", {"channels": 4, "blocks": 1, "classes": 4, "image": 4, "batch": 4}),
    # Wide enough that a peak is hundreds of kB: tests/runtime/test_memory.py's 10% is then far
    # above the few hundred bytes of an op's transients that decide a tiny model's peak.
    "mlp-wide": ("mlp", {"layers": 2, "hidden": 128, "features": 64, "outputs": 16, "batch": 16}),
    "gpt-wide": (
        "gpt",
        {"layers": 1, "hidden": 64, "heads": 2, "vocab": 128, "seq": 16, "batch": 4},
    ),
}
MEGATRON = "megatron:tp=2,dp=2"
# (world size, model, strategy).
TRAINING: list[tuple[int, str, str]] = [
    *((2, model, s) for model in ("mlp", "gpt", "resnet") for s in ("dp", "fsdp", "auto")),
    *((2, model, s) for model in ("gpt-tied", "widedeep") for s in ("dp", "auto")),
    (2, "widedeep", "fsdp"),  # its (1,)-shaped output bias stays replicated
    *(
        (4, model, s)
        for model in ("mlp", "gpt", "resnet")
        for s in ("dp", "fsdp", MEGATRON, "auto")
    ),
    *((4, "widedeep", s) for s in ("dp", MEGATRON, "auto")),
    # Gradient accumulation: "/mbK" plans K micro-batches of batch / K samples each.
    (2, "gpt", "dp/mb2"),
    (2, "mlp", "auto/mb4"),
    (4, "gpt", f"{MEGATRON}/mb2"),
    # Pipelines (1F1B): 2 stages with 4 micro-batches; an embedding tied across stages (the
    # last stage receives the weight and sends its gradient back); stages of 2 devices each.
    (2, "gpt-2l", "megatron:tp=1,pp=2,dp=1/mb4"),
    (2, "gpt-2l-tied", "megatron:tp=1,pp=2,dp=1/mb2"),
    (2, "gpt-2l", "auto/mb2"),
    (4, "gpt-2l", "megatron:tp=2,pp=2,dp=1/mb2"),
    (4, "gpt-2l", "megatron:tp=1,pp=2,dp=2/mb2"),
    # Recomputation ("/full", "/selective"): checkpointed runs of each block, recomputed in
    # backward (with tensor parallelism, their collectives run again).
    (2, "gpt-2l", "megatron:tp=1,pp=2,dp=1/mb2/full"),
    (4, "gpt-2l", "megatron:tp=2,pp=2,dp=1/mb2/selective"),
    (2, "mlp", "dp/full"),
    # Plans written before plans stated their recomputation per node (format 1: the two above,
    # saved by autosbp at commit aaecd13): they train under format 1's rule.
    (2, "gpt-2l", "format1-full"),
    (4, "gpt-2l", "format1-selective"),
]
FORMAT1 = Path(__file__).with_name("data")
# (id, model the Engine gets, (model, devices, strategy) the plan was made for, expected text)
REFUSALS: list[tuple[str, str, tuple[str, int, str], str]] = [
    ("foreign-model", "gpt", ("mlp", 2, "dp"), "fingerprint"),
    ("wrong-world", "mlp", ("mlp", 4, "dp"), "--nproc 4"),
]
REFUSAL_WORLD = 2


class AlphaBetaPrices:
    """Made-up prices for planning in tests (any prices give valid plans): ops at 10 TFLOP/s and
    1 GB/s with a 1 us floor; collectives and p2p at 10 us + bytes / (100 MB/s); half of the
    communication beside compute hidden."""

    overlap_efficiency = 0.5
    causal_skip = 0.0

    def op_time_s(
        self, flops: float, nbytes: float, dtype: torch.dtype, transcendentals: float = 0.0
    ) -> float:
        return max((flops + transcendentals) / 1e13, nbytes / 1e9, 1e-6)

    def collective_time_s(
        self, kind: str, message_bytes: float, group_size: int, link_class: str
    ) -> float:
        return 1e-5 + message_bytes / 1e8

    def p2p_time_s(self, nbytes: float, link_class: str) -> float:
        return 1e-5 + nbytes / 1e8


# ------------------------------------------------------------------------------ planning
def _build(model: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    zoo_name, kwargs = MODELS[model]
    return build_model(zoo_name, seed=0, **kwargs)


@cache
def _graph(model: str, micro_batches: int = 1, dtype: str = "fp32") -> OpGraph:
    module, inputs = _build(model)
    return capture_micro_batch(
        module, inputs, micro_batches, name=MODELS[model][0], dtype=DTYPES[dtype]
    )


@cache
def _plan_json(model: str, devices: int, strategy_mb: str) -> dict[str, Any]:
    if strategy_mb.startswith("format1-"):
        return json.loads((FORMAT1 / f"{strategy_mb}-{model}.json").read_text())
    strategy, *options = strategy_mb.split("/")
    micro_batches = next((int(o[2:]) for o in options if o.startswith("mb")), 1)
    recompute = next((o for o in options if o in ("selective", "full")), "none")
    dtype = next((o for o in options if o in DTYPES), "fp32")  # bf16: the mixed recipe
    graph = _graph(model, micro_batches, dtype)
    space = dataclasses.replace(
        strategy_space(strategy, recompute, max_stages=2), micro_batches=(micro_batches,)
    )
    batch = MODELS[model][1]["batch"]
    found = search(
        lambda count: graph, batch, devices, AlphaBetaPrices(), lambda shape, mesh_dim: "intra_node",
        space, optimizer="adam", memory_limit_bytes=None, time_limit_s=PLAN_TIME_LIMIT_S,
    )  # fmt: skip
    ctx = PlanContext("test", 0, strategy, batch, DTYPES[dtype], "adam")
    return assemble_plan(found, ctx).to_json()  # plain JSON data, as a plan file holds


def _case(case_id: str, model: str, plan: dict[str, Any]) -> dict[str, Any]:
    zoo_name, kwargs = MODELS[model]
    return {
        "id": case_id,
        "model": zoo_name,
        "model_kwargs": kwargs,
        "plan": plan,
        "steps": STEPS,
        "lr": LR,
    }


def _cases(world_size: int) -> list[dict[str, Any]]:
    cases = [
        _case(f"{model}-{s}", model, _plan_json(model, n, s))
        for n, model, s in TRAINING
        if n == world_size
    ]
    if world_size == REFUSAL_WORLD:
        cases += [
            _case(case_id, model, _plan_json(*made_for)) for case_id, model, made_for, _ in REFUSALS
        ]
    return cases


@pytest.fixture(scope="module")
def worlds() -> Callable[[int], dict[str, list[dict[str, Any]]]]:
    """world size -> {case id: the case's result on each rank}; each world is run once."""
    return cases_by_world(run_cases, _cases, WORKER_TIMEOUT_S)


# ------------------------------------------------------------------------------ tests
@pytest.mark.dist
@pytest.mark.parametrize(
    ("world_size", "model", "strategy"), TRAINING, ids=[f"{n}-{m}-{s}" for n, m, s in TRAINING]
)
def test_training_matches_single_device(
    worlds: Callable[[int], Any], world_size: int, model: str, strategy: str
) -> None:
    per_rank = worlds(world_size)[f"{model}-{strategy}"]
    assert "error" not in per_rank[0], per_rank[0]["error"]
    for rank, result in enumerate(per_rank):
        assert result["losses"] == per_rank[0]["losses"], f"rank {rank} reports another loss"
    verdict = judge(per_rank[0]["checks"])
    assert verdict.passed, verdict.text
    assert len(per_rank[0]["checks"]) == STEPS
    assert set(per_rank[0]["state"]) == set(_build(model)[0].state_dict())


@pytest.mark.dist
@pytest.mark.parametrize(
    ("case_id", "expected"), [(c[0], c[3]) for c in REFUSALS], ids=[c[0] for c in REFUSALS]
)
def test_engine_refuses_mismatched_plan(
    worlds: Callable[[int], Any], case_id: str, expected: str
) -> None:
    per_rank = worlds(REFUSAL_WORLD)[case_id]
    for result in per_rank:
        assert "error" in result and result["error"].startswith("PlanError"), result
        assert expected in result["error"]


def _mlp_plan(edit: str = "") -> Plan:
    """The 2-device dp plan of mlp, with `edit` applied: "stages" (the one stage listed twice)."""
    data = dict(_plan_json("mlp", 2, "dp"))
    if edit == "stages":
        data["stages"] = data["stages"] * 2
    return Plan.from_json(data)


def test_engine_refuses_overlapping_stages() -> None:
    module, inputs = _build("mlp")
    with pytest.raises(PlanError, match="stages"):
        Engine(module, _mlp_plan("stages"), torch.optim.SGD, example_inputs=inputs)


def test_engine_needs_a_distributed_world() -> None:
    module, inputs = _build("mlp")
    with pytest.raises(ExecutionError, match="torchrun"):
        Engine(module, _mlp_plan(), torch.optim.SGD, example_inputs=inputs)


def _engine_error(rank: int, world_size: int, plan: dict[str, Any], device: str) -> str:
    module, inputs = _build("mlp")
    try:
        Engine(module.to(device), Plan.from_json(plan), torch.optim.SGD, example_inputs=inputs)
    except ExecutionError as exc:
        return str(exc)
    return ""


@pytest.mark.dist
def test_engine_refuses_a_model_on_another_device_than_the_world_carries() -> None:
    """A gloo world carries CPU tensors: a model elsewhere (meta here; cuda beside gloo on a
    GPU machine) is refused on every rank with the fix, before any buffer is made."""
    errors = run_workers(_engine_error, 2, (_plan_json("mlp", 2, "dp"), "meta"), timeout_s=60)
    for error in errors:
        assert "on meta, but this world (gloo) carries cpu tensors" in error, error
        assert ".to('cpu')" in error
