"""Graph capture: an nn.Module and example inputs -> an `OpGraph` of ATen ops; and its interpreter.

Lives here: `capture` (torch.export in training IR, traced on fake CPU tensors whatever device
the model is on, then `builder.GraphBuilder`'s nodes, the tied parameters and the blocks),
`capture_micro_batch` (the graph of one micro-batch; `MicroBatchError` for a size the model
cannot run) and `run_graph`, the reference interpreter of a captured graph. Lives elsewhere:
the node/edge vocabulary (`graph`), one node per fx node in canonical form (`builder`), export
failures as messages (`failures`), flop formulas and op families (`flops`), repeated blocks
(`blocks`), a model of many alike layers from shallow exports (`repeats`: tried first; the
whole export where it returns None), SBP rules (`rules`), the distributed interpreter
(`runtime`).

Invariants:
- The graph does not depend on the model's device: export sees fake tensors on one device
  (`_CAPTURE_DEVICE`) and the builder records the canonical form (`builder`), so a model on
  meta and the same model on the CPU give the same nodes, arguments and fingerprint.
- Nodes are the export's placeholders (PARAMETER/BUFFER/INPUT), its ATen calls (COMPUTE) minus
  bookkeeping calls that return no tensor and have no users (`_assert_tensor_metadata` ...), and
  one OUTPUT node named "output" fed by the scalar loss. `order` is the export's program order,
  but for runs of one loop over an unordered collection, put in one order whatever the
  process's hash seed, and named as export named their places (`interchangeable`).
- `getitem` is folded: an edge's `uses` holds (tensor output index of the producer, InputRef index
  of the consumer); a multi-output op lists its tensor outputs in order (non-tensors skipped).
- Buffer updates of the training IR (`add_` on `num_batches_tracked`, batch norm's running
  stats) stay in place, so interpreting the nodes in `order` computes the loss and buffer
  updates exactly; in-place writes into activations are functional where that is exact
  (`builder`).
- Each example input is its own placeholder, even one tensor passed twice (`(ids, ids)` as ids
  and labels): the graph does not depend on how the inputs alias (micro-batches do not).
- A model of >= `repeats.MIN_LAYERS` alike layers is built from exports of 3, 4 and 5 of them,
  equal to the whole export (`repeats`); its `program` is None.
- A tied parameter (one tensor under two names) is one PARAMETER node, under the name export
  feeds its uses from; `meta["tied"]` maps the other names to it.
- `OpGraph.meta`: "constants" (lifted constant tensors by name, real values: made in forward
  from Python data), "buffer_mutations" (buffer name -> (node, output index), empty in training
  IR), "tied", "block_container", "capture_s".
Reference: torch.export programming model (training IR); OneFlow paper section 3.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from autosbp.capturing.batches import split_micro_batches
from autosbp.capturing.blocks import assign_blocks
from autosbp.capturing.builder import GraphBuilder, tensors_of
from autosbp.capturing.ctc import padded_ctc
from autosbp.capturing.failures import explain_export_failure, torch_report_held_back
from autosbp.capturing.fused_norms import fuse_norms
from autosbp.capturing.graph import InputRef, OpGraph, Role, kernel_of, run_device
from autosbp.capturing.interchangeable import order_interchangeable_runs
from autosbp.capturing.repeats import capture_by_repeats
from autosbp.capturing.training_ifs import (
    Absorbed,
    absorbing_ifs,
    check_assumptions,
    drop_dead_code,
)
from autosbp.errors import CaptureError, MicroBatchError

__all__ = ["capture", "capture_micro_batch", "capturing_in", "run_graph"]


def capture(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    name: str | None = None,
    dtype: torch.dtype | None = None,
) -> OpGraph:
    """Export `model(*example_inputs)` (which must return the scalar loss) to an `OpGraph`.

    Works on the meta device (no parameter memory). With `dtype`, the graph is the one of the
    model and inputs cast to it (every floating parameter, buffer and input, as `model.to`
    casts them), traced on fake tensors of that dtype: the model itself is not touched, so an
    fp32 model is planned and run in bf16 without its weights rounded. Raises `CaptureError`
    when the model cannot be exported or does not return a scalar.
    """
    name = name or type(model).__name__
    args = _check_inputs(model, example_inputs, name)
    start = time.perf_counter()
    with capturing_in(dtype) if dtype is not None else contextlib.nullcontext():
        opgraph = capture_by_repeats(model, args, name, _capture_whole)
        if opgraph is None:  # no repeated layers, or not provably repeated: every layer exported
            opgraph = _capture_whole(model, args, name)
    opgraph.meta["capture_s"] = time.perf_counter() - start
    return opgraph


@contextlib.contextmanager
def capturing_in(dtype: torch.dtype) -> Iterator[None]:
    """Every capture inside traces floating tensors in `dtype` (`capture`'s `dtype`)."""
    token = _CAST.set(dtype)
    try:
        yield
    finally:
        _CAST.reset(token)


def _capture_whole(model: nn.Module, args: tuple[torch.Tensor, ...], name: str) -> OpGraph:
    """`capture` by one export of the whole model."""
    absorbed = Absorbed()
    program = _export(model, args, name, absorbed)
    _check_loss(program, name)
    check_assumptions(absorbed, model, args, name)
    fused = fuse_norms(program)
    opgraph = _build_opgraph(program, model, name)
    opgraph.meta["absorbed"] = absorbed.lines()
    opgraph.meta["fused_norms"] = fused
    return opgraph


def capture_micro_batch(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    micro_batches: int = 1,
    *,
    name: str | None = None,
    dtype: torch.dtype | None = None,
) -> OpGraph:
    """The graph of one micro-batch of `example_inputs` (a global batch): what a plan with
    `micro_batches` is made for, and what the runtime runs once per micro-batch.

    Raises `MicroBatchError` when the model captures on the whole batch but not on a
    micro-batch (BatchNorm's "more than 1 value per channel" on one sample, a batch size
    assumed in forward): that count cannot be planned, others may.
    """
    piece = list(split_micro_batches(example_inputs, micro_batches)[0])
    try:
        return capture(model, piece, name=name, dtype=dtype)
    except MicroBatchError:
        raise
    except CaptureError as exc:
        if micro_batches == 1:
            raise
        try:  # does it capture on the whole batch? (only when the micro-batch failed)
            capture(model, example_inputs, name=name, dtype=dtype)
        except CaptureError:
            raise exc from None
        size = int(piece[0].shape[0]) if piece and piece[0].dim() else 1
        raise MicroBatchError(
            f"Model `{name or type(model).__name__}` captures on its batch of "
            f"{int(example_inputs[0].shape[0])} but not on a micro-batch of {size} samples "
            f"({micro_batches} micro-batches): {exc} Plan fewer micro-batches (BatchNorm needs "
            "at least 2 samples per micro-batch in training)."
        ) from exc


def _check_inputs(
    model: nn.Module, example_inputs: Sequence[torch.Tensor], name: str
) -> tuple[torch.Tensor, ...]:
    if not isinstance(model, nn.Module):
        raise CaptureError(
            f"capture needs an nn.Module, got {type(model).__name__} `{name}`; wrap it in a module "
            "whose forward returns the training loss."
        )
    args = tuple(example_inputs)
    bad = [
        f"#{i} ({type(a).__name__})" for i, a in enumerate(args) if not isinstance(a, torch.Tensor)
    ]
    if bad:
        raise CaptureError(
            f"Example inputs of model `{name}` must all be tensors; {', '.join(bad)} is not. "
            "Pass non-tensor settings to the model's constructor instead of to forward."
        )
    try:
        signature = inspect.signature(model.forward)
    except ValueError:  # not introspectable: export reports a mismatch itself
        return args
    try:
        signature.bind(*args)
    except TypeError as exc:
        raise CaptureError(
            f"Model `{name}`: forward{signature} cannot take the "
            f"{len(args)} example input(s) ({exc}); pass one example tensor per forward argument."
        ) from None
    return args


def _export(
    model: nn.Module, args: tuple[torch.Tensor, ...], name: str, absorbed: Absorbed
) -> ExportedProgram:
    """The exported program, with training-time `if`s absorbed (`training_ifs`)."""
    try:
        with (
            torch_report_held_back(),
            _on_fake_cpu(model, args) as (fake_args, originals),
            padded_ctc(absorbed),
            absorbing_ifs(absorbed),
        ):
            program = torch.export.export(model, fake_args, strict=False)
        drop_dead_code(program, absorbed)
    except CaptureError:
        raise  # said already, with the user's line (`training_ifs`)
    except Exception as exc:
        raise explain_export_failure(exc, model, name) from exc
    for key, value in program.constants.items():  # a non-persistent buffer: the model's tensor
        if id(value) in originals:
            program.constants[key] = originals[id(value)].to(value.dtype)  # cast as traced
    return program


# The device every capture traces on, whatever device the model's tensors are on: fake tensors
# (shapes, dtypes and strides, no memory) that say "cpu". Export's graph depends on the device
# it sees (attention kernels choose output strides per device; indexing with a Python scalar
# takes one path on the CPU and another elsewhere), so one device for every capture makes the
# graph of a meta model and of a real one the same: plan on meta, train on cpu or cuda.
_CAPTURE_DEVICE = torch.device("cpu")
# The dtype a capture traces floating tensors in (`capture`'s `dtype`; None: their own).
_CAST: contextvars.ContextVar[torch.dtype | None] = contextvars.ContextVar("cast", default=None)


@contextlib.contextmanager
def _on_fake_cpu(
    model: nn.Module, args: tuple[torch.Tensor, ...]
) -> Iterator[tuple[tuple[torch.Tensor, ...], dict[int, torch.Tensor]]]:
    """The model's parameters and buffers swapped for fake tensors on `_CAPTURE_DEVICE` (one
    per tensor, so tied ones stay tied) while the block runs, `args` as such fakes, and each
    fake's original by id (export lifts a non-persistent buffer, HF's `position_ids`, as a
    constant: the fake, until it is swapped back); the model is restored after. Constants
    made in forward from Python data keep their real values. Floating tensors are faked in
    the capture's dtype (`_CAST`), where one is set."""
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    fakes: dict[int, torch.Tensor] = {}
    originals: dict[int, torch.Tensor] = {}

    cast = _CAST.get()

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fakes:
            dtype = cast if cast is not None and t.is_floating_point() else t.dtype
            with mode:
                made = torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=_CAPTURE_DEVICE)
            fakes[id(t)] = (
                nn.Parameter(made, t.requires_grad) if isinstance(t, nn.Parameter) else made
            )
            originals[id(fakes[id(t)])] = t
        return fakes[id(t)]

    swapped: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for module in model.modules():
            tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
            for table in tables:
                for key, tensor in table.items():
                    if tensor is not None:
                        swapped.append((table, key, tensor))
                        table[key] = fake(tensor)
        # each input its own fake, even one passed twice ((ids, ids) as inputs and labels):
        # export would feed both uses from one placeholder, so the graph would depend on the
        # aliasing of inputs, which micro-batching undoes (and rebatching would refuse)
        fresh = [a.view(a.shape) for a in args]  # held here: their ids stay theirs
        yield tuple(fake(a) for a in fresh), originals
    finally:
        for table, key, tensor in reversed(swapped):
            table[key] = tensor


def _check_loss(program: ExportedProgram, name: str) -> None:
    user = _user_output_positions(program.graph_signature.output_specs)
    outputs = program.graph.output_node().args[0]
    assert isinstance(outputs, (list, tuple)), outputs
    loss = outputs[user[0]] if len(user) == 1 else None
    loss = loss.meta.get("val") if isinstance(loss, fx.Node) else loss
    if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point():
        return
    if len(user) != 1:
        got = f"{len(user)} outputs"
    elif isinstance(loss, torch.Tensor):
        got = f"a tensor of shape {list(loss.shape)} ({str(loss.dtype).removeprefix('torch.')})"
    else:
        got = f"a {type(loss).__name__}"
    raise CaptureError(
        f"Model `{name}` returns {got}, but autosbp plans training: forward must return the "
        "scalar training loss (a float tensor of shape []). Compute the loss inside forward, e.g. "
        "`return F.cross_entropy(logits.flatten(0, 1), targets.flatten())`, with the targets "
        "passed as an example input."
    )


def _user_output_positions(output_specs: Sequence[Any]) -> list[int]:
    return [i for i, spec in enumerate(output_specs) if spec.kind is OutputKind.USER_OUTPUT]


# ---------------------------------------------------------------------------------- the graph
def _build_opgraph(program: ExportedProgram, model: nn.Module, name: str) -> OpGraph:
    builder = GraphBuilder(program, name)
    for node in program.graph.nodes:
        builder.add(node)
    graph = builder.graph
    renamed = order_interchangeable_runs(graph, builder.sources)  # whatever the hash seed
    stacks = {renamed.get(n, n): stack for n, stack in builder.module_stacks.items()}
    mutations = {k: (renamed.get(n, n), i) for k, (n, i) in builder.buffer_mutations.items()}
    tied = _drop_tied_aliases(graph, model)
    graph.unknown_ops = _unknown_ops(graph)
    graph.meta = {
        "constants": dict(program.constants),
        "buffer_mutations": mutations,
        "tied": tied,
        "block_container": assign_blocks(graph, stacks),
    }
    return graph


def _drop_tied_aliases(graph: OpGraph, model: nn.Module) -> dict[str, str]:
    """Export keeps one placeholder per name of a tied tensor (e.g. `wte.weight` and
    `head.weight`) but feeds every use from one of them: drop the unused ones, so a tied
    parameter is one node. Returns {dropped name: kept name}."""
    names_of: dict[int, list[str]] = defaultdict(list)
    for fqn, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        names_of[id(tensor)].append(fqn)
    node_of = {
        node.name: n for n, node in graph.nodes() if node.role in (Role.PARAMETER, Role.BUFFER)
    }
    tied: dict[str, str] = {}
    for names in names_of.values():
        nodes = [node_of[fqn] for fqn in names if fqn in node_of]
        used = [n for n in nodes if graph.graph.out_degree(n)]
        if len(nodes) < 2 or len(used) != 1:
            continue
        for n in nodes:
            if n != used[0]:
                tied[graph.node(n).name] = graph.node(used[0]).name
                graph.remove_node(n)
    return tied


def _unknown_ops(graph: OpGraph) -> tuple[str, ...]:
    """The ops without an SBP rule (the planner gives them the all-B signature), named in one
    warning; an op whose every node has derived splits (`rules.derived`) is not one."""
    from autosbp.rules import derives_splits, has_rule, warn_unknown_ops  # lazy: torch-heavy

    nodes = [a for _, a in graph.nodes(Role.COMPUTE) if not has_rule(a.op)]
    split = {a.op for a in nodes} - {a.op for a in nodes if not derives_splits(a)}
    return warn_unknown_ops({a.op for a in nodes} - split)


# ------------------------------------------------------------------------------ interpreting
def run_graph(
    opgraph: OpGraph,
    params: Mapping[str, torch.Tensor],
    inputs: Sequence[torch.Tensor],
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Interpret the graph node by node: the loss of the model on `params` and `inputs`.

    `params` maps parameter and buffer names to tensors (buffers are updated in place, as eager
    would): `named_parameters` and `named_buffers` (remove_duplicate=False: every name of a
    tied tensor), whose non-persistent buffers `state_dict` leaves out (export lifts them as
    constants, and a capture on meta holds no values for them); other lifted constants come
    from the capture. `device` is the graph's
    `RUN_DEVICE`, where factory ops (arange, zeros ...) create tensors (default: the first
    input's device, else the CPU). Each op runs as `graph.kernel_of` says (views as reshape,
    rms_norm with the fused kernel's saves).
    """
    first = next(iter(inputs), None)
    device = torch.device(device or (first.device if first is not None else "cpu"))
    values: dict[str, list[torch.Tensor]] = {}
    user_inputs = iter(inputs)
    for name, node in opgraph.nodes():
        role = node.role
        if role is Role.INPUT:
            values[name] = [next(user_inputs)]
        elif role in (Role.PARAMETER, Role.BUFFER):
            values[name] = [_lookup_state(params, opgraph.meta.get("constants", {}), node.name)]
        else:
            tensors = [values[src][index] for src, index in _producers(opgraph, name)]
            if role is Role.OUTPUT:
                return tensors[0]
            args = run_device(_resolve(node.args, tensors), device)
            kwargs = run_device(_resolve(node.kwargs, tensors), device)
            assert node.target is not None, f"{name}: a compute node without a target"
            values[name] = tensors_of(kernel_of(node.target)(*args, **kwargs))
    raise CaptureError(f"Graph of `{opgraph.model_name}` has no output node.")


def _producers(opgraph: OpGraph, name: str) -> list[tuple[str, int]]:
    found = opgraph.producers(name)
    assert all(p is not None for p in found), f"{name}: an input without a producer"
    return found  # type: ignore[return-value]


def _lookup_state(
    params: Mapping[str, torch.Tensor], constants: Mapping[str, torch.Tensor], fqn: str
) -> torch.Tensor:
    if fqn in params:
        return params[fqn]
    if fqn in constants:
        return constants[fqn]
    raise CaptureError(
        f"run_graph: no tensor for parameter/buffer {fqn!r}; pass the model's state, e.g. "
        "`{**dict(model.named_parameters(remove_duplicate=False)), "
        "**dict(model.named_buffers(remove_duplicate=False))}`."
    )


def _resolve(value: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """`value` with every InputRef(i) replaced by tensors[i] (lists, tuples, dicts included)."""
    if isinstance(value, InputRef):
        return tensors[value.index]
    if isinstance(value, (list, tuple)):
        items = [_resolve(v, tensors) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, dict):
        return {k: _resolve(v, tensors) for k, v in value.items()}
    return value
