"""What every rank agrees on: the same plan, the same initial state, and who failed.

Lives here: `agree_on_plan` (every rank's plan digest, all-gathered: ranks given different plans
stop at once with an error naming them, instead of waiting in mismatched collectives until a
timeout), `agree_on_graph` (likewise every rank's graph fingerprint: one job never runs two
graphs, whatever made a rank capture another), `broadcast_initial_state` (every parameter, buffer and lifted constant takes rank 0's
value, so a model whose initialization is not seeded, or differs between processes, still
trains one set of weights), `from_rank0` (one tensor: a training job's batch, likewise) and
`agree` (a fallible part run on every rank, then every rank told who failed: the checkpoints'
save and load). Lives elsewhere: the Engine, which calls the first three before any other
collective (`runtime.engine`); the digest (`Plan.digest`), the fingerprint and why capture
gives one graph in every process (`autosbp.capturing.graph`, `autosbp.capturing.interchangeable`).

Invariants: all are collectives over the default group, called by every rank in the same
order; the broadcast walks the graph's state in graph order, the same on every rank (their
plans agreed, and each rank's graph matched the plan's fingerprint before). A tensor tied to
another (one object under two names) is sent once.
Scope: every rank receives each tensor whole, one broadcast per tensor from global rank 0, and
keeps its own shard afterwards (every rank builds the whole model anyway). Sending each rank
only its pieces would move less at start-up; the result is the same.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from autosbp.capturing.graph import OpGraph, Role
from autosbp.errors import CaptureError, ExecutionError, PlanError
from autosbp.plan import Plan

__all__ = ["agree", "agree_on_graph", "agree_on_plan", "broadcast_initial_state", "from_rank0"]

T = TypeVar("T")


def agree_on_plan(plan: Plan) -> None:
    """PlanError on every rank unless every rank holds the same plan (sha256 of its JSON)."""
    ranks_of = _ranks_by_digest(plan.digest())
    if len(ranks_of) == 1:
        return
    groups = "; ".join(f"ranks {ranks}: sha256 {d[:12]}..." for d, ranks in ranks_of.items())
    raise PlanError(
        f"the ranks hold {len(ranks_of)} different plans ({groups}); every rank must run the "
        "same plan, or their collectives never match. Load one plan file on every rank "
        "(autosbp.plan.load_plan), or build each rank's Plan from the same JSON."
    )


def agree_on_graph(graph: OpGraph) -> None:
    """CaptureError on every rank unless every rank captured the same graph (its fingerprint):
    a rank whose graph differs would run other ops in another order (module header)."""
    ranks_of = _ranks_by_digest(graph.fingerprint())
    if len(ranks_of) == 1:
        return
    groups = "; ".join(f"ranks {ranks}: fingerprint {d}" for d, ranks in ranks_of.items())
    raise CaptureError(
        f"the ranks captured {len(ranks_of)} different graphs of model `{graph.model_name}` "
        f"({groups}), so no rank runs a step. Capture gives one graph for one model, but this "
        "model's forward differs between processes: a loop over a set, or a dict built from "
        "one, whose order follows each process's hash seed with code that differs per key, a "
        "random or environment-dependent choice. Iterate in a fixed order (sorted(...)), or "
        "start every rank with the same PYTHONHASHSEED (e.g. PYTHONHASHSEED=0)."
    )


def _ranks_by_digest(digest: str) -> dict[str, list[int]]:
    """{hex digest: the ranks holding it}, from this rank's `digest` (hex) all-gathered (every
    rank's digest has the same length: sha256, or a fingerprint)."""
    mine = torch.tensor(list(bytes.fromhex(digest)), dtype=torch.uint8)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    ranks_of: dict[str, list[int]] = defaultdict(list)
    for rank, theirs in enumerate(gathered):
        ranks_of[bytes(theirs.tolist()).hex()].append(rank)
    return dict(ranks_of)


def broadcast_initial_state(model: nn.Module, graph: OpGraph) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and constant of `graph` (by name) with rank 0's value, copied
    into `model`'s own tensors on every rank; returns them by name (the Engine shards these).
    Tensors on the meta device are left as they are (the Engine refuses them, naming them)."""
    sources: dict[str, torch.Tensor] = dict(graph.meta.get("constants", {}))
    sources.update(model.named_buffers(remove_duplicate=False))
    sources.update(model.named_parameters(remove_duplicate=False))
    sent: set[int] = set()
    with torch.no_grad():
        for _, attrs in graph.nodes():
            if attrs.role not in (Role.PARAMETER, Role.BUFFER):
                continue
            tensor = sources[attrs.name]
            if id(tensor) in sent or tensor.is_meta:
                continue
            sent.add(id(tensor))
            tensor.copy_(from_rank0(tensor))
    return sources


def from_rank0(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's value of `tensor`, a new tensor (a collective: every rank calls it with a tensor
    of the same shape and dtype)."""
    wire = tensor.detach().clone().contiguous()
    if wire.dtype is torch.bool:  # gloo moves no bools; their bytes travel as uint8
        wire = wire.view(torch.uint8)
    dist.broadcast(wire, src=0)
    return wire.view(tensor.dtype)


def agree(what: str, fn: Callable[[], T]) -> T:
    """Run `fn` on every rank, then tell every rank who failed: the failing rank re-raises its
    error, the others raise one naming it. So no rank waits in a collective for one that quit."""
    error: Exception | None = None
    result: Any = None
    try:
        result = fn()
    except Exception as exc:  # re-raised below, after the other ranks have been told
        error = exc
    messages: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    for rank, message in enumerate(messages):
        if message is not None:
            raise ExecutionError(f"{what}: rank {rank} failed, so every rank stops. {message}")
    return result
