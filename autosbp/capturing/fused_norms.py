"""Fused norms: an RMSNorm written out in eager ops is captured as torch's one `rms_norm` op.

Lives here: `fuse_norms` (the rewrite of an exported program: each RMSNorm written in eager ops
becomes one `aten.rms_norm.default` node, and what was fused or kept eager as lines for the
user) and `rms_norm` (the kernel every interpreter runs that op as: `graph.kernel_of`). Lives
elsewhere: its SBP rule (`rules.norm`: rows split, the normalized dim whole, the weight B), what
its backward keeps as the planner prices it (`planner.memory.autograd_probe`, which runs this
kernel on fake tensors), where capture calls the pass (`export._capture_whole`).

The pattern (Hugging Face's LlamaRMSNorm and the 130-odd norms copied from it, T5's and
OLMo's, Moshi's and Helium's forms), on x of dtype d and h = x in the computation dtype c
(float32 for float16, bfloat16 and float32; float64 for float64), all in one module:

    h = x.to(c)                                   (absent where d is c)
    r = rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    n = h * r                                     (or x * r: the same product, promoted)
    then, each at most once, in either order:  .to(d)  and  * weight   (weight of shape [H])

becomes `rms_norm(x, [H], weight, eps)`. Torch's fused op computes (h * r * weight) in c and
rounds once to d. Every form above computes exactly that, but one: a weight multiplied after
the cast to a half dtype (Llama's `weight * n.to(d)`) is rounded twice in eager and once fused,
so the two agree up to one rounding of d (in float32 they are the same bits). The weight must
be of dtype d (torch's fused kernel takes no other: its composite path would run), so Gemma's
`* (1 + weight.float())` on a bfloat16 input stays eager (said so); in float32 its scale is of
dtype d, and is the weight. Casts to the same dtype are no-ops and are absorbed.

Invariants: only what computes exactly the norm is rewritten. Every intermediate (the square,
the mean, the sum with eps, the rsqrt, n, and each cast and product after it) is read by
nothing but the next step of the pattern (export's dtype asserts aside), so erasing them loses
no value; the upcast h, read elsewhere, is kept for its other readers. The mean is over the last
dim only, with keepdim; eps a number; the exponent 2. A value returned by the program is not
fused (its name is in the program's signature).

The kernel. On a device where torch has a fused kernel for `_fused_rms_norm` (CUDA, torch >=
2.8), `rms_norm` is torch's op itself: its backward keeps the input, the weight and an fp32
rstd per row. Elsewhere (the CPU) torch's `rms_norm` runs its composite, whose autograd keeps
the fp32 upcast and products as eager does; there `rms_norm` runs the same arithmetic as
torch's composite forward in an autograd.Function that keeps what the fused kernel keeps
(input, weight, rstd) and computes the gradients from them as torch's `_fused_rms_norm_backward`
does. So one graph runs and is priced alike on every device, as capture's canonical form wants.
References: torch aten/src/ATen/native/layer_norm.cpp (`rms_norm_symint`, `rms_norm_composite`),
torch/_decomp/decompositions.py (`_fused_rms_norm_backward`); Zhang and Sennrich 2019 (RMSNorm).
"""

from __future__ import annotations

import linecache
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

if TYPE_CHECKING:
    from torch.export import ExportedProgram

__all__ = ["fuse_norms", "rms_norm"]

aten = torch.ops.aten

# The dtype torch's rms_norm computes in, per input dtype (`toOpMathType`); other dtypes
# (integers, complex) are not fused.
_COMPUTE_DTYPE = {
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    torch.float32: torch.float32,
    torch.float64: torch.float64,
}
_BOOKKEEPING = (aten._assert_tensor_metadata.default,)  # export's dtype checks: read, no value


# ------------------------------------------------------------------------------- the kernel
def rms_norm(
    input: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """`aten.rms_norm.default` with the fused kernel's saves on every device (module header)."""
    if _torch_fuses(input, weight):
        return aten.rms_norm.default(input, list(normalized_shape), weight, eps)
    result: torch.Tensor = _RmsNorm.apply(input, tuple(normalized_shape), weight, eps)
    return result


def _torch_fuses(input: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Does torch's `rms_norm` run its fused kernel, with its own backward, here? On CUDA where
    `_fused_rms_norm` has a kernel and the weight is of the input's dtype (`rms_norm_symint`:
    else its composite runs; on MPS it fuses only without grad)."""
    if input.device.type != "cuda" or not hasattr(aten, "_fused_rms_norm"):
        return False
    kernel = torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", "CUDA")
    return bool(kernel) and (weight is None or weight.dtype == input.dtype)


class _RmsNorm(torch.autograd.Function):
    """torch's composite rms_norm forward, keeping (input, weight, rstd) as the fused op does."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        normalized_shape: tuple[int, ...],
        weight: torch.Tensor | None,
        eps: float | None,
    ) -> torch.Tensor:
        dims = _normalized_dims(input, normalized_shape)
        upcast = input.to(_compute_dtype(input.dtype))
        if eps is None:  # torch's default: the computation dtype's epsilon
            eps = torch.finfo(upcast.dtype).eps
        rstd = torch.rsqrt(upcast.pow(2).mean(dims, keepdim=True) + eps)
        result = upcast * rstd
        if weight is not None:
            result = result * weight
        ctx.save_for_backward(input, weight, rstd)
        ctx.dims = dims
        return result.to(input.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """torch's `_fused_rms_norm_backward`, with n = x rstd and g = grad weight:
        grad x = (g - n mean(n g)) rstd, grad weight = the rows' sum of grad n. In place where
        the buffer is this function's own and the dot without a product, so that at most three
        row-sized buffers live at once (the fused kernel holds none, and the planner prices no
        op's transients: with five, tests/runtime/test_fused_norms_runtime.py measured up to
        1.13 of the predicted peak, with three 1.07)."""
        input, weight, rstd = ctx.saved_tensors
        dims = ctx.dims
        compute = _compute_dtype(input.dtype)
        normed = input.to(compute) * rstd
        grad_c = grad.to(compute)  # grad itself where it is of the computation dtype already
        grad_input = grad_weight = None
        if weight is not None and ctx.needs_input_grad[2]:
            outer = list(range(input.dim() - len(dims)))  # the rows: summed into the weight's
            product = grad_c * normed
            grad_weight = (product.sum(outer) if outer else product).to(weight.dtype)
            del product
        if ctx.needs_input_grad[0]:
            if weight is not None:
                grad_c = grad_c * weight.to(compute)
            count = 1
            for d in dims:
                count *= input.shape[d]
            rows = normed.flatten(-len(dims)), grad_c.flatten(-len(dims))
            dot = torch.einsum("...i,...i->...", *rows)  # a batched dot: no row-sized product
            projected = normed.mul_(dot.div_(count).reshape(rstd.shape))  # n mean(n g), in n
            own = grad_c is not grad  # a buffer of this function's: written in place
            diff = grad_c.sub_(projected) if own else grad_c - projected
            grad_input = diff.mul_(rstd).to(input.dtype)
        return grad_input, None, grad_weight, None


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return _COMPUTE_DTYPE.get(dtype, dtype)


def _normalized_dims(input: torch.Tensor, normalized_shape: tuple[int, ...]) -> list[int]:
    return [input.dim() - 1 - i for i in range(len(normalized_shape))]


# ------------------------------------------------------------------------------- the rewrite
@dataclass(frozen=True, slots=True)
class _Match:
    """One RMSNorm found: its input, weight (or None), eps, the node its value leaves by
    (`last`), and the nodes that compute it (erased where nothing else reads them)."""

    x: fx.Node
    weight: fx.Node | None
    eps: float
    last: fx.Node
    nodes: tuple[fx.Node, ...]
    rounded_twice: bool  # the weight multiplied after the cast to a half dtype (module header)


@dataclass
class _Report:
    """What was fused or kept eager, per source line and module class: the module paths."""

    fused: dict[tuple[str, str, str], list[str]] = field(default_factory=lambda: defaultdict(list))
    eager: dict[tuple[str, str, str], list[str]] = field(default_factory=lambda: defaultdict(list))

    def lines(self) -> list[str]:
        rows = []
        for (where, module, how), paths in self.fused.items():
            rows.append(f"{where} {module} at {_paths(paths)}: {how}")
        for (where, module, why), paths in self.eager.items():
            rows.append(f"{where} {module} at {_paths(paths)}: kept eager, {why}")
        return rows


def fuse_norms(program: ExportedProgram) -> list[str]:
    """Rewrite every eager RMSNorm of `program` (module header) as `aten.rms_norm.default`, in
    place; one line per source line and module class fused or kept eager, saying which."""
    graph = program.graph_module.graph
    report = _Report()
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.rsqrt.default:
            continue
        found = _match(node)
        if found is None:
            continue
        where, module, path = _origin(node)
        if isinstance(found, str):
            report.eager[(where, module, found)].append(path)
            continue
        _replace(graph, found)
        report.fused[(where, module, _how(found))].append(path)
    if report.fused:
        program.graph_module.recompile()
    return report.lines()


def _how(found: _Match) -> str:
    eps = f"eps {found.eps:g}"
    weight = "with its weight" if found.weight is not None else "without a weight"
    how = (
        f"run as torch's fused rms_norm ({weight}, {eps}): backward keeps its input and an "
        "fp32 rstd per row"
    )
    if found.rounded_twice:
        how += " (the weight multiplied before the one rounding; eager rounds before it too)"
    return how


def _replace(graph: fx.Graph, found: _Match) -> None:
    """The fused node in place of `found.last`; the pattern's nodes erased where unread."""
    shape = [int(found.x.meta["val"].shape[-1])]
    with graph.inserting_before(found.last):
        fused = graph.call_function(
            aten.rms_norm.default, (found.x, shape, found.weight, found.eps)
        )
    fused.meta.update(found.last.meta)
    found.last.replace_all_uses_with(fused)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(found.nodes, key=order.__getitem__, reverse=True):
        for user in [u for u in node.users if u.target in _BOOKKEEPING]:
            graph.erase_node(user)
        if not node.users:
            graph.erase_node(node)


def _match(rsqrt: fx.Node) -> _Match | str | None:
    """The RMSNorm whose rstd `rsqrt` computes; a reason it stays eager where the statistics are
    a norm's but what follows is not exactly torch's op; None where it is no RMSNorm."""
    stats = _statistics(rsqrt)
    if stats is None:
        return None
    h, eps, steps = stats
    x = _cast_source(h) or h
    dtype = _val(x).dtype
    if dtype not in _COMPUTE_DTYPE:
        return None
    if _COMPUTE_DTYPE[dtype] != _val(h).dtype:
        return (
            f"its statistics are computed in {_name(_val(h).dtype)}, torch's rms_norm computes "
            f"them in {_name(_COMPUTE_DTYPE[dtype])} for a {_name(dtype)} input"
        )
    normed = _single_user(rsqrt)
    if normed is None or not _is_mul_of(normed, rsqrt, (h, x)):
        return "its rstd is read by more than the product with its input"
    if _val(normed).shape != _val(x).shape or not _same_module(normed, rsqrt):
        return "its product with the input is not of the input's shape"
    tail = _tail(normed, x, rsqrt)
    if isinstance(tail, str):
        return tail
    last, weight, chain, rounded_twice = tail
    if any(u.op == "output" for u in last.users):
        return "its value is returned by the model itself"
    nodes = (*steps, rsqrt, normed, *chain)
    if h is not x:
        nodes = (h, *nodes)
    return _Match(x, weight, eps, last, nodes, rounded_twice)


def _statistics(rsqrt: fx.Node) -> tuple[fx.Node, float, tuple[fx.Node, ...]] | None:
    """(h, eps, [square, mean, sum]) where rsqrt reads mean(h ** 2, last dim, keepdim) + eps,
    each read only by the next; None otherwise."""
    plus = _arg(rsqrt, 0)
    if plus is None or plus.target not in (aten.add.Tensor, aten.add.Scalar) or plus.kwargs:
        return None
    if len(plus.args) != 2:
        return None
    mean, eps = plus.args
    if not isinstance(mean, fx.Node) or not isinstance(eps, int | float) or isinstance(eps, bool):
        return None
    if (
        mean.target is not aten.mean.dim
        or mean.kwargs.get("dtype") is not None
        or len(mean.args) < 2
    ):
        return None
    square, dims = mean.args[:2]
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if not isinstance(square, fx.Node) or keepdim is not True:
        return None
    if not isinstance(dims, list | tuple) or list(dims) not in ([-1], [_val(square).dim() - 1]):
        return None
    squared = square.target is aten.square.default or (
        square.target is aten.pow.Tensor_Scalar and square.args[1] == 2 and not square.kwargs
    )
    if not squared:
        return None
    h = square.args[0]
    steps = (square, mean, plus)
    if not isinstance(h, fx.Node) or any(_single_user(s) is None for s in steps):
        return None
    if not all(_same_module(s, rsqrt) for s in steps) or float(eps) < 0:
        return None
    return h, float(eps), steps


def _tail(
    normed: fx.Node, x: fx.Node, rsqrt: fx.Node
) -> tuple[fx.Node, fx.Node | None, tuple[fx.Node, ...], bool] | str:
    """Follow n's single readers through at most one cast to x's dtype and one product with a
    weight (module header): (last node, weight, the nodes after n, rounded twice), or why not."""
    dtype = _val(x).dtype
    compute = _COMPUTE_DTYPE[dtype]
    width = tuple(_val(x).shape[-1:])
    last, weight, chain = normed, None, list[fx.Node]()
    cast = rounded_twice = False
    while (user := _single_user(last)) is not None and _same_module(user, rsqrt):
        if _cast_source(user) is last:
            if _val(user).dtype == _val(last).dtype:  # a cast to the same dtype: no-op
                last, chain = user, [*chain, user]
                continue
            if cast or _val(user).dtype != dtype:
                break
            last, chain, cast = user, [*chain, user], True
            continue
        scale = _other_factor(user, last)
        if scale is None or weight is not None or tuple(_val(scale).shape) != width:
            break
        scale_source = _cast_source(scale)
        if _val(scale).dtype == dtype:  # the weight itself (times n in c: promoted exactly)
            weight = scale
        elif (  # the weight's upcast to c, times n in c
            scale_source is not None
            and _val(scale_source).dtype == dtype
            and _val(scale).dtype == compute == _val(last).dtype
        ):
            weight = scale_source
            if _single_user(scale) is user:
                chain.append(scale)
        elif _val(last).dtype != dtype:
            return (
                f"it is scaled by a {_name(_val(scale).dtype)} tensor where its input is "
                f"{_name(dtype)}: torch's fused kernel takes a weight of the input's dtype"
            )
        else:
            break
        rounded_twice = cast and dtype != compute
        last, chain = user, [*chain, user]
    if _val(last).dtype != dtype:
        return (
            f"its normalized value is used in {_name(_val(last).dtype)} before its cast to "
            f"{_name(dtype)}"
        )
    return last, weight, tuple(chain), rounded_twice


# ------------------------------------------------------------------------------- fx helpers
def _cast_source(node: fx.Node) -> fx.Node | None:
    """The tensor `node` casts to another (or the same) dtype, changing nothing else; else None."""
    if node.op != "call_function":
        return None
    target, args, kwargs = node.target, node.args, node.kwargs
    if target is aten.to.dtype:
        extra = (*args[2:], *kwargs.values())
        plain = all(v in (False, None, torch.preserve_format) for v in extra)
    elif target is aten._to_copy.default:
        plain = len(args) == 1 and set(kwargs) <= {"dtype"} and "dtype" in kwargs
    elif target is aten.type_as.default:
        plain = len(args) == 2 and not kwargs
    else:
        return None
    source = args[0] if args else None
    return source if plain and isinstance(source, fx.Node) else None


def _is_mul_of(node: fx.Node, factor: fx.Node, others: tuple[fx.Node, ...]) -> bool:
    other = _other_factor(node, factor)
    return other is not None and other in others


def _other_factor(node: fx.Node, factor: fx.Node) -> fx.Node | None:
    """The other tensor of a two-tensor `mul.Tensor` one of whose factors is `factor`."""
    if node.target is not aten.mul.Tensor or node.kwargs or len(node.args) != 2:
        return None
    a, b = node.args
    if not isinstance(a, fx.Node) or not isinstance(b, fx.Node) or a is b:
        return None
    return b if a is factor else a if b is factor else None


def _single_user(node: fx.Node) -> fx.Node | None:
    """The one node reading `node` (export's dtype assertions aside), else None."""
    users = [u for u in node.users if u.target not in _BOOKKEEPING]
    return users[0] if len(users) == 1 else None


def _arg(node: fx.Node, index: int) -> fx.Node | None:
    value = node.args[index] if len(node.args) > index else None
    return value if isinstance(value, fx.Node) else None


def _same_module(node: fx.Node, anchor: fx.Node) -> bool:
    return _module(node) == _module(anchor)


def _module(node: fx.Node) -> tuple[str, str]:
    stack = node.meta.get("nn_module_stack") or {}
    path, kind = list(stack.values())[-1] if stack else ("", "")
    return str(path), str(getattr(kind, "__name__", kind))


def _val(node: fx.Node) -> torch.Tensor:
    value = node.meta["val"]
    assert isinstance(value, torch.Tensor), node.format_node()
    return value


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _origin(node: fx.Node) -> tuple[str, str, str]:
    """(`file:line` of the user's code that made `node`, its module's class, its module path)."""
    path, kind = _module(node)
    frames = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    where = "<unknown>"
    if frames:
        filename, line = frames[-1]
        code = linecache.getline(filename, int(line)).strip()
        where = f"{Path(filename).name}:{line}" + (f" `{code}`" if code else "")
    return where, kind.rpartition(".")[2] or "<top>", path or "<top>"


def _paths(paths: list[str]) -> str:
    """The module paths, each group alike but for its digit runs (the layers of a stack) as one
    path with `*` in their place: the same words whatever the depth (`depth_family` compares
    the exports' lines)."""
    groups: dict[str, list[str]] = defaultdict(list)
    for path in paths:
        groups[re.sub(r"\d+", "*", path)].append(path)
    return ", ".join(group[0] if len(group) == 1 else key for key, group in groups.items())
