"""`--check` (runtime/verify/step_check.py): it passes correct plans where a naive check false-alarms, and it
fails wrong ones, naming the tensors that differ and a cause only where the evidence shows one.

Oracles: in-process, a "plan" that is one device summing in another order (the batch cut in two
halves, each loss halved: the same function, other roundings) passes, and the same step with a
known bug (a gradient times 1 + 1e-3, doubled, halved; an update missed; a loss off) fails with
the matching cause. On gloo processes, the real job (`runtime.trainer.train_worker`): the models that
false-alarmed (a separate key bias, a bias feeding BatchNorm, dropout, an op with no float64
kernel) pass under data, fully sharded and tensor parallel plans, and bugs patched into the
runtime of the worker processes (tests/support/check_workers.py) fail. The README's 8-process
`megatron:tp=2,pp=2,dp=2` GPT, which failed the old check at 2.15e-05, passes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from autosbp.capturing.batches import split_micro_batches
from autosbp.errors import ExecutionError
from autosbp.planner.api import auto_parallelize
from autosbp.zoo import ZOO_MODELS, load_model
from launching.workers import run_workers
from runtime.jobs import TrainSpec, adam
from runtime.verify.one_device import disable_dropout
from runtime.verify.step_check import Reference
from runtime.verify.verdict import Kind, StepCheck, Verdict, judge
from tests.support import check_models
from tests.support.check_workers import run_checked

LR = 1e-2
STEPS = 3
MODELS_FILE = Path(check_models.__file__).resolve()
WORKER_TIMEOUT_S = 300.0
Tamper = Callable[[dict[str, torch.Tensor]], None]


def _model(name: str) -> str:
    """A zoo name as is; a builder of tests/support/check_models.py as `path:function`."""
    return name if name in ZOO_MODELS else f"{MODELS_FILE}:{name}"


# ------------------------------------------------------------------------- in one process
def _emulated_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: tuple[torch.Tensor, ...],
    pieces: int,
    tamper: Tamper | None = None,
) -> tuple[dict[str, torch.Tensor], float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One fp32 step of `model` with the batch cut in `pieces` (another summation order than
    the reference's), optionally with the gradients tampered: (weights before, loss,
    gradients, state after), as the job hands them to `Reference.check`."""
    before = _state(model)
    optimizer.zero_grad(set_to_none=True)
    loss = torch.zeros(())
    for piece in split_micro_batches(inputs, pieces):
        part = model(*piece) / pieces
        part.backward()
        loss += part.detach()
    gradients = {  # zeros where backward never reached, as Engine.full_gradients gives them
        n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        for n, p in model.named_parameters()
    }
    if tamper is not None:
        tamper(gradients)
        for name, p in model.named_parameters():
            p.grad = gradients[name].clone()
    optimizer.step()
    after = _state(model)
    return before, float(loss), gradients, after


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent ones too), as `Engine.full_state_dict`."""
    return {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}


def _check_in_process(
    name: str, pieces: int, tamper: Tamper | None = None, skip_update: str | None = None
) -> Verdict:
    """STEPS emulated steps of tests/support/check_models.py's `name`, checked against `Reference`."""
    model, inputs = getattr(check_models, name)()
    dropout = disable_dropout(model)
    reference = Reference(model, lambda ps: adam(ps, LR), 1, inputs, dropout)
    plan = copy.deepcopy(model)
    optimizer = adam([p for n, p in plan.named_parameters() if n != skip_update], LR)
    checks: list[StepCheck] = []
    for step in range(STEPS):
        before, loss, gradients, after = _emulated_step(plan, optimizer, inputs, pieces, tamper)
        checks.append(reference.check(step, inputs, before, loss, gradients, after))
    return judge(checks)


# (model, pieces the emulated plan cuts the batch in, text the verdict must hold). conv_bn keeps
# one piece: BatchNorm's statistics are per piece, so two pieces would be another function.
FALSE_ALARMS = [
    ("attention", 2, "Left out: 1 gradient(s) exactly 0 in float64"),
    ("attention", 2, "k_proj.bias"),
    ("conv_bn", 1, "conv.bias"),
    ("dropout", 2, "Dropout set to p = 0 on both sides: drop"),
    ("grouped", 2, "aten._grouped_mm.default"),
    ("buffers", 1, "matches single-device training"),  # bool, int64 and complex buffers
]


@pytest.mark.parametrize(
    ("name", "pieces", "says"), FALSE_ALARMS, ids=[f"{n}-{s[:12]}" for n, _, s in FALSE_ALARMS]
)
def test_a_regrouped_step_passes(name: str, pieces: int, says: str) -> None:
    verdict = _check_in_process(name, pieces)
    assert verdict.passed, verdict.text
    assert verdict.text.startswith("matches single-device training")
    assert says in verdict.text


def _scale(name: str, factor: float) -> Tamper:
    def tamper(gradients: dict[str, torch.Tensor]) -> None:
        gradients[name].mul_(factor)

    return tamper


def _scale_all(factor: float) -> Tamper:
    def tamper(gradients: dict[str, torch.Tensor]) -> None:
        for g in gradients.values():
            g.mul_(factor)

    return tamper


# (id, tamper, parameter left out of the optimizer, texts the verdict must hold)
BUGS: list[tuple[str, Tamper | None, str | None, tuple[str, ...]]] = [
    (
        "gradient-times-1.001",
        _scale("q_proj.weight", 1 + 1e-3),
        None,
        ("gradient of q_proj.weight [16, 16]", "1.001 times one device's", "the forward is right"),
    ),
    ("doubled", _scale_all(2.0), None, ("each gradient listed is 2 times one device's",)),
    ("halved", _scale("head.weight", 0.5), None, ("is 1/2 of one device's", "head.weight")),
    ("update-missed", None, "embed.weight", ("update of embed.weight", "optimizer's update")),
]


@pytest.mark.parametrize(
    ("tamper", "skip", "says"), [b[1:] for b in BUGS], ids=[b[0] for b in BUGS]
)
def test_a_wrong_step_fails(tamper: Tamper | None, skip: str | None, says: tuple[str, ...]) -> None:
    verdict = _check_in_process("attention", 2, tamper, skip)
    assert not verdict.passed
    assert verdict.text.startswith("the plan's training differs from one device")
    for text in says:
        assert text in verdict.text, verdict.text


BufferTamper = Callable[[torch.Tensor], object]
# (buffer of check_models.buffers, a wrong value of it after the step): one element of the
# bool mask and of the int64 permutation (must be equal), the complex spectrum off by 1e-3.
WRONG_BUFFERS: list[tuple[str, BufferTamper]] = [
    ("mask", lambda t: t[0, 1].logical_not_()),
    ("order", lambda t: t[0].add_(1)),
    ("spectrum", lambda t: t.mul_(1 + 1e-3)),
]


@pytest.mark.parametrize(("name", "tamper"), WRONG_BUFFERS, ids=[b[0] for b in WRONG_BUFFERS])
def test_a_wrong_buffer_of_any_dtype_fails(name: str, tamper: BufferTamper) -> None:
    """Issue #48 item 2: the check took `abs` of every buffer it did not bound, which bool has
    not (GPT-BigCode's causal mask), and held a complex one to exact equality."""
    model, inputs = check_models.buffers()
    reference = Reference(model, lambda ps: adam(ps, LR), 1, inputs)
    plan = copy.deepcopy(model)
    before, loss, gradients, after = _emulated_step(
        plan, adam(list(plan.parameters()), LR), inputs, 1
    )
    tamper(after[name])
    verdict = judge([reference.check(0, inputs, before, loss, gradients, after)])
    assert not verdict.passed
    assert f"buffer of {name}" in verdict.text, verdict.text


def test_a_clipped_step_at_the_schedules_rate_is_checked_as_the_job_ran_it() -> None:
    """The job clips its gradients to a global norm and steps at its schedule's rate (a warmup
    step's lr / 4 here): told both, the check passes; not told, it reads the clipped gradients
    as a wrong backward and the step as a wrong update (as `autosbp train --check
    --clip-grad-norm 1 --warmup-steps 2` did until 2026-12-07)."""
    model, inputs = check_models.attention()
    clip: list[float] = []

    def clipped(gradients: dict[str, torch.Tensor]) -> None:
        norm = float(torch.stack([g.norm() for g in gradients.values()]).norm())
        clip.append(0.5 * norm)  # a limit the step's norm passes: clipped by half
        for g in gradients.values():
            g.mul_(clip[0] / (norm + 1e-6))

    plan = copy.deepcopy(model)
    optimizer = adam(list(plan.parameters()), LR)
    for group in optimizer.param_groups:
        group["lr"] = LR / 4
    step = _emulated_step(plan, optimizer, inputs, 2, clipped)
    told = Reference(model, lambda ps: adam(ps, LR), 1, inputs)
    verdict = judge([told.check(0, inputs, *step, clip=clip[0], lr=LR / 4)])
    assert verdict.passed, verdict.text
    for told_only, wrong in (({}, "gradient of"), ({"clip": clip[0]}, "update of")):
        reference = Reference(model, lambda ps: adam(ps, LR), 1, inputs)
        verdict = judge([reference.check(0, inputs, *step, **told_only)])
        assert not verdict.passed and wrong in verdict.text, verdict.text


def test_a_wrong_loss_is_a_wrong_forward() -> None:
    model, inputs = check_models.attention()
    reference = Reference(model, lambda ps: adam(ps, LR), 1, inputs)
    plan = copy.deepcopy(model)
    before, loss, gradients, after = _emulated_step(
        plan, adam(list(plan.parameters()), LR), inputs, 2
    )
    verdict = judge([reference.check(0, inputs, before, loss * (1 + 1e-4), gradients, after)])
    assert not verdict.passed
    assert "The loss itself differs, so the forward differs" in verdict.text


def test_a_trained_frozen_parameter_is_named() -> None:
    """A parameter frozen on one device that the plan trains anyway (as `Engine` does with every
    parameter the graph holds) is a difference the verdict explains."""
    model, inputs = check_models.attention()
    dict(model.named_parameters())["o_proj.bias"].requires_grad_(False)
    reference = Reference(model, lambda ps: adam(ps, LR), 1, inputs)
    plan = copy.deepcopy(model).requires_grad_(True)
    step = _emulated_step(plan, adam(list(plan.parameters()), LR), inputs, 2)
    verdict = judge([reference.check(0, inputs, *step)])
    assert not verdict.passed
    assert "o_proj.bias: frozen on one device (requires_grad=False)" in verdict.text


def test_a_resumed_job_is_checked_without_updates() -> None:
    """Resumed from a checkpoint, the plan's optimizer holds state the reference never saw: the
    forward and backward are still compared, the updates are not, and the verdict says so."""
    model, inputs = check_models.attention()
    reference = Reference(model, None, 1, inputs)
    plan = copy.deepcopy(model)
    step = _emulated_step(plan, adam(list(plan.parameters()), LR), inputs, 2)
    check = reference.check(0, inputs, *step)
    assert dict(check.counts)[Kind.UPDATE] == 0 and dict(check.counts)[Kind.GRADIENT] > 0
    verdict = judge([check])
    assert verdict.passed, verdict.text
    assert "Updates not compared: the job resumed from a checkpoint" in verdict.text


def test_a_model_without_a_float64_path_is_refused_clearly() -> None:
    model, inputs = check_models.float32_only()
    reference = Reference(model, lambda ps: adam(ps, LR), 1, inputs)
    plan = copy.deepcopy(model)
    step = _emulated_step(plan, adam(list(plan.parameters()), LR), inputs, 2)
    with pytest.raises(
        ExecutionError, match=r"runs in fp32 but not in float64.*float32 inputs only"
    ):
        reference.check(0, inputs, *step)


def test_a_model_still_random_is_refused() -> None:
    model, inputs = check_models.functional_dropout()
    with pytest.raises(ExecutionError, match="depends on the random seed"):
        Reference(model, lambda ps: adam(ps, LR), 1, inputs, disable_dropout(model))


# --------------------------------------------------------------------- on gloo processes
@cache
def _plan(model: str, devices: int, strategy: str, profile: str = "cpu-gloo") -> dict[str, Any]:
    module, inputs = load_model(_model(model))
    plan = auto_parallelize(
        module, inputs, profile=profile, devices=devices, strategy=strategy, time_limit_s=30.0
    )
    return plan.to_json()


TP2 = "megatron:tp=2,pp=1,dp=1"
# (model, strategy, injected bug, texts the verdict must hold); two processes.
JOBS: list[tuple[str, str, str, tuple[str, ...]]] = [
    ("attention", "dp", "none", ("matches", "k_proj.bias")),
    ("attention", "fsdp", "none", ("matches", "k_proj.bias")),
    ("attention", TP2, "none", ("matches", "k_proj.bias")),
    ("attention", "auto", "none", ("matches",)),
    ("conv_bn", "dp", "none", ("matches", "conv.bias")),
    ("dropout", "dp", "none", ("matches", "drop")),
    ("grouped", "dp", "none", ("matches", "aten._grouped_mm.default")),
    ("gpt", "megatron:tp=2,pp=1,dp=1,mb=2", "none", ("matches",)),
    ("attention", "dp", "grad-scale", ("1.001 times one device's", "the forward is right")),
    ("attention", "fsdp", "grad-scale", ("1.001 times one device's", "the forward is right")),
    ("attention", TP2, "all-reduce-average", ("The loss itself differs",)),
    ("attention", "dp", "sync-twice", ("each gradient listed is 2 times one device's",)),
]


@pytest.fixture(scope="module")
def two_process_checks() -> dict[str, list[StepCheck]]:
    cases = [
        (f"{m}-{s}-{f}", TrainSpec(_model(m), {}, _plan(m, 2, s), STEPS, lr=LR, check=True), f)
        for m, s, f, _ in JOBS
    ]
    return run_workers(run_checked, 2, (cases,), timeout_s=WORKER_TIMEOUT_S)[0]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize(
    ("model", "strategy", "fault", "says"), JOBS, ids=[f"{m}-{s}-{f}" for m, s, f, _ in JOBS]
)
def test_jobs_pass_or_fail_as_they_should(
    two_process_checks: dict[str, list[StepCheck]],
    model: str,
    strategy: str,
    fault: str,
    says: tuple[str, ...],
) -> None:
    checks = two_process_checks[f"{model}-{strategy}-{fault}"]
    assert len(checks) == STEPS
    verdict = judge(checks)
    assert verdict.passed == (fault == "none"), verdict.text
    for text in says:
        assert text in verdict.text, verdict.text


@pytest.mark.slow
@pytest.mark.dist
def test_readme_eight_process_plan_passes() -> None:
    """The README's `autosbp train gpt --nproc 8 --plan p.json --check` with p.json from `autosbp
    plan gpt --devices 8 --profile dgx-a100 --strategy megatron:tp=2,pp=2,dp=2` (the old check:
    2.15e-05 > 1e-05)."""
    spec = TrainSpec(
        "gpt", {}, _plan("gpt", 8, "megatron:tp=2,pp=2,dp=2", "dgx-a100"), 2, lr=LR, check=True
    )
    checks = run_workers(run_checked, 8, ([("readme", spec, "none")],), timeout_s=WORKER_TIMEOUT_S)
    verdict = judge(checks[0]["readme"])
    assert verdict.passed, verdict.text
    assert {kind for kind, n in checks[0]["readme"][0].counts if n} == {
        Kind.LOSS,
        Kind.GRADIENT,
        Kind.UPDATE,
    }
