"""Runs of the same code over an unordered collection, put in one order: the graph of a model
is the same in every process.

Lives here: `order_interchangeable_runs`, the pass `export` runs on every graph it builds.
Lives elsewhere: the rest of the canonical form (`builder`: devices, copies, in-place writes,
no_grad regions), the fingerprint (`graph.OpGraph.fingerprint`), the ranks' agreement on one
graph before the first step (`runtime.state.startup.agree_on_graph`).

Why. Export records ops in the order Python ran them. Python iterates a `set` of strings in an
order set by the per-process hash seed (PYTHONHASHSEED), and a dict built from one inherits it:
Gemma3 and ModernBERT compute their rotary tables in `for layer_type in set(config.layer_types)`,
so one process records the sliding window's table first and another the global one. Export
names nodes by counters in that order (`cos`, `cos_1`), so the node named `cos` reads the
sliding table's frequencies in one process and the global table's in the other: two graphs,
two fingerprints, one model.

What. A segment of the program order made of k >= 2 consecutive runs of one template (node for
node the same op, module path, input and output shapes and dtypes, arguments and Python stack
(export's `stack_trace`), and the same edges inside the run), none reading another, holding no
in-place write, is what a loop over k keys gives whatever their order; straight-line code that
repeats an op (q, k and v projections, one line's several multiplications) differs in its
lines or arguments, and keeps its order. The runs are sorted by what does not depend on that
order: the positions of the nodes they read before the segment (canonical by induction:
segments are canonicalized left to right, and each keeps its span), then the positions of
their readers after the segment. Names stay where they were: the t-th node of the segment takes the
name export gave the t-th node, which is the same in every process (the runs' op sequences are
equal, and export's counters follow positions). A segment takes the largest span found at its
start (a loop's runs, not a repeated op inside one run).

Invariants: the identity where the program order holds no such segment, or holds its runs
sorted already (the 36 models of the real-model suite before issue #48 keep their
fingerprints); `order` keeps its list of names; a topological order stays one (no run reads
another, and the segment keeps its span).
Limits: runs whose code differs per key (an `if` on the key inside the loop) or whose
arguments do (a scaling per key) are not recognised, nor runs whose readers lie in a later
segment not yet sorted; their processes then disagree, and the ranks' agreement refuses to
start.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence

from autosbp.capturing.graph import OpGraph, Role

__all__ = ["order_interchangeable_runs"]

Run = tuple[int, int]  # (start position, length)


def order_interchangeable_runs(graph: OpGraph, sources: Mapping[str, str]) -> dict[str, str]:
    """Sort every segment of interchangeable runs of `graph` (the module header) in place;
    `sources`: each compute node's Python stack (export's `stack_trace`). Returns {old name:
    new name} of the nodes that changed names."""
    return _Pass(graph, sources).run()


class _Pass:
    """One left-to-right scan of `graph.order` (which keeps its names: nodes move between them)."""

    def __init__(self, graph: OpGraph, sources: Mapping[str, str]) -> None:
        self.graph = graph
        self.order = graph.order
        self.position = {name: i for i, name in enumerate(self.order)}
        self.templates = [_template(graph, name, sources) for name in self.order]
        self.at: dict[Hashable, list[int]] = defaultdict(list)
        for i, template in enumerate(self.templates):
            if template is not None:
                self.at[template].append(i)

    def run(self) -> dict[str, str]:
        renamed: dict[str, str] = {}  # segments are disjoint spans: their renames compose
        i = 0
        while i < len(self.order):
            found = self._segment_at(i)
            if found is None:
                i += 1
                continue
            length, count = found
            mapping = self._sorted_runs(i, length, count)
            self.graph.rename(mapping)
            renamed.update(mapping)
            i += length * count
        return renamed

    def _segment_at(self, i: int) -> tuple[int, int] | None:
        """(run length, run count) of the widest segment of interchangeable runs at `i`."""
        if self.templates[i] is None:
            return None
        best: tuple[int, int] | None = None
        later = self.at[self.templates[i]]  # ascending positions of the same template
        for j in later[bisect.bisect_right(later, i) :]:
            length = j - i
            if 2 * length > len(self.order) - i:
                break
            count = 1
            while self._interchangeable((i, length), i + count * length):
                count += 1
            if count > 1 and (best is None or length * count > best[0] * best[1]):
                best = (length, count)
        return best

    def _interchangeable(self, first: Run, start: int) -> bool:
        """Is the run at `start` the first run's twin (template and inner edges, offset for
        offset) reading nothing of the runs before it?"""
        begin, length = first
        templates = self.templates
        if start + length > len(templates) or None in templates[start : start + length]:
            return False
        if templates[begin : begin + length] != templates[start : start + length]:
            return False
        for t in range(length):
            ours = self.graph.producers(self.order[begin + t])
            theirs = self.graph.producers(self.order[start + t])
            for a, b in zip(ours, theirs, strict=True):
                if self._offset(a, begin, length) != self._offset(b, start, length):
                    return False
                if b is not None and begin <= self.position[b[0]] < start:
                    return False  # reads an earlier run: not interchangeable
        return True

    def _offset(self, producer: tuple[str, int] | None, begin: int, length: int) -> object:
        """(offset in the run, output index) of a producer inside the run at `begin`."""
        if producer is None:
            return None
        where = self.position[producer[0]] - begin
        return (where, producer[1]) if 0 <= where < length else "outside"

    def _sorted_runs(self, begin: int, length: int, count: int) -> dict[str, str]:
        """{old name: new name} that puts the segment's runs in their canonical order."""
        end = begin + length * count
        runs = [self.order[begin + r * length : begin + (r + 1) * length] for r in range(count)]
        keys = [self._key(run, begin, end) for run in runs]
        ranked = sorted(range(count), key=keys.__getitem__)  # stable: equal keys, equal graphs
        names = [name for r in ranked for name in runs[r]]
        return {
            old: new for old, new in zip(names, self.order[begin:end], strict=True) if old != new
        }

    def _key(self, run: Sequence[str], begin: int, end: int) -> tuple[object, ...]:
        """What orders a run: the positions it reads before the segment, then the positions of
        its readers after it (neither depends on the order of the runs)."""
        inside = set(run)
        reads, readers = [], []
        for name in run:
            for producer in self.graph.producers(name):
                if producer is not None and producer[0] not in inside:
                    reads.append((self.position[producer[0]], producer[1]))
            for reader in self.graph.readers(name):
                if reader not in inside:
                    readers.append((self.position[reader], sorted(self.graph.uses(name, reader))))
        assert all(p < begin for p, _ in reads) and all(p >= end for p, _ in readers), run
        return (reads, sorted(readers))


def _template(graph: OpGraph, name: str, sources: Mapping[str, str]) -> Hashable | None:
    """What every run of one loop has at one offset: the op, its module, shapes, arguments and
    the Python lines that made it; None for a node no run holds (a placeholder, the output, an
    in-place write whose order a move could change)."""
    node = graph.node(name)
    if node.role is not Role.COMPUTE or (node.schema is not None and node.schema.is_mutable):
        return None
    arguments = repr((node.args, node.kwargs))
    return (node.op, node.module_path, node.inputs, node.outputs, arguments, sources.get(name))
