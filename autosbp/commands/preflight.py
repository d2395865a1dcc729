"""What `autosbp train` checks in the parent, before any process starts.

Lives here: `check_job`: the plan against the model (the model's graph at the plan's
micro-batch size, captured on the meta device, must have the plan's fingerprint and pass every
whole-plan check, `autosbp.plan.check_plan`) and the model trainable (parameters the loss
depends on). Lives elsewhere: the whole-plan checks (`autosbp.plan.checks`), the checkpoint
arguments (`commands.train`: they read runtime's checkpoint format), the job (`runtime.jobs`).

Why here: a problem found after launch costs the ranks' start-up (10-30 s on 2 cores) and comes
back as a rank's failure; found here, it costs one capture and reads as one paragraph.
"""

from __future__ import annotations

from typing import Any

from autosbp.errors import CaptureError
from autosbp.plan import Plan, check_plan
from autosbp.plan.values import DTYPES

__all__ = ["check_job"]


def check_job(plan: Plan, model: str, model_args: dict[str, Any], source: str) -> None:
    """Refuse `plan` for `model` (from --model-args) before launching, naming the problem."""
    import networkx as nx

    from autosbp.capturing.export import capture_micro_batch
    from autosbp.capturing.graph import Role
    from autosbp.zoo import load_model

    module, inputs = load_model(model, model_args, device="meta")
    graph = capture_micro_batch(
        module, inputs, plan.micro_batches, name=model, dtype=DTYPES[plan.dtype]
    )
    plan.check_model(graph.fingerprint(), f"model `{model}`")
    check_plan(plan, graph, source=source)
    params = [node for node, _ in graph.nodes(Role.PARAMETER)]
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    if not params and frozen:
        raise CaptureError(
            f"every parameter of model `{model}` is frozen (requires_grad=False: "
            f"{len(frozen)} tensors, {', '.join(frozen[:3])}{', ...' if len(frozen) > 3 else ''}), "
            "so training has nothing to change (torch's optimizers refuse an empty parameter "
            "list); unfreeze what should train (module.requires_grad_(True))."
        )
    if not params:
        raise CaptureError(
            f"model `{model}` has no parameters, so training has nothing to change; give it "
            "layers with parameters (nn.Linear, nn.Parameter, ...)."
        )
    outputs = [node for node, _ in graph.nodes(Role.OUTPUT)]
    reaching = set().union(*(nx.ancestors(graph.graph, node) for node in outputs))
    if not reaching.intersection(params):
        raise CaptureError(
            f"the loss of model `{model}` depends on none of its {len(params)} parameter "
            "tensors, so every gradient is zero and training changes nothing; make forward "
            "compute the loss through the model's layers."
        )
