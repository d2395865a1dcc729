"""`Engine`: train a model under a Plan on every rank of a torch.distributed world.

Lives here: the checks that a plan fits this model and world, this rank's stage and state (each
parameter of its stage as the local shard of its plan SBP, a leaf that requires grad; buffers
likewise), the step (the pipeline's firings, gradient sync, the optimizer) and
`full_state_dict`. Lives elsewhere: the stages' meshes, the cross-stage sends and receives, the
loss seed and the stage's firing loop (`runtime.parallel.pipeline`), the stage's program
(`runtime.execute.program`), the firing order (`autosbp.schedule.stage_orders`), the
collectives and process groups (`runtime.execute.collectives`, `runtime.execute.groups`), the
gradient sync (`runtime.parallel.grad_sync`), the plan and its whole-plan checks
(`autosbp.plan`), the ranks' agreement on the plan and on rank 0's initial state
(`runtime.state.startup`), capture (`autosbp.capturing.export`).

Invariants:
- Everything is planned in the constructor; `step` runs prebuilt closures only.
- A parameter in layout p ends backward with its gradient in dual(p) (P where p has B, S where p
  has S); the sync boxes dual(p) -> p (an all-reduce over p's B mesh dims of its stage), in
  DDP's flat buckets, each launched while the last micro-batch's backward still runs, as soon
  as its gradients are final (`runtime.parallel.grad_sync`). A parameter read on a later stage (a tied
  embedding) is sent there every micro-batch and its gradient sent back.
- Parameter gathers (a parameter's boxing with a collective, FSDP / ZeRO-3) run as the plan
  prices them (`runtime.parallel.prefetch`): `prefetch_blocks` blocks ahead, freed after forward and
  gathered again in backward where `reshard_after_forward`, their gradients reduce-scattered
  while backward goes on, on process groups of their own.
- The optimizer steps on local shards: exact for elementwise optimizers (SGD, Adam, AdamW), not
  for ones that take norms across a whole tensor (LAMB, gradient clipping by global norm).
- Every wait is bounded by the world's timeout.
Reference: docs/architecture.md ("The rooms in detail"); torch DDP's gradient buckets
(`bucket_cap_mb`, 25 MB by default).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from autosbp.capturing.batches import split_micro_batches
from autosbp.capturing.graph import OpGraph, Role
from autosbp.errors import ExecutionError, PlanError
from autosbp.layout import shard_tensor
from autosbp.plan import Plan, check_plan
from autosbp.plan.recompute import recomputed_nodes
from autosbp.rules import NdSignature
from autosbp.sbp import B, Mesh, NdSbp, Partial, format_nd_sbp
from autosbp.schedule import stage_orders
from autosbp.timeline import SpanHook
from runtime.execute.groups import build_groups, world_timeout
from runtime.execute.instructions import Boxer
from runtime.execute.program import Program, build_program, read_signatures
from runtime.parallel.gathers import GatherPolicy, has_collective, plan_gather_policy
from runtime.parallel.grad_sync import GradSync, build_sync_groups, sync_patterns
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
from runtime.parallel.prefetch import GatherSetup
from runtime.state.startup import agree_on_plan, broadcast_initial_state

__all__ = ["Engine"]

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


class Engine:
    """Runs training steps of `model` under `plan` on this rank (call on every rank).

    `optimizer_factory(local_params)` builds the optimizer over this rank's shards;
    `example_inputs` are the inputs the plan was made with (their shapes are checked); `graph`
    is an already captured graph of one micro-batch of `model` to skip capturing again;
    `recorder` (an autosbp.timeline.Recorder, or any SpanHook) wraps every actor firing of
    every step, and the parameter gathers, re-gathers and gradient reduce-scatters that run
    beside them (`runtime.parallel.prefetch`). `gathers` runs those as asked instead of as the plan
    says (`plan_gather_policy`: its prefetch depth and re-gathered parameters). Before anything else, every rank checks that all hold the same plan, and takes
    rank 0's initial parameters and buffers (`runtime.state.startup`).
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        optimizer_factory: OptimizerFactory,
        *,
        example_inputs: Sequence[torch.Tensor],
        graph: OpGraph | None = None,
        recorder: SpanHook | None = None,
        gathers: GatherPolicy | None = None,
    ) -> None:
        check_plan(plan)  # the plan alone, before anything distributed; against the graph below
        if not dist.is_available() or not dist.is_initialized():
            raise ExecutionError(
                "Engine needs an initialized torch.distributed world; launch with torchrun "
                f"--nproc-per-node {plan.device_count} (or launching.workers.run_workers) and call "
                "dist.init_process_group first."
            )
        agree_on_plan(plan)
        plan.check_world(dist.get_world_size())
        self.micro_batches = plan.micro_batches
        if graph is None:  # the program runs one micro-batch: capture at that size
            from autosbp.capturing.export import capture_micro_batch

            graph = capture_micro_batch(model, example_inputs, self.micro_batches)
        plan.check_model(graph.fingerprint(), f"model `{graph.model_name}`")
        check_plan(plan, graph)
        self.plan, self.graph = plan, graph
        self.rank = dist.get_rank()
        meshes = stage_meshes(plan)
        self.stage, self.index = locate(meshes, self.rank)
        self.mesh = meshes[self.stage]
        self.coords = self.mesh.coords(self.index)
        self.signatures = read_signatures(graph, plan, self.mesh.shape)
        stage_of = node_stages(plan)
        self.boxer = Boxer(self.mesh, build_groups(meshes))
        self.layouts = _state_layouts(graph, self.signatures, plan)
        self.shapes = {a["name"]: a["outputs"][0].shape for _, a in graph.nodes() if a["name"]}
        self.owner = {
            attrs["name"]: stage_of[node]
            for node, attrs in graph.nodes()
            if attrs["role"] in (Role.PARAMETER, Role.BUFFER)
        }
        self.state = _materialize(
            broadcast_initial_state(model, graph),
            graph,
            self.layouts,
            self.mesh,
            self.coords,
            lambda n: self.owner[n] == self.stage,
        )
        self.parameters = {
            name: self.state[name] for name in _names(graph, Role.PARAMETER) if name in self.state
        }
        self._timeout = world_timeout()
        boundaries = stage_boundaries(graph, stage_of)
        received, sent = stage_values(boundaries, self.stage)
        self.program: Program = build_program(
            graph, self.signatures, self.state, self.coords, self.boxer,
            stage_of=stage_of, stage=self.stage, received=received, sent=sent,
            recomputed=recomputed_nodes(plan, graph),
            gathering=self._gathering(meshes, gathers or plan_gather_policy(plan, self.stage)),
        )  # fmt: skip
        trained = [self.layouts[name] for name in _names(graph, Role.PARAMETER)]
        scheduled = self.program.gathers
        self.grad_sync = GradSync(
            self.parameters,
            self.layouts,
            self.mesh,
            build_sync_groups(meshes, sync_patterns(trained, self.mesh.shape)),
            self._timeout,
            deferred=scheduled.deferred if scheduled else (),
        )
        self.optimizer = optimizer_factory(list(self.parameters.values()))
        self.recorder = recorder
        self._span = recorder.span if recorder is not None else _no_span
        links = build_links(graph, self.signatures, boundaries, meshes, self.stage, self.index)
        loss_stage = meshes[stage_of["output"]] if "output" in stage_of else meshes[-1]
        self.pipeline = Pipeline(
            self.program, Transfers(links, self._timeout, self._span),
            stage_orders(len(meshes), self.micro_batches)[self.stage],
            LossBoxing.build(self.boxer, self.program.loss_layout), self.micro_batches,
            self.grad_sync.arm, loss_stage.device_ids[0], len(meshes) > 1, self._span,
        )  # fmt: skip
        if scheduled is not None:
            scheduled.span_hook, scheduled.on_gradient = recorder, self.grad_sync.gradient_ready

    def _gathering(self, meshes: Sequence[Mesh], policy: GatherPolicy) -> GatherSetup | None:
        """Process groups of the parameter gathers' own (a collective: every rank decides alike,
        from the whole graph), or None where the plan gathers no parameter."""
        graph, signatures = self.graph, self.signatures
        gathered = any(
            has_collective(self.boxer.steps(have, want, attrs["outputs"][0].shape))
            for node, attrs in graph.nodes(Role.PARAMETER)
            for consumer in graph.graph.successors(node)
            for _, index in graph.graph.edges[node, consumer]["uses"]
            if (have := signatures[node].outputs[0]) != (want := signatures[consumer].inputs[index])
        )
        if not gathered:
            return None
        return GatherSetup(policy, build_groups(meshes), build_groups(meshes), self._timeout)

    # ---- one step --------------------------------------------------------------------------

    def step(self, batch: Sequence[torch.Tensor]) -> float:
        """One training step on the global `batch` (the same tensors on every rank): this
        stage's forward and backward of each micro-batch in its 1F1B order (`stage_orders`),
        activations and gradients exchanged with the other stages, gradients accumulated (each
        loss scaled by 1/micro-batches: the loss must be a mean over the batch), gradient sync,
        optimizer step. Returns the full loss (the mean over micro-batches) on every rank."""
        self.optimizer.zero_grad(set_to_none=True)
        self.grad_sync.zero_grad()  # bucketed gradients: zeroed views of their buckets
        value = self.pipeline.run(split_micro_batches(batch, self.micro_batches))
        with self._span("grad_sync"):  # what backward did not hide
            self.grad_sync.finish()
        with self._span("optimizer"):
            self.optimizer.step()
        return self.pipeline.share_loss(value)  # every rank returns the loss of the last stage

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer assembled whole (tied names included). A collective: every
        rank must call it, and every rank gets the full tensors."""
        return self._assemble(self.owner, lambda name: self.state.get(name))

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient of the last step, synced and assembled whole (zeros where
        backward never reached it; tied names included). Valid from the end of `step` until the
        next one. A collective, like `full_state_dict`."""
        return self._assemble(
            {name: self.owner[name] for name in _names(self.graph, Role.PARAMETER)},
            lambda name: _gradient(self.parameters[name]) if name in self.parameters else None,
        )

    def _assemble(
        self, owners: Mapping[str, int], local_of: Callable[[str], torch.Tensor | None]
    ) -> dict[str, torch.Tensor]:
        """Each name of `owners` (name -> its stage) whole on every rank: `local_of(name)` is this
        rank's piece in the name's layout, None off its stage (broadcast from the stage's first
        device)."""
        out: dict[str, torch.Tensor] = {}
        staged = len(self.plan.stages) > 1
        with torch.no_grad():
            for name, owner in owners.items():
                shape, layout, local = self.shapes[name], self.layouts[name], local_of(name)
                if local is not None:
                    gather = self.boxer.chain(layout, (B,) * self.mesh.ndim, shape, local.dtype)
                    whole = gather(local.detach()).clone()
                else:
                    whole = torch.empty(shape, dtype=self._dtype_of(name))
                if staged:
                    dist.broadcast(whole, src=self.plan.stages[owner].devices[0])
                out[name] = whole
        for alias, kept in self.graph.meta.get("tied", {}).items():
            if kept in out:
                out[alias] = out[kept]
        return out

    def _dtype_of(self, name: str) -> torch.dtype:
        node = next(n for n, a in self.graph.nodes() if a["name"] == name)
        return self.graph.graph.nodes[node]["outputs"][0].dtype

    # ---- helpers ---------------------------------------------------------------------------


def _gradient(param: torch.Tensor) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)


@contextlib.contextmanager
def _no_span(kind: str, micro_batch: int | None = None) -> Iterator[None]:
    yield


def _names(graph: OpGraph, role: Role) -> list[str]:
    return [attrs["name"] for _, attrs in graph.nodes(role)]


def _state_layouts(
    graph: OpGraph, signatures: Mapping[str, NdSignature], plan: Plan
) -> dict[str, NdSbp]:
    """Parameter/buffer name -> its plan layout (the placeholder's output), checked against the
    plan's parameter table."""
    layouts: dict[str, NdSbp] = {}
    for node, attrs in graph.nodes():
        if attrs["role"] not in (Role.PARAMETER, Role.BUFFER):
            continue
        name, layout = attrs["name"], signatures[node].outputs[0]
        assert not any(isinstance(s, Partial) for s in layout), f"{name}: a P placeholder"
        listed = plan.params.get(name)
        if attrs["role"] is Role.PARAMETER and (
            listed is None or listed.sbp != format_nd_sbp(layout)
        ):
            raise PlanError(
                f"the plan gives parameter {name!r} the SBP {listed.sbp if listed else 'none'} in "
                f"its parameter table but {format_nd_sbp(layout)} in its node; the plan is "
                "inconsistent (edited by hand?): make it again."
            )
        layouts[name] = layout
    return layouts


def _materialize(
    sources: Mapping[str, torch.Tensor],
    graph: OpGraph,
    layouts: Mapping[str, NdSbp],
    mesh: Mesh,
    coords: tuple[int, ...],
    here: Callable[[str], bool],
) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter (a fresh leaf that requires grad) and buffer of
    its stage (`here(name)`)."""
    state: dict[str, torch.Tensor] = {}
    for _, attrs in graph.nodes():
        if attrs["role"] not in (Role.PARAMETER, Role.BUFFER):
            continue
        name = attrs["name"]
        if not here(name):
            continue
        full = sources[name].detach()
        if full.is_meta:
            raise ExecutionError(
                f"{name!r} of model `{graph.model_name}` is on the meta device: the Engine takes "
                "initial values from the model. Materialize it first (model.to_empty(device=...) "
                "and initialize the weights), then build the Engine."
            )
        local = shard_tensor(full, layouts[name], mesh, coords).clone()
        state[name] = local.requires_grad_(attrs["role"] is Role.PARAMETER)
    return state
