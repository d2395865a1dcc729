"""A plan's layouts on the user's own model, for the user's own training loop (torch DTensor).

Lives here: `distribute` (public as `autosbp.distribute`): a single-stage plan's parameters
become DTensors with the plan's placements on the plan's DeviceMesh, and the model's forward
distributes its inputs per the plan's input SBPs. torch's own op propagation then runs the
model: DTensor picks each op's collectives, not the plan's signatures (the plan's layouts are
where the parameters and inputs live; `runtime.engine` is what runs the plan itself). Lives
elsewhere: the plan in DTensor's terms (`autosbp.plan.device_mesh`, `placements`:
`autosbp.plan.dtensor`), the plan's own runtime (`runtime.engine`).

Invariants:
- Every rank calls `distribute` on the same model (same names, shapes and values: seed it, or
  load the same weights), in an initialized world of the plan's device count; a parameter
  becomes the DTensor of its whole value (`distribute_tensor`: rank 0's value, scattered).
- Inputs are whole tensors on every rank (rank 0's are used, as for parameters) and become
  DTensors with their input node's placements; tensors made inside forward (a constant, a mask)
  are plain and taken as replicated (`implicit_replication`). Buffers stay plain tensors,
  replicated likewise.
- Tied parameters stay tied: one DTensor for every module that shares the parameter.
- The distributing forward holds its model weakly (no cycle model -> forward -> model), so a
  model the user's code drops is freed at once, its DTensors with it, not at the next cycle
  collection.
- A parameter or input whose plan layout is partial (P) is refused: a whole tensor has no
  partial form to start from; so is a plan whose ops communicate inside themselves (context
  parallelism: `autosbp.plan.dtensor.check_dtensor_expressible` says why).
Limits (torch 2.13's DTensor, not this module; docs/limits.md): `F.mse_loss` over a
batch-sharded input gives gradients 2x too large (write `(pred - target).pow(2).mean()`), and
CPU attention (`_scaled_dot_product_flash_attention_for_cpu`) has no sharding strategy; and a
process that trained on DTensors over gloo may abort in interpreter shutdown after
`destroy_process_group` ("terminate called without an active exception") unless the cycle
collector ran first (`gc.collect()` before the destroy).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Placement, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication

from autosbp.errors import PlanError
from autosbp.plan import Plan, device_mesh, placements
from autosbp.plan.dtensor import check_dtensor_expressible

__all__ = ["distribute", "input_names"]

# torch.export's names for the placeholders that are not user inputs: parameters ("p_" + the
# name, dots as underscores), buffers ("b_"), lifted tensor constants ("c_").
_EXPORT_PREFIXES = ("p_", "b_", "c_")


def distribute(model: nn.Module, plan: Plan, *, device_type: str | None = None) -> nn.Module:
    """Make `model`'s parameters DTensors with `plan`'s placements (in place; returned), and its
    forward distribute its inputs per the plan's input SBPs. Train it with any loop: the loss
    is a DTensor (`loss.backward()`, `loss.full_tensor()`), each gradient a DTensor with its
    parameter's placements. `device_type`: "cpu" or "cuda" (`autosbp.plan.device_mesh`'s default)."""
    check_dtensor_expressible(plan)
    mesh = device_mesh(plan, device_type=device_type)
    names = {id(p): name for name, p in model.named_parameters()}
    _check_parameters(model, plan)
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in made:
                placements = _placements(plan, names[id(param)], "parameter")
                value = distribute_tensor(param.detach(), mesh, placements)
                made[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad)
            module._parameters[key] = made[id(param)]
    inputs = tuple((name, _placements(plan, name, "input")) for name in input_names(plan))
    forward = _distributing(model.forward, mesh, inputs, plan.model_name)
    model.forward = forward  # type: ignore[method-assign]
    return model


def input_names(plan: Plan) -> list[str]:
    """The plan's user-input nodes in forward's order: its placeholders that are not a
    parameter, a buffer or a lifted constant (torch.export's names)."""
    return [
        name
        for name, node in plan.nodes.items()
        if node.op == "placeholder" and not name.startswith(_EXPORT_PREFIXES)
    ]


def _check_parameters(model: nn.Module, plan: Plan) -> None:
    """PlanError unless the model's parameters are the plan's, with the plan's shapes."""
    params = dict(model.named_parameters())
    missing = sorted(set(plan.params) - set(params))
    extra = sorted(set(params) - set(plan.params))
    shapes = [
        f"{n}: model {tuple(p.shape)}, plan {plan.params[n].shape}"
        for n, p in params.items()
        if n in plan.params and plan.params[n].shape and tuple(p.shape) != plan.params[n].shape
    ]
    if missing or extra or shapes:
        found = "; ".join(
            part
            for part in (
                f"not in the model: {', '.join(missing[:5])}" if missing else "",
                f"not in the plan: {', '.join(extra[:5])}" if extra else "",
                f"other shapes: {', '.join(shapes[:5])}" if shapes else "",
            )
            if part
        )
        raise PlanError(
            f"the plan is for {plan.model_name}, and this model's parameters differ ({found}); "
            "distribute the model the plan was made for, with the same arguments."
        )


def _placements(plan: Plan, name: str, what: str) -> tuple[Placement, ...]:
    found = placements(plan, name)
    if any(isinstance(p, Partial) for p in found):
        raise PlanError(
            f"the plan lays out {what} {name!r} as a partial value ({plan.nodes.get(name)}); a "
            "whole tensor has no partial form to start from. Plan without that layout."
        )
    return found


def _distributing(
    forward: Callable[..., Any],
    mesh: Any,
    inputs: tuple[tuple[str, tuple[Placement, ...]], ...],
    model_name: str,
) -> Callable[..., Any]:
    """`forward` with its tensor inputs made DTensors per `inputs` (in order), run under
    implicit replication; a bound method is held weakly (the module header)."""
    held: Callable[[], Callable[..., Any] | None] = (
        weakref.WeakMethod(forward) if inspect.ismethod(forward) else lambda: forward
    )

    def distributed_forward(*args: Any, **kwargs: Any) -> Any:
        run = held()
        assert run is not None, "a forward called after its model was freed"
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if len(tensors) != len(inputs):
            raise PlanError(
                f"the plan for {model_name} has {len(inputs)} tensor inputs "
                f"({', '.join(n for n, _ in inputs)}), and forward got {len(tensors)}; pass them "
                "as the example inputs the plan was made with."
            )
        placed = iter(inputs)

        def place(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            _, placements = next(placed)
            if isinstance(value, DTensor):
                return value  # the caller distributed it already
            return distribute_tensor(value, mesh, placements)

        args = tuple(place(a) for a in args)
        kwargs = {k: place(v) for k, v in kwargs.items()}
        with implicit_replication():
            return run(*args, **kwargs)

    distributed_forward.__name__ = getattr(forward, "__name__", "forward")
    distributed_forward.__doc__ = forward.__doc__  # not functools.wraps: its __wrapped__ holds it
    return distributed_forward
