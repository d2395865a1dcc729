"""Which samples of a map-style data set make each global batch, and where a job is in them.

Lives here: `Position` (epoch, samples consumed in it) and `Sampler` (the data set's indices of
each global batch, its JSON-able `state` and `from_state`). Lives elsewhere: reading the samples
and cutting them to a rank's boxes (`runtime.data.loader`), the data sets (`runtime.data.sources`,
`runtime.data.tokens`).

Invariants:
- Epoch e's order depends on (seed, e) only: `torch.randperm` drawn from a generator seeded with
  the first 63 bits of sha256("seed:e"), so every rank and every process (a restart too) computes
  the same order with no communication; `shuffle=False` keeps 0, 1, 2, ... (evaluation).
- A global batch is the next `global_batch` entries of the epoch's order. When fewer are left the
  epoch ends and they are dropped; under shuffling each epoch drops other samples.
- The position is (epoch, samples consumed in the epoch), so a sampler rebuilt from `state()`
  hands out exactly the batches the uninterrupted one would. Resumed with another global batch,
  it goes on from the consumed samples of the same order (Megatron-LM's
  MegatronPretrainingSampler): no sample of the epoch is seen twice or skipped, save the tail the
  new batch size drops.
- The order is a function of torch's CPU generator: the same torch version gives the same order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from autosbp.errors import DataError

__all__ = ["Position", "Sampler"]


@dataclass(frozen=True, slots=True)
class Position:
    """Where a job is in its data: the epoch, and the samples of its order already handed out."""

    epoch: int = 0
    consumed: int = 0


class Sampler:
    """The global batches of a map-style data set of `size` samples, from `position` on."""

    def __init__(
        self,
        size: int,
        global_batch: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        position: Position = Position(),
    ) -> None:
        assert 1 <= global_batch <= size, f"a global batch of {global_batch} from {size} samples"
        assert position.epoch >= 0 and 0 <= position.consumed <= size, position
        self.size, self.global_batch = size, global_batch
        self.seed, self.shuffle = seed, shuffle
        self.position = position
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, its order), cached

    def next_batch(self) -> torch.Tensor:
        """The data set's indices of the next global batch (int64); moves the position on."""
        epoch, consumed = self.position.epoch, self.position.consumed
        if consumed + self.global_batch > self.size:  # the epoch's tail is dropped
            epoch, consumed = epoch + 1, 0
        rows = self.order(epoch)[consumed : consumed + self.global_batch]
        self.position = Position(epoch, consumed + self.global_batch)
        return rows

    def batches_left(self) -> int:
        """Whole global batches left in the current epoch."""
        return (self.size - self.position.consumed) // self.global_batch

    def order(self, epoch: int) -> torch.Tensor:
        """Epoch `epoch`'s order of the data set's indices."""
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                digest = hashlib.sha256(f"{self.seed}:{epoch}".encode()).digest()
                generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)
                order = torch.randperm(self.size, generator=generator)
            else:
                order = torch.arange(self.size)
            self._order = (epoch, order)
        return self._order[1]

    def state(self) -> dict[str, int | bool]:
        """The position and what it is a position in, JSON-able (`from_state` reads it)."""
        return {
            "size": self.size,
            "global_batch": self.global_batch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.position.epoch,
            "consumed": self.position.consumed,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, object], size: int, global_batch: int) -> Sampler:
        """The sampler `state()` describes, over a data set of `size` samples, with `global_batch`
        (which may differ from the state's: the job goes on from the consumed samples). The seed
        and shuffling are the state's."""
        saved, seed, epoch, consumed = (
            _whole(state, k) for k in ("size", "seed", "epoch", "consumed")
        )
        shuffle = state.get("shuffle")
        if not isinstance(shuffle, bool):
            raise _not_a_position(state)
        if saved != size or epoch < 0 or not 0 <= consumed <= size:
            raise DataError(
                f"The data position was saved over a data set of {saved} samples (epoch {epoch}, "
                f"{consumed} consumed) but the data set now has {size}: its order would differ. "
                "Resume with the same data set (the same function and arguments), or start the "
                "data afresh."
            )
        position = Position(epoch, consumed)
        return cls(size, global_batch, seed=seed, shuffle=shuffle, position=position)


def _whole(state: Mapping[str, object], key: str) -> int:
    value = state.get(key)
    if type(value) is not int:
        raise _not_a_position(state)
    return value


def _not_a_position(state: Mapping[str, object]) -> DataError:
    return DataError(
        f"The data position {dict(state)!r} is not one a data loader saved (it holds whole-number "
        "size, seed, epoch and consumed, and shuffle true or false); resume from a checkpoint "
        "this version wrote, or start the data afresh."
    )
