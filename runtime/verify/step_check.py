"""`--check`: is each training step of a plan the step one device takes, up to fp32 rounding?

Lives here: `StepChecker` (every rank: gathers the plan's weights and gradients each step; rank 0
compares them), `Reference` (rank 0's oracle: the model on one device in float64 and in fp32,
and the job's optimizer on whole tensors), the bounds below and the comparisons that apply
them. Lives elsewhere: evaluating the model on one device (float64, fp32, nudged draws, the fp32
fallback, dropout off: `runtime.verify.one_device`), the values a comparison yields and the
verdict's text (`runtime.verify.verdict`), the job that steps the checker (`runtime.jobs`), the
CLI's table (`autosbp.commands.train`), the gathering of whole tensors
(`Engine.full_state_dict`, `Engine.full_gradients`).

Why not compare trajectories. Two correct fp32 programs that sum in different orders differ by
rounding, and Adam divides each gradient element by its own running size: an element whose exact
gradient is about 0 (an attention key bias, as softmax ignores a constant per row; a bias feeding
a normalization) takes lr-sized steps in a direction set by rounding noise. Two one-process runs
that differ only in thread count drift 5.2e-2 apart on ResNet-18. So the check never follows a
trajectory of its own: at every step t it takes the plan's own weights w_t and asks two
questions, each with a bound derived below.

1. The forward and backward: the loss L, every parameter's gradient g, every buffer the forward
   updates (BatchNorm's running statistics). The reference evaluates them at w_t in float64 (x64)
   and in fp32, on the plan's micro-batches (the same BatchNorm statistics; each loss scaled by
   1/m). float64 rounds 2^29 times finer than fp32, so x64 stands for the exact value, and the
   distance of an fp32 evaluation from it is what fp32 rounding does to this computation on one
   device: measured, because it depends on every reduction's length n and magnitudes (a sum of
   n terms errs by about sqrt(n) u sum|terms|, u = 2^-24; Higham & Mary 2019, "A new approach to
   probabilistic rounding error analysis") and on how each layer conditions the next, which no
   formula knows for an arbitrary model. One fp32 evaluation is one draw of that error: in a
   well-conditioned model (every zoo model, GPT-2, Llama, BERT) the sum of many roundings, the
   same size every draw; in an ill-conditioned one (MobileNetV2 at batch 4: BatchNorm over a few
   values, ReLU6) carried by one amplified rounding, so one draw can fall 5x short of the next,
   or a rounding can flip a branch at a kink. So the reference takes NUDGED more draws: fp32 with
   every floating weight, buffer and input moved one ulp up or down at random (the size of one
   rounding, which sends every rounding inside the step to another draw: the random perturbation
   of data of Chaitin-Chatelin & Fraysse 1996, "Lectures on Finite Precision Computations",
   PRECISE), and the noise e1 of a value is the second largest of the six distances, robust to
   one draw short by chance and to one on an outlying branch. The plan adds the same terms in
   other groupings (shards, then a collective; micro-batches), which obey the same law, so its
   error eP = ||xP - x64|| must satisfy, per tensor,
       eP <= NOISE_FACTOR * max(e1, rho * ||x64||, u * ||x64||),
   where rho, the step's relative rounding (the second largest over the draws of ||g - g64|| /
   ||g64|| over all gradients together), floors a tensor whose own e1 is small (a scalar's), and
   u ||x64|| is the rounding of the result itself, which no fp32 value escapes.
   NOISE_FACTOR = GROUPING_FACTOR * CHANCE_FACTOR: grouping, a sum of n terms cut into N shards
   and a collective errs like sqrt(n/N + N) <= sqrt(2n) for N <= n, against sqrt(n) on one
   device, and kernels block their sums alike (2 covers sqrt(2) with room); chance, where the
   error is the sum of many independent roundings an error sample exceeds 8 times its typical
   size with probability about 1e-15 (a normal tail), and where one rounding carries it (one
   degree of freedom, the worst case) the plan's error exceeds 16x the second largest of six
   draws of the same size with probability 6e-6 per step, 3e-4 if the plan's draws are twice
   the size (simulated). A wrong rule or boxing step errs by a share of the value itself: a sum
   counted twice or missed, a wrong shard, 1e-3 and more, 10^3 to 10^6 times the bound of a
   well-conditioned model. The verdict states rho's range: where fp32 itself cannot tell the
   value better (a branch flip at a kink), the bound says so rather than false-alarm.
   Excluded, and named: a gradient whose float64 value is below ZERO_FRACTION of its fp32
   rounding error. float64 resolves 2^-29 of fp32's rounding, so such a gradient is exactly 0
   (the key bias, the bias before a normalization); fp32 holds rounding noise there only, of no
   scale to compare. The update (2.) still checks what the optimizer does with that noise.
2. The optimizer's update: the reference applies the job's optimizer, on whole tensors, to w_t
   with the plan's own gradients, and compares with the plan's w_{t+1}. The same elementwise
   formula on the same inputs: only the order of operations inside one element may differ
   (vector lanes against a scalar tail, fused or not; measured: 1 ulp). Per element:
       |wP' - wR'| <= 2u |wR'| + UPDATE_FRACTION * |w_t - wR'|
   (each side rounds its last subtraction once; the step itself agrees to k u per side for k of
   about 10 operations, and Adam's state recurrences keep their rounding below 3u / (1 - beta2),
   about 2^-12 of the step). A sharding bug (an update missed, doubled, or given another
   element's state) is off by the step itself, at least 1 - beta1 = 0.1 of it; 2^-10 lies between,
   4 times above rounding and 100 times below a bug.
Dropout: a mask drawn per rank cannot match one device's, so the check sets p = 0 on every
torch.nn dropout module on both sides (named in the report) and then probes that the model is
deterministic (two forwards under different seeds give the same loss); it refuses a model that is
still random (functional dropout with its own probability) rather than compare noise.
An op without a float64 kernel (Hugging Face Mixtral's grouped matmul): it runs in fp32 inside the
float64 reference (inputs rounded to fp32, output widened) and is named in the report; its
rounding is then part of both e1 and eP, and the bound stays one device's own error. A model that
fails in float64 outside one op (a dtype test in its Python code) is refused with an error that
says so: without a float64 path nothing measures fp32's own error, and no bound can be derived.
A resumed job: the engine's optimizer holds state from a checkpoint that the reference never saw,
so updates are not compared (the verdict says so); the forward and backward still are.
Limit: a kink met within rounding (ReLU at 0, a max or top-k between equal scores) can take a
different branch in the plan than on one device; when no draw of the reference meets it too
(about 1e-7 of the elements at kinks per step), it is reported as one tensor failing at one step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from autosbp.errors import ExecutionError
from runtime.optim import OptimizerRecipe
from runtime.verify.one_device import (
    Evaluation,
    Float32Fallback,
    evaluate,
    inexact,
    nudged,
    require_deterministic,
    widen,
)
from runtime.verify.verdict import Deviation, Kind, Notes, StepCheck

if TYPE_CHECKING:
    from runtime.engine import Engine

__all__ = ["Reference", "StepChecker"]

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
State = Mapping[str, torch.Tensor]

U_FP32 = 2.0**-24  # unit roundoff of IEEE 754 binary32: |fl(x) - x| <= u |x|
GROUPING_FACTOR = 2.0  # derived in the header (1.): sqrt(2) from cutting a sum, with room
CHANCE_FACTOR = 8.0  # derived in the header (1.): a normal tail; one degree of freedom, six draws
NOISE_FACTOR = GROUPING_FACTOR * CHANCE_FACTOR
ZERO_FRACTION = 2.0**-20  # derived in the header (1.): float64 resolves 2^-29 of fp32's rounding
UPDATE_FRACTION = 2.0**-10  # derived in the header (2.): rounding 2^-12, a bug 2^-3.3 of a step
NUDGED = 5  # fp32 samples at nudged values besides the plain one, derived in the header (1.)


class Reference:
    """Rank 0's oracle: `model` on one device in float64 and fp32, and `optimizer` on whole
    tensors; `check` compares one step of the plan with them (see the module header)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerFactory | OptimizerRecipe | None,
        micro_batches: int,
        inputs: Sequence[torch.Tensor],
        dropout: tuple[str, ...] = (),
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        require_deterministic(model, inputs, dropout)
        self.compute = compute_dtype or next(model.parameters()).dtype
        self.unit = unit_roundoff(self.compute)
        self.fp32 = _floating_in(copy.deepcopy(model), self.compute)  # the draws: the plan's
        self.fp64 = copy.deepcopy(model).double()
        self.fallback = Float32Fallback()
        self.weights = {
            name: p.detach().clone().requires_grad_(True)
            for name, p in model.named_parameters()
            if p.requires_grad
        }
        self.optimizer = _optimizer(optimizer, self.weights)
        self.micro_batches = micro_batches
        self.dropout = dropout
        self.frozen = tuple(n for n, p in model.named_parameters() if not p.requires_grad)

    def check(
        self,
        step: int,
        inputs: Sequence[torch.Tensor],
        before: State,
        loss: float,
        gradients: State,
        after: State,
        weights: Sequence[float] | None = None,
        *,
        clip: float | None = None,
        lr: float | None = None,
    ) -> StepCheck:
        """Compare the plan's step `step` (its weights `before`, loss, synced `gradients`, and
        state `after`) with one device at the same weights, its micro-batches weighed as the
        plan weighed them (`weights`: by their kept targets; None: 1/m each), its gradients
        clipped to the global norm `clip` as the job clips them, its update at the job's
        learning rate of the step (`lr`: its schedule's; None: the optimizer's own)."""
        exact = self._exact(before, inputs, weights)
        cast = _in_dtype(before, self.compute), _inputs_in(inputs, self.compute)
        m = self.micro_batches
        samples = [evaluate(self.fp32, *cast, m, weights)] + [
            evaluate(self.fp32, *nudged(*cast, seed=step * NUDGED + k), m, weights)
            for k in range(NUDGED)
        ]
        if clip is not None:  # one device's clipping (torch's clip_grad_norm_) of each
            for evaluation in (exact, *samples):
                _clip(evaluation.gradients, clip)
        noise = _noise(exact, samples)
        excluded = [
            name
            for name, g in exact.gradients.items()
            if g.norm() < ZERO_FRACTION * noise[f"gradient {name}"]
        ]
        kept = [name for name in exact.gradients if name not in excluded]
        rounding = sorted(
            _relative_error([s.gradients[n] for n in kept], [exact.gradients[n] for n in kept])
            for s in samples
        )[-2]  # the second largest, as for each value (`_noise`)
        unit = self.unit
        rows = [
            _deviation(Kind.LOSS, "loss", torch.tensor(loss), exact.loss, noise, rounding, unit)
        ]
        rows += [
            _deviation(Kind.GRADIENT, n, gradients[n], exact.gradients[n], noise, rounding, unit)
            for n in kept
        ]
        rows += [
            _deviation(Kind.BUFFER, n, after[n], b, noise, rounding, unit)
            for n, b in exact.buffers.items()
        ]
        if self.optimizer is not None:
            rows += self._updates(self.optimizer, before, gradients, after, lr)
        rows += [_elementwise(n, after[n], before[n], before[n]) for n in self.frozen]
        notes = Notes(
            tuple(excluded), self.dropout, tuple(sorted(self.fallback.ops)), self.frozen,
            updates_compared=self.optimizer is not None,
            dtype={torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.compute, "fp32"),
        )  # fmt: skip
        return StepCheck.of(step, float(exact.loss), rounding, rows, notes)

    def _exact(
        self, state: State, inputs: Sequence[torch.Tensor], weights: Sequence[float] | None
    ) -> Evaluation:
        """The float64 evaluation; a model that runs in fp32 (just did) but not in float64, for
        a reason other than one op's kernel, gets an error that says so."""
        try:
            with self.fallback:
                return evaluate(self.fp64, state, inputs, self.micro_batches, weights)
        except Exception as error:
            raise ExecutionError(
                f"--check's float64 reference failed: the model runs in fp32 but not in float64 "
                f"on one device ({type(error).__name__}: {error}). An op without a float64 kernel "
                "would run in fp32 (runtime/verify/one_device.py); this failure is outside one op "
                "(a dtype test or cast in the model's Python code?). Make forward dtype-generic, "
                "or train without --check."
            ) from error

    def _updates(
        self,
        optimizer: torch.optim.Optimizer,
        before: State,
        gradients: State,
        after: State,
        lr: float | None,
    ) -> list[Deviation]:
        """The job's optimizer on whole tensors from the plan's weights and gradients, at the
        step's learning rate, against the plan's updated weights (header, 2.)."""
        if lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr
        with torch.no_grad():
            for name, w in self.weights.items():
                w.copy_(before[name])
                w.grad = gradients[name].to(w.dtype).clone()
        optimizer.step()
        return [_elementwise(n, after[n], w, before[n]) for n, w in self.weights.items()]


class StepChecker:
    """Every rank: the plan's weights before a step, its gradients and state after it (all
    collectives, so every rank calls `after_step`); rank 0 also holds the `Reference` built from
    `model` (dropout already off: `disable_dropout` before the engine) and returns each step's
    `StepCheck`. Build it right before the first step to check (after loading a checkpoint);
    `optimizer` is the job's, or None when the engine's optimizer already holds state the
    reference cannot know (a resumed job): updates are then not compared, and the verdict says
    so. A step the engine skipped (fp16's loss scale overflowed: no update) is not compared:
    `after_step` returns None for it."""

    def __init__(
        self,
        engine: Engine,
        model: nn.Module,
        inputs: Sequence[torch.Tensor],
        optimizer: OptimizerFactory | OptimizerRecipe | None,
        dropout: tuple[str, ...] = (),
    ) -> None:
        self.engine = engine
        compute = engine.precision.compute_dtype
        self.reference = (
            Reference(model, optimizer, engine.micro_batches, inputs, dropout, compute)
            if engine.rank == 0
            else None
        )
        self.before = engine.full_state_dict()
        self.skipped = engine.skipped_steps  # a step the engine skips is not compared

    def after_step(
        self, step: int, inputs: Sequence[torch.Tensor], loss: float
    ) -> StepCheck | None:
        gradients, after = self.engine.full_gradients(), self.engine.full_state_dict()
        before, self.before = self.before, after
        skipped, self.skipped = self.engine.skipped_steps > self.skipped, self.engine.skipped_steps
        if self.reference is None or skipped:  # fp16's loss scale overflowed: no update made
            return None
        weights = self.engine.loss_weights
        lr = self.engine.optimizer.param_groups[0]["lr"]  # the job's schedule sets every group's
        return self.reference.check(
            step, inputs, before, loss, gradients, after, weights,
            clip=self.engine.clip_grad_norm, lr=lr,
        )  # fmt: skip


def _deviation(
    kind: Kind,
    name: str,
    plan: torch.Tensor,
    exact: torch.Tensor,
    noise: Mapping[str, float],
    rounding: float,
    unit: float = 2.0**-24,
) -> Deviation:
    """One tensor of the forward/backward against float64 (header, 1.). A tensor of an exact
    dtype (bool: GPT-BigCode's causal mask; integer: a step counter) must be equal: its error is
    the count of elements that differ, its size the count of elements. A complex one is bounded
    as the floats of its real and imaginary parts."""
    if not inexact(exact):
        differ = float((plan.to(exact.dtype) != exact).sum())
        return Deviation(kind, name, tuple(exact.shape), differ, 0.0, float(exact.numel()))
    plan, exact = _as_real(widen(plan)), _as_real(exact)
    size = float(exact.norm())
    own = noise["loss" if kind is Kind.LOSS else f"{kind.value} {name}"]
    bound = NOISE_FACTOR * max(own, rounding * size, unit * size)
    error = float((plan - exact).norm())
    scale = float((plan * exact).sum() / (exact * exact).sum()) if size > 0 else None
    if scale is not None and float((plan - scale * exact).norm()) > bound:
        scale = None  # no single factor explains the difference
    return Deviation(kind, name, tuple(exact.shape), error, bound, size, scale)


def _clip(gradients: dict[str, torch.Tensor], max_norm: float) -> None:
    """Scale `gradients` in place as the job clips them (`runtime.parallel.grad_norm`, torch's
    `clip_grad_norm_`): by max_norm / (norm + 1e-6) where that is below 1."""
    norm = float(torch.stack([g.double().norm() for g in gradients.values()]).norm())
    factor = max_norm / (norm + 1e-6)
    if factor < 1.0:
        for g in gradients.values():
            g.mul_(factor)


def unit_roundoff(dtype: torch.dtype) -> float:
    """u of a floating dtype: |fl(x) - x| <= u |x| (2^-24 fp32, 2^-8 bf16, 2^-11 fp16)."""
    return float(torch.finfo(dtype).eps) / 2


def _optimizer(
    optimizer: OptimizerFactory | OptimizerRecipe | None, weights: Mapping[str, torch.Tensor]
) -> torch.optim.Optimizer | None:
    """The job's optimizer over the reference's whole fp32 weights."""
    if optimizer is None:
        return None
    if isinstance(optimizer, OptimizerRecipe):
        return optimizer.build(weights, {n: tuple(w.shape) for n, w in weights.items()})
    return optimizer(list(weights.values()))


def _floating_in(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` with its floating parameters and buffers in `dtype` (complex and integer ones as
    they are: `Module.to(dtype)` would narrow complex ones too)."""
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            if tensor.is_floating_point() and tensor.dtype != dtype:
                tensor.data = tensor.data.to(dtype)
    return model


def _in_dtype(state: State, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The plan's weights as its programs read them: floating ones cast to the compute dtype
    (under a mixed recipe, the fp32 masters rounded once, as the engine's copies are)."""
    return {n: t.to(dtype) if t.is_floating_point() else t for n, t in state.items()}


def _inputs_in(inputs: Sequence[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)


def _noise(exact: Evaluation, samples: Sequence[Evaluation]) -> dict[str, float]:
    """Per value ("loss", "gradient NAME", "buffer NAME"): the second largest distance of the
    fp32 samples from float64 (header, 1.); 0 for an integer value, which must be equal."""

    def second(want: torch.Tensor, got: Iterable[torch.Tensor]) -> float:
        if not inexact(want):
            return 0.0
        return sorted(float((g - want).norm()) for g in got)[-2]

    out = {"loss": second(exact.loss, (s.loss for s in samples))}
    for n, g in exact.gradients.items():
        out[f"gradient {n}"] = second(g, (s.gradients[n] for s in samples))
    for n, b in exact.buffers.items():
        out[f"buffer {n}"] = second(b, (s.buffers[n] for s in samples))
    return out


def _elementwise(
    name: str, plan: torch.Tensor, want: torch.Tensor, before: torch.Tensor
) -> Deviation:
    """The update of one tensor: its worst element against that element's bound (header, 2.);
    `size` is that element's step. A tensor of an exact dtype must be equal (`_deviation`)."""
    shape = tuple(want.shape)
    if not inexact(want):
        return _deviation(Kind.UPDATE, name, plan, want, {}, 0.0)
    plan, want, before = widen(plan).flatten(), widen(want).flatten(), widen(before).flatten()
    if not want.numel():
        return Deviation(Kind.UPDATE, name, shape, 0.0, 0.0, 0.0)
    diff, step = (plan - want).abs(), (before - want).abs()
    bound = 2 * U_FP32 * want.abs() + UPDATE_FRACTION * step
    ratio = torch.where(diff > 0, diff / bound, torch.zeros_like(diff))  # x / 0 = inf
    at = int(ratio.argmax())
    return Deviation(Kind.UPDATE, name, shape, float(diff[at]), float(bound[at]), float(step[at]))


def _as_real(x: torch.Tensor) -> torch.Tensor:
    """A complex tensor as the floats of its real and imaginary parts (the same norm)."""
    return torch.view_as_real(x) if x.is_complex() else x


def _relative_error(approx: Iterable[torch.Tensor], exact: Iterable[torch.Tensor]) -> float:
    """||approx - exact|| / ||exact|| over all tensors together (0 when exact is 0)."""
    error = size = 0.0
    for a, e in zip(approx, exact, strict=True):
        error += float((a - e).square().sum())
        size += float(e.square().sum())
    return (error / size) ** 0.5 if size > 0 else 0.0
