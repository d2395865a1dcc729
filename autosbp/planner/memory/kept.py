"""What a graph keeps from forward to backward, per micro-batch, under a recomputation mode.

Lives here: `Kept` (per representative node, the outputs it keeps in its own layout and the
intermediates its backward keeps, and the inputs it keeps as read that a re-gather could apply
to; per edge, the uses whose consumer keeps the value, which the
layouts then price as the producer's tensor or as a boxed copy) and `kept_for_backward`, which reads
it off the graph with what autograd saves (`memory.autograd_probe`). Lives elsewhere: bytes per
candidate and pair (`memory`), recomputation modes (`space.stages`), ties (`space.ties`).

The facts (autograd's, per op, `memory.autograd_probe.saved_by`):
- a value is kept when a backward that will run saves it: its consumer's (an input it saves),
  its producer's (an output it saves, e.g. softmax), or a checkpointed run's (the inputs of a
  recomputed run (`space.recomputation.recompute_runs`: the runtime checkpoints each run, which
  saves what it reads from outside it, as produced, not its parameters: one use of each such
  value stands for it, on the edge into the run);
- a view keeps its input exactly when something keeps its output (it aliases it), whatever
  the recomputation;
- a recomputed op's own saves are not kept across: its run is recomputed in backward, one run
  at a time, and holds them while it does (`rematerialized`, `recomputed_uses`), priced as
  `none` prices them, except values kept across anyway (the run's inputs, or a value a later
  op keeps), which add only their converted copies. So a recomputing mode keeps across what
  `none` keeps outside its runs, plus the runs' inputs (which `none` keeps too where an op of
  the run saves them: a block's first norm or product), and while one run recomputes, what
  `none` keeps of it.
Where the consumer keeps a value that reached it through boxing, what stays is the boxed copy
(an all-gather's, all-to-all's or all-reduce's output); a conversion that only slices (B to S)
is a view of the producer's tensor. So each kept use is priced on its edge (`memory.
use_bytes`): the copy when the conversion materializes one, else the producer's tensor when this
use is the value's only holder (`KeptUse.sole`). A value with several holders, or kept by its
producer, is counted once at the producer (in its layout), and its uses add only their copies:
an upper bound where every holder converts it (a holder that reads the producer's tensor
itself keeps it; which one does is a choice of pairs that no linear term can see). Values of
parameters, buffers and user inputs are counted as model state and inputs already; their uses
add only copies.

Tied copies (repeated blocks) share their representative's row: what each copy keeps is
merged (the union: an upper bound where copies differ, equal where they do not, as in
identical blocks).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field, replace

from autosbp.capturing.flops import op_family
from autosbp.capturing.graph import OpGraph, OpNode, Role
from autosbp.planner.memory.autograd_probe import requires_grad_of, saved_by
from autosbp.planner.space.recomputation import base_modes, recompute_runs
from autosbp.planner.space.ties import twin_key

__all__ = ["Kept", "KeptMemo", "KeptUse", "kept_for_backward"]

_STATE = (Role.PARAMETER, Role.BUFFER, Role.INPUT)  # values counted apart (model state, inputs)


@dataclass(frozen=True, slots=True)
class KeptUse:
    """A use (producer output `out_idx` -> consumer input `in_idx`) whose value stays until
    backward; `sole`: its only holder, so where the conversion makes no copy the producer's
    tensor is what this use keeps. `converted`: what stays is the value as the consumer reads
    it (a saved input); else as it was produced (a checkpointed run's input: the run converts
    it again when it recomputes)."""

    out_idx: int
    in_idx: int
    sole: bool = False
    converted: bool = True


@dataclass(frozen=True)
class Kept:
    """What one graph keeps per micro-batch in flight (the module docstring), per
    representative node and per edge twin (`space.ties.twin_key`)."""

    outputs: Mapping[str, frozenset[int]]  # kept in the node's own layout
    extra_bytes: Mapping[str, int]  # intermediates its backward saves (whole tensors)
    rematerialized: Mapping[str, frozenset[int]]  # recomputed nodes: outputs while recomputing
    uses: Mapping[Hashable, tuple[KeptUse, ...]]  # per edge twin: uses kept until backward
    recomputed_uses: Mapping[Hashable, tuple[KeptUse, ...]]  # kept while their block recomputes
    regatherable: frozenset[str]  # parameters some consumer keeps (after any conversion)
    # per representative consumer: the inputs it keeps as it reads them whose value an op made
    # (floating): where such an input reaches it through a collective, backward may convert it
    # again from the producer's tensor instead of keeping the copy (`timing.regather`)
    regather_inputs: Mapping[str, frozenset[int]] = field(default_factory=dict)
    # per representative op: the share of its floating inputs whose gradient backward computes
    # (1 where every input requires grad; 0 under a frozen part, where backward runs nothing)
    backward_share: Mapping[str, float] = field(default_factory=dict)

    def outputs_of(self, name: str) -> frozenset[int]:
        return self.outputs.get(name, frozenset())


_SELF = ("self",)  # a value's producer (or a checkpoint of its consumer's run) keeps it
# Per value (node, output): who keeps it, _SELF or (consumer, output, input, converted).
Holders = dict[tuple[str, int], list[tuple]]


def kept_for_backward(
    graph: OpGraph,
    representative: Mapping[str, str],
    recompute: str,
    *,
    like: Kept | None = None,
    flags: Mapping[tuple[str, int], bool] | None = None,
) -> Kept:
    """What `graph` keeps under `recompute` (the module docstring), merged per representative:
    across (per micro-batch in flight) and, apart, what a recomputed run's ops save while it
    recomputes (`rematerialized`, `recomputed_uses`). `like`: what a graph of the same
    structure keeps under `recompute` (another micro-batch count of one model, `space.
    structure`): which values are kept is the same, only the intermediates' bytes are this
    graph's. `flags`: `saved.requires_grad_of(graph)`, where known (it reads the structure)."""
    flags = requires_grad_of(graph) if flags is None else flags
    if like is not None:
        rebatched = _rebatched(like, graph, representative, flags)
        if rebatched is not None:
            return rebatched
    runs = recompute_runs(graph, recompute)
    holders: Holders = defaultdict(list)  # until backward
    again: Holders = defaultdict(list)  # while the run that holds them recomputes
    saved_by_run: set[tuple[str, int, int | None]] = set()  # (value, run): its checkpoint keeps it
    for v in reversed(graph.order):  # a view's consumers come first: they decide what it keeps
        attrs = graph.node(v)
        if attrs.role is not Role.COMPUTE:
            continue
        producers, run = graph.producers(v), runs.get(v)
        if op_family(attrs.op) == "view":  # it keeps its input where its output is kept
            outs = range(len(attrs.outputs))
            keeps = {0} if any(holders.get((v, o)) for o in outs) else set()
            again_keeps = {0} if any(again.get((v, o)) for o in outs) else set()
        else:
            saved = saved_by(attrs, tuple(flags[p] if p else False for p in producers))
            keeps, again_keeps = (
                (set(saved.inputs), set()) if run is None else (set(), set(saved.inputs))
            )
            for o in saved.outputs:
                (holders if run is None else again)[(v, o)].append(_SELF)
        for i, found in enumerate(producers):
            if found is None:
                continue
            u, o = found
            read = (u, o, run)  # a checkpointed run saves what it reads, once
            if _read_by_run(graph.node(u), runs.get(u), run) and read not in saved_by_run:
                saved_by_run.add(read)
                holders[(u, o)].append((v, o, i, False))
            if i in keeps:
                holders[(u, o)].append((v, o, i, True))
            if i in again_keeps:
                again[(u, o)].append((v, o, i, True))
    kept = _merged(
        graph, representative, holders, again, _extras(graph, representative, flags), runs
    )
    return replace(kept, backward_share=_backward_shares(graph, representative, flags))


def _rebatched(
    like: Kept, graph: OpGraph, rep: Mapping[str, str], flags: Mapping[tuple[str, int], bool]
) -> Kept | None:
    """`like` with this graph's edge keys (their tensors) and intermediates' bytes; None where
    an edge key does not map one to one (then the caller reads the graph afresh)."""
    keys, extras = _graph_terms(graph, rep, flags)
    if keys is None:
        return None
    try:
        uses: dict[Hashable, tuple[KeptUse, ...]] = {
            keys[_head(k)]: found for k, found in like.uses.items()
        }
        again: dict[Hashable, tuple[KeptUse, ...]] = {
            keys[_head(k)]: found for k, found in like.recomputed_uses.items()
        }
    except KeyError:
        return None
    return replace(like, uses=uses, recomputed_uses=again, extra_bytes=extras)


# The last graphs' edge keys and extras (`_graph_terms`): every mode of a micro-batch count reads
# the same ones. Keyed by id, the graph held beside them so the id stays its own.
_TERMS: dict[int, tuple[OpGraph, Mapping[str, str], Mapping, tuple]] = {}
_TERMS_KEPT = 4


def _graph_terms(
    graph: OpGraph, rep: Mapping[str, str], flags: Mapping[tuple[str, int], bool]
) -> tuple[dict[tuple, tuple] | None, dict[str, int]]:
    """Each edge twin's key by its head (None where two twins share a head) and `_extras`."""
    found = _TERMS.get(id(graph))
    if found is not None and found[0] is graph and found[1] is rep and found[2] is flags:
        return found[3]
    table: dict[tuple, tuple] = {}
    unique = True
    for u, v in graph.graph.edges:
        key = twin_key(graph, rep, u, v)
        if table.setdefault(key[:3], key) != key:
            unique = False
            break
    terms = (table if unique else None, _extras(graph, rep, flags))
    if len(_TERMS) >= _TERMS_KEPT:
        _TERMS.pop(next(iter(_TERMS)))
    _TERMS[id(graph)] = (graph, rep, flags, terms)
    return terms


def _head(key: Hashable) -> tuple:
    """An edge twin's key (`space.ties.twin_key`) less its tensors."""
    assert isinstance(key, tuple)
    return key[:3]


def _extras(
    graph: OpGraph, rep: Mapping[str, str], flags: Mapping[tuple[str, int], bool]
) -> dict[str, int]:
    """Per representative, the most bytes of intermediates any of its copies' backward saves."""
    extra: dict[str, int] = {}
    for v, attrs in graph.nodes(Role.COMPUTE):
        if op_family(attrs.op) != "view":
            producers = graph.producers(v)
            saved = saved_by(attrs, tuple(flags[p] if p else False for p in producers))
            extra[rep[v]] = max(extra.get(rep[v], 0), saved.extra_bytes)
    return extra


def _backward_shares(
    graph: OpGraph, rep: Mapping[str, str], flags: Mapping[tuple[str, int], bool]
) -> dict[str, float]:
    """Per representative, the largest share over its copies of floating inputs that require
    grad: backward computes one gradient per such input (a matmul under a frozen weight, one of
    its two products; an op fed by frozen state alone, none)."""
    share: dict[str, float] = {}
    for v, attrs in graph.nodes(Role.COMPUTE):
        floating = [
            (p, meta)
            for p, meta in zip(graph.producers(v), attrs.inputs, strict=True)
            if meta.dtype.is_floating_point or meta.dtype.is_complex
        ]
        needed = sum(1 for p, _ in floating if p is not None and flags.get(p, False))
        value = needed / len(floating) if floating else 0.0
        share[rep[v]] = max(share.get(rep[v], 0.0), value)
    return share


def _read_by_run(producer: OpNode, producer_run: int | None, run: int | None) -> bool:
    """Does the checkpointed `run` (None: none) save this producer's value? What it reads from
    outside it, except parameters, buffers and user inputs (counted apart)."""
    return run is not None and producer.role not in _STATE and producer_run != run


def _merged(
    graph: OpGraph,
    rep: Mapping[str, str],
    holders: Holders,
    again: Holders,
    extra: dict[str, int],
    runs: Mapping[str, int],
) -> Kept:
    outputs, uses = _priced(graph, rep, holders, lambda u, o: True)
    # While a run recomputes, a value it makes and nothing keeps across is priced as `none`
    # would price it; values kept across anyway (read from outside, or kept by a later op)
    # add only their converted copies.
    remat, again_uses = _priced(
        graph, rep, again, lambda u, o: u in runs and not holders.get((u, o))
    )
    regatherable = {  # a parameter some consumer keeps (after any conversion)
        rep[u]
        for (u, _), found in holders.items()
        if graph.node(u).role is Role.PARAMETER and any(h is not _SELF for h in found)
    }
    return Kept(
        {r: frozenset(o) for r, o in outputs.items()}, extra,
        {r: frozenset(o) for r, o in remat.items()},
        {k: _uses(u) for k, u in uses.items()}, {k: _uses(u) for k, u in again_uses.items()},
        frozenset(regatherable), _regather_inputs(graph, rep, holders),
    )  # fmt: skip


def _regather_inputs(
    graph: OpGraph, rep: Mapping[str, str], holders: Holders
) -> dict[str, frozenset[int]]:
    """Per representative consumer, the inputs it keeps as read (a saved input, not a
    checkpoint's) whose value a compute op made in a floating dtype (`Kept.regather_inputs`);
    parameters re-gather as FSDP does (`regatherable`), model state and inputs are not made
    by an op."""
    found: dict[str, set[int]] = defaultdict(set)
    for (u, o), held in holders.items():
        attrs = graph.node(u)
        if attrs.role is not Role.COMPUTE or not attrs.outputs[o].dtype.is_floating_point:
            continue
        for holder in held:
            if holder is not _SELF and holder[3]:
                found[rep[holder[0]]].add(holder[2])
    return {r: frozenset(i) for r, i in found.items()}


def _priced(
    graph: OpGraph, rep: Mapping[str, str], holders: Holders, own: Callable[[str, int], bool]
) -> tuple[dict[str, set[int]], dict[Hashable, dict[tuple[int, int], tuple[bool, bool]]]]:
    """Where the values `holders` keep are priced: per representative the outputs kept in its
    own layout (kept by its producer, or by several holders that each convert it), per edge
    twin the kept uses, one of them `KeptUse.sole` where it alone stands for the producer's
    tensor (the only holder, or a checkpoint that keeps it as produced). A value `own` says
    is not this pricing's to count (it is counted elsewhere), and values of views and of model
    state, add only copies."""
    outputs: dict[str, set[int]] = defaultdict(set)
    uses: dict[Hashable, dict[tuple[int, int], tuple[bool, bool]]] = defaultdict(dict)
    for (u, o), found in holders.items():
        attrs = graph.node(u)
        edges = [h for h in found if h is not _SELF]
        apart = attrs.role in _STATE or op_family(attrs.op) == "view" or not own(u, o)
        as_produced = [h for h in edges if not h[3]]
        at_node = not apart and (len(edges) != len(found) or (len(edges) > 1 and not as_produced))
        if at_node:
            outputs[rep[u]].add(o)
        stands = None if apart or at_node else (as_produced or edges)[0]
        for holder in edges:
            v, _, i, converted = holder
            key = twin_key(graph, rep, u, v)
            sole = holder is stands
            was = uses[key].get((o, i), (False, False))
            uses[key][(o, i)] = (was[0] or sole, was[1] or converted)
    return outputs, uses


def _uses(pairs: Mapping[tuple[int, int], tuple[bool, bool]]) -> tuple[KeptUse, ...]:
    return tuple(KeptUse(o, i, *flags) for (o, i), flags in sorted(pairs.items()))


@dataclass
class KeptMemo:
    """What backward keeps in each graph under each mode, shared by every mesh of a graph and
    every search of a plan request (`search.graph_memo.GraphMemo`); graphs of one structure
    (rebatched micro-batch graphs, `space.configs.structure`) share which values are kept and
    which require grad (`kept_for_backward`'s `like` and `flags`), each graph its own bytes.
    `none` is always kept (the backward shares and the parameters some consumer keeps are read
    from it). Graphs are keyed by identity, held beside their `Kept` so the id stays their own."""

    by_graph: dict[int, tuple[OpGraph, dict[str, Kept]]] = field(default_factory=dict)
    structural: dict[tuple[Hashable, str], Kept] = field(default_factory=dict)  # (structure, mode)
    flags: dict[Hashable, dict] = field(default_factory=dict)  # per structure: requires grad

    def of(
        self,
        graph: OpGraph,
        structure: Hashable,
        representative: Mapping[str, str],
        modes: tuple[str, ...],
    ) -> dict[str, Kept]:
        """What backward keeps in `graph` under `none` and each of `modes` (a space's: each as
        `space.recomputation.base_modes` reads it), and under any mode asked for before."""
        found = self.by_graph.get(id(graph))
        if found is None:
            found = self.by_graph[id(graph)] = (graph, {})
        memo = found[1]
        wanted = [m for m in dict.fromkeys(("none", *base_modes(modes))) if m not in memo]
        if wanted:
            flags = self.flags.get(structure)
            if flags is None:
                flags = self.flags[structure] = requires_grad_of(graph)
            for mode in wanted:
                like = self.structural.get((structure, mode))
                memo[mode] = kept_for_backward(graph, representative, mode, like=like, flags=flags)
                self.structural.setdefault((structure, mode), memo[mode])
        return memo

    def backward_share(
        self, graph: OpGraph, structure: Hashable, representative: Mapping[str, str]
    ) -> Mapping[str, float]:
        """`Kept.backward_share`, its structure's: from the first graph of it asked (it is
        structural, and what the other graphs keep is only read once one of their
        configurations gets its node bound)."""
        known = self.structural.get((structure, "none"))
        return (known or self.of(graph, structure, representative, ())["none"]).backward_share
