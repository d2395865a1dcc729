"""How far correct plans stay from `--check`'s bounds, and how far wrong ones go past them.

For every (model, plan) below, the real job (`runtime.trainer.train_worker` with `check`) on gloo
processes, and the worst error / bound of each kind over its steps (runtime/verify/step_check.py: at most 1
passes); then the sharded ones (fsdp, tp=2) with the optimizer given one gradient times
1 + 1e-3, the smallest bug the check must catch (tests/support/check_workers.py). The margin on either side is the
figure: correct plans sit below 1 by the factor the bounds leave for chance and grouping, and
the bug sits above it by orders of magnitude. Models: the zoo, the check's own cases
(tests/support/check_models.py) and, when `transformers` imports, tests/support/real_models.py's third-party
models. A job that does not run (a capture or planning limit outside the check) is listed with
its error.

Regenerate: `python bench/check.py` (about 40 minutes on 2 busy cores); `--quick`: the zoo on 2
processes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

from rich.console import Console  # noqa: E402 - after the path fix above
from rich.table import Table  # noqa: E402

from autosbp.errors import AutosbpError  # noqa: E402
from autosbp.planner.api import auto_parallelize  # noqa: E402
from autosbp.zoo import ZOO_MODELS, load_model  # noqa: E402
from launching.workers import run_workers  # noqa: E402
from runtime.jobs import TrainSpec  # noqa: E402
from runtime.verify.verdict import Kind, StepCheck, judge  # noqa: E402
from tests.support.check_workers import run_checked  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS = 5
TP2 = "megatron:tp=2,pp=1,dp=1"
ZOO_JOBS = [
    *((2, m, s) for m in ("mlp", "gpt", "widedeep", "resnet") for s in ("dp", "fsdp", "auto")),
    (2, "gpt", TP2),
    (4, "gpt", "megatron:tp=2,pp=1,dp=2"),
    (4, "gpt", "megatron:tp=2,pp=2,dp=1,mb=2"),
]
CHECK_JOBS = [
    *((2, "tests/support/check_models.py:attention", s) for s in ("dp", "fsdp", TP2, "auto")),
    *((2, f"tests/support/check_models.py:{m}", "dp") for m in ("conv_bn", "dropout", "grouped")),
]
REAL_MODELS = (
    "gpt2", "llama", "mistral", "qwen2", "mixtral", "bert", "t5", "vit", "resnet", "convnext",
    "mobilenet_v2", "inplace_cnn",
)  # fmt: skip


def _spec(model: str, devices: int, strategy: str) -> TrainSpec:
    path = model if model in ZOO_MODELS else str(ROOT / model)
    module, inputs = load_model(path)
    plan = auto_parallelize(
        module, inputs, profile="cpu-gloo", devices=devices, strategy=strategy, time_limit_s=30.0
    )
    return TrainSpec(path, {}, plan.to_json(), STEPS, check=True)


def _worst(checks: list[StepCheck], kind: Kind) -> str:
    ratios = [r for c in checks if (r := c.ratio(kind)) is not None]
    return f"{max(ratios):.3g}" if ratios else "-"


def _run(jobs: list[tuple[int, str, str]], fault: str, table: Table, console: Console) -> None:
    """One launch per job (a job that fails does not take the others with it); one row each."""
    for devices, model, strategy in jobs:
        label = f"{model.rpartition(':')[2]} {strategy}"
        start = time.perf_counter()
        try:
            with console.status(f"{label} on {devices} processes ({fault})"):
                spec = _spec(model, devices, strategy)
                checks = run_workers(run_checked, devices, ([(label, spec, fault)],))[0][label]
        except AutosbpError as error:
            reason = str(error).splitlines()[0]
            table.add_row(label, str(devices), fault, "-", "-", "-", "-", f"not run: {reason}")
            continue
        console.log(f"{label}, {devices} processes, {fault}: {time.perf_counter() - start:.0f} s")
        verdict = judge(checks)
        excluded = sorted({n for c in checks for n in c.notes.excluded})
        notes = ("pass" if verdict.passed else "FAIL") + (
            f"; left out {', '.join(excluded)}" if excluded else ""
        )
        table.add_row(label, str(devices), fault, *(_worst(checks, k) for k in Kind), notes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the zoo on 2 processes only")
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 150))
    table = Table(title=f"--check: worst error / bound over {STEPS} steps (at most 1 passes)")
    for column in ("job", "procs", "bug", *(k.value for k in Kind), "verdict"):
        table.add_column(column, justify="left" if column in ("job", "verdict") else "right")
    jobs = [j for j in ZOO_JOBS if j[0] == 2] if args.quick else [*ZOO_JOBS, *CHECK_JOBS]
    if not args.quick:
        try:
            import transformers  # noqa: F401 - only whether it imports

            jobs += [
                (2, f"tests/support/real_models.py:{m}", s)
                for m in REAL_MODELS
                for s in ("auto", "fsdp")
            ]
        except ImportError:
            console.print("transformers does not import: third-party models skipped")
    _run(jobs, "none", table, console)
    _run([j for j in jobs if j[0] == 2 and j[2] in ("fsdp", TP2)], "grad-scale", table, console)
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
