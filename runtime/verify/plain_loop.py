"""The same training job as a plain PyTorch loop on one process: the curve a plan's job is shown
beside (`autosbp demo`, bench/runtime.py).

Lives here: `plain_losses` (a job's recipe run by torch alone: the model's own forward and
backward on the whole batch, torch's AdamW or Adam or SGD over the same two parameter groups,
`torch.nn.utils.clip_grad_norm_`, the schedule's learning rate, on the job's batches: its
sampler with its seed) and `PlainCurve`. Lives elsewhere: the job (`runtime.jobs`), its data
(`runtime.data`), the schedule's formula (`runtime.optim.LrSchedule`), the step-by-step check
of a plan against one device (`runtime.verify.step_check`, the oracle of correctness: this is
the user's comparison of curves, not a proof).

The loop runs in fp32 whatever the job's dtype: it is what a user would write first, so a
bf16 job's curve beside it shows what mixed precision costs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from runtime.optim import SGD_MOMENTUM, LrSchedule

if TYPE_CHECKING:
    from runtime.job_spec import TrainSpec

__all__ = ["PlainCurve", "plain_losses"]


@dataclass(frozen=True)
class PlainCurve:
    """The plain loop's loss per step, its evaluations (step, mean loss) and its seconds per
    step (the mean over the steps after the first)."""

    losses: tuple[float, ...]
    evals: tuple[tuple[int, float], ...]
    step_s: float


def plain_losses(spec: TrainSpec, global_batch: int, optimizer: str) -> PlainCurve:
    """`spec`'s job (its model, data, optimizer kind `optimizer`, schedule, clipping and
    evaluations) by torch alone on this process, over the job's batches of `global_batch`."""
    from autosbp.zoo import load_model
    from runtime.data import BatchLayout, EvalLoader, RankLoader, input_specs, load_data

    model, example = load_model(spec.model, spec.model_args)
    layout = BatchLayout.whole(global_batch, input_specs(example))
    assert spec.data is not None, "the plain loop runs a job with a data set"
    train = RankLoader(load_data(spec.data, spec.data_args), layout, seed=spec.seed)
    evals = (
        EvalLoader(load_data(spec.eval_data, spec.eval_args), layout)
        if spec.eval_data is not None
        else None
    )
    step_optimizer = _optimizer(model, optimizer, spec.lr, spec.weight_decay)
    schedule = LrSchedule(spec.lr, spec.steps, spec.lr_schedule, spec.warmup_steps, spec.min_lr)
    losses: list[float] = []
    evaluated: list[tuple[int, float]] = []
    took: list[float] = []
    for step, (pieces, _) in zip(range(spec.steps), train, strict=False):
        start = time.perf_counter()
        schedule.apply(step_optimizer, step)
        step_optimizer.zero_grad()
        loss = model(*_whole(pieces))
        loss.backward()
        if spec.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip_grad_norm)
        step_optimizer.step()
        took.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
        done = step + 1
        if evals is not None and (
            done == spec.steps or (spec.eval_every and done % spec.eval_every == 0)
        ):
            evaluated.append((done, _evaluate(model, evals, spec.eval_batches)))
    mean_s = sum(took[1:]) / max(len(took) - 1, 1)
    return PlainCurve(tuple(losses), tuple(evaluated), mean_s)


def _optimizer(
    model: torch.nn.Module, kind: str, lr: float, weight_decay: float
) -> torch.optim.Optimizer:
    """torch's optimizer of `kind`, weight decay on the parameters of 2 or more dims only."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=lr)
    return torch.optim.SGD(groups, lr=lr, momentum=SGD_MOMENTUM if kind == "sgd_momentum" else 0.0)


def _whole(pieces: tuple[tuple[torch.Tensor | None, ...], ...]) -> tuple[torch.Tensor, ...]:
    """The one micro-batch of a whole layout, every input read."""
    (batch,) = pieces
    return tuple(x for x in batch if x is not None)


def _evaluate(model: torch.nn.Module, loader: object, batches: int | None) -> float:
    losses = []
    model.eval()
    with torch.no_grad():
        for pieces, _ in loader:  # type: ignore[attr-defined]
            losses.append(float(model(*_whole(pieces))))
            if batches is not None and len(losses) == batches:
                break
    model.train()
    return sum(losses) / len(losses)
