"""This rank's pieces of each global batch: the training loader and the evaluation loader.

Lives here: `RankLoader` (training: endless, shuffled by default, resumable through `state()`),
`EvalLoader` (one sequential, unshuffled pass over an evaluation set each time it is iterated)
and `LoadInfo` (what a step's metrics need of the loading). Lives elsewhere: what a rank needs
(`runtime.data.layout`), which samples make a batch (`runtime.data.sampler`), loading and
checking the user's data (`runtime.data.sources`).

Invariants:
- From a data set of samples, a rank calls `samples[i]` for exactly the rows `layout.rows()`
  names (none on a rank whose boxes are all None) and collates each piece by stacking the
  per-sample tensors of its box's rows.
- From an iterable of whole global batches every rank, even one that reads no input, builds
  each whole batch and cuts its pieces from it: an iterable cannot be read in part, and every
  rank must stay at the same position. Each pass over it is a fresh `iter()` (an epoch), assumed
  to give the same batches in the same order.
- A piece is cut to its box, its floating data cast to the plan's dtype, contiguous, on `device`.
- The constructor checks the data against the layout on every rank (its size, and item 0 or
  the first batch, read even where the rank reads no input), so a bad data set is refused
  alike everywhere before the first step; every later item or batch is checked as it is read.
- `state()` is the same on every rank (it holds no rank's rows), JSON-able, and a loader built
  with it yields, bit for bit, the batches the uninterrupted one would have. Resuming an
  iterable skips the batches already consumed: it costs building them again (the user's
  iterable gives no way to seek).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from autosbp.errors import DataError
from runtime.data.layout import BatchLayout, RankBatch, cut_piece
from runtime.data.sampler import Sampler
from runtime.data.sources import (
    BatchData,
    SampleData,
    as_data,
    check_batch,
    read_item,
    sample_count,
)

__all__ = ["EvalLoader", "LoadInfo", "RankLoader"]

Batch = tuple[torch.Tensor, ...]


@dataclass(frozen=True, slots=True)
class LoadInfo:
    """What one step's loading was, for metrics."""

    rows_read: int  # samples this rank read: data-set items, or every row of an iterable's batch
    load_s: float  # seconds spent reading, collating, cutting, casting and moving
    epoch: int  # the epoch the batch came from


class RankLoader:
    """This rank's pieces of each global batch: iterating gives `(RankBatch, LoadInfo)` per step.

    `data`: a data set of samples, an iterable of whole global batches (`runtime.data.sources`),
    or what `load_data` returned. Samples come in a new order each epoch from `seed` (the same
    on every rank), or in order with `shuffle=False`; `state` (a `state()` of an earlier loader,
    from a checkpoint) resumes where that one was, with that one's seed and shuffling. An
    iterable's batches come in its own order (`seed` and `shuffle` do not apply to it).
    """

    def __init__(
        self,
        data: object,
        layout: BatchLayout,
        *,
        seed: int = 0,
        shuffle: bool = True,
        state: Mapping[str, object] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.data, self.layout, self.device = as_data(data), layout, torch.device(device)
        self._rows = layout.rows()
        self._sampler: Sampler | None = None
        self._passes: _Passes | None = None
        if isinstance(self.data, SampleData):
            size = sample_count(self.data, layout.global_batch)
            read_item(self.data, 0, layout.inputs)
            if state is None:
                self._sampler = Sampler(size, layout.global_batch, seed=seed, shuffle=shuffle)
            else:
                saved = _saved(state, "samples", self.data.origin)
                self._sampler = Sampler.from_state(saved, size, layout.global_batch)
        else:
            self._passes = _Passes(self.data, layout, endless=True)
            if state is not None:
                saved = _saved(state, "batches", self.data.origin)
                self._passes.skip(_count(saved, "epoch"), _count(saved, "batches"))

    def __iter__(self) -> Iterator[tuple[RankBatch, LoadInfo]]:
        return self

    def __next__(self) -> tuple[RankBatch, LoadInfo]:
        start = time.perf_counter()
        if self._sampler is not None:
            assert isinstance(self.data, SampleData)
            indices = self._sampler.next_batch()
            batch = _from_samples(self.data, indices, self._rows, self.layout, self.device)
            rows, epoch = len(self._rows), self._sampler.position.epoch
        else:
            assert self._passes is not None
            whole = self._passes.next_batch()
            assert whole is not None  # an endless pass starts over
            batch = _from_batch(whole, self.layout, self.device)
            rows, epoch = self.layout.global_batch, self._passes.epoch
        return batch, LoadInfo(rows, time.perf_counter() - start, epoch)

    def state(self) -> dict[str, object]:
        """Where the loader is, JSON-able and the same on every rank (for checkpoints)."""
        if self._sampler is not None:
            return {"kind": "samples", **self._sampler.state()}
        assert self._passes is not None
        return {
            "kind": "batches",
            "global_batch": self.layout.global_batch,
            "epoch": self._passes.epoch,
            "batches": self._passes.taken,
        }


class EvalLoader:
    """This rank's pieces of an evaluation set: each iteration is one pass over it in order, in
    whole global batches (a last partial batch is left out), `(RankBatch, LoadInfo)` per batch."""

    def __init__(
        self, data: object, layout: BatchLayout, *, device: torch.device | str = "cpu"
    ) -> None:
        self.data, self.layout, self.device = as_data(data), layout, torch.device(device)
        self._rows = layout.rows()
        self._first: _Passes | None = None
        if isinstance(self.data, SampleData):
            self._size = sample_count(self.data, layout.global_batch)
            read_item(self.data, 0, layout.inputs)
        else:
            self._first = _Passes(self.data, layout, endless=False)

    def __iter__(self) -> Iterator[tuple[RankBatch, LoadInfo]]:
        if isinstance(self.data, SampleData):
            sampler = Sampler(self._size, self.layout.global_batch, shuffle=False)
            for _ in range(sampler.batches_left()):
                start = time.perf_counter()
                indices = sampler.next_batch()
                batch = _from_samples(self.data, indices, self._rows, self.layout, self.device)
                yield batch, LoadInfo(len(self._rows), time.perf_counter() - start, 0)
            return
        passes, self._first = self._first or _Passes(self.data, self.layout, False), None
        while True:
            start = time.perf_counter()
            whole = passes.next_batch()
            if whole is None:
                return
            batch = _from_batch(whole, self.layout, self.device)
            yield batch, LoadInfo(self.layout.global_batch, time.perf_counter() - start, 0)


class _Passes:
    """Whole global batches from an iterable, checked, pass after pass (a pass: a fresh iter);
    the first batch is read at construction, so a bad iterable is refused before any step."""

    def __init__(self, data: BatchData, layout: BatchLayout, endless: bool) -> None:
        self.data, self.layout, self.endless = data, layout, endless
        self.epoch, self.taken = 0, 0  # the pass, and the batches handed out from it
        self._iterator = self._start()
        self._peeked: Batch | None = None
        self._peeked = self._pull()
        if self._peeked is None:
            raise DataError(
                f"{data.origin} gave no batch; an iterable of whole global batches (of "
                f"{layout.global_batch} samples) must give at least one, each time it is "
                "iterated (a list, or an IterableDataset whose __iter__ starts over)."
            )

    def next_batch(self) -> Batch | None:
        """The next batch; at the end of a pass: None, or (endless) the next pass's first."""
        batch: Batch | None
        if self._peeked is not None:
            batch, self._peeked = self._peeked, None
        else:
            batch = self._pull()
        if batch is None and self.endless:
            self.epoch, self.taken, self._iterator = self.epoch + 1, 0, self._start()
            batch = self._pull()
            if batch is None:
                raise DataError(
                    f"{self.data.origin} ran out of batches after epoch {self.epoch - 1}: a "
                    "second pass over it gave none (an iterator or generator gives its batches "
                    "once). Return an iterable whose iter() starts over (a list, an "
                    "IterableDataset), or train fewer steps."
                )
        self.taken += batch is not None
        return batch

    def skip(self, epoch: int, batches: int) -> None:
        """Go to batch `batches` of pass `epoch` (a resume): the skipped batches are built."""
        self.epoch = epoch
        for _ in range(batches):
            if self.next_batch() is None or self.epoch != epoch:
                raise DataError(
                    f"{self.data.origin} gave fewer than the {batches} batches a pass had "
                    "when the data position was saved; resume with the same data (the same "
                    "function and arguments), or start the data afresh."
                )

    def _start(self) -> Iterator[object]:
        try:
            return iter(self.data.batches)
        except Exception as exc:
            raise _read_failed(self.data, "iter()", exc) from exc

    def _pull(self) -> Batch | None:
        index = self.taken
        try:
            batch = next(self._iterator, None)
        except Exception as exc:
            raise _read_failed(self.data, f"reading batch {index}", exc) from exc
        if batch is None:
            return None
        where = f"batch {index} of {self.data.origin} (epoch {self.epoch})"
        return check_batch(batch, self.layout.inputs, self.layout.global_batch, where)


def _from_samples(
    data: SampleData,
    indices: torch.Tensor,
    rows: tuple[int, ...],
    layout: BatchLayout,
    device: torch.device,
) -> RankBatch:
    """Items `indices[r]` for the rows `r` of `rows` (the layout's), stacked into its boxes."""
    items = {row: read_item(data, int(indices[row]), layout.inputs) for row in rows}
    return _rank_batch(layout, device, lambda i, rows: torch.stack([items[r][i] for r in rows]))


def _from_batch(whole: Batch, layout: BatchLayout, device: torch.device) -> RankBatch:
    return _rank_batch(layout, device, lambda i, rows: whole[i][rows.start : rows.stop])


def _rank_batch(
    layout: BatchLayout, device: torch.device, take: Callable[[int, range], torch.Tensor]
) -> RankBatch:
    """[micro-batch][input] -> the piece of its box; `take(i, rows)`: those rows of input i."""
    return tuple(
        tuple(
            None if box is None else cut_piece(take(i, layout.box_rows(j, box)), box, spec, device)
            for i, (spec, box) in enumerate(zip(layout.inputs, layout.boxes, strict=True))
        )
        for j in range(layout.micro_batches)
    )


def _saved(state: Mapping[str, object], kind: str, origin: str) -> Mapping[str, object]:
    if state.get("kind") != kind:
        given = "a data set of samples" if kind == "samples" else "an iterable of batches"
        raise DataError(
            f"The data position {dict(state)!r} was not saved for {given}, which {origin} "
            "gives; resume with the data the position was saved with, or start the data afresh."
        )
    return state


def _count(state: Mapping[str, object], key: str) -> int:
    value = state.get(key)
    if type(value) is not int or value < 0:
        raise DataError(
            f"The data position {dict(state)!r} has no whole-number {key}; resume from a "
            "checkpoint this version wrote, or start the data afresh."
        )
    return value


def _read_failed(data: BatchData, what: str, exc: Exception) -> DataError:
    return DataError(
        f"{what} of {data.origin} failed with {type(exc).__name__}: {exc}. Fix the iterable so "
        "that it gives whole global batches (tuples of tensors)."
    )
