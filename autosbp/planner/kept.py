"""What a graph keeps from forward to backward, per micro-batch, under a recomputation mode.

Lives here: `Kept` (per representative node, the outputs it keeps in its own layout and the
intermediates its backward keeps; per edge, the uses whose consumer keeps the value, which the
layouts then price as the producer's tensor or as a boxed copy) and `kept_for_backward`, which
reads it off the graph with what autograd saves (`saved`). Lives elsewhere: bytes per candidate
and pair (`memory`), recomputation modes (`pipeline`), ties (`reduce`).

The facts (autograd's, per op, `saved.saved_by`):
- a value is kept when a backward that will run saves it: its consumer's (an input it saves),
  its producer's (an output it saves, e.g. softmax), or a checkpointed run's (the inputs of a
  recomputed run of a block: `runtime.execute.program` checkpoints each such run, which saves what it
  reads from outside it, not its parameters);
- a view keeps its input exactly when something keeps its output (it aliases it), whatever
  the recomputation;
- a recomputed op's own saves are not kept: its block's run is recomputed in backward, one
  block at a time (`rematerialized`: what it holds while that happens).
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
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from autosbp.capturing.flops import op_family
from autosbp.capturing.graph import OpGraph, OpNode, Role
from autosbp.planner.autograd_probe import requires_grad_of, saved_by
from autosbp.planner.pipeline import recomputed
from autosbp.planner.reduce import twin_key

__all__ = ["Kept", "KeptUse", "kept_for_backward"]

_STATE = (Role.PARAMETER, Role.BUFFER, Role.INPUT)  # values counted apart (model state, inputs)


@dataclass(frozen=True, slots=True)
class KeptUse:
    """A use (producer output `out_idx` -> consumer input `in_idx`) whose value stays until
    backward; `sole`: its only holder, so where the conversion makes no copy the producer's
    tensor is what this use keeps."""

    out_idx: int
    in_idx: int
    sole: bool = False


@dataclass(frozen=True)
class Kept:
    """What one graph keeps per micro-batch in flight (the module docstring), per
    representative node and per edge twin (`reduce.twin_key`)."""

    outputs: Mapping[str, frozenset[int]]  # kept in the node's own layout
    extra_bytes: Mapping[str, int]  # intermediates its backward saves (whole tensors)
    rematerialized: Mapping[str, frozenset[int]]  # recomputed nodes: outputs while recomputing
    uses: Mapping[Hashable, tuple[KeptUse, ...]]  # per edge twin: uses kept until backward
    recomputed_uses: Mapping[Hashable, tuple[KeptUse, ...]]  # kept while their block recomputes
    regatherable: frozenset[str]  # parameters some consumer keeps (after any conversion)

    def outputs_of(self, name: str) -> frozenset[int]:
        return self.outputs.get(name, frozenset())


_SELF = ("self",)  # a value's producer (or a checkpoint of its consumer's run) keeps it


def kept_for_backward(graph: OpGraph, representative: Mapping[str, str], recompute: str) -> Kept:
    """What `graph` keeps under `recompute` (the module docstring), merged per representative."""
    flags = requires_grad_of(graph)
    holders: dict[tuple[str, int], list[tuple]] = defaultdict(list)
    rematerialized: dict[str, tuple[int, ...]] = {}
    recomputed_uses: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
    extras: dict[str, int] = {}
    for v in reversed(graph.order):  # a view's consumers come first: they decide what it keeps
        attrs = graph.node(v)
        if attrs.role is not Role.COMPUTE:
            continue
        producers = graph.producers(v)
        again = recomputed(attrs, recompute)
        if op_family(attrs.op) == "view":
            held = any(holders.get((v, o)) for o in range(len(attrs.outputs)))
            keeps = frozenset({0} if held else ())
        else:
            saved = saved_by(attrs, tuple(flags[p] if p else False for p in producers))
            keeps = saved.inputs
            extras[v] = saved.extra_bytes
            if again:
                rematerialized[v] = tuple(range(len(attrs.outputs)))
            else:
                for o in saved.outputs:
                    holders[(v, o)].append(_SELF)
        for i, found in enumerate(producers):
            if found is None:
                continue
            u, o = found
            if again and _checkpoint_input(graph.node(u), attrs, recompute):
                holders[(u, o)].append(_SELF)
            if i in keeps:
                if again and op_family(attrs.op) != "view":
                    recomputed_uses[(u, v)].append((o, i))
                else:
                    holders[(u, o)].append((v, o, i))
    return _merged(graph, representative, holders, extras, rematerialized, recomputed_uses)


def _checkpoint_input(producer: OpNode, consumer: OpNode, recompute: str) -> bool:
    """Does the checkpointed run of a recomputed `consumer` save this producer's value? It
    saves what it reads from outside the run, except parameters and buffers (the runtime holds
    them anyway)."""
    if producer.role in _STATE:
        return False
    inside = recomputed(producer, recompute) and producer.block == consumer.block
    return not inside


def _merged(
    graph: OpGraph,
    rep: Mapping[str, str],
    holders: Mapping[tuple[str, int], list[tuple]],
    extras: Mapping[str, int],
    rematerialized: Mapping[str, tuple[int, ...]],
    recomputed_uses: Mapping[tuple[str, str], list[tuple[int, int]]],
) -> Kept:
    outputs: dict[str, set[int]] = defaultdict(set)
    uses: dict[Hashable, dict[tuple[int, int], bool]] = defaultdict(dict)
    regatherable: set[str] = set()
    for (u, o), found in holders.items():
        attrs = graph.node(u)
        edges = [h for h in found if h is not _SELF]
        apart = attrs.role in _STATE or op_family(attrs.op) == "view"
        at_node = not apart and (len(edges) != len(found) or len(edges) > 1)
        if at_node:
            outputs[rep[u]].add(o)
        for v, _, i in edges:
            key = twin_key(graph, rep, u, v)
            sole = not apart and not at_node
            uses[key][(o, i)] = uses[key].get((o, i), False) or sole
            if attrs.role is Role.PARAMETER:
                regatherable.add(rep[u])
    remat: dict[str, set[int]] = defaultdict(set)
    for v, outs in rematerialized.items():
        remat[rep[v]].update(outs)
    extra: dict[str, int] = {}
    for v, nbytes in extras.items():
        extra[rep[v]] = max(extra.get(rep[v], 0), nbytes)
    again: dict[Hashable, dict[tuple[int, int], bool]] = defaultdict(dict)
    for (u, v), pairs in recomputed_uses.items():
        key = twin_key(graph, rep, u, v)
        again[key].update(dict.fromkeys(pairs, False))
    return Kept(
        {r: frozenset(o) for r, o in outputs.items()}, extra,
        {r: frozenset(o) for r, o in remat.items()},
        {k: _uses(u) for k, u in uses.items()}, {k: _uses(u) for k, u in again.items()},
        frozenset(regatherable),
    )  # fmt: skip


def _uses(pairs: Mapping[tuple[int, int], bool]) -> tuple[KeptUse, ...]:
    return tuple(KeptUse(o, i, sole) for (o, i), sole in sorted(pairs.items()))
