"""What a training job relies on, under every layout the planner emits (issue #44's proof):
clipping's global norm, resumes that see the same batches, each rank's rows, the loss
normalised as one device does, and a step refused when ranks hold different batches.

Oracles:
- the gradient's global 2-norm of one device (float64 of the model's own fp32 gradients on the
  whole batch): the engine's norm, under dp, fsdp, tp=2, pp=2, vp=2, zero=1, zero=2, cp=2 and
  ep=2, must lie within 16x one device's own fp32 rounding of it (fp32 against float64, the
  bound `--check` derives: runtime/verify/step_check.py), floored at fp32's u of the norm;
- the uninterrupted run: a job checkpointed after step 2 (with its loader's position) and
  resumed by a fresh engine and loader gives steps 3 and 4 bit for bit (dp, vp=2, zero=1);
- the layout: under pp=2 x dp=2 the first stage reads only the token ids and the last only the
  labels, each data-parallel rank half of the rows; under tp=2 both ranks read every row, as
  replicas must;
- one device on the whole batch: a micro-batched step whose micro-batches ignore different
  numbers of targets gives one device's loss and gradients (rel 1e-5: fp32 sums in another
  order), where weighting each micro-batch 1/m would not;
- the model under `eval()`: `Engine.evaluate` of a model with dropout (a module and
  attention's dropout_p) and batch norm gives its eval-mode loss (rel 1e-5), twice alike (no
  draw, no running statistic moved), and the training step after it does not (dp, fsdp, tp=2).
"""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from autosbp.planner.api import auto_parallelize
from autosbp.zoo import load_model
from tests.support.job_workers import run_job_cases
from tests.support.worlds import cases_by_world

GPT = {"layers": 4, "hidden": 32, "heads": 2, "vocab": 64, "seq": 8, "batch": 8}
TEXT_GPT = {**GPT, "vocab": 256}  # byte tokens
MOE = {"layers": 2, "hidden": 32, "heads": 2, "experts": 4, "ffn": 64, "vocab": 64, "seq": 8,
       "batch": 8}  # fmt: skip
CLIP = 0.5
U_FP32 = 2.0**-24
NORMS = [
    ("gpt", GPT, "dp"),
    ("gpt", GPT, "fsdp"),
    ("gpt", GPT, "megatron:tp=2,pp=1,dp=1"),
    ("gpt", GPT, "megatron:tp=1,pp=2,dp=1,mb=2"),
    ("gpt", GPT, "megatron:tp=1,pp=2,dp=1,vp=2,mb=2"),
    ("gpt", GPT, "megatron:tp=1,pp=1,dp=2,zero=1"),
    ("gpt", GPT, "megatron:tp=1,pp=1,dp=2,zero=2,mb=2"),
    ("gpt", GPT, "megatron:cp=2"),
    ("moe", MOE, "megatron:tp=1,pp=1,dp=2,ep=2"),
]
RESUMES = ["dp", "megatron:tp=1,pp=2,dp=1,vp=2,mb=2", "megatron:tp=1,pp=1,dp=2,zero=1"]
WEIGHED = ["dp", "megatron:tp=1,pp=2,dp=1"]
EVAL_MODEL = f"{Path(__file__).resolve().parents[1] / 'support' / 'eval_models.py'}:build"
EVALUATED = ["dp", "fsdp", "megatron:tp=2,pp=1,dp=1"]


@cache
def _plan(model: str, args: tuple, strategy: str, devices: int, **options: Any) -> dict:
    module, inputs = load_model(model, dict(args))
    plan = auto_parallelize(
        module, inputs, profile="cpu-gloo", devices=devices, strategy=strategy,
        time_limit_s=30.0, **options,
    )  # fmt: skip
    return plan.to_json()


def _case(kind: str, model: str, args: dict, strategy: str, devices: int = 2, **extra: Any) -> dict:
    options = {"clip_grad_norm": CLIP} if kind == "norm" else {}
    if kind == "weights":
        options["micro_batches"] = 2
    return {
        "id": f"{kind}-{strategy}", "kind": kind, "model": model, "args": args,
        "plan": _plan(model, tuple(sorted(args.items())), strategy, devices, **options),
        "clip": CLIP, **extra,
    }  # fmt: skip


def _cases(world_size: int) -> list[dict]:
    if world_size == 4:
        return [_case("rows", "gpt", GPT, "megatron:tp=1,pp=2,dp=2,mb=2", 4)]
    folder = Path(_FOLDER.name)
    return [
        *(_case("norm", m, a, s) for m, a, s in NORMS),
        *(
            _case("resume", "gpt", TEXT_GPT, s, folder=str(folder / f"ck{i}"))
            for i, s in enumerate(RESUMES)
        ),
        _case("rows", "gpt", GPT, "megatron:tp=2,pp=1,dp=1"),
        *(_case("weights", "gpt", GPT, s) for s in WEIGHED),
        _case("mixed-batches", "gpt", GPT, "dp"),
        *(_case("eval", EVAL_MODEL, {}, s) for s in EVALUATED),
    ]


class _Folder:
    name = ""


_FOLDER = _Folder()
_worlds = cases_by_world(run_job_cases, _cases, timeout_s=600.0)


@pytest.fixture(scope="module", autouse=True)
def _checkpoints(tmp_path_factory: pytest.TempPathFactory) -> None:
    _FOLDER.name = str(tmp_path_factory.mktemp("checkpoints"))


def _one_device(model: str, args: dict, labels_ignored: bool = False) -> dict[str, torch.Tensor]:
    module, inputs = load_model(model, args)
    if labels_ignored:
        ids, labels = inputs
        labels = labels.clone()
        labels[: len(labels) // 2, 2:] = -100
        inputs = (ids, labels)
    loss = module(*inputs)
    loss.backward()
    out = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    out["loss"] = loss.detach()
    return out


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize(("model", "args", "strategy"), NORMS, ids=[s for _, _, s in NORMS])
def test_the_global_norm_is_one_devices(model: str, args: dict, strategy: str) -> None:
    found = _worlds(2)[f"norm-{strategy}"]
    norms = {r["norm"] for r in found}
    assert len(norms) == 1  # every rank clips by the same norm
    grads = _one_device(model, args)
    grads.pop("loss")
    exact = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
    fp32 = float(torch.stack([g.norm() for g in grads.values()]).norm())
    bound = 16 * max(abs(fp32 - exact), U_FP32 * exact)
    assert abs(norms.pop() - exact) <= bound, (exact, found[0]["norm"], bound)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("strategy", RESUMES)
def test_a_resumed_job_continues_bit_for_bit(strategy: str) -> None:
    for found in _worlds(2)[f"resume-{strategy}"]:
        assert found["resumed"] == found["first"][2:], found


@pytest.mark.dist
@pytest.mark.slow
def test_each_rank_reads_only_the_rows_its_placement_needs() -> None:
    pp_dp = _worlds(4)["rows-megatron:tp=1,pp=2,dp=2,mb=2"]
    per_stage: dict[int, list[dict]] = {}
    for found in pp_dp:
        per_stage.setdefault(found["stage"], []).append(found)
    assert [f["reads"] for f in per_stage[0]] == [[0], [0]]  # the ids on the first stage
    assert [f["reads"] for f in per_stage[1]] == [[1], [1]]  # the labels on the last
    for stage in per_stage.values():  # data parallel: each its half, together the batch
        rows = [set(f["rows"]) for f in stage]
        assert not rows[0] & rows[1] and rows[0] | rows[1] == set(range(GPT["batch"]))
    tp = _worlds(2)["rows-megatron:tp=2,pp=1,dp=1"]
    assert [f["rows"] for f in tp] == [list(range(GPT["batch"]))] * 2  # replicas: every row


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("strategy", WEIGHED)
def test_ignored_targets_are_normalised_over_the_whole_batch(strategy: str) -> None:
    want = _one_device("gpt", GPT, labels_ignored=True)
    for found in _worlds(2)[f"weights-{strategy}"]:
        assert found["weights"] is not None and found["weights"][0] < found["weights"][1]
        assert math.isclose(found["loss"], float(want["loss"]), rel_tol=1e-5)
        for name, grad in found["gradients"].items():
            got = torch.tensor(grad)
            assert torch.allclose(got, want[name].flatten(), rtol=1e-4, atol=1e-6), name


@pytest.mark.dist
@pytest.mark.slow
def test_different_batches_on_different_ranks_are_refused() -> None:
    messages = _worlds(2)["mixed-batches-dp"]
    assert all("different batches on different ranks" in m for m in messages), messages


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("strategy", EVALUATED)
def test_evaluation_runs_the_model_in_eval_mode(strategy: str) -> None:
    module, inputs = load_model(EVAL_MODEL)
    with torch.no_grad():
        want = float(module.eval()(*inputs))
        trained = float(module.train()(*inputs))  # draws: only far from eval's value
    assert abs(trained - want) > 1e-2 * want  # the model's modes differ on this batch
    for found in _worlds(2)[f"eval-{strategy}"]:
        first, again = found["evaluations"]
        assert first == again and math.isclose(first, want, rel_tol=1e-5), (first, want)
        assert abs(found["trained"] - want) > 1e-2 * want, found
