"""The pipeline: the stages' meshes, the values crossing stages, and one stage's firing loop.

Lives here: `stage_meshes` and `locate` (which stage and device of it this rank is),
`node_stages` and `stage_boundaries` (the values each pair of stages exchanges), `Links` (this
rank's peers and the local pieces it sends and receives), `Transfers` (the point-to-point sends
and receives of one step), `LossBoxing` (the loss's seed and value) and `Pipeline` (the stage's
forwards and backwards per micro-batch in its firing order, and the loss every rank returns).
Lives elsewhere: the firing order (`autosbp.schedule.stage_orders`, the actor rules the planner
priced), the stage's program (`runtime.execute.program`, which runs one micro-batch's forward),
gradient sync (`runtime.parallel.grad_sync`, armed here before each chunk's last backward), the
parameter gathers (`runtime.parallel.prefetch`, whose `finish_backward` runs here after each
backward), the Engine that composes them (`runtime.engine`).

Invariants:
- Each stage runs the firing order it is given: receives block, sends do not (isend, waited for
  at the end of the step), so the actor rules' order cannot deadlock.
- A value crossing stages keeps its layout: device i of one stage sends its local piece to
  device i of the other (every stage has the same mesh shape), and the gradient comes back the
  same way. Values travel in `stage_boundaries` order, which is also the order of the program's
  imports and exports; gradients only for floating values, each pair of stages and direction on
  its own tag (`boundary_tag`).
- Interleaved (v model chunks per rank), each chunk is a stage of its own (its program, its
  traffic); the firing order says which chunk fires, and the loss is on the chunk that holds it.
  A chunk's parameters are final at its own last backward, before the rank's last firing for
  every chunk but the first: the gradient sync is armed for them there (`Pipeline.finishes`).
- Zero bubble (an order with WEIGHT firings, `autosbp.zero_bubble`): BACKWARD computes and sends
  the input gradients only, WEIGHT later adds the weights' (`runtime.parallel.split_backward`);
  gradient sync is armed before the last firing that adds gradients (the last WEIGHT).
- The loss (layout L, on its stage) is boxed to P on every mesh dim before backward, and every
  rank seeds 1: the backward of that boxing (B -> P keeps the seed on coordinate 0 of each B
  mesh dim) makes the seeds sum to exactly one, so a replicated loss is not counted once per
  device. Each micro-batch's loss is scaled by 1/micro-batches (a mean over the batch). Every
  rank returns the loss (broadcast from the loss's stage).
- Every wait is bounded by the world's timeout.
Reference: Narayanan et al. 2021 (1F1B, interleaved 1F1B); torch.distributed.pipelining (stages exchanging
activations and gradients by isend/irecv).
"""

from __future__ import annotations

import datetime
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autosbp.capturing.graph import OpGraph, Role, TensorMeta
from autosbp.plan import Plan
from autosbp.rules import NdSignature
from autosbp.sbp import B, Mesh, NdSbp, P, local_shape
from autosbp.schedule import Phase, Step
from runtime.execute.instructions import Boxer
from runtime.execute.program import Program, Value
from runtime.parallel.split_backward import WeightGradients, input_gradients

__all__ = [
    "Links",
    "LossBoxing",
    "Pipeline",
    "SharedLoss",
    "Transfers",
    "boundary_tag",
    "build_links",
    "locate",
    "node_stages",
    "stage_boundaries",
    "stage_meshes",
    "stage_values",
]

Span = Callable[..., AbstractContextManager[None]]  # `SpanHook.span`: (kind, micro-batch)
Peers = tuple[tuple[int, int, tuple[TensorMeta, ...]], ...]  # (peer rank, tag, local metas)


def stage_meshes(plan: Plan) -> list[Mesh]:
    """Every stage's mesh: the plan's mesh shape over the stage's devices."""
    return [
        Mesh(plan.mesh_shape, plan.mesh_dims, stage.devices, plan.link_classes)
        for stage in plan.stages
    ]


def locate(meshes: Sequence[Mesh], rank: int) -> tuple[int, int]:
    """(stage, device index in its mesh) of global `rank`."""
    stage = next(s for s, mesh in enumerate(meshes) if rank in mesh.device_ids)
    return stage, meshes[stage].device_ids.index(rank)


def node_stages(plan: Plan) -> dict[str, int]:
    """Node name -> the stage the plan runs it on."""
    return {name: node.stage for name, node in plan.nodes.items()}


def stage_boundaries(
    graph: OpGraph, stage_of: Mapping[str, int] | None
) -> dict[tuple[int, int], list[Value]]:
    """(sending stage, receiving stage) -> the values it carries, in graph order: every output
    of a non-input node read on a later stage (user inputs are read by each stage itself)."""
    out: dict[tuple[int, int], list[Value]] = {}
    if stage_of is None:
        return out
    for name in graph.order:
        if graph.node(name).role is Role.INPUT:
            continue
        readers: dict[tuple[int, int], None] = {}
        for v in graph.graph.successors(name):
            if stage_of[v] != stage_of[name]:
                for out_idx, _ in graph.uses(name, v):
                    readers[(stage_of[v], out_idx)] = None
        for reader, out_idx in sorted(readers):
            out.setdefault((stage_of[name], reader), []).append((name, out_idx))
    return out


def boundary_tag(src: int, dst: int, num_stages: int) -> int:
    """The tag of values from stage `src` to stage `dst` (their gradients: + 1)."""
    return 2 * (src * num_stages + dst)


def stage_values(
    boundaries: Mapping[tuple[int, int], Sequence[Value]], stage: int
) -> tuple[list[Value], list[Value]]:
    """The values `stage` receives and those it sends, each in exchange order (the program's
    imports and exports)."""
    ordered = sorted(boundaries.items())
    received = [v for (_, dst), values in ordered if dst == stage for v in values]
    sent = [v for (src, _), values in ordered if src == stage for v in values]
    return received, sent


@dataclass(frozen=True, slots=True)
class Links:
    """Peers and local tensor metas of this rank's cross-stage traffic, in exchange order:
    values in (from earlier stages), values out, gradients in (for values out, floating only),
    gradients out (for values in, floating only)."""

    values_in: Peers
    values_out: Peers
    grads_in: Peers
    grads_out: Peers


def build_links(
    graph: OpGraph,
    signatures: Mapping[str, NdSignature],
    boundaries: Mapping[tuple[int, int], Sequence[Value]],
    meshes: Sequence[Mesh],
    stage: int,
    index: int,
) -> Links:
    """Device `index` of one stage talks to device `index` of another: a value keeps its layout
    across stages (every stage has the same mesh shape), so each sends its own local piece.
    Each pair of (virtual) stages has its own tags (`boundary_tag`): interleaved, two ranks
    exchange the values of several pairs, each in its own order."""

    def local(value: Value) -> TensorMeta:
        node, out = value
        meta = graph.node(node).outputs[out]
        layout = signatures[node].outputs[out]
        return TensorMeta(local_shape(meta.shape, layout, meshes[stage].shape), meta.dtype)

    values_in, values_out = [], []
    for (src, dst), values in sorted(boundaries.items()):
        metas = tuple(local(v) for v in values)
        tag = boundary_tag(src, dst, len(meshes))
        if dst == stage:
            values_in.append((meshes[src].device_ids[index], tag, metas))
        if src == stage:
            values_out.append((meshes[dst].device_ids[index], tag, metas))

    def floating(links: list[tuple[int, int, tuple[TensorMeta, ...]]]) -> Peers:
        kept = [
            (peer, tag + 1, tuple(m for m in metas if m.dtype.is_floating_point))
            for peer, tag, metas in links
        ]
        return tuple(link for link in kept if link[2])

    return Links(tuple(values_in), tuple(values_out), floating(values_out), floating(values_in))


class Transfers:
    """One step's point-to-point traffic over `links`: `receive` blocks, `send` starts an
    isend kept until `wait` (the end of the step). A link to this rank itself (an earlier
    chunk's value, as HF Llama's rotary cos and sin) passes a copy through `mailbox`, queued
    per tag and shared by the rank's chunks: gloo has no pair to itself."""

    def __init__(
        self, links: Links, timeout: datetime.timedelta, span: Span, device: torch.device,
        mailbox: dict[int, deque[torch.Tensor]],
    ) -> None:  # fmt: skip
        self.links, self.timeout, self.span, self.device = links, timeout, span, device
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []
        self.rank, self.mailbox = dist.get_rank(), mailbox

    def receive(self, mb: int, *, backward: bool) -> list[torch.Tensor]:
        """This micro-batch's values from earlier stages (forward), or the gradients of the
        values this stage sent (backward), in `stage_boundaries` order."""
        links = self.links.grads_in if backward else self.links.values_in
        if not links:
            return []
        out = []
        with self.span("recv", mb):
            for peer, tag, metas in links:
                for meta in metas:
                    if peer == self.rank:
                        buffer = self.mailbox[tag].popleft()
                    else:
                        buffer = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
                        _p2p(dist.irecv, buffer, peer, tag).wait(self.timeout)
                    if not backward and buffer.is_floating_point():
                        buffer.requires_grad_(True)
                    out.append(buffer)
        return out

    def send(self, tensors: Sequence[torch.Tensor], *, backward: bool) -> None:
        links = self.links.grads_out if backward else self.links.values_out
        position = 0
        for peer, tag, metas in links:
            for _ in metas:
                tensor = tensors[position].detach().contiguous()
                position += 1
                if peer == self.rank:  # the receiving chunk's own tensor, as a receive's is
                    self.mailbox.setdefault(tag, deque()).append(tensor.clone())
                else:
                    self.pending.append((_p2p(dist.isend, tensor, peer, tag), tensor))
        assert position == len(tensors), f"sent {position} of {len(tensors)} values"

    def wait(self) -> None:
        """Every send of the step done (the tensors are kept alive until then)."""
        for work, _ in self.pending:
            work.wait(self.timeout)
        self.pending.clear()


@dataclass(frozen=True, slots=True)
class LossBoxing:
    """The loss's two boxings from its layout: to P on every mesh dim (the backward seed) and
    to B on every mesh dim (its value, the same on every device of its stage)."""

    seed: Callable[[torch.Tensor], torch.Tensor]
    value: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def build(cls, boxer: Boxer, layout: NdSbp | None) -> LossBoxing | None:
        """None on a stage without the loss."""
        if layout is None:
            return None
        ndim = boxer.mesh.ndim
        return cls(boxer.chain(layout, (P,) * ndim, ()), boxer.chain(layout, (B,) * ndim, ()))


InFlight = tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]


@dataclass(frozen=True, slots=True)
class SharedLoss:
    """A step's loss as every rank learns it: the loss, the factor every gradient takes (1.0,
    but where the micro-batches were weighed by their kept targets and some were ignored:
    size x m / N, so that micro-batch k's share is n_k / N, as one device normalises the whole
    batch) and, then, those weights n_k / N (None: 1/m each)."""

    loss: float
    factor: float = 1.0
    weights: list[float] | None = None


@dataclass
class Pipeline:
    """This rank's part of one step: `order` (its firing order: (phase, chunk, micro-batch))
    of the forwards of `programs` (one per chunk the rank holds, in chunk order: one without
    interleaving) and their backwards, each chunk's values and gradients exchanged through its
    `transfers`; `arm` runs right before each chunk's last backward (gradient sync: with the
    chunk's tensors, and with None, every one, before the rank's last), and `loss_root` is
    the first rank of the loss's stage. With WEIGHT firings (zero bubble) each backward is
    split: `weights` are the tensors whose gradients WEIGHT adds (the stage's parameters)."""

    programs: Sequence[Program]
    transfers: Sequence[Transfers]
    order: Sequence[Step]
    loss: LossBoxing | None
    micro_batches: int
    arm: Callable[[Iterable[torch.Tensor] | None], None]
    loss_root: int
    staged: bool  # more than one stage: the loss is broadcast
    span: Span
    device: torch.device  # where the loss is summed (`collectives.world_device`)
    weights: Sequence[torch.Tensor] = ()
    last_backward: int = field(init=False)  # the last firing in `order` that adds gradients
    split: bool = field(init=False)  # zero bubble: backward in two (input, weight)
    # firing -> the chunk parameters whose gradients it finishes (before the rank's last)
    finishes: dict[int, list[torch.Tensor]] = field(init=False)
    _seeds: list[float] = field(init=False, default_factory=list)  # this step's, per micro-batch
    _kept: float = field(init=False, default=0.0)  # the step's kept targets (weighed loss)
    _size: float = field(init=False, default=0.0)  # a micro-batch's targets
    _seed_scale: float = field(init=False, default=1.0)  # fp16's loss scale in `_seeds`

    def __post_init__(self) -> None:
        self.split = any(phase is Phase.WEIGHT for phase, _, _ in self.order)
        last = Phase.WEIGHT if self.split else Phase.BACKWARD
        final = {chunk: i for i, (phase, chunk, _) in enumerate(self.order) if phase is last}
        self.last_backward = max(final.values())
        at: dict[int, tuple[torch.Tensor, int]] = {}  # a chunk's tensors: its last such firing
        for chunk, program in enumerate(self.programs):
            for value in program.template:
                if isinstance(value, torch.Tensor):
                    held = at.get(id(value), (value, -1))
                    at[id(value)] = (value, max(held[1], final[chunk]))
        self.finishes = {}
        for value, position in at.values():
            if position < self.last_backward:
                self.finishes.setdefault(position, []).append(value)

    def run(
        self,
        pieces: Sequence[Sequence[torch.Tensor]],
        weights: Sequence[float] | None = None,
        seed_scale: float = 1.0,
    ) -> torch.Tensor:
        """Every firing of the step on the micro-batches `pieces`; returns this rank's share
        of the loss (on the loss's stage the micro-batches' losses summed with `weights`,
        default 1/m each: their mean; 0 elsewhere). Backward seeds each micro-batch's loss
        with its weight times `seed_scale` (fp16's loss scale)."""
        m = self.micro_batches
        self._seeds = [w * seed_scale for w in (weights or [1.0 / m] * m)]
        self._kept = self._size = 0.0
        self._seed_scale = seed_scale
        in_flight: dict[tuple[int, int], InFlight] = {}
        deferred: dict[tuple[int, int], WeightGradients] = {}
        value = torch.zeros((), device=self.device)
        for position, (phase, chunk, mb) in enumerate(self.order):
            last = position == self.last_backward
            if position in self.finishes:  # an earlier chunk's last backward: sync its own
                self.arm(self.finishes[position])
            if phase is Phase.FORWARD:
                in_flight[(chunk, mb)], counted = self._forward(pieces[mb], chunk, mb)
                loss = in_flight[(chunk, mb)][2]
                if loss is not None and self.loss is not None:
                    if weights is None and len(counted) == 1:  # weighed by its kept targets
                        self._seeds[mb] = seed_scale * self._weigh(*counted[0])
                    with torch.no_grad():
                        value += self.loss.value(loss.detach()) * (self._seeds[mb] / seed_scale)
            elif phase is Phase.WEIGHT:
                if last:
                    self.arm(None)  # every gradient is final in this firing: sync them
                with self.span("weight", mb, chunk):
                    deferred.pop((chunk, mb)).run()
            else:
                flight = in_flight.pop((chunk, mb))
                later = self._backward(chunk, mb, flight, last=last)
                if later is not None:
                    deferred[(chunk, mb)] = later
        for transfers in self.transfers:
            transfers.wait()
        return value

    def run_forwards(self, pieces: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
        """The forwards alone (evaluation, under no_grad): micro-batch after micro-batch, each
        through this rank's chunks in order. Every forward depends only on forwards earlier in
        that order (an earlier micro-batch, or an earlier chunk of its own), and every rank
        runs its forwards in it, so the blocking receives cannot deadlock. Returns this rank's
        share of the loss, as `run`."""
        value = torch.zeros((), device=self.device)
        self._kept = self._size = 0.0
        for mb, piece in enumerate(pieces):
            for chunk in range(len(self.programs)):
                (_, _, loss), counted = self._forward(piece, chunk, mb)
                gathers = self.programs[chunk].gathers
                if gathers is not None:
                    gathers.finish_backward(mb)  # no backward follows: end the pass
                if loss is not None and self.loss is not None:
                    weight = self._weigh(*counted[0]) if len(counted) == 1 else 1 / len(pieces)
                    value += self.loss.value(loss.detach()) * weight
        for transfers in self.transfers:
            transfers.wait()
        return value

    def kept_factor(self) -> float:
        """The factor size x m / N of a step (or evaluation) whose micro-batches were weighed
        by their kept targets (on the loss's stage), 1.0 where nothing was ignored."""
        m = self.micro_batches
        if not self._kept or self._kept == self._size * m:
            return 1.0
        return self._size * m / self._kept

    def _weigh(self, count: torch.Tensor, size: int) -> float:
        """A micro-batch's weight from its kept targets: n_k / (size x m), exact up to the
        step's factor size x m / N (`share_loss`), which makes it n_k / N."""
        kept = float(count)
        self._kept += kept
        self._size = float(size)
        return kept / (size * self.micro_batches)

    def share_loss(self, value: torch.Tensor, *, weights: bool = True) -> SharedLoss:
        """The loss on every rank (broadcast from the loss's stage), with the factor every
        gradient takes and (`weights`: after a training step) the micro-batches' weights
        (`SharedLoss`)."""
        m = self.micro_batches
        factor = self.kept_factor()
        shares = [w * factor / self._seed_scale for w in self._seeds] if weights else [0.0] * m
        both = torch.tensor([float(value), factor, *shares], dtype=torch.float64)
        if self.staged:
            both = both.to(self.device)
            dist.broadcast(both, src=self.loss_root)
            both = both.cpu()
        loss, factor = float(both[0]) * float(both[1]), float(both[1])
        return SharedLoss(loss, factor, None if factor == 1.0 else both[2:].tolist())

    def _forward(
        self, piece: Sequence[torch.Tensor], chunk: int, mb: int
    ) -> tuple[InFlight, tuple[tuple[torch.Tensor, int], ...]]:
        transfers = self.transfers[chunk]
        received = transfers.receive(mb, backward=False)
        with self.span("forward", mb, chunk):
            loss, exports, counted = self.programs[chunk].run(piece, received, mb)
        transfers.send(exports, backward=False)
        return (received, exports, loss), counted

    def _backward(
        self, chunk: int, mb: int, flight: InFlight, *, last: bool
    ) -> WeightGradients | None:
        """The backward of one micro-batch on one chunk (split: its input gradients, and what
        its weight gradients need later), the input gradients sent to earlier stages."""
        received, exports, loss = flight
        transfers, program = self.transfers[chunk], self.programs[chunk]
        grads = transfers.receive(mb, backward=True)
        if last:
            self.arm(None)  # every gradient is final in this backward: sync them
        floating = [x for x in received if x.is_floating_point()]
        later = None
        with self.span("backward", mb, chunk):
            seed = None
            if loss is not None and self.loss is not None:
                seed = self.loss.seed(loss) * self._seeds[mb]
            roots, root_grads = _roots(seed, exports, grads)
            if self.split:
                found, later = input_gradients(roots, root_grads, floating, self.weights)
            else:
                if roots:
                    torch.autograd.backward(roots, root_grads)
                found = [x.grad for x in floating]
            if program.gathers is not None:
                program.gathers.finish_backward(mb)
        zeros = [
            torch.zeros_like(x) if g is None else g for g, x in zip(found, floating, strict=True)
        ]
        transfers.send(zeros, backward=True)
        return later


def _roots(
    seed: torch.Tensor | None, exports: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """The roots of one micro-batch's backward on one stage and their gradients: the loss seed
    (last stage) and the exports later stages sent gradients for (floating values, in order)."""
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
    return roots, root_grads


def _p2p(
    op: Callable[..., dist.Work | None], tensor: torch.Tensor, peer: int, tag: int
) -> dist.Work:
    """One isend/irecv with a global peer rank (`boundary_tag`: one per pair of stages and
    direction)."""
    work = op(tensor, peer, tag=tag)
    assert work is not None, "isend/irecv returned no work: is this rank in the default group?"
    return work
