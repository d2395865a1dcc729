"""This rank's sharded state: each parameter and buffer of its stage as its piece of its layout.

Lives here: `StageState` (the layout, global shape, dtype and owning stage of every parameter
and buffer of the plan; this rank's local tensors of its stage; the whole tensors assembled
back: `full_state_dict`, `full_gradients`), `state_layouts` (each one's layout, checked) and
`shard_state`, which builds it. Lives elsewhere:
rank 0's initial values every rank starts from (`runtime.state.startup`), the boxing that
gathers a piece back (`runtime.execute.instructions.Boxer`), saving and loading the state
(`runtime.state.checkpoint`), the Engine that trains it (`runtime.engine`).

Invariants:
- A parameter's local piece is a fresh leaf that requires grad; a buffer's does not. A stage
  holds the pieces of its own parameters and buffers only (the plan's stage of their node).
- Every layout is the placeholder's output SBP in the plan, never P, and a parameter's agrees
  with the plan's parameter table (a plan edited by hand is refused).
- Assembling is a collective: every rank gathers its stage's pieces to B and the stage's first
  device broadcasts them to the others, in the same name order on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autosbp.capturing.graph import OpGraph, Role
from autosbp.errors import ExecutionError, PlanError
from autosbp.layout import shard_tensor
from autosbp.plan import Plan
from autosbp.rules import NdSignature
from autosbp.sbp import B, Mesh, NdSbp, Partial, format_nd_sbp
from runtime.execute.collectives import world_device
from runtime.execute.instructions import Boxer

__all__ = ["StageState", "shard_state", "state_layouts"]


@dataclass(frozen=True)
class StageState:
    """`layouts`, `owner` (its stage) and `dtypes`: of every parameter and buffer of the plan;
    `shapes`: every named node's global shape; `state`: this rank's local tensors of its stage
    (parameters and buffers), `parameters` the parameters among them, in graph order;
    `trained`: every parameter's name, of every stage, in graph order; `tied`: alias -> the
    name it shares its tensor with; `stage_roots`: each stage's first rank."""

    layouts: dict[str, NdSbp]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    owner: dict[str, int]
    state: dict[str, torch.Tensor]
    parameters: dict[str, torch.Tensor]
    trained: tuple[str, ...]
    tied: dict[str, str]
    stage_roots: tuple[int, ...]

    def full_state_dict(
        self, boxer: Boxer, held: Mapping[str, tuple[torch.Tensor, NdSbp]] | None = None
    ) -> dict[str, torch.Tensor]:
        """Every parameter and buffer assembled whole (tied names included); `held`: name ->
        the tensor holding its value and its layout where it is not the local piece
        (`Engine.held_state`: a master held as its ZeRO shard). A collective."""

        def local_of(name: str) -> tuple[torch.Tensor, NdSbp] | None:
            if held and name in held:
                return held[name]
            local = self.state.get(name)
            return (local, self.layouts[name]) if local is not None else None

        return self._assemble(boxer, self.owner, local_of)

    def full_gradients(
        self, boxer: Boxer, sharded: Mapping[str, tuple[torch.Tensor, NdSbp]] | None = None
    ) -> dict[str, torch.Tensor]:
        """Every parameter's gradient, assembled whole (zeros where backward never reached it;
        tied names included); `sharded`: name -> the synced gradient and its layout where it is
        not the parameter's own (ZeRO-1's shard: `runtime.parallel.sharded_update`). A
        collective."""

        def local_of(name: str) -> tuple[torch.Tensor, NdSbp] | None:
            if sharded and name in sharded:
                return sharded[name]
            if name not in self.parameters:
                return None
            return _gradient(self.parameters[name]), self.layouts[name]

        return self._assemble(boxer, {name: self.owner[name] for name in self.trained}, local_of)

    def _assemble(
        self,
        boxer: Boxer,
        owners: Mapping[str, int],
        local_of: Callable[[str], tuple[torch.Tensor, NdSbp] | None],
    ) -> dict[str, torch.Tensor]:
        """Each name of `owners` (name -> its stage) whole on every rank: `local_of(name)` is this
        rank's piece and its layout, None off its stage (broadcast from the stage's first
        device)."""
        out: dict[str, torch.Tensor] = {}
        staged = len(self.stage_roots) > 1
        with torch.no_grad():
            for name, owner in owners.items():
                shape, found = self.shapes[name], local_of(name)
                if found is not None:
                    local, layout = found
                    gather = boxer.chain(layout, (B,) * boxer.mesh.ndim, shape, local.dtype)
                    whole = gather(local.detach()).clone()
                else:
                    whole = torch.empty(shape, dtype=self.dtypes[name], device=world_device())
                if staged:
                    dist.broadcast(whole, src=self.stage_roots[owner])
                out[name] = whole
        for alias, kept in self.tied.items():
            if kept in out:
                out[alias] = out[kept]
        return out


def shard_state(
    sources: Mapping[str, torch.Tensor],
    graph: OpGraph,
    layouts: Mapping[str, NdSbp],
    plan: Plan,
    mesh: Mesh,
    coords: tuple[int, ...],
    stage: int,
    *,
    master_dtype: torch.dtype | None = None,
) -> StageState:
    """This rank's `StageState`: the whole initial tensors `sources` (by name) cut to the pieces
    at `coords` of `mesh` (`stage`'s) of the stage's parameters and buffers, in their
    `layouts` (`state_layouts`). Each piece takes the dtype of the graph's tensor, but
    parameters take `master_dtype` where given (a mixed recipe's fp32 masters, cut from the
    model's own values, never from a rounded copy)."""
    owner = {
        attrs.name: plan.nodes[node].stage
        for node, attrs in graph.nodes()
        if attrs.role in (Role.PARAMETER, Role.BUFFER)
    }
    pipeline = plan.pipeline_stages  # interleaved, a rank holds every chunk of its stage
    state = _materialize(
        sources, graph, layouts, mesh, coords, lambda n: owner[n] % pipeline == stage,
        master_dtype,
    )  # fmt: skip
    trained = tuple(attrs.name for _, attrs in graph.nodes(Role.PARAMETER))
    return StageState(
        layouts=dict(layouts),
        shapes={a.name: a.outputs[0].shape for _, a in graph.nodes() if a.name},
        dtypes={
            attrs.name: master_dtype
            if master_dtype is not None and attrs.role is Role.PARAMETER
            else attrs.outputs[0].dtype
            for _, attrs in graph.nodes()
            if attrs.role in (Role.PARAMETER, Role.BUFFER)
        },
        owner=owner,
        state=state,
        parameters={name: state[name] for name in trained if name in state},
        trained=trained,
        tied=dict(graph.meta.get("tied", {})),
        stage_roots=tuple(s.devices[0] for s in plan.stages),
    )


def _gradient(param: torch.Tensor) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)


def state_layouts(
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
    master_dtype: torch.dtype | None,
) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter (a fresh leaf that requires grad, in
    `master_dtype` where given) and buffer of its stage (`here(name)`), in the graph's dtype."""
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
        parameter = attrs.role is Role.PARAMETER
        dtype = master_dtype if parameter and master_dtype is not None else attrs.outputs[0].dtype
        local = shard_tensor(full, layouts[name], mesh, coords).to(dtype, copy=True)
        state[name] = local.requires_grad_(parameter)
    return state
