"""Module-level workers for the checkpoint tests (spawned by `launching.workers.run_workers`).

Lives here: `run_checkpoint_cases`: per case, build an `Engine`, optionally load a checkpoint
(and save it again at once, under this case's plan), train some steps, optionally save one
after a chosen step (optionally with a file size limit on some ranks: a full disk), and report
losses (and the full state on rank 0), the loaded checkpoint's steps and extra state, or the
error. Lives elsewhere: planning, damaging checkpoints and the oracles
(tests/runtime/test_checkpoint.py, in the parent process), checkpoints themselves
(`runtime.state.checkpoint`).

Invariants: every rank runs the cases in the same order (collectives match by order); a failed
load or save raises on every rank (runtime.state.checkpoint agrees on failures), so it is
reported as data and the next case still runs; results are plain Python and numpy.
"""

from __future__ import annotations

import contextlib
import functools
import resource
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from autosbp.capturing.export import capture_micro_batch
from autosbp.capturing.graph import OpGraph
from autosbp.errors import AutosbpError
from autosbp.plan import Plan
from autosbp.plan.values import DTYPES
from autosbp.zoo import build_model
from runtime.engine import Engine
from runtime.state.checkpoint import load_checkpoint, save_checkpoint
from tests.support.shared_captures import shares_captures

Case = dict[str, Any]
"""{"id": str, "model": zoo name, "model_kwargs": dict, "plan": Plan JSON, "optimizer": a key of
OPTIMIZERS, "lr": float, "load": path or None, "resave": path or None (saved right after the
load), "steps": int, "save": path or None, "save_at": the step count after which to save
(default: all of them), "extra": the extra state to save (a dict, or "rank" for {"rank":
this rank's number}), "limit_file_bytes": {rank: bytes} (a file size limit while saving), "state": bool}"""

OPTIMIZERS: dict[str, Any] = {
    "adam": torch.optim.Adam,
    "adamw": functools.partial(torch.optim.AdamW, weight_decay=0.1),
    "sgd": torch.optim.SGD,
    "sgd_momentum": functools.partial(torch.optim.SGD, momentum=0.9),
    "adafactor": torch.optim.Adafactor,  # row and column factors: not elementwise
}


@shares_captures
def run_checkpoint_cases(rank: int, world_size: int, cases: list[Case]) -> list[dict[str, Any]]:
    """Per case: {"losses": [...], "step": int, "extra": ...} (plus {"state": {name: array}}
    on rank 0 when asked), or {"error": "ErrorClass: message"}."""
    graphs: dict[tuple[str, str, int, str], OpGraph] = {}
    plans: dict[int, Plan] = {}  # by id of the plan's JSON: cases share it (pickled once)
    results = []
    for case in cases:
        model, inputs = build_model(case["model"], seed=0, **case["model_kwargs"])
        micro_batches, dtype = case["plan"]["micro_batches"], case["plan"]["dtype"]
        key = (case["model"], repr(sorted(case["model_kwargs"].items())), micro_batches, dtype)
        if key not in graphs:  # the Engine runs one micro-batch: its graph is at that size
            graphs[key] = capture_micro_batch(
                model, inputs, micro_batches, name=case["model"], dtype=DTYPES[dtype]
            )
        try:
            if id(case["plan"]) not in plans:
                plans[id(case["plan"])] = Plan.from_json(case["plan"])
            plan = plans[id(case["plan"])]
            results.append(_run(case, model, inputs, graphs[key], plan, rank))
        except AutosbpError as exc:
            results.append({"error": f"{type(exc).__name__}: {exc}"})
    return results


def _run(
    case: Case,
    model: torch.nn.Module,
    inputs: tuple[torch.Tensor, ...],
    graph: OpGraph,
    plan: Plan,
    rank: int,
) -> dict[str, Any]:
    optimizer, lr = OPTIMIZERS[case["optimizer"]], case["lr"]
    engine = Engine(
        model,
        plan,
        lambda params: optimizer(params, lr=lr),
        example_inputs=inputs,
        graph=graph,
    )
    out: dict[str, Any] = {"step": 0, "extra": {}}
    if case["load"] is not None:
        manifest = load_checkpoint(engine, case["load"])
        out.update(step=manifest.step, extra=manifest.extra)
        if case.get("resave") is not None:
            save_checkpoint(engine, case["resave"], step=manifest.step, extra=manifest.extra)
    save_at = case.get("save_at", case["steps"])
    extra = {"rank": rank} if case.get("extra") == "rank" else case.get("extra")
    losses = []
    for k in range(case["steps"] + 1):
        if case["save"] is not None and k == save_at:
            with _file_size_limit(case.get("limit_file_bytes", {}).get(rank)):
                save_checkpoint(engine, case["save"], step=out["step"] + k, extra=extra)
        if k < case["steps"]:
            losses.append(engine.step(inputs))
    out["losses"] = losses
    if case["state"]:
        state = engine.full_state_dict()
        if rank == 0:
            out["state"] = {name: np.array(t.detach()) for name, t in state.items()}
    return out


@contextlib.contextmanager
def _file_size_limit(limit_bytes: int | None) -> Iterator[None]:
    """Files this process writes may not grow past `limit_bytes` in the block (RLIMIT_FSIZE: a
    write past it fails with EFBIG, as one on a full disk fails with ENOSPC; SIGXFSZ ignored so
    that it is an OSError, not a kill)."""
    if limit_bytes is None:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
