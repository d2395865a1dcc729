"""`Engine`: train a model under a Plan on every rank of a torch.distributed world.

Lives here: the Engine, which composes the parts each rank runs, in this order: the checks that
the plan fits this world and model (and that every rank holds the same plan), this rank's place
(stage, mesh, coordinates), its sharded state, its stage's program, gradient sync, the
optimizer and the pipeline; `step` (one training step: the pipeline's firings, then gradient
sync and the optimizer), `full_state_dict` and `full_gradients`. Lives elsewhere, one part per
module: the plan and its whole-plan checks (`autosbp.plan`), capture
(`autosbp.capturing.export`), the ranks' agreement on the plan, on the graph and on rank 0's
initial state (`runtime.state.startup`), the sharded state and its assembly (`runtime.state.shards`), the
program (`runtime.execute.program`), process groups and collectives (`runtime.execute.groups`,
`runtime.execute.collectives`), the stages' meshes, their traffic and the firing loop
(`runtime.parallel.pipeline`, in the order `autosbp.zero_bubble.plan_orders` gives), gradient
sync (`runtime.parallel.grad_sync`), parameter gathers (`runtime.parallel.gathers`,
`runtime.parallel.prefetch`). A new parallel dimension is one module of `runtime.parallel`
that the constructor composes.

Invariants:
- Everything is planned in the constructor; `step` runs prebuilt closures only.
- The constructor's collectives (the plan's and the graph's agreement, process groups, the
  initial state) run in the same order on every rank.
- A parameter in layout p ends backward with its gradient in dual(p) (P where p has B, S where p
  has S); the sync boxes dual(p) -> p (`runtime.parallel.grad_sync`). A parameter read on a
  later stage (a tied embedding) is sent there every micro-batch and its gradient sent back.
- Parameter gathers (a parameter's boxing with a collective, FSDP / ZeRO-3) run as the plan
  prices them (`runtime.parallel.prefetch`), unless `gathers` says otherwise.
- The optimizer steps on local shards: exact for elementwise optimizers (SGD, Adam, AdamW), not
  for ones that take norms across a whole tensor (LAMB, gradient clipping by global norm). Where
  the plan shards a parameter's optimizer states (ZeRO-1), it steps the shard of those
  (`runtime.parallel.sharded_update`), which converts the gradient in and the weight back out.
- Every wait is bounded by the world's timeout.
Reference: docs/architecture.md ("Start here", "The rooms in detail").
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from autosbp.boxing.params import gathers_parameters, gathers_run_beside
from autosbp.capturing.batches import split_micro_batches
from autosbp.capturing.graph import OpGraph, Role
from autosbp.errors import ExecutionError, NonFiniteError
from autosbp.plan import Plan, check_plan
from autosbp.plan.recompute import recomputed_nodes
from autosbp.plan.values import DTYPES
from autosbp.rules import NdSignature
from autosbp.sbp import Mesh, NdSbp, parse_nd_sbp
from autosbp.timeline import SpanHook
from autosbp.zero_bubble import plan_orders
from runtime.data import BatchLayout, InputSpec, RankBatch, RankLoader
from runtime.execute.collectives import world_device
from runtime.execute.groups import build_groups, world_timeout
from runtime.execute.instructions import Boxer, evaluating
from runtime.execute.program import Pieces, Program, Value, build_program
from runtime.execute.signatures import read_signatures
from runtime.optim import OptimizerRecipe
from runtime.parallel.gathers import GatherPolicy, plan_gather_policy
from runtime.parallel.grad_norm import clip_gradients, report_gradients
from runtime.parallel.grad_sync import GradSync, build_grad_sync
from runtime.parallel.pipeline import (
    LossBoxing,
    Pipeline,
    Transfers,
    build_links,
    locate,
    node_stages,
    stage_boundaries,
    stage_meshes,
    stage_values,
)
from runtime.parallel.precision import LossScale, Weights
from runtime.parallel.prefetch import GatherSchedule, gather_setup
from runtime.parallel.sharded_update import build_sharded_update
from runtime.state.shards import StageState, shard_state, state_layouts
from runtime.state.startup import agree_on_graph, agree_on_plan, broadcast_initial_state
from runtime.verify.finite import NonFinite

__all__ = ["Engine", "clip_refusal"]

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
Boundaries = Mapping[tuple[int, int], Sequence[Value]]


class Engine:
    """Runs training steps of `model` under `plan` on this rank (call on every rank).

    `optimizer_factory(local_params)` builds the optimizer over this rank's shards (or an
    `runtime.optim.OptimizerRecipe`, which also sees their names and whole shapes: weight decay
    on matrices only); `clip_grad_norm` clips the gradients by their global norm (the plan must
    have priced it);
    `example_inputs` are the inputs the plan was made with (their shapes are checked); `graph`
    is an already captured graph of one micro-batch of `model` to skip capturing again;
    `recorder` (an autosbp.timeline.Recorder, or any SpanHook) wraps every firing of every
    step (a forward, backward or weight of one micro-batch in the stage's order), and the
    parameter gathers, re-gathers and gradient reduce-scatters that run beside them
    (`runtime.parallel.prefetch`). `gathers` runs those as asked instead of as the
    plan says (`plan_gather_policy`: its prefetch depth and re-gathered parameters).
    `non_finite`: a step whose loss or a gradient is nan or inf raises `NonFiniteError` before
    its update (STOP), or makes no update and counts in `skipped_steps` (SKIP). Before
    anything else, every rank checks that all hold the same plan and captured the same graph,
    and takes rank 0's initial parameters and buffers (`runtime.state.startup`).
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        optimizer_factory: OptimizerFactory | OptimizerRecipe,
        *,
        example_inputs: Sequence[torch.Tensor],
        graph: OpGraph | None = None,
        recorder: SpanHook | None = None,
        gathers: GatherPolicy | None = None,
        non_finite: NonFinite = NonFinite.STOP,
        clip_grad_norm: float | None = None,
    ) -> None:
        _check_world(plan)
        _check_device(model)
        _check_clip(plan, clip_grad_norm)
        self.non_finite, self.skipped_steps = non_finite, 0
        self.clip_grad_norm = clip_grad_norm
        self.grad_norm = 0.0  # the last step's, before clipping (`runtime.parallel.grad_norm`)
        # The last step's micro-batch weights where not 1/m each (`pipeline.SharedLoss`)
        self.loss_weights: list[float] | None = None
        self._batch_checked = False  # the first global batch is compared across the ranks
        self.precision = plan.precision
        self.loss_scale = LossScale() if self.precision.loss_scaling == "dynamic" else None
        graph = _checked_graph(model, example_inputs, plan, graph)
        self.plan, self.graph, self.micro_batches = plan, graph, plan.micro_batches
        self.rank = dist.get_rank()
        meshes = stage_meshes(plan)
        self.stage, self.index = locate(meshes, self.rank)
        # The (virtual) stages this rank runs: its stage, and interleaved its v chunks.
        self.chunks = tuple(range(self.stage, len(meshes), plan.pipeline_stages))
        self.mesh = meshes[self.stage]
        self.coords = self.mesh.coords(self.index)
        self.signatures = read_signatures(graph, plan, self.mesh.shape)
        self.boxer = Boxer(self.mesh, build_groups(meshes))
        layouts = state_layouts(graph, self.signatures, plan)
        self.shards: StageState = shard_state(
            broadcast_initial_state(model, graph), graph, layouts, plan, self.mesh, self.coords,
            self.stage, master_dtype=torch.float32 if self.precision.mixed else None,
        )  # fmt: skip
        # What the programs read: the buffers, and each parameter's compute weight (its fp32
        # master itself, or under a mixed recipe a copy in the compute dtype).
        self.weights = Weights(self.shards.parameters, self.precision.compute_dtype)
        self._compute_state = {**self.shards.state, **self.weights.compute}
        self._timeout = world_timeout()
        stage_of = node_stages(plan)
        boundaries = stage_boundaries(graph, stage_of)
        _check_schedule(plan, graph, self.signatures, self.boxer)
        self.programs = [
            self._build_program(meshes, stage_of, boundaries, gathers, chunk)
            for chunk in self.chunks
        ]
        self.program = self.programs[0]  # its gathers: interleaved plans have none
        self._state_layouts = _state_layouts(plan, self.layouts)  # read by every checkpoint
        self.update = build_sharded_update(
            self.parameters, self.layouts, self._state_layouts, self.shapes, self.boxer,
            plan.grad_bucket_bytes,
            frozenset(n for n, p in plan.params.items() if p.gradient_sbp != p.sbp),
            self.weights.register, self.weights.compute,
        )  # fmt: skip
        self.weights.release(self.update.held_as_shards)  # their fp32 masters: the shards
        self.grad_sync = self._build_grad_sync(meshes, self.program.gathers)
        self._connect_precision()
        self.optimizer = (
            optimizer_factory.build(self.optimized, self.shapes)
            if isinstance(optimizer_factory, OptimizerRecipe)
            else optimizer_factory(list(self.optimized.values()))
        )
        self.recorder = recorder
        self._span = recorder.span if recorder is not None else _no_span
        self.pipeline = self._build_pipeline(meshes, stage_of, boundaries)
        _connect_gathers(self.program.gathers, recorder, self.grad_sync)
        for program in self.programs:
            if program.op_comm is not None:  # exchanges inside ops are spans too
                program.op_comm.span_hook = recorder

    # ---- the parts, each built by one call -------------------------------------------------

    def _build_program(
        self,
        meshes: Sequence[Mesh],
        stage_of: Mapping[str, int],
        boundaries: Boundaries,
        gathers: GatherPolicy | None,
        stage: int,
    ) -> Program:
        """`stage`'s program (this rank's, or one of its chunks): what it receives and sends,
        what it recomputes (the plan's nodes) and how it gathers parameters (the plan's
        policy, or `gathers`)."""
        graph, signatures = self.graph, self.signatures
        policy = gathers or plan_gather_policy(self.plan, stage)
        received, sent = stage_values(boundaries, stage)
        return build_program(
            graph, signatures, self._compute_state, self.coords, self.boxer,
            stage_of=stage_of, stage=stage, received=received, sent=sent,
            recomputed=recomputed_nodes(self.plan, graph),
            gathering=gather_setup(graph, signatures, self.boxer, meshes, policy, self._timeout),
            param_grad_dtype=self.precision.reduce_dtype if self.weights.mixed else None,
            regathered={n: frozenset(node.regathered) for n, node in self.plan.nodes.items()},
            overlapped={n: node.overlap_chunks for n, node in self.plan.nodes.items()},
        )  # fmt: skip

    def _build_grad_sync(
        self, meshes: Sequence[Mesh], scheduled: GatherSchedule | None
    ) -> GradSync:
        """Gradient sync of this stage's parameters (the gathers' schedule adds in the
        gradients it reduce-scatters itself: `deferred`)."""
        synced = {n: t for n, t in self.parameters.items() if n not in self.update.unsynced}
        return build_grad_sync(
            synced, self.layouts, self.shards.trained, meshes, self.mesh, self._timeout,
            self.plan.grad_bucket_bytes, deferred=scheduled.deferred if scheduled else (),
            register=self.weights.register, reduce_dtype=self.precision.reduce_dtype,
        )  # fmt: skip

    def _connect_precision(self) -> None:
        """Under a mixed recipe, the parameter gathers' deferred gradients are summed in the
        reduce dtype and added into the fp32 masters (`runtime.parallel.precision`)."""
        if not self.weights.mixed:
            return
        self.weights.destination = self.grad_sync.view_for
        for program in self.programs:
            if program.gathers is not None:
                program.gathers.reduce_dtype = self.precision.reduce_dtype
                program.gathers.grad_targets = self.weights.masters

    def _build_pipeline(
        self, meshes: Sequence[Mesh], stage_of: Mapping[str, int], boundaries: Boundaries
    ) -> Pipeline:
        """The stage's firings in the plan's schedule (`stage_orders`), each chunk's traffic
        with the other stages, the loss's seed, and the rank that tells every rank the loss."""
        plan, graph, device = self.plan, self.graph, world_device()
        mailbox: dict = {}  # the rank's chunks, one to another
        transfers = [
            Transfers(
                build_links(graph, self.signatures, boundaries, meshes, chunk, self.index),
                self._timeout, self._span, device, mailbox,
            )
            for chunk in self.chunks
        ]  # fmt: skip
        loss_stage = meshes[stage_of["output"]] if "output" in stage_of else meshes[-1]
        layout = next((p.loss_layout for p in self.programs if p.loss_layout is not None), None)
        order = plan_orders(
            plan.schedule, plan.pipeline_stages, self.micro_batches, plan.virtual_stages
        )[self.stage]
        return Pipeline(
            programs=self.programs,
            transfers=transfers,
            order=order,
            loss=LossBoxing.build(self.boxer, layout),
            micro_batches=self.micro_batches,
            arm=lambda tensors: self.grad_sync.arm(self.weights.masters_of(tensors)),
            loss_root=loss_stage.device_ids[0],
            staged=len(meshes) > 1,
            span=self._span,
            device=device,
            weights=tuple(self.weights.compute.values()),
        )

    # ---- this rank's state -----------------------------------------------------------------

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """Parameter/buffer name -> this rank's local tensor (its stage's only); a master held
        as its ZeRO shard is a NaN here (`parameters`): read values by `held_state`."""
        return self.shards.state

    @property
    def parameters(self) -> dict[str, torch.Tensor]:
        """Parameter name -> this rank's local shard (its stage's only), in graph order. Under
        a mixed recipe with the optimizer's states sharded, a parameter's fp32 master is its
        shard, and the tensor here holds one NaN (`Weights.release`): `held_state` says where
        each value is."""
        return self.shards.parameters

    @property
    def held_state(self) -> dict[str, tuple[torch.Tensor, NdSbp]]:
        """Parameter/buffer name -> this rank's tensor holding its value at full precision
        and that tensor's layout: `state`'s, but a master held as its shard (`Weights.release`)
        by the shard, in the optimizer's layout. What checkpoints save."""
        held = {name: (local, self.layouts[name]) for name, local in self.shards.state.items()}
        for name in self.weights.released:
            held[name] = (self.optimized[name], self._state_layouts[name])
        return held

    @property
    def optimized(self) -> dict[str, torch.Tensor]:
        """Parameter name -> the tensor this rank's optimizer steps (its stage's only): the
        parameter's shard, or where its optimizer states are sharded (ZeRO-1) the shard of
        those (`runtime.parallel.sharded_update`), in graph order."""
        return self.update.optimized(self.parameters)

    @property
    def optimized_layouts(self) -> dict[str, NdSbp]:
        """Parameter name -> the layout of the tensor the optimizer steps and of its states
        (every stage's: the plan's `optimizer_state_sbp`)."""
        return self._state_layouts

    @property
    def layouts(self) -> dict[str, NdSbp]:
        """Parameter/buffer name -> its plan layout (every stage's)."""
        return self.shards.layouts

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Named node -> its global shape."""
        return self.shards.shapes

    @property
    def owner(self) -> dict[str, int]:
        """Parameter/buffer name -> the stage that holds it."""
        return self.shards.owner

    # ---- one step --------------------------------------------------------------------------

    def step(self, batch: Sequence[torch.Tensor] | RankBatch) -> float:
        """One training step: this stage's forward and backward of each micro-batch (of each
        of its chunks, interleaved) in the plan's schedule (`stage_orders`), activations and
        gradients exchanged with the other stages, gradients accumulated (each loss scaled by
        1/micro-batches: the loss must be a mean over the batch), gradient sync, the global
        gradient norm (`grad_norm`) and clipping, the optimizer step. Returns the full loss
        (the mean over micro-batches) on every rank. A loss or gradient that is nan or inf
        stops the step before its update (`non_finite`).

        `batch` is either the global batch (the same tensors on every rank: the first one is
        compared across the ranks, so a loop that gives each rank other rows is an error, not
        silently wrong steps), or this rank's pieces of it, as `loader` gives them
        (`runtime.data.RankBatch`: each rank reads only its rows)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.grad_sync.zero_grad()  # bucketed gradients: None, then views of their buckets
        self.update.zero_grad(self.grad_sync.holds)  # ZeRO-1's others: zeroed in place
        scale = 1.0 if self.loss_scale is None else self.loss_scale.scale
        value = self.pipeline.run(self._pieces(batch), seed_scale=scale)
        with self._span("grad_sync"):  # what backward did not hide, then ZeRO-1's slices
            self.grad_sync.finish()
            self.update.scatter_gradients()
        shared = self.pipeline.share_loss(value)  # every rank: the last stage's loss
        loss, self.loss_weights = shared.loss, shared.weights
        with self._span("optimizer"):  # the check, then the update (priced as one)
            if shared.factor != 1.0:  # micro-batches weighed by their kept targets: n_k / N
                grads = [t.grad for t in self.optimized.values() if t.grad is not None]
                if grads:
                    torch._foreach_mul_(grads, shared.factor)
            bad = self._check_gradients(loss)
            if bad is None:
                if self.clip_grad_norm is not None:
                    clip_gradients(self.optimized, self.grad_norm, self.clip_grad_norm)
                self.optimizer.step()
                self.update.gather_weights()
                self.weights.refresh()
        if bad is not None:
            if self.loss_scale is not None and math.isfinite(loss):
                self.loss_scale.update(overflowed=True)  # fp16: skipped, the scale halved
                self.skipped_steps += 1
                return loss
            if self.non_finite is NonFinite.STOP:
                raise NonFiniteError(bad)
            self.skipped_steps += 1
        elif self.loss_scale is not None:
            self.loss_scale.update(overflowed=False)
        return loss

    def _check_gradients(self, loss: float) -> str | None:
        """The gradients unscaled (fp16), their global norm (`grad_norm`) and whether the step
        may update: None, or what is not finite (a collective over the world)."""
        if self.loss_scale is not None:
            grads = [t.grad for t in self.optimized.values() if t.grad is not None]
            if grads:
                torch._foreach_mul_(grads, 1.0 / self.loss_scale.scale)
        report = report_gradients(
            self.optimized, self._state_layouts, self.coords, self.mesh.shape, self.shards.trained
        )
        self.grad_norm = report.norm
        if not math.isfinite(loss):
            return f"the loss is {loss}"
        return report.problem()

    def evaluate(self, batch: Sequence[torch.Tensor] | RankBatch) -> float:
        """The loss of `batch` (as `step` takes it) under the plan, as the model computes it
        under `nn.Module.eval()` and `torch.no_grad()`: dropout off, batch norm by its running
        statistics (`autosbp.rules.in_eval_mode`), every stage's forwards, micro-batch by
        micro-batch, no state changed (a buffer another op writes is restored). What the
        model decides in Python by `self.training` was decided when it was captured, in
        training mode. A collective: every rank calls it."""
        kept = {n: t.detach().clone() for n, t in self.shards.state.items() if not t.requires_grad}
        with torch.no_grad(), evaluating():
            value = self.pipeline.run_forwards(self._pieces(batch))
            for name, tensor in kept.items():
                self.shards.state[name].copy_(tensor)
        return self.pipeline.share_loss(value, weights=False).loss

    def batch_layout(self) -> BatchLayout:
        """What this rank needs of each global batch: per user input, its piece of one
        micro-batch (None where none of this rank's programs reads it), from the plan's input
        layouts (`runtime.data`)."""
        metas = [attrs.outputs[0] for _, attrs in self.graph.nodes(Role.INPUT)]
        boxes: list[tuple[slice, ...] | None] = [None] * len(metas)
        for program in self.programs:
            for loader in program.inputs:
                whole = tuple(slice(0, n) for n in loader.meta.shape)
                boxes[loader.position] = loader.index or whole
        specs = tuple(
            InputSpec(meta.shape[1:], meta.dtype, name)
            for meta, name in zip(metas, _input_names(self.graph), strict=True)
        )
        return BatchLayout(self.plan.global_batch, self.micro_batches, specs, tuple(boxes))

    def loader(
        self,
        data: object,
        *,
        seed: int = 0,
        shuffle: bool = True,
        state: Mapping[str, object] | None = None,
    ) -> RankLoader:
        """This rank's loader of `data` (a data set of per-sample tuples, or an iterable of
        global batches; `runtime.data`): each step's pieces for `step`, shuffled by `seed`
        per epoch, resumed from `state` (a checkpoint's `RankLoader.state()`)."""
        return RankLoader(
            data, self.batch_layout(), seed=seed, shuffle=shuffle, state=state,
            device=world_device(),
        )  # fmt: skip

    def _pieces(self, batch: Sequence[torch.Tensor] | RankBatch) -> list[Pieces] | list[tuple]:
        """The step's micro-batches: this rank's pieces as given (a RankBatch), or the global
        batch, the same on every rank (checked), cut into micro-batches, floating inputs in
        the plan's compute dtype."""
        if batch and all(isinstance(piece, tuple) for piece in batch):
            if len(batch) != self.micro_batches:
                raise ExecutionError(
                    f"step() got pieces of {len(batch)} micro-batches, but the plan runs "
                    f"{self.micro_batches}; take the pieces from engine.loader(...)."
                )
            return [Pieces(piece) for piece in batch]
        wanted = self.precision.compute_dtype
        tensors = tuple(
            x.to(wanted) if x.is_floating_point() else x
            for x in batch
            if isinstance(x, torch.Tensor)  # every one: a RankBatch was taken above
        )
        if len(tensors) != len(batch):
            raise ExecutionError(
                "step() takes the global batch as a sequence of tensors (one per model input), "
                "or this rank's pieces from engine.loader(...); got a mix of both."
            )
        if not self._batch_checked:  # a loop that feeds each rank its own rows does so at once
            _check_same_batch(tensors)
            self._batch_checked = True
        return split_micro_batches(tensors, self.micro_batches)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer assembled whole (tied names included). A collective: every
        rank must call it, and every rank gets the full tensors."""
        return self.shards.full_state_dict(self.boxer, self.held_state)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient of the last step, synced and assembled whole (zeros where
        backward never reached it; tied names included). Valid from the end of `step` until the
        next one. A collective, like `full_state_dict`."""
        return self.shards.full_gradients(self.boxer, self.update.gradients())


def _check_world(plan: Plan) -> None:
    """The plan alone (before anything distributed; against the graph later), an initialized
    world of its size, and every rank holding the same plan."""
    check_plan(plan)
    if not dist.is_available() or not dist.is_initialized():
        raise ExecutionError(
            "Engine needs an initialized torch.distributed world; launch with torchrun "
            f"--nproc-per-node {plan.device_count} (or launching.workers.run_workers) and call "
            "dist.init_process_group first."
        )
    agree_on_plan(plan)
    plan.check_world(dist.get_world_size())


def _check_same_batch(batch: Sequence[torch.Tensor]) -> None:
    """Every rank was given the same global batch: a fingerprint of its values (sums weighted
    by position, in float64) compared across the world by one all-reduce. A user loop that
    hands each rank its own rows would otherwise train on a batch no rank holds."""
    if dist.get_world_size() == 1:
        return
    prints = []
    for x in batch:
        values = x.detach().reshape(-1).to(torch.float64)
        weights = torch.arange(1, values.numel() + 1, dtype=torch.float64, device=values.device)
        prints += [values.sum(), (values * weights.remainder(7919)).sum()]
    mine = torch.stack(prints).nan_to_num(nan=1.5e308) if prints else torch.zeros(1)
    both = torch.cat([mine, -mine]).to(world_device())
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    low, high = -both[len(mine) :], both[: len(mine)]
    if not torch.equal(low, high):
        raise ExecutionError(
            "step() was given different batches on different ranks; with a global batch every "
            "rank must pass the same tensors (rank 0's rows, say). To give each rank only its "
            "own rows, pass this rank's pieces instead: engine.step(pieces) with pieces from "
            "engine.loader(data_set)."
        )


def _input_names(graph: OpGraph) -> list[str]:
    """The user inputs' names (forward's parameters, as export named the placeholders)."""
    return [attrs.name or name for name, attrs in graph.nodes(Role.INPUT)]


def _check_clip(plan: Plan, clip_grad_norm: float | None) -> None:
    """Clipping as the plan priced it: its update prices one more pass over the gradients."""
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise ExecutionError(
            f"clip_grad_norm must be a positive norm, got {clip_grad_norm!r}; pass None for "
            "no clipping."
        )
    if (clip_grad_norm is not None) != plan.clips_gradients:
        raise clip_refusal(plan, clip_grad_norm)


def clip_refusal(plan: Plan, clip_grad_norm: float | None) -> ExecutionError:
    """The error for clipping the plan did not price (or no clipping where it did)."""
    made = "with" if plan.clips_gradients else "without"
    asked = "none" if clip_grad_norm is None else f"clipping at {clip_grad_norm:g}"
    return ExecutionError(
        f"the plan was priced {made} gradient clipping, but the job asks for {asked}; make "
        "the plan with the same clipping (`--clip-grad-norm` at `autosbp plan` and `autosbp "
        "train`, or auto_parallelize(..., clip_grad_norm=...))."
    )


def _check_device(model: nn.Module) -> None:
    """The model's tensors live where the world carries them (`world_device`): the runtime
    makes its receive and collective buffers there."""
    where, carried = {t.device.type for t in model.state_dict().values()}, world_device().type
    if where - {carried}:
        raise ExecutionError(
            f"the model's tensors are on {', '.join(sorted(where))}, but this world "
            f"({dist.get_backend()}) carries {carried} tensors. Move the model with "
            f".to('{carried}'), or join the world with the backend of its device "
            "(nccl for cuda, gloo for cpu)."
        )


def _check_schedule(
    plan: Plan, graph: OpGraph, signatures: Mapping[str, NdSignature], boxer: Boxer
) -> None:
    """ExecutionError for a schedule this runtime cannot run: zero bubble beside recomputation,
    interleaving or zero bubble beside parameter gathers (`gathers_run_beside`; every rank
    decides alike, from the whole graph)."""
    split = plan.schedule != "1f1b"
    if split and recomputed_nodes(plan, graph):
        raise ExecutionError(
            f"the plan runs the {plan.schedule} schedule (backward split in two) and recomputes "
            "activations; its weight-gradient passes would recompute each checkpointed block "
            "once per weight. Make the plan with --recompute none, or with schedule 1f1b."
        )
    if not gathers_run_beside(plan.virtual_stages, split) and gathers_parameters(
        graph, signatures.__getitem__, boxer.mesh
    ):
        what = (
            f"runs the {plan.schedule} schedule (backward split in two)"
            if split
            else f"interleaves {plan.virtual_stages} model chunks per stage"
        )
        raise ExecutionError(
            f"the plan {what} and gathers parameters (an FSDP/ZeRO-3 layout); the runtime does "
            "not run both together yet. Make the plan with vp=1 and schedule 1f1b, or with "
            "layouts that keep each parameter whole or split without gathers (megatron:... "
            "without fsdp)."
        )


def _checked_graph(
    model: nn.Module, example_inputs: Sequence[torch.Tensor], plan: Plan, graph: OpGraph | None
) -> OpGraph:
    """`graph`, or `model` captured at one micro-batch (what the program runs), checked to be
    the graph of every other rank, then the graph the plan was made for."""
    if graph is None:
        from autosbp.capturing.export import capture_micro_batch

        graph = capture_micro_batch(
            model, example_inputs, plan.micro_batches, dtype=DTYPES[plan.dtype]
        )
    agree_on_graph(graph)  # one graph on every rank, before any rank refuses it alone
    plan.check_model(graph.fingerprint(), f"model `{graph.model_name}`")
    check_plan(plan, graph)
    return graph


def _state_layouts(plan: Plan, layouts: Mapping[str, NdSbp]) -> dict[str, NdSbp]:
    """Parameter name -> its optimizer states' layout (the plan's; the parameter's own where
    the plan states the same)."""
    return {
        name: parse_nd_sbp(p.optimizer_state_sbp)
        if p.optimizer_state_sbp != p.sbp
        else layouts[name]
        for name, p in plan.params.items()
        if name in layouts
    }


def _connect_gathers(
    scheduled: GatherSchedule | None, recorder: SpanHook | None, grad_sync: GradSync
) -> None:
    """The gathers' spans go to the recorder, and the gradients they reduce-scatter to the
    gradient sync."""
    if scheduled is not None:
        scheduled.span_hook, scheduled.on_gradient = recorder, grad_sync.gradient_ready


@contextlib.contextmanager
def _no_span(kind: str, micro_batch: int | None = None, chunk: int = 0) -> Iterator[None]:
    yield
