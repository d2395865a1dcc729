"""`Engine`: train a model under a Plan on every rank of a torch.distributed world.

Lives here: the checks that a plan fits this model and world, this rank's stage and state (each
parameter of its stage as the local shard of its plan SBP, a leaf that requires grad; buffers
likewise), the step (the stage's 1F1B order of forwards and backwards per micro-batch, the
cross-stage sends and receives, the loss seed, gradient sync, the optimizer) and
`full_state_dict`. Lives elsewhere: the stage's program (`runtime.execute.program`), the firing order
(`autosbp.schedule.stage_orders`), the collectives and process groups (`runtime.execute.collectives`,
`runtime.execute.groups`), the gradient sync (`runtime.parallel.grad_sync`), the plan and its whole-plan
checks (`autosbp.plan`), the ranks' agreement on the plan and on rank 0's initial state
(`runtime.state.startup`), capture (`autosbp.capturing.export`).

Invariants:
- Everything is planned in the constructor; `step` runs prebuilt closures only.
- Each stage runs the firing order the actor rules give it (`stage_orders`): receives block,
  sends do not (isend, waited for at the end of the step), so the order cannot deadlock. A
  value crossing stages keeps its layout: device i of one stage sends its local piece to device
  i of the other, and the gradient comes back the same way.
- The loss (layout L, on the last stage) is boxed to P on every mesh dim before backward, and
  every rank seeds 1: the backward of that boxing (B -> P keeps the seed on coordinate 0 of each
  B mesh dim) makes the seeds sum to exactly one, so a replicated loss is not counted once per
  device. Every rank returns the loss (broadcast from the last stage).
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
Reference: docs/architecture.md ("Runtime"); Narayanan et al. 2021 (1F1B); torch DDP's gradient buckets
(`bucket_cap_mb`, 25 MB by default).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from autosbp.capturing.batches import split_micro_batches
from autosbp.capturing.graph import OpGraph, Role, TensorMeta
from autosbp.errors import ExecutionError, PlanError
from autosbp.layout import shard_tensor
from autosbp.plan import Plan, check_plan
from autosbp.plan.recompute import recomputed_nodes
from autosbp.rules import NdSignature
from autosbp.sbp import B, Mesh, NdSbp, P, Partial, format_nd_sbp, local_shape
from autosbp.schedule import Phase, stage_orders
from autosbp.timeline import SpanHook
from runtime.execute.groups import build_groups, world_timeout
from runtime.execute.instructions import Boxer
from runtime.execute.program import Program, build_program, read_signatures, stage_boundaries
from runtime.parallel.gathers import GatherPolicy, has_collective, plan_gather_policy
from runtime.parallel.grad_sync import GradSync, build_sync_groups, sync_patterns
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
        meshes = [
            Mesh(plan.mesh_shape, plan.mesh_dims, stage.devices, plan.link_classes)
            for stage in plan.stages
        ]
        self.stage = next(s for s, mesh in enumerate(meshes) if self.rank in mesh.device_ids)
        self.mesh = meshes[self.stage]
        self.index = self.mesh.device_ids.index(self.rank)
        self.coords = self.mesh.coords(self.index)
        self.signatures = read_signatures(graph, plan, self.mesh.shape)
        stage_of = {name: node.stage for name, node in plan.nodes.items()}
        self.boxer = Boxer(self.mesh, build_groups(meshes))
        self.layouts = _state_layouts(graph, self.signatures, plan)
        self.shapes = {a.name: a.outputs[0].shape for _, a in graph.nodes() if a.name}
        self.owner = {
            attrs.name: stage_of[node]
            for node, attrs in graph.nodes()
            if attrs.role in (Role.PARAMETER, Role.BUFFER)
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
        self.program: Program = build_program(
            graph, self.signatures, self.state, self.coords, self.boxer,
            stage_of=stage_of, stage=self.stage, recomputed=recomputed_nodes(plan, graph),
            gathering=self._gathering(meshes, gathers or plan_gather_policy(plan, self.stage)),
        )  # fmt: skip
        self._links = _links(graph, self.signatures, stage_of, meshes, self.stage, self.index)
        self._order = stage_orders(len(meshes), self.micro_batches)[self.stage]
        self._last_stage = meshes[stage_of["output"]] if "output" in stage_of else meshes[-1]
        ndim = self.mesh.ndim
        loss_layout = self.program.loss_layout
        if loss_layout is not None:
            self._seed = self.boxer.chain(loss_layout, (P,) * ndim, ())
            self._loss_value = self.boxer.chain(loss_layout, (B,) * ndim, ())
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
        self._last_backward = max(
            i for i, (phase, _) in enumerate(self._order) if phase is Phase.BACKWARD
        )
        self.optimizer = optimizer_factory(list(self.parameters.values()))
        self.recorder = recorder
        self._span = recorder.span if recorder is not None else _no_span
        if scheduled is not None:
            scheduled.span_hook, scheduled.on_gradient = recorder, self.grad_sync.gradient_ready

    def _gathering(self, meshes: Sequence[Mesh], policy: GatherPolicy) -> GatherSetup | None:
        """Process groups of the parameter gathers' own (a collective: every rank decides alike,
        from the whole graph), or None where the plan gathers no parameter."""
        graph, signatures = self.graph, self.signatures
        gathered = any(
            has_collective(self.boxer.steps(have, want, attrs.outputs[0].shape))
            for node, attrs in graph.nodes(Role.PARAMETER)
            for consumer in graph.graph.successors(node)
            for _, index in graph.uses(node, consumer)
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
        pieces = split_micro_batches(batch, self.micro_batches)
        in_flight: dict[
            int, tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]
        ] = {}
        sends: list[tuple[dist.Work, torch.Tensor]] = []
        value = torch.zeros(())
        for position, (phase, mb) in enumerate(self._order):
            if phase is Phase.FORWARD:
                received = self._receive(mb, backward=False)
                with self._span("forward", mb):
                    loss, exports = self.program.run(pieces[mb], received, mb)
                sends += self._send(exports, backward=False)
                in_flight[mb] = (received, exports, loss)
                if loss is not None:
                    with torch.no_grad():
                        value += self._loss_value(loss.detach()) / self.micro_batches
            else:
                received, exports, loss = in_flight.pop(mb)
                grads = self._receive(mb, backward=True)
                if position == self._last_backward:
                    self.grad_sync.arm()  # gradients are final in this backward: sync them
                with self._span("backward", mb):
                    _backward(
                        self._seed(loss) * (1.0 / self.micro_batches) if loss is not None else None,
                        exports,
                        grads,
                    )
                    if self.program.gathers is not None:
                        self.program.gathers.finish_backward(mb)
                sends += self._send(
                    [x.grad if x.grad is not None else torch.zeros_like(x) for x in received
                     if x.is_floating_point()],
                    backward=True,
                )  # fmt: skip
        for work, _ in sends:
            work.wait(self._timeout)
        with self._span("grad_sync"):  # what backward did not hide
            self.grad_sync.finish()
        with self._span("optimizer"):
            self.optimizer.step()
        if len(self.plan.stages) > 1:  # every rank returns the loss of the last stage
            dist.broadcast(value, src=self._last_stage.device_ids[0])
        return float(value)

    def _receive(self, mb: int, *, backward: bool) -> list[torch.Tensor]:
        """This micro-batch's values from earlier stages (forward), or the gradients of the
        values this stage sent (backward), in `stage_boundaries` order."""
        links = self._links.grads_in if backward else self._links.values_in
        if not links:
            return []
        out = []
        with self._span("recv", mb):
            for peer, metas in links:
                for meta in metas:
                    buffer = torch.empty(meta.shape, dtype=meta.dtype)
                    _p2p(dist.irecv, buffer, peer, int(backward)).wait(self._timeout)
                    if not backward and buffer.is_floating_point():
                        buffer.requires_grad_(True)
                    out.append(buffer)
        return out

    def _send(
        self, tensors: Sequence[torch.Tensor], *, backward: bool
    ) -> list[tuple[dist.Work, torch.Tensor]]:
        links = self._links.grads_out if backward else self._links.values_out
        works, position = [], 0
        for peer, metas in links:
            for _ in metas:
                tensor = tensors[position].detach().contiguous()
                position += 1
                works.append((_p2p(dist.isend, tensor, peer, int(backward)), tensor))
        assert position == len(tensors), f"sent {position} of {len(tensors)} values"
        return works

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
        node = next(n for n, a in self.graph.nodes() if a.name == name)
        return self.graph.node(node).outputs[0].dtype

    # ---- helpers ---------------------------------------------------------------------------


def _p2p(
    op: Callable[..., dist.Work | None], tensor: torch.Tensor, peer: int, tag: int
) -> dist.Work:
    """One isend/irecv with a global peer rank (a tag per direction: 0 values, 1 gradients)."""
    work = op(tensor, peer, tag=tag)
    assert work is not None, "isend/irecv returned no work: is this rank in the default group?"
    return work


def _gradient(param: torch.Tensor) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)


@contextlib.contextmanager
def _no_span(kind: str, micro_batch: int | None = None) -> Iterator[None]:
    yield


def _backward(
    seed: torch.Tensor | None, exports: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
) -> None:
    """Backward of one micro-batch on one stage: from the loss seed (last stage) and from the
    gradients later stages sent for this stage's exports (floating values only, in order)."""
    roots: list[torch.Tensor] = []
    root_grads: list[torch.Tensor | None] = []
    if seed is not None:
        roots.append(seed)
        root_grads.append(None)
    floating = [x for x in exports if x.is_floating_point()]
    for tensor, grad in zip(floating, grads, strict=True):
        if tensor.requires_grad:
            roots.append(tensor)
            root_grads.append(grad)
    if roots:
        torch.autograd.backward(roots, root_grads)


@dataclass(frozen=True)
class _Links:
    """Peers and local tensor metas of this rank's cross-stage traffic, in exchange order:
    values in (from earlier stages), values out, gradients in (for values out, floating only),
    gradients out (for values in, floating only)."""

    values_in: tuple[tuple[int, tuple[TensorMeta, ...]], ...]
    values_out: tuple[tuple[int, tuple[TensorMeta, ...]], ...]
    grads_in: tuple[tuple[int, tuple[TensorMeta, ...]], ...]
    grads_out: tuple[tuple[int, tuple[TensorMeta, ...]], ...]


def _links(
    graph: OpGraph,
    signatures: Mapping[str, NdSignature],
    stage_of: Mapping[str, int],
    meshes: Sequence[Mesh],
    stage: int,
    index: int,
) -> _Links:
    """Device `index` of one stage talks to device `index` of another: a value keeps its layout
    across stages (every stage has the same mesh shape), so each sends its own local piece."""

    def local(value: tuple[str, int]) -> TensorMeta:
        node, out = value
        meta = graph.node(node).outputs[out]
        layout = signatures[node].outputs[out]
        return TensorMeta(local_shape(meta.shape, layout, meshes[stage].shape), meta.dtype)

    values_in, values_out = [], []
    for (src, dst), values in sorted(stage_boundaries(graph, stage_of).items()):
        metas = tuple(local(v) for v in values)
        if dst == stage:
            values_in.append((meshes[src].device_ids[index], metas))
        if src == stage:
            values_out.append((meshes[dst].device_ids[index], metas))

    def floating(links: list) -> tuple:
        kept = [
            (peer, tuple(m for m in metas if m.dtype.is_floating_point)) for peer, metas in links
        ]
        return tuple((peer, metas) for peer, metas in kept if metas)

    return _Links(tuple(values_in), tuple(values_out), floating(values_out), floating(values_in))


def _names(graph: OpGraph, role: Role) -> list[str]:
    return [attrs.name for _, attrs in graph.nodes(role)]


def _state_layouts(
    graph: OpGraph, signatures: Mapping[str, NdSignature], plan: Plan
) -> dict[str, NdSbp]:
    """Parameter/buffer name -> its plan layout (the placeholder's output), checked against the
    plan's parameter table."""
    layouts: dict[str, NdSbp] = {}
    for node, attrs in graph.nodes():
        if attrs.role not in (Role.PARAMETER, Role.BUFFER):
            continue
        name, layout = attrs.name, signatures[node].outputs[0]
        assert not any(isinstance(s, Partial) for s in layout), f"{name}: a P placeholder"
        listed = plan.params.get(name)
        if attrs.role is Role.PARAMETER and (listed is None or listed.sbp != format_nd_sbp(layout)):
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
        if attrs.role not in (Role.PARAMETER, Role.BUFFER):
            continue
        name = attrs.name
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
        state[name] = local.requires_grad_(attrs.role is Role.PARAMETER)
    return state
