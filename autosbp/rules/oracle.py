"""The execution oracle of the rules: run a signature on simulated devices and assemble the result.

Lives here: `node_from_call` (an `OpNode`, as capture would build it, from a plain call),
`run_global` (the op on whole tensors), `shard_inputs` (every device's pieces, P as random addends)
and `simulate` (shard, run `local_op` per device, check B copies agree, assemble; a signature
that communicates inside the op runs one thread per device, its collectives through
`SimulatedComm`, in memory). Used by the tests and by anyone adding a rule. Lives elsewhere: real multi-process execution (runtime), the
DTensor peer check (tests/support/rules_helpers.py).

Invariants: P inputs are random addends that sum to the global value, never "value on device 0,
zeros elsewhere" only, so a rule that wrongly accepts P fails here; every B output is checked to
be equal on all devices of its mesh dim (assembly alone would read just one of them).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from autosbp.capturing.graph import InputRef, OpNode, Role, TensorMeta
from autosbp.layout import assemble_tensor
from autosbp.rules import exchanges, local_op
from autosbp.rules.core import NdSignature, Node, as_tuple, default_local_op, resolve_refs
from autosbp.sbp import Broadcast, Mesh, NdSbp, Partial, Split


def node_from_call(
    target: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any] | None = None
) -> tuple[OpNode, tuple[torch.Tensor, ...]]:
    """The node of `target(*args, **kwargs)` and its tensor inputs in InputRef order.

    Tensors (also inside lists) become InputRef(i) in order of appearance; outputs are measured by
    running the call once on clones (so in-place ops leave the given tensors alone).
    """
    inputs: list[torch.Tensor] = []

    def ref(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            inputs.append(value)
            return InputRef(len(inputs) - 1)
        if isinstance(value, list | tuple) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(ref(v) for v in value)
        return value

    node_args = tuple(ref(a) for a in args)
    node_kwargs = {k: ref(v) for k, v in (kwargs or {}).items()}
    node = OpNode(
        str(target), Role.COMPUTE, target=target, args=node_args, kwargs=node_kwargs,
        inputs=tuple(TensorMeta(tuple(t.shape), t.dtype) for t in inputs),
    )  # fmt: skip
    outs = _call_raw(node, [t.clone() for t in inputs])
    outputs = tuple(TensorMeta(tuple(t.shape), t.dtype) for t in outs)
    return dataclasses.replace(node, outputs=outputs), tuple(inputs)


def run_global(node: Node, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The op on whole tensors (one device): the reference every signature must reproduce."""
    return default_local_op(node)([t.clone() for t in inputs])


def shard_inputs(
    tensor: torch.Tensor, nd_sbp: NdSbp, mesh_shape: Sequence[int], generator: torch.Generator
) -> list[torch.Tensor]:
    """The piece of every device (row-major mesh order); P mesh dims get random addends.

    Devices that differ only in B coordinates hold identical pieces (the addends of a later P
    mesh dim are drawn once per path of non-B choices), as a replicated tensor must.
    """
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
    pieces: list[tuple[torch.Tensor, tuple[int, ...]]] = [(tensor, ())]
    for sbp, size in zip(nd_sbp, mesh_shape, strict=True):
        cut = []
        for piece, path in pieces:
            if isinstance(sbp, Broadcast):
                cut += [(piece, path)] * size
                continue
            gen = torch.Generator().manual_seed(hash((seed, *path)) & 0x7FFFFFFF)
            parts = _cut(piece, sbp, size, gen)
            cut += [(part, (*path, k)) for k, part in enumerate(parts)]
        pieces = cut
    return [piece.clone(memory_format=torch.contiguous_format) for piece, _ in pieces]


@dataclass(frozen=True, slots=True)
class Simulated:
    """What `simulate` assembled: the op's outputs, and its inputs after the call (in-place ops
    such as batch norm's running-stat updates show there)."""

    outputs: tuple[torch.Tensor, ...]
    inputs: tuple[torch.Tensor, ...]


def simulate(
    node: Node,
    nd_sig: NdSignature,
    mesh_shape: Sequence[int],
    global_inputs: Sequence[torch.Tensor],
    generator: torch.Generator | None = None,
) -> Simulated:
    """Run `nd_sig` on every simulated device of `mesh_shape` and assemble outputs and inputs."""
    mesh = Mesh.of(tuple(mesh_shape))
    gen = generator or torch.Generator().manual_seed(0)
    per_input = [
        shard_inputs(t, nd, mesh.shape, gen)
        for t, nd in zip(global_inputs, nd_sig.inputs, strict=True)
    ]
    per_device = _run_devices(node, nd_sig, mesh, per_input)
    outs = []
    for k, nd_sbp in enumerate(nd_sig.outputs):
        pieces = [device_outs[k] for device_outs in per_device]
        _check_broadcast_copies(node, pieces, nd_sbp, mesh)
        outs.append(assemble_tensor(pieces, nd_sbp, mesh))
    ins = [assemble_tensor(p, nd, mesh) for p, nd in zip(per_input, nd_sig.inputs, strict=True)]
    return Simulated(tuple(outs), tuple(ins))


def _run_devices(
    node: Node, nd_sig: NdSignature, mesh: Mesh, per_input: Sequence[Sequence[torch.Tensor]]
) -> list[tuple[torch.Tensor, ...]]:
    """Every device's local outputs: in turn, or one thread each where the op communicates."""

    def run(index: int, comm: SimulatedComm | None = None) -> tuple[torch.Tensor, ...]:
        kernel = local_op(node, nd_sig, mesh.shape, mesh.coords(index), comm)
        return kernel([pieces[index] for pieces in per_input])

    if not exchanges(node, nd_sig, mesh.shape):
        return [run(index) for index in range(mesh.size)]
    board = _Board(mesh)
    with ThreadPoolExecutor(mesh.size) as pool:
        futures = [pool.submit(run, i, SimulatedComm(board, i)) for i in range(mesh.size)]
        return [f.result(timeout=60) for f in futures]


class _Board:
    """Where simulated devices post their pieces: per (mesh dim, group, call number)."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.posted: dict[tuple[int, tuple[int, ...], int], dict[int, torch.Tensor]] = {}
        self.ready = threading.Condition()

    def group(self, index: int, mesh_dim: int) -> tuple[int, ...]:
        """The devices along `mesh_dim` through device `index`, in coordinate order."""
        coords = list(self.mesh.coords(index))
        members = []
        for k in range(self.mesh.shape[mesh_dim]):
            coords[mesh_dim] = k
            members.append(self.mesh.index(tuple(coords)))
        return tuple(members)

    def exchange(
        self, key: tuple[int, tuple[int, ...], int], member: int, x: torch.Tensor
    ) -> dict[int, torch.Tensor]:
        """Post `x` as `member`'s piece; every member's pieces once all have posted."""
        with self.ready:
            pieces = self.posted.setdefault(key, {})
            pieces[member] = x.detach().clone()
            self.ready.notify_all()
            if not self.ready.wait_for(lambda: len(pieces) == len(key[1]), timeout=60):
                raise TimeoutError(f"simulated exchange {key}: {len(pieces)} pieces posted")
            return pieces


class SimulatedComm:
    """`rules.comm.OpComm` for simulated devices in threads (forward only, no autograd)."""

    def __init__(self, board: _Board, index: int) -> None:
        self.board, self.index = board, index
        self.calls: dict[tuple[int, tuple[int, ...]], int] = {}

    def _post(
        self, mesh_dim: int, x: torch.Tensor
    ) -> tuple[tuple[int, ...], dict[int, torch.Tensor]]:
        group = self.board.group(self.index, mesh_dim)
        count = self.calls.get((mesh_dim, group), 0)
        self.calls[(mesh_dim, group)] = count + 1
        return group, self.board.exchange((mesh_dim, group, count), self.index, x)

    def all_gather(self, x: torch.Tensor, dim: int, mesh_dim: int) -> torch.Tensor:
        group, pieces = self._post(mesh_dim, x)
        return torch.cat([pieces[member] for member in group], dim=dim)

    def swap(self, x: torch.Tensor, mesh_dim: int, peer: int) -> torch.Tensor:
        group, pieces = self._post(mesh_dim, x)
        return pieces[group[peer]]

    def shift(self, x: torch.Tensor, mesh_dim: int) -> tuple[torch.Tensor, Callable[[], None]]:
        group, pieces = self._post(mesh_dim, x)
        previous = group[(group.index(self.index) - 1) % len(group)]
        return pieces[previous], lambda: None


def _cut(
    piece: torch.Tensor, sbp: Split | Broadcast | Partial, size: int, gen: torch.Generator
) -> list[torch.Tensor]:
    if isinstance(sbp, Split):
        return list(piece.chunk(size, dim=sbp.dim))
    if isinstance(sbp, Broadcast) or sbp.op != "sum":
        return [piece] * size  # max/min are idempotent: every device may hold the value
    addends = [torch.randn(piece.shape, generator=gen, dtype=piece.dtype) for _ in range(size - 1)]
    return [piece - sum(addends, torch.zeros_like(piece)), *addends]


def _check_broadcast_copies(
    node: Node, pieces: Sequence[torch.Tensor], nd_sbp: NdSbp, mesh: Mesh
) -> None:
    for index in range(mesh.size):
        coords = mesh.coords(index)
        for mesh_dim, sbp in enumerate(nd_sbp):
            if isinstance(sbp, Broadcast) and coords[mesh_dim] != 0:
                first = list(coords)
                first[mesh_dim] = 0
                other = pieces[mesh.index(first)]
                if not _same(pieces[index], other):
                    raise AssertionError(
                        f"{node.op}: B output differs on devices {tuple(first)} and {coords}"
                    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        atol = 1e-6 * max(1.0, math.sqrt(a.numel()))
        return torch.allclose(a, b, rtol=1e-5, atol=atol, equal_nan=True)  # nan: empty's fill
    return torch.equal(a, b)


def _call_raw(node: Node, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    args = resolve_refs(node.args, inputs)
    kwargs = {k: resolve_refs(v, inputs) for k, v in node.kwargs.items()}
    assert node.target is not None, f"{node.op}: no target to call"
    return as_tuple(node.target(*args, **kwargs))
