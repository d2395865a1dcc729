"""Matmul-like ops as einsum strings: linear, mm, bmm, matmul, addmm, baddbmm.

Lives here: `EINSUM` (op -> einsum spec, plus the name of an optional addend broadcast to the
output, like linear's bias), the generation rules below, and the letter assignment for ops with
batch dims ("..."). Lives elsewhere: attention (`attention`), convolutions (`conv`).

Generation rules, each per einsum letter, for one mesh dim:
  free letter (in the output)   operands holding it (non-broadcast) S, others B -> output S;
                                the addend follows the output by broadcasting
  contracting letter            operands holding it S -> output P (sum_k splits into partial sums);
                                the addend must be P (added once in total, not once per device)
  linearity                     operand i P, other operands B, addend P -> P (bilinear in operands)
  all B                         -> B
References: torch/distributed/tensor/_ops/_einsum_strategy.py; OneFlow matmul_op.cpp.
"""

from __future__ import annotations

from dataclasses import dataclass

from autosbp.rules.core import (
    Node,
    OpRule,
    Shape,
    Signature,
    all_broadcast,
    arg_shape,
    make_signature,
    out_shapes,
    tensor_slots,
)
from autosbp.rules.pointwise import aligned_sbp
from autosbp.sbp import B, P, S, Sbp


@dataclass(frozen=True, slots=True)
class Einsum:
    """`spec` over the schema arguments `operands`; `addend` (if any) is added to the product."""

    spec: str
    operands: tuple[str, ...]
    addend: str | None = None


EINSUM: dict[str, Einsum] = {
    "aten.mm.default": Einsum("mk,kn->mn", ("self", "mat2")),
    "aten.bmm.default": Einsum("bmk,bkn->bmn", ("self", "mat2")),
    "aten.linear.default": Einsum("...k,nk->...n", ("input", "weight"), "bias"),
    "aten.addmm.default": Einsum("mk,kn->mn", ("mat1", "mat2"), "self"),
    "aten.baddbmm.default": Einsum("bmk,bkn->bmn", ("batch1", "batch2"), "self"),
    "aten.matmul.default": Einsum("", ("self", "other")),  # letters follow the ranks
}


def einsum_signatures(node: Node, einsum: Einsum) -> list[Signature]:
    slots = tensor_slots(node)
    operand_shapes = [arg_shape(node, name) for name in einsum.operands]
    letters, out_letters = letters_of(einsum, operand_shapes)
    out_shape = out_shapes(node)[0]
    addend = einsum.addend if einsum.addend in slots else None
    addend_shape = arg_shape(node, addend) if addend else ()

    def sig(operands: list[Sbp], addend_sbp: Sbp, out: Sbp) -> Signature:
        by_name: dict[str, Sbp] = dict(zip(einsum.operands, operands, strict=True))
        if addend:
            by_name[addend] = addend_sbp
        return make_signature(node, by_name, (out,))

    sigs = [all_broadcast(node)]
    for letter in dict.fromkeys("".join(letters)):
        if letter in out_letters:
            out_dim = out_letters.index(letter)
            ops = [
                _free_sbp(lt, shape, letter, out_shape[out_dim])
                for lt, shape in zip(letters, operand_shapes, strict=True)
            ]
            if any(s is not B for s in ops):
                sigs.append(sig(ops, aligned_sbp(addend_shape, out_shape, out_dim), S(out_dim)))
        else:  # contracting: every operand holding it is split there
            ops = [S(lt.index(letter)) if letter in lt else B for lt in letters]
            sigs.append(sig(ops, P, P))
    for i in range(len(einsum.operands)):  # linearity
        sigs.append(sig([P if j == i else B for j in range(len(einsum.operands))], P, P))
    return sigs


def _free_sbp(letters: str, shape: Shape, letter: str, out_size: int) -> Sbp:
    if letter not in letters:
        return B
    dim = letters.index(letter)
    return S(dim) if shape[dim] == out_size else B  # a size-1 batch dim broadcasts: B


def letters_of(einsum: Einsum, shapes: list[Shape]) -> tuple[list[str], str]:
    """Concrete letters per operand and for the output (batch dims take letters from 'A')."""
    if not einsum.spec:
        return _matmul_letters(shapes)
    ins, out = einsum.spec.split("->")
    terms = ins.split(",")
    batch_rank = (
        max(len(shape) - (len(t) - 3) for t, shape in zip(terms, shapes, strict=True) if "..." in t)
        if "..." in ins
        else 0
    )
    batch = "".join(chr(ord("A") + i) for i in range(batch_rank))
    return [t.replace("...", batch) for t in terms], out.replace("...", batch)


def _matmul_letters(shapes: list[Shape]) -> tuple[list[str], str]:
    """torch.matmul's rank cases: a 1-D operand drops its dim; batch dims align from the right."""
    a, b = shapes
    a_core = "k" if len(a) == 1 else "mk"
    b_core = "k" if len(b) == 1 else "kn"
    batch_rank = max(len(a) - len(a_core), len(b) - len(b_core), 0)
    batch = "".join(chr(ord("A") + i) for i in range(batch_rank))
    a_letters = batch[batch_rank - (len(a) - len(a_core)) :] + a_core
    b_letters = batch[batch_rank - (len(b) - len(b_core)) :] + b_core
    out = batch + ("m" if len(a) > 1 else "") + ("n" if len(b) > 1 else "")
    return [a_letters, b_letters], out


def rules() -> dict[str, OpRule]:
    """This family's rows of the registry."""

    def make(einsum: Einsum) -> OpRule:
        return OpRule(lambda node, mesh_dim_size: einsum_signatures(node, einsum))

    return {op: make(einsum) for op, einsum in EINSUM.items()}
