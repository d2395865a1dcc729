"""CTC loss captures (issue #29: Wav2Vec2ForCTC refused, `_ctc_loss` sizes its output by the
lengths' values and `masked_select` its targets by the mask's count): HF's lines, reproduced
here, trace as `autosbp::ctc_loss` on padded targets (`capturing.ctc`). Oracle: the eager
model, torch's own CTC on concatenated targets, in float64: the captured graph interpreted on
the same weights gives its loss and its gradients, under every reduction."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autosbp.capturing.export import capture, run_graph
from autosbp.errors import CaptureError

FRAMES, BATCH, CLASSES, LONGEST = 12, 4, 6, 5


class CtcHead(nn.Module):
    """Wav2Vec2ForCTC's loss as transformers writes it (modeling_wav2vec2.py), on a linear head."""

    def __init__(self, reduction: str, padded: bool = False) -> None:
        super().__init__()
        self.head = nn.Linear(8, CLASSES)
        self.reduction, self.padded = reduction, padded

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(features)  # [batch, frames, classes]
        input_lengths = torch.full((len(labels),), FRAMES) - torch.arange(len(labels)) % 2
        labels_mask = labels >= 0
        target_lengths = labels_mask.sum(-1)
        targets = labels if self.padded else labels.masked_select(labels_mask)
        log_probs = nn.functional.log_softmax(logits, dim=-1, dtype=torch.float64).transpose(0, 1)
        return nn.functional.ctc_loss(
            log_probs, targets, input_lengths, target_lengths, blank=0,
            reduction=self.reduction, zero_infinity=False,
        ).sum()  # fmt: skip


def _model_and_inputs(reduction: str, padded: bool = False) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    model = CtcHead(reduction, padded).double()
    features = torch.randn(BATCH, FRAMES, 8, dtype=torch.float64)
    labels = torch.randint(1, CLASSES, (BATCH, LONGEST))
    lengths = torch.tensor([5, 2, 4, 1])  # uneven; padded by -100 as a data collator pads
    labels[torch.arange(LONGEST) >= lengths[:, None]] = -100
    return model, (features, labels)


@pytest.mark.parametrize(
    ("reduction", "padded"),
    [("mean", False), ("sum", False), ("none", False), ("mean", True)],
    ids=["mean", "sum", "none", "padded-targets"],
)
def test_ctc_captures_with_torchs_loss_and_gradients(reduction: str, padded: bool) -> None:
    model, inputs = _model_and_inputs(reduction, padded)
    graph = capture(model, inputs)
    ops = {a.op for _, a in graph.nodes()}
    assert "autosbp.ctc_loss.default" in ops and "aten.masked_select.default" not in ops, ops
    assert "traced as autosbp::ctc_loss" in "\n".join(graph.meta["absorbed"])
    state = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    got = run_graph(graph, state, inputs)
    got.backward()
    want = model(*inputs)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(state[name].grad, param.grad, rtol=1e-10, atol=1e-12)


def test_unbatched_ctc_is_still_refused_with_the_line() -> None:
    """Not the batched form: left as it was (torch's `_ctc_loss`), refused as data-shaped."""

    class Unbatched(nn.Module):
        def forward(self, log_probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            lengths = (torch.tensor(FRAMES), (targets >= 0).sum())
            return nn.functional.ctc_loss(log_probs.log_softmax(-1), targets, *lengths)

    with pytest.raises(CaptureError, match="ctc_loss"):
        capture(Unbatched(), (torch.randn(FRAMES, CLASSES), torch.randint(1, CLASSES, (3,))))
