"""Rules of the graph's boundary nodes: placeholders (parameters, buffers, inputs) and the output.

Lives here: the "signature" of a placeholder (no inputs, one output that is B or S(d) for any dim
d; the registry's divisibility filter drops splits that do not divide) and of the output node
(its input, the loss, may be B or P). Lives elsewhere: materializing a placeholder's local shard
(`layout.shard_tensor`, called by the runtime), everything that happens between.

Invariants: a placeholder is never P (a parameter, buffer or user input is one value, not a sum
to be taken later), so data parallel (B parameters), Megatron TP (S parameters on one mesh dim)
and ZeRO/FSDP (S parameters on the data-parallel mesh dim) all emerge from these choices.
References: OneFlow variable_op.cpp (any S(i) or B); docs/architecture.md ("Planner").
"""

from __future__ import annotations

from autosbp.errors import SbpError
from autosbp.rules.core import LocalOp, NdSignature, Node, OpRule, Shape, Signature
from autosbp.sbp import B, P, S


def _placeholder_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    rank = len(node.outputs[0].shape)
    return [Signature((), (B,)), *(Signature((), (S(d),)) for d in range(rank))]


def _placeholder_local(node: Node, sig: NdSignature, mesh_shape: Shape, coords: Shape) -> LocalOp:
    raise SbpError(
        f"placeholder {node.name or node.op!r} has no local kernel: its value comes "
        "from outside the graph; materialize its shard with autosbp.layout.shard_tensor."
    )


def _output_signatures(node: Node, mesh_dim_size: int) -> list[Signature]:
    # The loss may stay P: summing the partial losses (one all-reduce of a scalar) gives it.
    n_in = len(node.inputs)
    return [Signature((B,) * n_in, ()), Signature((P,) * n_in, ())]


def _output_local(node: Node, sig: NdSignature, mesh_shape: Shape, coords: Shape) -> LocalOp:
    return LocalOp(lambda *args: (), (), {}, 0)


def rules() -> dict[str, OpRule]:
    """This family's rows of the registry."""
    return {
        "placeholder": OpRule(_placeholder_signatures, _placeholder_local),
        "output": OpRule(_output_signatures, _output_local),
    }
