"""CTC loss with targets whole per row: the form capture can trace (issue #29).

Lives here: `autosbp::ctc_loss`, torch's CTC loss per sample on padded targets `[batch, S]`
(one row per sample, read up to its target length) as one op of static shape `[batch]`; and
`padded_ctc`, the context capture exports a model in, which turns the pattern libraries write
(Hugging Face's Wav2Vec2, HuBERT, ...):

    flat = labels.masked_select(labels >= 0)             # concatenated targets, data-shaped
    loss = F.ctc_loss(log_probs, flat, input_lengths, target_lengths, reduction=...)

into `autosbp::ctc_loss(log_probs, labels, input_lengths, target_lengths)` followed by the
reduction in plain ops. The padded form is torch's own second form of the same loss (its docs:
"targets: (N, S) or (sum(target_lengths))"), so the values and gradients are torch's; what
changes is that no shape depends on the labels' values (`_ctc_loss`'s `log_alpha` is sized by
the longest target, `masked_select`'s output by the mask's count). Lives elsewhere: its SBP
rule (`rules.loss`: split by sample), the other training-forward patterns
(`capturing.training_ifs`).

Invariants: a batched `ctc_loss` call (log_probs `[T, batch, C]`) is rewritten only when its
targets are padded `[batch, S]` already (torch's `_ctc_loss` sizes its output by the lengths'
values either way) or the result of a `masked_select` of an integer `[batch, S]` tensor seen
in the same export; else it runs as it was, and fails with the user's line as before. Reduction
"mean" is torch's: each sample's loss over its target length (at least 1), then the batch mean.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from autosbp.capturing.training_ifs import Absorbed, user_line

__all__ = ["ctc_loss", "padded_ctc"]


@torch.library.custom_op("autosbp::ctc_loss", mutates_args=())
def ctc_loss(
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    input_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int,
    zero_infinity: bool,
) -> torch.Tensor:
    """Per-sample CTC loss `[batch]`: log_probs `[T, batch, C]`, targets `[batch, S]` padded."""
    return F.ctc_loss(
        log_probs, targets, input_lengths, target_lengths, blank=blank, reduction="none",
        zero_infinity=zero_infinity,
    )  # fmt: skip


@ctc_loss.register_fake
def _(
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    input_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int,
    zero_infinity: bool,
) -> torch.Tensor:
    return log_probs.new_empty(log_probs.shape[1])


def _save(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    log_probs, targets, input_lengths, target_lengths, blank, zero_infinity = inputs
    ctx.save_for_backward(log_probs, targets, input_lengths, target_lengths)
    ctx.blank, ctx.zero_infinity = blank, zero_infinity


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """torch's own gradient: the loss recomputed on a leaf copy of log_probs."""
    log_probs, targets, input_lengths, target_lengths = ctx.saved_tensors
    with torch.enable_grad():
        leaf = log_probs.detach().requires_grad_()
        loss = F.ctc_loss(
            leaf, targets, input_lengths, target_lengths, blank=ctx.blank, reduction="none",
            zero_infinity=ctx.zero_infinity,
        )  # fmt: skip
        (grad_log_probs,) = torch.autograd.grad(loss, leaf, grad)
    return grad_log_probs, None, None, None, None, None


ctc_loss.register_autograd(_backward, setup_context=_save)


class _Padding(TorchFunctionMode):
    def __init__(self, absorbed: Absorbed) -> None:
        super().__init__()
        self.absorbed = absorbed
        self._selected: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (out, source)

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is F.ctc_loss:
            padded = self._padded(*args, **kwargs)
            if padded is not None:
                return padded
        result = func(*args, **kwargs)
        if func in (torch.masked_select, torch.Tensor.masked_select) and _is_padded(args[0]):
            self._selected[id(result)] = (result, args[0])
        return result

    def _padded(
        self,
        log_probs: torch.Tensor,
        targets: torch.Tensor,
        input_lengths: torch.Tensor,
        target_lengths: torch.Tensor,
        blank: int = 0,
        reduction: str = "mean",
        zero_infinity: bool = False,
    ) -> torch.Tensor | None:
        held = self._selected.get(id(targets))
        if held is not None and held[0] is targets:
            labels = held[1]  # the rows the concatenated targets were selected from
        elif targets.dim() == 2:
            labels = targets  # padded already: only the lengths' tensors made it data-shaped
        else:
            return None
        if log_probs.dim() != 3:
            return None
        where, code = user_line()
        how = "traced as autosbp::ctc_loss on the padded targets (torch's (N, S) form)"
        self.absorbed.rewritten.append((where, code, how))
        per_sample = ctc_loss(
            log_probs, labels, input_lengths, target_lengths, blank, zero_infinity
        )
        if reduction == "none":
            return per_sample
        if reduction == "sum":
            return per_sample.sum()
        return (per_sample / target_lengths.clamp(min=1).to(per_sample.dtype)).mean()


def _is_padded(source: Any) -> bool:
    return (
        isinstance(source, torch.Tensor)
        and source.dim() == 2
        and not source.dtype.is_floating_point
        and not source.dtype.is_complex
    )


@contextlib.contextmanager
def padded_ctc(absorbed: Absorbed) -> Iterator[None]:
    """Export inside this: `ctc_loss` on `masked_select`-ed targets as `autosbp::ctc_loss`,
    each recorded in `absorbed` (`drop_dead_code` then erases the unread `masked_select`)."""
    with _Padding(absorbed):
        yield
