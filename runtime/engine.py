"""`Engine`: train a model under a single-stage Plan on every rank of a torch.distributed world.

Lives here: the checks that a plan fits this model and world, this rank's state (each parameter
as the local shard of its plan SBP, a leaf that requires grad; buffers likewise), the step (the
program's forward, the loss seed, backward, gradient sync, the optimizer) and `full_state_dict`.
Lives elsewhere: the forward program (`runtime.program`), the collectives and process groups
(`runtime.boxing`, `runtime.groups`), the plan (`autosbp.plan`), capture (`autosbp.capturing`).

Invariants:
- Everything is planned in the constructor; `step` runs prebuilt closures only.
- The loss (layout L) is boxed to P on every mesh dim before backward, and every rank seeds 1:
  the backward of that boxing (B -> P keeps the seed on coordinate 0 of each B mesh dim) makes
  the seeds sum to exactly one, so a replicated loss is not counted once per device.
- A parameter in layout p ends backward with its gradient in dual(p) (P where p has B, S where p
  has S); the sync boxes dual(p) -> p (an all-reduce over p's B mesh dims). Gradients with the
  same B mesh dims and dtype are synced together in flat buckets (as DDP does), in graph order.
- The optimizer steps on local shards: exact for elementwise optimizers (SGD, Adam, AdamW), not
  for ones that take norms across a whole tensor (LAMB, gradient clipping by global norm).
- Every wait is a collective of the process groups, bounded by the world's timeout.
Reference: design.md 3.7; torch DDP's gradient buckets (`bucket_cap_mb`, 25 MB by default).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from autosbp.errors import ExecutionError, PlanError
from autosbp.graph import OpGraph, Role
from autosbp.layout import shard_tensor
from autosbp.plan import Plan
from autosbp.rules import NdSignature
from autosbp.sbp import B, Broadcast, Mesh, NdSbp, P, Partial, format_nd_sbp
from autosbp.schedule import GRAD_BUCKET_BYTES, split_micro_batches
from runtime.closures import Boxer
from runtime.groups import build_groups
from runtime.program import Program, build_program, read_signatures

__all__ = ["Engine"]

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


@dataclass(frozen=True, slots=True)
class GradBucket:
    """Parameters whose gradients sync with one chain: flattened, boxed, split back."""

    params: tuple[torch.Tensor, ...]
    sync: Callable[[torch.Tensor], torch.Tensor]


class Engine:
    """Runs training steps of `model` under `plan` on this rank (call on every rank).

    `optimizer_factory(local_params)` builds the optimizer over this rank's shards;
    `example_inputs` are the inputs the plan was made with (their shapes are checked); `graph`
    is an already captured graph of `model` to skip capturing again.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        optimizer_factory: OptimizerFactory,
        *,
        example_inputs: Sequence[torch.Tensor],
        graph: OpGraph | None = None,
    ) -> None:
        _check_scope(plan)
        if not dist.is_available() or not dist.is_initialized():
            raise ExecutionError(
                "Engine needs an initialized torch.distributed world; launch with torchrun "
                f"--nproc-per-node {plan.device_count} (or costmodel.launch.run_workers) and call "
                "dist.init_process_group first."
            )
        plan.check_world(dist.get_world_size())
        self.micro_batches = plan.micro_batches
        if graph is None:  # the program runs one micro-batch: capture at that size
            from autosbp.capturing import capture_micro_batch

            graph = capture_micro_batch(model, example_inputs, self.micro_batches)
        plan.check_model(graph.fingerprint(), f"model `{graph.model_name}`")
        self.plan, self.graph = plan, graph
        self.mesh = Mesh(plan.mesh_shape, plan.mesh_dims, plan.stages[0].devices, plan.link_classes)
        self.rank = dist.get_rank()
        self.coords = self.mesh.coords(self.mesh.device_ids.index(self.rank))
        self.signatures = read_signatures(graph, plan, self.mesh.shape)
        self.boxer = Boxer(self.mesh, build_groups([self.mesh]))
        self.layouts = _state_layouts(graph, self.signatures, plan)
        self.shapes = {a["name"]: a["outputs"][0].shape for _, a in graph.nodes() if a["name"]}
        self.state = _materialize(model, graph, self.layouts, self.mesh, self.coords)
        self.parameters = {name: self.state[name] for name in _names(graph, Role.PARAMETER)}
        self.program: Program = build_program(
            graph, self.signatures, self.state, self.coords, self.boxer
        )
        loss_layout, ndim = self.program.loss_layout, self.mesh.ndim
        self._seed = self.boxer.chain(loss_layout, (P,) * ndim, ())
        self._loss_value = self.boxer.chain(loss_layout, (B,) * ndim, ())
        self._buckets = _grad_buckets(self.parameters, self.layouts, self.mesh, self._bucket_sync)
        self.optimizer = optimizer_factory(list(self.parameters.values()))

    # ---- one step --------------------------------------------------------------------------

    def step(self, batch: Sequence[torch.Tensor]) -> float:
        """One training step on the global `batch` (the same tensors on every rank): forward and
        backward of each micro-batch (gradients accumulate, each loss scaled by 1/micro-batches:
        the loss must be a mean over the batch), gradient sync, optimizer step. Returns the full
        loss (the mean over micro-batches)."""
        self.optimizer.zero_grad(set_to_none=True)
        value = 0.0
        for micro_batch in split_micro_batches(batch, self.micro_batches):
            loss = self.program.run(micro_batch)
            with torch.no_grad():
                value += float(self._loss_value(loss.detach())) / self.micro_batches
            (self._seed(loss) * (1.0 / self.micro_batches)).backward()
        with torch.no_grad():
            for bucket in self._buckets:
                _sync_bucket(bucket)
        self.optimizer.step()
        return value

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer assembled whole (tied names included). A collective: every
        rank must call it, and every rank gets the full tensors."""
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, local in self.state.items():
                shape, layout = self.shapes[name], self.layouts[name]
                gather = self.boxer.chain(layout, (B,) * self.mesh.ndim, shape, local.dtype)
                out[name] = gather(local.detach()).clone()
        for alias, kept in self.graph.meta.get("tied", {}).items():
            if kept in out:
                out[alias] = out[kept]
        return out

    # ---- helpers ---------------------------------------------------------------------------

    def _bucket_sync(
        self, numel: int, broadcast: tuple[bool, ...], dtype: torch.dtype
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """A flat buffer of local gradients is P on the mesh dims where its parameters are B,
        and whole (B) on the others (each rank's buffer is its own shards): box it to all-B."""
        src = tuple(P if b else B for b in broadcast)
        return self.boxer.chain(src, (B,) * self.mesh.ndim, (numel,), dtype, donate=True)


def _check_scope(plan: Plan) -> None:
    if len(plan.stages) != 1:
        raise PlanError(
            f"not supported yet: pipeline stages. This plan has {len(plan.stages)} stages; this "
            "runtime runs plans of one stage (micro-batches accumulate gradients). Make a plan "
            "with one stage for now."
        )


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
    model: nn.Module,
    graph: OpGraph,
    layouts: Mapping[str, NdSbp],
    mesh: Mesh,
    coords: tuple[int, ...],
) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter (a fresh leaf that requires grad) and buffer."""
    sources: dict[str, torch.Tensor] = dict(graph.meta.get("constants", {}))
    sources.update(model.named_buffers(remove_duplicate=False))
    sources.update(model.named_parameters(remove_duplicate=False))
    state: dict[str, torch.Tensor] = {}
    for _, attrs in graph.nodes():
        if attrs["role"] not in (Role.PARAMETER, Role.BUFFER):
            continue
        name = attrs["name"]
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


BucketSync = Callable[[int, tuple[bool, ...], torch.dtype], Callable[[torch.Tensor], torch.Tensor]]


def _grad_buckets(
    params: Mapping[str, torch.Tensor],
    layouts: Mapping[str, NdSbp],
    mesh: Mesh,
    make_sync: BucketSync,
) -> tuple[GradBucket, ...]:
    """Parameters that are B on a mesh dim of more than one device, grouped by (which mesh dims
    those are, dtype) in graph order, cut into buckets of at most GRAD_BUCKET_BYTES."""
    current: dict[tuple[tuple[bool, ...], torch.dtype], list[torch.Tensor]] = {}
    buckets: list[tuple[tuple[bool, ...], list[torch.Tensor]]] = []
    for name, param in params.items():
        broadcast = tuple(
            isinstance(sbp, Broadcast) and size > 1
            for sbp, size in zip(layouts[name], mesh.shape, strict=True)
        )
        if not any(broadcast):
            continue  # split (or alone) on every mesh dim: the gradient is already in place
        members = current.get((broadcast, param.dtype))
        if members is None or sum(p.nbytes for p in members) + param.nbytes > GRAD_BUCKET_BYTES:
            members = current[(broadcast, param.dtype)] = []
            buckets.append((broadcast, members))
        members.append(param)
    return tuple(
        GradBucket(
            tuple(members), make_sync(sum(p.numel() for p in members), broadcast, members[0].dtype)
        )
        for broadcast, members in buckets
    )


def _sync_bucket(bucket: GradBucket) -> None:
    """dual(p) -> p for every gradient of the bucket, through one flat buffer."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
    flat = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1)
    synced = bucket.sync(flat)
    offset = 0
    for param in bucket.params:
        if param.grad is not None:
            param.grad = synced[offset : offset + param.numel()].view_as(param)
        offset += param.numel()
