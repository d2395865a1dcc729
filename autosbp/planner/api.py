"""`auto_parallelize`: model + example inputs + hardware -> the fastest plan that fits.

Lives here: the public entry point (argument checks with clear errors, the model in its
training dtype and the example inputs at the global batch, capture, the search, comparison with
hand plans) and the adapter from a costmodel cluster to the planner's `Prices`. Lives elsewhere:
the search and the ILP (`search`, `ilp`), the plan format (`plan`), prices (`costmodel`).

Planning never needs parameter values: a model on the meta device plans like a real one (the
CLI builds every model there), and the dtype and batch it is planned in are the graph's own:
prices follow each tensor's dtype, so the model is cast before capture, never after.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from autosbp.capturing.export import capturing_in
from autosbp.capturing.graph import OpGraph
from autosbp.errors import MicroBatchError, PlanError
from autosbp.plan import HandPlan, Plan
from autosbp.planner.assemble import DTYPE_NAMES, PlanContext, assemble_plan
from autosbp.planner.search.entry import (
    Found,
    GraphFor,
    GraphMemo,
    TimeLimitWarning,
    divisors,
    search,
)
from autosbp.planner.search.schedules import best_of, search_spaces
from autosbp.planner.space.strategy import Space, hand_strategies, strategy_space
from autosbp.planner.timing.recipe import Recipe

DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
# Memory kept free for the framework, allocator fragmentation and transient buffers
# (an assumption; PyTorch's caching allocator typically loses 5-10% to fragmentation).
MEMORY_RESERVE_FRACTION = 0.1


class ClusterPrices:
    """The planner's `Prices` over a costmodel cluster (dtype names translated); equal where
    the clusters are (their profile and node count), so that the searches of equal clusters
    share boxing prices (`search.graph_memo.GraphMemo.pricers_of`)."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterPrices) and self.cluster == other.cluster

    def __hash__(self) -> int:
        return hash(self.cluster)

    def op_time_s(
        self, flops: float, nbytes: float, dtype: torch.dtype, transcendentals: float = 0.0
    ) -> float:
        name = DTYPE_NAMES.get(dtype, "fp32")
        return float(self.cluster.op_time_s(flops, nbytes, name, transcendentals))

    def collective_time_s(
        self, kind: str, message_bytes: float, group_size: int, link_class: str
    ) -> float:
        return float(self.cluster.collective_time_s(kind, message_bytes, group_size, link_class))

    def p2p_time_s(self, nbytes: float, link_class: str) -> float:
        return float(self.cluster.p2p_time_s(nbytes, link_class))

    @property
    def overlap_efficiency(self) -> float:
        return float(self.cluster.overlap_efficiency)

    @property
    def causal_skip(self) -> float:
        return float(self.cluster.causal_skip)


def auto_parallelize(
    model: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    profile: str = "cpu-gloo",
    devices: int,
    memory_limit: int | None = None,
    global_batch: int | None = None,
    optimizer: str = "adam",
    dtype: str | None = None,
    strategy: str = "auto",
    recompute: str = "auto",
    time_limit_s: float = 60.0,
    micro_batches: int | None = None,
    name: str | None = None,
    progress: Callable[[str], None] | None = None,
    compare: bool = False,
    jobs: int | None = None,
    reduce_dtype: str = "fp32",
    clip_grad_norm: float | None = None,
) -> Plan:
    """Plan `model` (which returns its training loss, a mean over the batch) for `devices`
    devices of `profile`; `example_inputs` are one batch (dim 0).

    `global_batch`: the samples per step, when not the example inputs' batch: every input whose
    dim 0 is that batch is resized to it before capture (`at_global_batch`). `dtype` (fp32,
    bf16, fp16; default: the model's own): the training dtype; the model is captured as if its
    floating parameters, buffers and example inputs were cast to it (`capturing_in`: the model
    is not touched), and the plan trains in that dtype with fp32 masters (`Plan.precision`).
    `memory_limit` (bytes per device) defaults to the
    profile's device memory minus a 10% reserve. The search chooses pipeline stages, the mesh
    of each stage, one signature per op, the micro-batch count (unless `micro_batches` is
    given: every count that divides the batch) and the recomputation (`recompute`: auto,
    none, selective, mlp, full, or full:K: the first K blocks of each stage; auto offers full:K
    where nothing fits under none), best-first by proven bounds over the whole space within
    `time_limit_s` (`search`); `strategy` restricts it to a hand plan (dp, fsdp,
    megatron:tp=T,pp=P,dp=D[,mb=M]) priced by the same model. `compare`: also price the usual
    hand plans (`space.strategy.hand_strategies`) into `Plan.hand_plans`. When the time limit stops
    the search before it proves its plan optimal, the best plan so far is returned with a
    `TimeLimitWarning` that says the proven gap and how to raise the limit. `jobs`: processes
    the search runs in (default: every core, for spaces of 64 configurations or more).
    `reduce_dtype` (fp32, bf16): the dtype gradients are summed in across devices;
    `clip_grad_norm`: the update clips the gradients by their global norm (the value is the
    engine's; the plan prices the pass and records that it clips).
    """
    from autosbp.capturing.rebatch import micro_batch_graphs

    dtype = dtype or _dtype_of(model)
    _check_request(devices, optimizer, dtype)  # before the capture, which can take a while
    _check_limits(memory_limit, global_batch, time_limit_s, jobs)
    space = strategy_space(strategy, recompute)
    inputs = at_global_batch(example_inputs, global_batch)
    batch = int(inputs[0].shape[0]) if inputs and inputs[0].dim() else 1
    counts = (micro_batches,) if micro_batches is not None else space.micro_batches
    if counts is None:  # the counts the space may choose: only those are captured
        counts = tuple(
            c for c in _micro_batch_counts(inputs) if (batch // c) % space.data_parallel == 0
        ) or (1,)
    graphs: dict[int, OpGraph] = {}
    # the counts whose micro-batch does not capture, and why: every search of the request (each
    # hand plan's, with compare) asks for every count, and a capture fails alike each time
    refused: dict[int, str] = {}
    together = True  # may every count capture at once (none has failed it yet)?

    def graph_for(count: int) -> OpGraph:
        nonlocal together
        if count in refused:
            raise MicroBatchError(refused[count])
        if count not in graphs:  # every count at once: two exports, the rest rebatched
            if progress:
                progress(f"capturing micro-batches of {', '.join(map(str, counts))}")
            with capturing_in(DTYPES[dtype]):  # the model itself is not cast
                if together:
                    try:
                        graphs.update(micro_batch_graphs(model, inputs, counts, name=name))
                    except MicroBatchError:
                        together = False
                if count not in graphs:  # one size does not capture: each alone, the others do
                    try:
                        graphs.update(micro_batch_graphs(model, inputs, (count,), name=name))
                    except MicroBatchError as exc:
                        refused[count] = str(exc)
                        raise
        return graphs[count]

    return _plan(
        graph_for, counts, profile=profile, devices=devices, memory_limit=memory_limit,
        global_batch=batch, optimizer=optimizer, dtype=dtype, strategy=strategy,
        recompute=recompute, time_limit_s=time_limit_s, progress=progress, compare=compare,
        jobs=jobs, reduce_dtype=reduce_dtype, clips_gradients=clip_grad_norm is not None,
    )  # fmt: skip


def at_global_batch(
    example_inputs: Sequence[torch.Tensor], global_batch: int | None
) -> tuple[torch.Tensor, ...]:
    """`example_inputs` with every input whose dim 0 is the first input's (the batch) resized
    to `global_batch` samples (unchanged when None or equal). Meta inputs are new meta tensors;
    real ones repeat their samples in turn (capture reads shapes, not values)."""
    inputs = tuple(example_inputs)
    if global_batch is None or not inputs:
        return inputs
    if inputs[0].dim() == 0:
        raise PlanError(
            f"global_batch={global_batch} needs example inputs with a batch (dim 0), but the "
            "first example input is a scalar; leave global_batch out (`--global-batch`)."
        )
    batch = int(inputs[0].shape[0])
    if batch == global_batch:
        return inputs
    samples = torch.arange(global_batch) % batch

    def resized(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[0] != batch:
            return x
        if x.device.type == "meta":
            return torch.empty((global_batch, *x.shape[1:]), dtype=x.dtype, device="meta")
        return x[samples.to(x.device)]

    return tuple(resized(x) for x in inputs)


def in_dtype(
    model: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    dtype: str,
    *,
    owned: bool = False,
) -> tuple[torch.Tensor, ...]:
    """The model's floating parameters and buffers in `dtype` (cast in place: on the meta
    device, or when the caller built the model, `owned`; a real model is its owner's to cast),
    and the floating example inputs cast."""
    _check_request(1, "adam", dtype)
    wanted = DTYPES[dtype]
    state = [
        t for t in itertools.chain(model.parameters(), model.buffers()) if t.is_floating_point()
    ]
    if any(t.dtype != wanted for t in state):
        real = sorted({str(t.dtype) for t in state if t.device.type != "meta"})
        if real and not owned:
            raise PlanError(
                f"the model's parameters are {', '.join(real)} but dtype={dtype!r}; cast the "
                f"model first (model.to(torch.{str(wanted).removeprefix('torch.')})), build it on "
                "the meta device (planning needs no values), or plan in its own dtype."
            )
        model.to(wanted)
    return tuple(x.to(wanted) if x.is_floating_point() else x for x in example_inputs)


def _dtype_of(model: torch.nn.Module) -> str:
    """The name of the dtype most of the model's floating parameters have (fp32 if none)."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    if not counts:
        return "fp32"
    found = max(counts, key=lambda d: counts[d])
    if found not in DTYPE_NAMES:
        raise PlanError(
            f"the model's parameters are {found}, which the planner does not price; use one of "
            f"{sorted(DTYPES)} (pass dtype=... to cast a meta model)."
        )
    return DTYPE_NAMES[found]


def _micro_batch_counts(example_inputs: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """Every count that divides the batch when every input's dim 0 is that batch (only 1 for
    unbatched inputs)."""
    sizes = {int(x.shape[0]) if x.dim() else 0 for x in example_inputs}
    if len(sizes) != 1 or 0 in sizes:
        return (1,)
    return divisors(sizes.pop())


def plan_graph(
    graph: OpGraph,
    *,
    profile: str,
    devices: int,
    memory_limit: int | None,
    global_batch: int | None,
    optimizer: str,
    dtype: str,
    strategy: str,
    time_limit_s: float,
    micro_batches: int = 1,
    recompute: str = "auto",
) -> Plan:
    """`auto_parallelize` on an already captured graph of one micro-batch (of `micro_batches`)."""
    return plan_graphs(
        {micro_batches: graph}, profile=profile, devices=devices, memory_limit=memory_limit,
        global_batch=global_batch, optimizer=optimizer, dtype=dtype, strategy=strategy,
        time_limit_s=time_limit_s, recompute=recompute,
    )  # fmt: skip


def plan_graphs(
    graphs: Mapping[int, OpGraph],
    *,
    profile: str,
    devices: int,
    memory_limit: int | None,
    global_batch: int | None,
    optimizer: str,
    dtype: str,
    strategy: str,
    time_limit_s: float,
    recompute: str = "auto",
    progress: Callable[[str], None] | None = None,
    compare: bool = False,
    jobs: int | None = None,
    memo: GraphMemo | None = None,
) -> Plan:
    """`auto_parallelize` on already captured graphs: micro-batch count -> the graph of one
    micro-batch (`rebatch.micro_batch_graphs`); the search tries these counts. `memo`: what
    earlier plans of these graphs computed of them (`search.graph_memo.GraphMemo`; a caller
    that plans one model under many strategies passes one; None: a fresh one)."""
    counts = tuple(sorted(graphs))
    if not counts:
        raise PlanError("no graph to plan; capture the model first (rebatch.micro_batch_graphs).")
    batch = _batch_of(graphs[counts[0]]) * counts[0]
    if global_batch is not None and global_batch != batch:
        raise PlanError(
            f"the graphs were captured at a global batch of {batch} (micro-batches of "
            f"{batch // counts[0]} x {counts[0]}), not global_batch={global_batch}; capture the "
            "model at that batch (auto_parallelize resizes the example inputs itself)."
        )
    return _plan(
        graphs.__getitem__, counts, profile=profile, devices=devices,
        memory_limit=memory_limit, global_batch=batch, optimizer=optimizer, dtype=dtype,
        strategy=strategy, recompute=recompute, time_limit_s=time_limit_s, progress=progress,
        compare=compare, jobs=jobs, memo=memo,
    )  # fmt: skip


def _plan(
    graph_for: GraphFor,
    counts: tuple[int, ...],
    *,
    profile: str,
    devices: int,
    memory_limit: int | None,
    global_batch: int,
    optimizer: str,
    dtype: str,
    strategy: str,
    recompute: str,
    time_limit_s: float,
    progress: Callable[[str], None] | None = None,
    compare: bool = False,
    jobs: int | None = None,
    reduce_dtype: str = "fp32",
    clips_gradients: bool = False,
    memo: GraphMemo | None = None,
) -> Plan:
    """The searches of one request (the plan, then with `compare` each usual hand plan), which
    share what depends only on the graphs (`memo`, `search.graph_memo.GraphMemo`)."""
    from costmodel import Cluster, load_profile

    _check_request(devices, optimizer, dtype)
    _check_recipe(reduce_dtype)
    _check_limits(memory_limit, global_batch, time_limit_s, jobs)
    hw = load_profile(profile)
    per_node = int(hw.topology.devices_per_node.value)
    cluster = Cluster(hw, nodes=-(-devices // per_node))
    limit = (
        memory_limit
        if memory_limit is not None
        else int(cluster.memory_bytes * (1 - MEMORY_RESERVE_FRACTION))
    )
    first = graph_for(counts[0])
    blocks = len({a.block for _, a in first.nodes() if a.block is not None})
    prices = ClusterPrices(cluster)
    memo = memo if memo is not None else GraphMemo()

    def link_of(shape: tuple[int, ...], mesh_dim: int) -> str:
        return cluster.link_class_for_mesh_dim(shape, mesh_dim).value

    def found_in(space: Space, time_left_s: float) -> Found:
        if space.micro_batches is None:  # the strategy names no count (mb=M): search them
            space = dataclasses.replace(space, micro_batches=counts)
        return search(
            graph_for, global_batch, devices, prices, link_of, space,
            optimizer=optimizer, memory_limit_bytes=limit, time_limit_s=time_left_s,
            devices_per_node=per_node, progress=progress, jobs=jobs,
            recipe=Recipe(DTYPES[reduce_dtype], clips_gradients), memo=memo,
        )  # fmt: skip

    def found_for(chosen: str) -> Found:
        if progress:
            progress(f"searching {chosen}")
        return best_of(search_spaces(chosen, recompute, blocks), found_in, time_limit_s)

    ctx = PlanContext(
        hw.name, limit, strategy, global_batch, DTYPES[dtype], optimizer, reduce_dtype,
        clips_gradients,
    )  # fmt: skip
    best = found_for(strategy)
    note = best.effort.limit_note(best.prediction.step_time_s) if best.effort else None
    if note is not None:  # said in words: the CLI prints it, a caller may make it an error
        warnings.warn(note, TimeLimitWarning, stacklevel=3)
    if not compare:
        return assemble_plan(best, ctx)
    hand = []
    for chosen in hand_strategies(devices, per_node, blocks):
        if chosen == strategy:
            continue
        try:
            found = found_for(chosen)
        except PlanError as exc:  # it does not fit, or its degrees do not divide the model
            hand.append(HandPlan(chosen, None, None, str(exc).split(". ")[0]))  # why, not how
            continue
        peak = int(max(found.prediction.peak_bytes))
        hand.append(HandPlan(chosen, found.prediction.step_time_s, peak))
    return dataclasses.replace(assemble_plan(best, ctx), hand_plans=tuple(hand))


def _check_request(devices: int, optimizer: str, dtype: str) -> None:
    if not isinstance(devices, int) or devices < 1:
        raise PlanError(
            f"devices must be a positive integer, got {devices!r}; pass the number of devices "
            "to plan for, e.g. devices=8 (`--devices 8` on the command line)."
        )
    if optimizer not in ("adam", "adamw", "sgd", "sgd_momentum"):
        raise PlanError(
            f"optimizer {optimizer!r} is not known; use adam, adamw, sgd or sgd_momentum."
        )
    if dtype not in DTYPES:
        raise PlanError(f"dtype {dtype!r} is not known; use one of {sorted(DTYPES)}.")


def _check_recipe(reduce_dtype: str) -> None:
    if reduce_dtype not in ("fp32", "bf16"):
        raise PlanError(
            f"reduce_dtype {reduce_dtype!r} is not known; gradients are summed in fp32 (the "
            "default) or bf16 (`--reduce-dtype`)."
        )


def _check_limits(
    memory_limit: int | None, global_batch: int | None, time_limit_s: float, jobs: int | None
) -> None:
    """Sizes and limits that must be > 0 when given (None: the default)."""
    for name, value, flag in (
        ("memory_limit", memory_limit, "--memory-gib"),
        ("global_batch", global_batch, "--global-batch"),
        ("time_limit_s", time_limit_s, "--time-limit-s"),
        ("jobs", jobs, "--jobs"),
    ):
        if value is not None and not value > 0:
            raise PlanError(
                f"{name} must be positive, got {value!r}; pass a positive value or leave it out "
                f"for the default (`{flag}` on the command line)."
            )


def _batch_of(graph: OpGraph) -> int:
    from autosbp.capturing.graph import Role

    for _, attrs in graph.nodes(Role.INPUT):
        if attrs.outputs and attrs.outputs[0].shape:
            return int(attrs.outputs[0].shape[0])
    return 1
