"""The training job's learning rates and the figures it reports.

Oracles:
- torch's own schedulers: warmup then linear or cosine decay (`LinearLR`, `CosineAnnealingLR`
  chained by `SequentialLR`) give `LrSchedule`'s rate at every step (rel 1e-9: torch's
  cosine is recursive, ours closed-form); WSD, which torch does not have, against its
  definition (Hägele et al. 2024: flat after warmup, then linear to the minimum over the last
  fifth) at the steps where it turns;
- PaLM's model FLOPs (Chowdhery et al. 2022, appendix B): 6N + 12 L H T per token for a GPT's
  N matmul weights, L layers, width H and sequence T. The FLOPs the job reports MFU from
  (`Throughput`, the captured graph's) count the matmuls as PaLM does plus the elementwise ops
  PaLM leaves out (bias, norms, GELU, softmax, residuals: fewer than 100 per element of a
  token's H-wide activations and 10 per attention score, per layer), so they lie between
  PaLM's and PaLM's plus that share;
- the files read back: every row written to --metrics is one JSON line, and TensorBoard's own
  reader finds each numeric field of each row under its tag at its step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR

from autosbp.capturing import capture
from autosbp.zoo import build_model
from runtime.metrics import EvalRow, MetricsSink, Throughput
from runtime.optim import WSD_DECAY_FRACTION, LrSchedule

LR, MIN_LR = 3e-3, 3e-4


def _torch_rates(kind: str, steps: int, warmup: int) -> list[float]:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    span = steps - warmup
    decay: LRScheduler
    if kind == "linear":
        decay = LinearLR(optimizer, 1.0, MIN_LR / LR, total_iters=span - 1)
    else:
        decay = CosineAnnealingLR(optimizer, T_max=span - 1, eta_min=MIN_LR)
    schedule: LRScheduler = decay
    if warmup:
        rise = LinearLR(optimizer, 1.0 / warmup, 1.0, total_iters=warmup - 1)
        schedule = SequentialLR(optimizer, [rise, decay], milestones=[warmup])
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return rates


@pytest.mark.parametrize("kind", ["linear", "cosine"])
@pytest.mark.parametrize(("steps", "warmup"), [(50, 0), (50, 5), (200, 20), (7, 1)])
def test_warmup_and_decay_are_torchs(kind: str, steps: int, warmup: int) -> None:
    ours = LrSchedule(LR, steps, kind, warmup, MIN_LR)
    want = _torch_rates(kind, steps, warmup)
    assert [ours.at(s) for s in range(steps)] == pytest.approx(want, rel=1e-9)
    assert ours.at(steps - 1) == pytest.approx(MIN_LR, rel=1e-9)


def test_wsd_is_flat_then_decays_linearly_over_its_last_fifth() -> None:
    steps, warmup = 110, 10
    ours = LrSchedule(LR, steps, "wsd", warmup, MIN_LR)
    decay = round(WSD_DECAY_FRACTION * (steps - warmup))  # 20 steps
    assert [ours.at(s) for s in range(warmup)] == pytest.approx(
        [LR * (s + 1) / warmup for s in range(warmup)]
    )
    assert {ours.at(s) for s in range(warmup, steps - decay)} == {LR}
    cooldown = [ours.at(s) for s in range(steps - decay, steps)]
    assert cooldown == pytest.approx(
        [LR - (LR - MIN_LR) * (k + 1) / decay for k in range(decay)], rel=1e-12
    )


def test_constant_is_the_peak_after_warmup() -> None:
    ours = LrSchedule(LR, 10, "constant", 4)
    assert [ours.at(s) for s in range(10)] == pytest.approx([LR / 4, LR / 2, 3 * LR / 4] + [LR] * 7)


@pytest.mark.parametrize(
    ("layers", "hidden", "heads", "seq", "vocab"), [(2, 256, 4, 128, 512), (4, 64, 4, 64, 256)]
)
def test_the_reported_flops_are_palms_plus_the_elementwise_ops(
    layers: int, hidden: int, heads: int, seq: int, vocab: int
) -> None:
    batch, micro_batches = 2, 3
    model, inputs = build_model(
        "gpt", layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab, batch=batch,
        device="meta",
    )  # fmt: skip
    found = Throughput.of(capture(model, inputs), micro_batches, batch * micro_batches)
    tokens = batch * seq * micro_batches
    assert (found.samples, found.tokens) == (batch * micro_batches, tokens)
    weights = layers * 12 * hidden * hidden + vocab * hidden  # qkv, proj, fc, proj; the head
    palm = tokens * (6 * weights + 12 * layers * hidden * seq)
    elementwise = 3 * tokens * layers * (100 * hidden + 10 * heads * seq)
    assert palm <= found.model_flops <= palm + elementwise, found.model_flops / palm


def test_mfu_is_the_model_flops_per_second_over_the_devices_peak() -> None:
    found = Throughput(samples=8, tokens=512, model_flops=6e12)
    row = found.row(
        step=1, loss=2.0, lr=LR, grad_norm=1.0, step_s=2.0, load_s=0.5, peak_bytes=1,
        peak_flops=1e12, devices=4, skipped=False,
    )  # fmt: skip
    assert (row.samples_per_s, row.tokens_per_s, row.data_share) == (4.0, 256.0, 0.25)
    assert math.isclose(row.mfu or 0.0, 6e12 / 2.0 / (4 * 1e12))


def _rows() -> list:
    found = Throughput(samples=4, tokens=None, model_flops=1e9)
    common = {"grad_norm": 0.5, "load_s": 0.01, "peak_bytes": 1 << 20, "peak_flops": None}
    rows: list = [
        found.row(
            step=s, loss=3.0 - s / 10, lr=LR * s, step_s=0.1 * s, devices=2, skipped=False, **common
        )
        for s in (1, 2, 3)
    ]
    rows.append(EvalRow(step=3, eval_loss=2.5, batches=4, eval_s=0.2))
    return rows


def test_metrics_file_holds_one_json_row_per_line(tmp_path: Path) -> None:
    rows = _rows()
    sink = MetricsSink(tmp_path / "m.jsonl", None, append=False)
    for row in rows:
        sink.write(row)
    sink.close()
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [row.to_json() for row in rows]


def test_tensorboard_reads_back_every_numeric_field(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = _rows()
    sink = MetricsSink(None, tmp_path / "board", append=False)
    for row in rows:
        sink.write(row)
    sink.close()
    board = EventAccumulator(str(tmp_path / "board"))
    board.Reload()
    want: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        prefix = "eval" if isinstance(row, EvalRow) else "train"
        for key, value in row.to_json().items():
            if key != "step" and isinstance(value, (int, float)):
                want.setdefault(f"{prefix}/{key}", []).append((row.step, float(value)))
    assert set(board.Tags()["scalars"]) == set(want)
    for tag, points in want.items():
        events = board.Scalars(tag)
        assert [e.step for e in events] == [step for step, _ in points], tag
        values = [value for _, value in points]  # TensorBoard stores float32
        assert [e.value for e in events] == pytest.approx(values, rel=1e-6), tag
