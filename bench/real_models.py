"""The real-model table: every model of tests/support/real_models.py and real_model_families.py
through every step a user takes.

Steps (one column each): capture on meta and on the CPU with the same fingerprint; plan on 4
cpu-gloo processes and on 64 DGX A100 GPUs with the hand plans priced beside (`--compare`);
train 2 steps on 2 gloo processes under the auto plan, fsdp and tensor parallel 2 (heads or
channels), and for issue #48's families (`FAULTS`: bool buffers, set-ordered rotary tables, eye
in the loss) also interleaved (vp=2, their 4-layer `DEEPER` variant), context parallel (cp=2)
and ZeRO-1, each with `--check`'s machinery (runtime/verify/step_check.py). Prints a markdown
table, pass or the first line of the reason ("-": not run for that model), and the seconds each
column took. The assertions of a share of the same steps are tests/models/test_real_models.py
(which plans on 64 A100s only: the 4-process cpu-gloo column is this bench's); this prints what
they assert, and the rest, for docs/real-models.md.

Run: `python bench/real_models.py [model,model,...]` (default: every model; ~15 minutes on 2
cores).
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autosbp.capturing.export import capture
from autosbp.planner.api import auto_parallelize
from launching.workers import run_workers
from tests.models.test_real_models import INTERLEAVED, PROOF, STRATEGIES
from tests.support.real_model_families import BUILDERS, DEEPER, FAULTS
from tests.support.real_model_workers import build, train_checked

STEPS = 2
COLUMN_NAMES = ("auto", "fsdp", "tp=2", "vp=2", "cp=2", "zero=1")
TRAINED = dict(zip(COLUMN_NAMES, (*STRATEGIES, *PROOF), strict=True))  # column -> strategy
COLUMNS = ("capture meta = cpu", "plan cpu-gloo 4", "plan dgx-a100 64", *TRAINED)


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


def _capture(name: str) -> str:
    with torch.device("meta"):
        meta = capture(*BUILDERS[name](), name=name)
    return (
        "pass"
        if meta.fingerprint() == capture(*BUILDERS[name](), name=name).fingerprint()
        else "fail: fingerprints differ"
    )


def _args(name: str, strategy: str) -> dict | None:
    """4 layers where the strategy interleaves (`DEEPER`)."""
    return DEEPER[name] if strategy == INTERLEAVED else None


def _runs(name: str, column: str) -> bool:
    """Does the matrix train `name` under `column`? The three usual plans for every model; the
    issue #48 plans for its families (interleaving where a 4-layer variant exists)."""
    if column in ("auto", "fsdp", "tp=2"):
        return True
    return name in FAULTS and (column != "vp=2" or name in DEEPER)


def _plan(
    name: str, profile: str, devices: int, strategy: str = "auto", compare: bool = True
) -> tuple[str, dict | None]:
    model, inputs = build(name, "meta", _args(name, strategy))
    try:
        plan = auto_parallelize(
            model, inputs, profile=profile, devices=devices, strategy=strategy, compare=compare,
            name=name, time_limit_s=120.0,
        )  # fmt: skip
    except Exception as exc:
        return f"fail: {_first_line(exc)}", None
    return "pass", plan.to_json()


def main() -> None:
    warnings.simplefilter("ignore")
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(BUILDERS)
    rows: dict[str, dict[str, str]] = {name: {} for name in names}
    seconds = dict.fromkeys(COLUMNS, 0.0)
    cases = []
    for name in names:
        start = time.perf_counter()
        rows[name][COLUMNS[0]] = _capture(name)
        seconds[COLUMNS[0]] += time.perf_counter() - start
        for column, (profile, devices) in zip(
            COLUMNS[1:3], (("cpu-gloo", 4), ("dgx-a100", 64)), strict=True
        ):
            start = time.perf_counter()
            rows[name][column] = _plan(name, profile, devices)[0]
            seconds[column] += time.perf_counter() - start
        for column, strategy in TRAINED.items():
            if not _runs(name, column):
                rows[name][column] = "-"
                continue
            verdict, plan = _plan(name, "cpu-gloo", 2, strategy, compare=False)
            rows[name][column] = verdict
            if plan is not None:
                case = {"id": f"{name}|{column}", "model": name, "plan": plan, "steps": STEPS}
                cases.append({**case, "lr": 1e-2, "args": _args(name, strategy)})
    start = time.perf_counter()
    results = run_workers(train_checked, 2, (cases,), timeout_s=3600.0)[0]
    seconds["auto"] = time.perf_counter() - start  # the training columns together
    for case, result in zip(cases, results, strict=True):
        name, column = case["id"].split("|")
        if "error" in result:
            rows[name][column] = f"fail: {result['error'].splitlines()[0][:120]}"
        else:
            rows[name][column] = (
                "pass" if result["passed"] else f"fail: {result['verdict'].splitlines()[0]}"
            )
    print("| model | " + " | ".join(COLUMNS) + " |")
    print("| --- " * (len(COLUMNS) + 1) + "|")
    for name in names:
        print(f"| {name} | " + " | ".join(rows[name][c] for c in COLUMNS) + " |")
    passed = sum(v == "pass" for row in rows.values() for v in row.values())
    total = sum(v != "-" for row in rows.values() for v in row.values())
    print(
        f"\n{passed} of {total} steps pass; seconds per column: "
        + ", ".join(f"{c} {s:.0f}" for c, s in seconds.items() if s)
    )


if __name__ == "__main__":
    main()
