"""What a training job spends loading its data, beside a plain PyTorch loop with a DataLoader.

The demo's job (its GPT, byte tokens of the standard library's source, 64 per row, 16 rows a
step, AdamW, fp32) trained three ways in one run, each for --steps steps:
- autosbp: `runtime.jobs.train` under the auto plan on --nproc gloo processes, each rank
  loading only the rows its placement needs (`runtime.data`); its metrics rows give the
  samples/s and the data-loading share of each step (the slowest rank's load over the step);
- torch: the model's own forward and backward and torch's AdamW on one process, its batches
  from `torch.utils.data.DataLoader(shuffle=True, num_workers=0)` over the same data set, the
  load timed apart from the step as the job times it.
The first --skip steps of each are left out (allocation, the first collectives). Printed per
run and as the median of --runs runs with their spread: samples/s of each, their ratio, and
the data-loading share of each. The loss of both is printed too: the same model and data, so
a wrong loader shows as a curve apart.

    python bench/data_loading.py [--steps 60] [--runs 3] [--nproc 2]

Needs a quiet machine: the figures are wall-clock times, and torch's loop runs on every core
(its intra-op threads), which a busy machine slows by far more than the job's one-thread ranks
(measured under a load of 6 on 2 cores: 2.2-2.9 s a step on 2 threads, 0.04 s on one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parents[1])  # this script's folder would shadow packages

import torch  # noqa: E402 - after the path fix above
from torch.utils.data import DataLoader  # noqa: E402

from autosbp.commands.demo import DEMO_MODEL, SEQ  # noqa: E402
from autosbp.planner.api import auto_parallelize  # noqa: E402
from autosbp.zoo import load_model  # noqa: E402
from runtime.data import stdlib_text  # noqa: E402
from runtime.jobs import TrainSpec, train  # noqa: E402

LR, DECAY = 3e-3, 0.1


def autosbp_run(plan: dict[str, Any], steps: int, skip: int, nproc: int) -> dict[str, float]:
    name, args = DEMO_MODEL
    with tempfile.TemporaryDirectory() as folder:
        metrics = Path(folder) / "m.jsonl"
        spec = TrainSpec(
            name, args, plan, steps, lr=LR, weight_decay=DECAY,
            data="stdlib_text", data_args={"seq": SEQ}, metrics=str(metrics),
        )  # fmt: skip
        train(spec)
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rows = [r for r in rows if r["kind"] == "train"][skip:]
    assert len(rows) == steps - skip, (len(rows), nproc)
    return {
        "samples_per_s": statistics.mean(r["samples_per_s"] for r in rows),
        "data_share": statistics.mean(r["data_share"] for r in rows),
        "last_loss": rows[-1]["loss"],
    }


def torch_run(steps: int, skip: int) -> dict[str, float]:
    name, args = DEMO_MODEL
    model, _ = load_model(name, args)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": DECAY},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=LR,
    )
    loader = DataLoader(
        stdlib_text(seq=SEQ), batch_size=args["batch"], shuffle=True, drop_last=True,
        generator=torch.Generator().manual_seed(0), num_workers=0,
    )  # fmt: skip
    batches = iter(loader)
    loads, totals, loss = [], [], 0.0
    for _ in range(steps):
        start = time.perf_counter()
        ids, labels = next(batches)
        loaded = time.perf_counter()
        optimizer.zero_grad()
        out = model(ids, labels)
        out.backward()
        optimizer.step()
        loss = float(out.detach())
        end = time.perf_counter()
        loads.append(loaded - start)
        totals.append(end - start)
    loads, totals = loads[skip:], totals[skip:]
    return {
        "samples_per_s": args["batch"] * len(totals) / sum(totals),
        "data_share": sum(loads) / sum(totals),
        "last_loss": loss,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args(argv)
    name, model_args = DEMO_MODEL
    module, inputs = load_model(name, model_args)
    plan = auto_parallelize(
        module, inputs, profile="cpu-gloo", devices=args.nproc, optimizer="adamw",
        time_limit_s=60.0,
    ).to_json()  # fmt: skip
    ours, theirs = [], []
    for run in range(args.runs):
        ours.append(autosbp_run(plan, args.steps, args.skip, args.nproc))
        theirs.append(torch_run(args.steps, args.skip))
        a, t = ours[-1], theirs[-1]
        print(
            f"run {run + 1}: autosbp {args.nproc} procs {a['samples_per_s']:.1f} samples/s "
            f"(loading {a['data_share']:.2%}, last loss {a['last_loss']:.3f}); torch 1 proc + "
            f"DataLoader {t['samples_per_s']:.1f} samples/s (loading {t['data_share']:.2%}, "
            f"last loss {t['last_loss']:.3f}); ratio {a['samples_per_s'] / t['samples_per_s']:.2f}x"
        )
    print(f"median of {args.runs} runs (min-max):")
    for label, key in (("samples/s", "samples_per_s"), ("loading share", "data_share")):
        for who, runs in ((f"autosbp ({args.nproc} procs)", ours), ("torch (1 proc)", theirs)):
            values = [r[key] for r in runs]
            print(
                f"  {label:14} {who:20} {statistics.median(values):.4g} "
                f"({min(values):.4g}-{max(values):.4g})"
            )
    ratios = [a["samples_per_s"] / t["samples_per_s"] for a, t in zip(ours, theirs, strict=True)]
    print(
        f"  samples/s ratio autosbp / torch: {statistics.median(ratios):.2f}x "
        f"({min(ratios):.2f}-{max(ratios):.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
